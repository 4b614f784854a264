"""Cleans up a failed iteration: open steps aborted, rows released."""

from __future__ import annotations

from lppo.hooks import IterationContext, PPOCallback


class AbortCleanup(PPOCallback):
    """On any exception inside an iteration, abort open steps and release the rows.

    Aborting restores the pre-``begin`` state (no optimizer step; gradients dropped), so a
    half-trained step never leaks into the model. The controller then re-raises the error as
    :class:`~lppo.controller.IterationError` naming the iteration, phase, epoch and chunk.
    """

    def on_ppo_abort(self, ctx: IterationContext, error: BaseException) -> None:
        """Abort every open step and release the rows (exactly once)."""
        for module in ctx.controller.trainable_modules():
            if module.step_open:
                module.abort()
        ctx.release_rows()
