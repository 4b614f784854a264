"""``ReplayDataModule``: the replay store plus the chunk planner, streaming chunks on demand."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch
from lightning.pytorch import LightningDataModule

from lppo.iteration.balance import Moves, balanced_owners, move_rows
from lppo.iteration.chunks import iter_chunks
from lppo.iteration.data_settings import DataSettings
from lppo.iteration.planner import ChunkPlanner, EpochPlan, RowLayout
from lppo.parallel import SINGLE, ProcessGroup
from lppo.replay.base import ReplayStore
from lppo.replay.memory import MemoryReplayStore
from lppo.types import Chunk, StepPlan


class ReplayDataModule(LightningDataModule):
    """Owns the iteration's replay store and streams planned chunks out of it.

    Nothing is materialized beyond the chunk being trained: :meth:`stream` reads each chunk's
    rows from the store when the training loop reaches it and pads only that chunk. The
    ``data:`` settings are validated once, here, into :attr:`settings` (a
    :class:`~lppo.iteration.data_settings.DataSettings`); the planner is built once, by
    :meth:`configure`.

    Args:
        max_tokens_per_chunk: padded-token budget of one chunk (``rows × longest row``); the
            knob that bounds activation memory.
        max_tokens_per_score_chunk: padded-token budget of one chunk of the score phase
            (forward passes without gradients keep no activations, so larger chunks are
            cheap in memory and faster); ``null``: ``max_tokens_per_chunk``; ``auto`` (the
            default): :data:`~lppo.iteration.data_settings.SCORE_CHUNK_FACTOR` (4) times that.
        store: the replay backend (default: the in-process :class:`MemoryReplayStore`).
        drop_budget: samples that may be lost per iteration (invalid rows, rollout failures)
            before the iteration fails.
        fixed_rows_per_rank: every data-parallel rank trains the same number of rows per step
            (engines with fixed micro-batch shapes); requires ``drop_budget=0``.
        shuffle: shuffle rows every epoch.
        seed: base seed of the shuffles.
        balance_ranks: after each rollout, move rows between data-parallel ranks so each
            holds about the same number of tokens (exact; see :mod:`lppo.iteration.balance`); not
            applied with ``fixed_rows_per_rank``.
        share_prompts: rows that answer the same prompt compute it once in every forward over
            a chunk, and chunks keep the sample order so a prompt's samples share chunks
            (:mod:`lppo.modules.shared`; the same results to round-off). ``auto`` (the
            default): on where every model of the run supports it and prompts are long enough
            for it to pay (the run plan decides, :func:`lppo.modules.shared.decide`).

    Raises:
        ValueError: a bad setting, naming the key, the value and the fix.
    """

    def __init__(
        self,
        max_tokens_per_chunk: int = 4096,
        store: ReplayStore | None = None,
        drop_budget: int = 0,
        fixed_rows_per_rank: bool = False,
        shuffle: bool = True,
        seed: int = 0,
        max_tokens_per_score_chunk: int | Literal["auto"] | None = "auto",
        balance_ranks: bool = True,
        share_prompts: bool | Literal["auto"] = "auto",
    ) -> None:
        super().__init__()
        # Built (and so validated) here, once: a bad ``data:`` value stops the run at setup.
        self.settings = DataSettings(
            max_tokens_per_chunk=max_tokens_per_chunk,
            max_tokens_per_score_chunk=max_tokens_per_score_chunk,
            drop_budget=drop_budget,
            fixed_rows_per_rank=fixed_rows_per_rank,
            shuffle=shuffle,
            seed=seed,
            balance_ranks=balance_ranks,
            share_prompts=share_prompts,
        )
        self.store: ReplayStore = store if store is not None else MemoryReplayStore()
        self.group: ProcessGroup = SINGLE
        self._planner: ChunkPlanner | None = None
        #: The run's resources close the store (:meth:`hand_over_close`), not these hooks.
        self._close_handed_over = False
        self._store_closed = False
        self._failed = False  # the fit raised: no rank may wait for the others at close

    @staticmethod
    def check(data: object) -> ReplayDataModule:
        """``data``, the trainer's data module, if it is a :class:`ReplayDataModule`.

        Raises:
            TypeError: naming the class given and the fix.
        """
        if not isinstance(data, ReplayDataModule):
            raise TypeError(
                f"PPOSystem needs a ReplayDataModule (got {type(data).__name__}); "
                "use `data: class_path: lppo.iteration.data.ReplayDataModule`."
            )
        return data

    @property
    def planner(self) -> ChunkPlanner:
        """The chunk planner of this run, built by :meth:`configure`.

        A caller that never configures (plain Python, one process, e.g. a
        :class:`~lppo.iteration.controller.PPOController` built by hand) gets a
        single-process planner, built on first use and kept.
        """
        if self._planner is None:
            self._planner = ChunkPlanner(self.settings)
        return self._planner

    def configure(
        self,
        world_size: int = 1,
        rank: int = 0,
        max_row_length: int | None = None,
        rows_per_iteration: int | None = None,
        minibatches: int = 1,
        group: ProcessGroup = SINGLE,
        share_prompts: bool = False,
    ) -> None:
        """Set up for a run: check the run's shape, build the planner, connect the store.

        The one call setup makes (:meth:`PPOSystem.configure_model`), so the planner is built
        here, once per fit, for this rank of ``world_size``. Collective over ``group`` (the
        data-parallel ranks): a shared store starts or attaches to its services here, every
        rank on rank 0's (:meth:`ReplayStore.connect`).

        Args:
            world_size: data-parallel size.
            rank: this process's data-parallel rank.
            max_row_length: longest row the configuration can produce (prompt + new tokens).
            rows_per_iteration: rows each iteration puts into the store, when known.
            minibatches: the most optimizer steps per epoch any phase will ask for.
            group: the data-parallel process group the store is shared across.
            share_prompts: ``data.share_prompts`` as the run plan decided it (chunks keep the
                sample order).

        Raises:
            ValueError: naming the keys, the values and the fix (:meth:`DataSettings.check_run`).
        """
        self.settings.check_run(
            world_size=world_size,
            rank=rank,
            max_row_length=max_row_length,
            rows_per_iteration=rows_per_iteration,
            minibatches=minibatches,
        )
        self._planner = ChunkPlanner(self.settings, world_size, rank, sample_order=share_prompts)
        self.group = group
        self._store_closed = self._failed = False  # a new fit connects, so it closes, again
        self.store.connect(group)

    def layout(self, row_ids: Sequence[int], group: ProcessGroup = SINGLE) -> RowLayout:
        """Lengths and owners of every rank's rows (this rank's are ``row_ids``).

        One all-gather over ``group`` of the rows' metadata (no tensor is read); every rank
        gets the same layout and so plans the same steps.
        """
        return RowLayout.gather(group.all_gather_object(self.store.meta(row_ids)))

    def balance(
        self, rows: RowLayout, names: Sequence[str], group: ProcessGroup = SINGLE
    ) -> tuple[RowLayout, Moves]:
        """Re-cut ``rows`` into blocks of near-equal tokens per rank, moving rows as needed.

        Collective over ``group`` (see :func:`lppo.iteration.balance.move_rows`). With
        ``balance_ranks=false``, ``fixed_rows_per_rank`` or one rank nothing moves.

        Args:
            rows: every rank's rows as generated (:meth:`layout`).
            names: the rows' columns (what a moved row carries).
            group: the data-parallel ranks.

        Returns:
            The layout the iteration trains on, and what moved on this rank.
        """
        owners = rows.owners
        if self.settings.balance_ranks and not self.settings.fixed_rows_per_rank:
            owners = balanced_owners(rows.meta.lengths, rows.owners, group.size)
        moves = move_rows(self.store, rows, owners, names, group)
        if owners == rows.owners:
            return rows, moves
        if self.store.shared:
            return RowLayout(meta=rows.meta, owners=tuple(owners)), moves
        return self.layout(moves.owned, group), moves

    def plan(
        self,
        rows: RowLayout,
        phase: str,
        iteration: int,
        epoch: int = 0,
        minibatches: int = 1,
        dropped: int = 0,
        no_grad: bool = False,
    ) -> EpochPlan:
        """This rank's plan of one epoch of ``phase`` over the iteration's ``rows``.

        Each rank's chunks hold only rows it owns; ``no_grad=True`` packs them within
        ``max_tokens_per_score_chunk`` (see :meth:`ChunkPlanner.plan`).
        """
        return self.planner.plan(
            rows.meta,
            epoch=epoch,
            minibatches=minibatches,
            phase=phase,
            iteration=iteration,
            dropped=dropped,
            owners=rows.owners,
            no_grad=no_grad,
        )

    def stream(self, step: StepPlan, names: Sequence[str]) -> Iterator[Chunk]:
        """Yield the chunks of ``step`` with columns ``names``, reading each when reached."""
        return iter_chunks(self.store, step, names)

    def _shared_across_ranks(self) -> bool:
        return self.store.shared and self.group.size > 1

    def _barrier(self) -> None:
        self.group.all_reduce(torch.zeros(1))

    def close_store(self) -> None:
        """The store lets go of what it started (a local Ray, TransferQueue); once per fit.

        A store shared across ranks is closed on rank 0 last (after a barrier), since rank 0
        started what the others attached to; after a failed fit (:meth:`on_exception`) each
        rank closes its own at once, since the others may never reach that barrier. A second
        call does nothing (no second barrier).
        """
        if self._store_closed:
            return
        self._store_closed = True
        if self._failed or not self._shared_across_ranks():
            self.store.close()
            return
        if self.group.rank > 0:
            self.store.close()
        self._barrier()  # every other rank has let go
        if self.group.rank == 0:
            self.store.close()

    def hand_over_close(self) -> Callable[[], None]:
        """Give the store's close to the run's resources (:mod:`lppo.runtime.lifetimes`).

        Lightning tears the data module down before the model, so from its own hooks the
        store would close before the runner and engine that still put rows into it; once
        handed over, :meth:`teardown` and :meth:`on_exception` leave the store open for the
        run's resources to close in reverse start order.

        Returns:
            :meth:`close_store`, for ``RunResources.enter("store", ...)``.
        """
        self._close_handed_over = True
        return self.close_store

    def teardown(self, stage: str) -> None:
        """End of fit: close the store (:meth:`close_store`), unless handed over."""
        if not self._close_handed_over:
            self.close_store()

    def on_exception(self, exception: BaseException) -> None:
        """A failed fit (Lightning calls no ``teardown`` then): close this rank's store too.

        Handed over (:meth:`hand_over_close`), it is only noted: the run's resources close
        the store later, without a barrier.
        """
        self._failed = True
        if not self._close_handed_over:
            self.close_store()

    def state_dict(self) -> dict[str, Any]:
        """The store's content (empty at iteration boundaries).

        Every rank calls it (Lightning's checkpoint dump); with a store shared across ranks,
        a barrier first, so that every rank has released its iteration's rows.
        """
        if self._shared_across_ranks():
            self._barrier()
        return {"store": self.store.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the store's content (a shared store: rank 0 restores it for every rank).

        Every rank calls it; with a store shared across ranks only rank 0 loads, and no rank
        goes on (to put rows) before it has.
        """
        if not self._shared_across_ranks():
            self.store.load_state_dict(state_dict["store"])
            return
        if self.group.rank == 0:
            self.store.load_state_dict(state_dict["store"])
        self._barrier()
