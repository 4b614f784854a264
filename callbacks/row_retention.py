"""Retains the iteration's rows through every critic and actor epoch; releases them once."""

from __future__ import annotations

from lppo.iteration.hooks import IterationContext, PPOCallback
from lppo.types import IterationResult


class RowRetention(PPOCallback):
    """Claims the iteration's rows when they enter the store and releases them exactly once.

    Rows stay in the store through every critic and actor epoch (each epoch re-reads them) and
    are released after both phases, or when the iteration fails. This callback is the only
    place lppo releases rows; the controller checks that it happened.
    """

    def on_rollout_end(self, ctx: IterationContext) -> None:
        """Claim the rows for this iteration."""
        ctx.store.claim(ctx.row_ids, owner=f"iteration-{ctx.iteration}")

    def on_iteration_end(self, ctx: IterationContext, result: IterationResult) -> None:
        """Release the rows once both phases are done."""
        self._release(ctx)

    def on_ppo_abort(self, ctx: IterationContext, error: BaseException) -> None:
        """Release the rows of a failed iteration (those that reached the store)."""
        self._release(ctx)

    @staticmethod
    def _release(ctx: IterationContext) -> None:
        if ctx.rows_released:
            return
        ctx.rows_released = True
        if ctx.row_ids:
            ctx.store.release(ctx.row_ids)
