"""Takes the optimizer step at the end of every step's chunks (epoch end when K = 1)."""

from __future__ import annotations

from lppo.hooks import IterationContext, PPOCallback


class OptimizerStep(PPOCallback):
    """Calls ``finish()`` on the open module once its chunks are done and records the stats.

    With one minibatch per epoch this is the epoch-end optimizer step; with ``K`` minibatches it
    fires after each of the ``K`` steps. A step whose gradient norm is not finite is recorded
    with ``stepped=False`` and counted in ``ctx.info["skipped_steps"]``.
    """

    def on_train_step_end(self, ctx: IterationContext) -> None:
        """Finish the open step."""
        module = ctx.module
        if module is None or not module.step_open:
            return
        stats = module.finish()
        ctx.step_stats.append(stats)
        if not stats.stepped:
            ctx.info["skipped_steps"] = ctx.info.get("skipped_steps", 0) + 1
