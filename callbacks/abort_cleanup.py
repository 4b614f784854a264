"""Cleans up a failed iteration: open optimizer steps are aborted."""

from __future__ import annotations

from lppo.iteration.hooks import IterationContext, PPOCallback


class AbortCleanup(PPOCallback):
    """On any exception inside an iteration, abort every open step.

    Aborting restores the pre-``begin`` state (no optimizer step; gradients dropped), so a
    half-trained step never leaks into the model. The rows are released by
    :class:`~lppo.callbacks.RowRetention`; the controller then re-raises the error as
    :class:`~lppo.errors.IterationError` naming the iteration, phase, epoch and chunk.
    """

    def on_ppo_abort(self, ctx: IterationContext, error: BaseException) -> None:
        """Abort every open step."""
        for module in ctx.modules:
            if module.step_open:
                module.abort()
