"""Takes the optimizer step at the end of every step's chunks (epoch end when K = 1)."""

from __future__ import annotations

import warnings
from typing import Any

from lppo.iteration.hooks import IterationContext, PPOCallback
from lppo.types import StepStats


class SkippedStepsExceeded(RuntimeError):
    """Too many optimizer steps were skipped for non-finite gradients: training on garbage."""


class OptimizerStep(PPOCallback):
    """Calls ``finish()`` on the open module once its chunks are done and records the stats.

    With one minibatch per epoch this is the epoch-end optimizer step; with ``K`` minibatches it
    fires after each of the ``K`` steps. A step whose gradient norm is not finite takes no
    update (``stepped=False``), is warned about, counted in ``ctx.info["skipped_steps"]``, and
    counts against ``model.ppo.max_consecutive_skipped_steps`` (per module, reset by a step
    taken) and ``model.ppo.max_skipped_steps`` (per run); past either, the iteration fails with
    :class:`SkippedStepsExceeded`. The counters are this callback's state (checkpointed when
    it is among the trainer's callbacks).
    """

    def __init__(self) -> None:
        super().__init__()
        self.consecutive: dict[str, int] = {}
        self.total = 0

    def on_train_step_end(self, ctx: IterationContext) -> None:
        """Finish the open step; account for a skipped one."""
        module = ctx.module
        if module is None or not module.step_open:
            return
        stats = module.finish()
        ctx.step_stats.append(stats)
        if stats.stepped:
            self.consecutive[stats.role] = 0
            return
        ctx.info["skipped_steps"] = ctx.info.get("skipped_steps", 0) + 1
        self._skipped(ctx, stats)

    def _skipped(self, ctx: IterationContext, stats: StepStats) -> None:
        run = self.consecutive.get(stats.role, 0) + 1
        self.consecutive[stats.role] = run
        self.total += 1
        message = (
            f"{ctx.where()}: {stats.role} step skipped, {stats.skip_reason} "
            f"({run} in a row, {self.total} this run)"
        )
        cfg = ctx.config
        if run > cfg.max_consecutive_skipped_steps:
            raise SkippedStepsExceeded(
                f"{message}: more than model.ppo.max_consecutive_skipped_steps="
                f"{cfg.max_consecutive_skipped_steps}. Lower the learning rate, check the rewards "
                "and inputs for non-finite values, or raise the limit."
            )
        if cfg.max_skipped_steps is not None and self.total > cfg.max_skipped_steps:
            raise SkippedStepsExceeded(
                f"{message}: more than model.ppo.max_skipped_steps={cfg.max_skipped_steps}."
            )
        warnings.warn(message, RuntimeWarning, stacklevel=2)

    def state_dict(self) -> dict[str, Any]:
        """The skip counters."""
        return {"consecutive": dict(self.consecutive), "total": self.total}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.consecutive = {str(k): int(v) for k, v in state_dict.get("consecutive", {}).items()}
        self.total = int(state_dict.get("total", 0))
