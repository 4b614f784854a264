"""Retains the iteration's rows through every critic and actor epoch; releases them once."""

from __future__ import annotations

from lppo.hooks import IterationContext, PPOCallback


class RowRetention(PPOCallback):
    """Claims the iteration's rows when they enter the store and releases them exactly once.

    Rows stay in the store through every critic and actor epoch (each epoch re-reads them) and
    are released after both phases, or by :class:`~lppo.callbacks.AbortCleanup` on failure.
    """

    def on_rollout_end(self, ctx: IterationContext) -> None:
        """Claim the rows for this iteration."""
        ctx.controller.data.store.claim(ctx.row_ids, owner=f"iteration-{ctx.iteration}")

    def on_iteration_end(self, ctx: IterationContext) -> None:
        """Release the rows once both phases are done."""
        ctx.release_rows()
