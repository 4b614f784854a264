"""Draws the reward curve (mean ± std per iteration) to a PNG at the end of training."""

from __future__ import annotations

import math
import os
from typing import Any

import lightning.pytorch as pl

from lppo.iteration.hooks import IterationContext, PPOCallback
from lppo.run.interrupts import RunInterrupted
from lppo.types import IterationResult, iteration_number


def run_dir(trainer: pl.Trainer) -> str:
    """The run directory: ``trainer.default_root_dir`` (falls back to ``trainer.log_dir``)."""
    root = getattr(trainer, "default_root_dir", None)
    if root:
        return str(root)
    return str(trainer.log_dir or os.getcwd())


def band(points: list[tuple[int, float, float, float, float]]) -> tuple[list[float], list[float]]:
    """Lower and upper edges of the drawn band: mean ± std within the iteration's min..max.

    Clipped to the rewards the iteration observed, so the band of a reward in [0, 1] stays
    in [0, 1]. ``points``: ``(iteration, mean, std, min, max)``; a non-finite std draws none.
    """
    stds = [p[2] if math.isfinite(p[2]) else 0.0 for p in points]
    lows = [max(p[1] - s, p[3]) for p, s in zip(points, stds, strict=True)]
    highs = [min(p[1] + s, p[4]) for p, s in zip(points, stds, strict=True)]
    return lows, highs


class RewardCurve(PPOCallback):
    """Collects ``rollout/reward_mean`` ± ``reward_std`` per iteration and plots them.

    Points are read from the ``IterationResult`` of every ``on_iteration_end`` and kept in
    :meth:`state_dict`, so a resumed run plots the whole curve. At ``on_train_end`` the global
    rank zero writes a PNG (matplotlib, Agg canvas) to ``<dirpath>/<filename>``; when the
    run has held-out evaluations (:class:`~lppo.callbacks.Evaluation`), their
    ``eval/reward_mean`` points (read from the run log at that moment, so resumed runs
    included) are drawn too, one series per ``prefix``. The PNG's path is recorded in the run
    log's ``files`` as ``reward_curve``.

    Args:
        filename: name of the PNG file.
        dirpath: folder of the PNG; ``None`` means the run directory
            (``trainer.default_root_dir``).
        title: plot title.
    """

    def __init__(
        self,
        filename: str = "reward_curve.png",
        dirpath: str | None = None,
        title: str = "Reward per iteration",
    ) -> None:
        super().__init__()
        self.filename = filename
        self.dirpath = dirpath
        self.title = title
        self.points: list[tuple[int, float, float, float, float]] = []
        self.eval_points: dict[str, list[tuple[int, float]]] = {}
        self._path: str | None = None
        self._trained = False  # this process reached training (else an earlier run's PNG stays)

    @property
    def path(self) -> str | None:
        """Where the PNG is (or will be) written; ``None`` before the trainer is known."""
        return self._path

    def resolve_path(self, trainer: pl.Trainer) -> str:
        """Compute (and remember) the PNG path for ``trainer``."""
        folder = self.dirpath if self.dirpath is not None else run_dir(trainer)
        self._path = os.path.join(folder, self.filename)
        return self._path

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Resolve :attr:`path` early and record it in the run log (the summary reports it)."""
        pl_module.run_log.files["reward_curve"] = self.resolve_path(trainer)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """From here on the PNG is this run's to write."""
        self._trained = True

    def on_iteration_end(self, ctx: IterationContext, result: IterationResult) -> None:
        """Record the reward of the iteration that just finished (a failed one has none)."""
        if result.failed:
            return
        stats = result.rollout
        low = stats.extra.get("reward_min", -math.inf)
        high = stats.extra.get("reward_max", math.inf)
        point = (int(result.iteration), stats.reward_mean, stats.reward_std, low, high)
        self.points = [p for p in self.points if p[0] != point[0]]
        self.points.append(point)
        self.points.sort(key=lambda p: p[0])

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Write the PNG (global rank zero only)."""
        path = self.resolve_path(trainer)
        self.eval_points = pl_module.run_log.evaluation_points("reward_mean")
        if trainer.is_global_zero:
            self.write(path)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """Write the PNG of an interrupted or failed run, its title saying so.

        A start that failed before training leaves an earlier run's PNG as it was.
        """
        status = "interrupted" if isinstance(exception, RunInterrupted) else "failed"
        path = self.resolve_path(trainer)
        if not self._trained and os.path.exists(path):
            return
        self.eval_points = pl_module.run_log.evaluation_points("reward_mean")
        if trainer.is_global_zero:
            self.write(path, subtitle=f"run {status}")

    # ------------------------------------------------------------------ drawing
    def write(self, path: str | None = None, subtitle: str = "") -> str:
        """Draw the collected points (and :attr:`eval_points`) to ``path`` and return it.

        ``path`` defaults to :attr:`path`; ``subtitle`` is appended to the title.
        """
        path = path if path is not None else self._path
        if path is None:
            raise ValueError("RewardCurve.write needs a path before the trainer is known.")
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(6.4, 4.0), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        xs = [iteration_number(p[0]) for p in self.points]
        means = [p[1] for p in self.points]
        if xs:
            ax.fill_between(xs, *band(self.points), alpha=0.25, label="± std (within min..max)")
            ax.plot(xs, means, marker="o" if len(xs) < 50 else None, label="reward mean")
        for prefix, points in sorted(self.eval_points.items()):
            ax.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                marker="s",
                linestyle="--",
                label=f"{prefix} reward mean (evaluation prompts)",
            )
        if xs or self.eval_points:
            ax.legend(loc="best")
        else:
            ax.text(0.5, 0.5, "no iterations", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel("iteration")
        ax.set_ylabel("reward")
        ax.set_title(f"{self.title} ({subtitle})" if subtitle else self.title)
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fig.savefig(path, format="png")
        self._path = path
        return path

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The collected ``(iteration, reward_mean, reward_std, reward_min, reward_max)``."""
        return {"points": [list(p) for p in self.points]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        unbounded = [-math.inf, math.inf]  # points saved before the range was recorded
        self.points = [
            (int(p[0]), *(float(v) for v in (list(p[1:]) + unbounded)[:4]))
            for p in state_dict.get("points", [])
        ]
