"""``RunLog``: the run's metrics axis and its per-iteration history, owned by ``PPOSystem``.

Every row lppo logs (an iteration's metrics, its optimizer steps, a held-out evaluation, a
failed iteration) takes the next step of one monotonically increasing axis, so wandb and
``metrics.csv`` show them in order. The run log is that axis and what callbacks record on it;
callbacks reach it through :attr:`lppo.iteration.hooks.IterationContext.run_log` (or
``PPOSystem.run_log`` from Lightning hooks) and never look each other up. It is saved in the
system's checkpoints, so a resumed run continues the axis, the history, the evaluations and
the failure count.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from lightning.pytorch.loggers import Logger

__all__ = ["RunLog"]


class RunLog:
    """The step axis, the per-iteration history and the held-out evaluations of a run.

    Attributes:
        step: the next step of the metrics axis.
        history: one summary per logged iteration (``iteration``, ``step`` and what the
            metrics logger records: rewards, losses, seconds).
        evaluations: ``prefix -> [entry, ...]``: every held-out evaluation, in iteration
            order (``iteration``, ``step`` and its metrics).
        failed: failed iterations so far (the failure policy's count).
        files: ``name -> path`` of files callbacks write (not saved; set at setup).
    """

    def __init__(self) -> None:
        self.step = 0
        self.history: list[dict[str, float]] = []
        self.evaluations: dict[str, list[dict[str, float]]] = {}
        self.failed = 0
        self.files: dict[str, str] = {}

    def log(self, loggers: Sequence[Logger], row: Mapping[str, float]) -> int:
        """Log ``row`` to every logger at the next step of the axis; returns that step."""
        step = self.step
        for logger in loggers:
            logger.log_metrics(dict(row), step=step)
        self.step += 1
        return step

    def add_evaluation(self, prefix: str, entry: dict[str, float]) -> None:
        """Record a held-out evaluation of ``prefix`` (kept in iteration order)."""
        entries = self.evaluations.setdefault(prefix, [])
        entries.append(dict(entry))
        entries.sort(key=lambda h: h["iteration"])

    def evaluation_points(self, metric: str = "reward_mean") -> dict[str, list[tuple[int, float]]]:
        """``{prefix: [(iteration, metric), ...]}`` of every evaluation recorded so far."""
        return {
            prefix: [(int(h["iteration"]), float(h.get(metric, math.nan))) for h in entries]
            for prefix, entries in self.evaluations.items()
            if entries
        }

    def state_dict(self) -> dict[str, Any]:
        """The axis position, the history, the evaluations and the failure count."""
        return {
            "step": self.step,
            "history": [dict(h) for h in self.history],
            "evaluations": {k: [dict(h) for h in v] for k, v in self.evaluations.items()},
            "failed": self.failed,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; logging continues after the saved step."""
        self.step = int(state.get("step", 0))
        self.history = [dict(h) for h in state.get("history", [])]
        evaluations = state.get("evaluations", {})
        self.evaluations = {k: [dict(h) for h in v] for k, v in evaluations.items()}
        self.failed = int(state.get("failed", 0))
