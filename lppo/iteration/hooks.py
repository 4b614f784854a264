"""lppo's own callback hooks and the per-iteration context they receive.

:class:`PPOCallback` is a Lightning :class:`~lightning.pytorch.callbacks.Callback` with extra
hooks that the controller calls during an RL iteration, so one callback object serves both
``Trainer(callbacks=[...])`` and the pure-Python :class:`~lppo.iteration.controller.PPOController`.
The context carries what callbacks act on (the store, the modules, the settings), never the
controller itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import Callback

from lppo.config import PPOConfig
from lppo.run.log import RunLog
from lppo.types import IterationResult, StepStats, iteration_label

if TYPE_CHECKING:
    from lppo.modules.lifecycle import ChunkResult, PPOModule
    from lppo.replay.base import ReplayStore
    from lppo.types import StepPlan


@dataclass
class IterationContext:
    """Where an RL iteration stands; handed to every hook.

    Attributes:
        iteration: RL iteration index (0-based).
        store: the replay store holding the iteration's rows.
        modules: the modules that take optimizer steps (critic, actor).
        config: the algorithm settings.
        phase: ``collect``, ``score``, ``advantages``, ``critic``, ``actor`` or ``release``.
        epoch: epoch inside the phase (``-1`` outside training phases).
        minibatch: optimizer step inside the epoch (``-1`` outside training phases).
        chunk: index of the chunk inside the step (``-1`` before the first).
        row_ids: ids of the iteration's rows in the replay store.
        module: the module whose step is open (actor or critic), if any.
        plan: the plan of the open step, if any.
        step_stats: statistics of every finished step of the iteration, in order.
        rows_released: set by the callback that released the iteration's rows (the controller
            checks it at the end of the iteration).
        trainer: the Lightning trainer when run under one, else ``None``.
        run_log: the run's metrics axis and history (the one place callbacks log rows and
            find what other callbacks recorded).
        info: free-form per-iteration values callbacks may share (e.g. timings).
    """

    iteration: int
    store: ReplayStore
    modules: tuple[PPOModule, ...] = ()
    config: PPOConfig = field(default_factory=PPOConfig)
    phase: str = "collect"
    epoch: int = -1
    minibatch: int = -1
    chunk: int = -1
    row_ids: tuple[int, ...] = ()
    module: PPOModule | None = None
    plan: StepPlan | None = None
    step_stats: list[StepStats] = field(default_factory=list)
    rows_released: bool = False
    trainer: Any = None
    run_log: RunLog = field(default_factory=RunLog)
    info: dict[str, Any] = field(default_factory=dict)

    def where(self) -> str:
        """Human-readable position, counted from 1 like the progress output.

        For example ``iteration 3, phase critic, epoch 1, chunk 4``.
        """
        parts = [iteration_label(self.iteration), f"phase {self.phase}"]
        if self.epoch >= 0:
            parts.append(f"epoch {self.epoch + 1}")
        if self.minibatch > 0:
            parts.append(f"minibatch {self.minibatch + 1}")
        if self.chunk >= 0:
            parts.append(f"chunk {self.chunk + 1}")
        return ", ".join(parts)


class PPOCallback(Callback):
    """A Lightning callback that also receives lppo's iteration hooks (all no-ops here)."""

    def on_rollout_end(self, ctx: IterationContext) -> None:
        """Rows of the iteration are in the store (``ctx.row_ids``)."""

    def on_phase_epoch_start(self, ctx: IterationContext) -> None:
        """A critic or actor epoch starts (``ctx.phase``, ``ctx.epoch``)."""

    def on_train_step_start(self, ctx: IterationContext) -> None:
        """A step was begun (``ctx.module``, ``ctx.plan``); no chunk trained yet."""

    def on_chunk_end(self, ctx: IterationContext, result: ChunkResult) -> None:
        """A chunk was trained or skipped (``ctx.chunk``)."""

    def on_train_step_end(self, ctx: IterationContext) -> None:
        """Every chunk of the open step is done; the step is still open."""

    def on_phase_epoch_end(self, ctx: IterationContext) -> None:
        """A critic or actor epoch ended; its steps are in ``ctx.step_stats``."""

    def on_iteration_end(self, ctx: IterationContext, result: IterationResult) -> None:
        """Both phases are done; ``result`` is what the iteration did (rows not yet released).

        Also called for a failed iteration (``result.failed`` is its error; its rows were
        released when it failed), after ``on_ppo_abort``.
        """

    def on_ppo_abort(self, ctx: IterationContext, error: BaseException) -> None:
        """The iteration failed at ``ctx.where()``; clean up."""


def abort_all(
    callbacks: Sequence[PPOCallback], ctx: IterationContext, error: BaseException
) -> None:
    """Run every ``on_ppo_abort`` hook; a failing one never hides the original error."""
    for cb in callbacks:
        try:
            cb.on_ppo_abort(ctx, error)
        except Exception as cleanup_error:
            error.add_note(
                f"lppo: {type(cb).__name__}.on_ppo_abort failed during cleanup: "
                f"{type(cleanup_error).__name__}: {cleanup_error}"
            )
    if ctx.row_ids and not ctx.rows_released:
        error.add_note(
            f"lppo: rows {ctx.row_ids[0]}..{ctx.row_ids[-1]} of the failed iteration were "
            "not released (no RowRetention callback released them)."
        )
