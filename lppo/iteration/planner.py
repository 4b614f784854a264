"""The chunk planner: which rows each rank trains, in which chunks, for every optimizer step.

The planner works from :class:`~lppo.types.RowMeta` alone (lengths and valid-token counts), so
it knows every step's global normalizers before the first chunk is read.

Per epoch: invalid rows (no valid token) are filtered out and counted against the drop budget;
the valid rows are shuffled with a seed derived from ``(seed, phase, iteration, epoch)``, split
into ``minibatches`` optimizer steps, and each step is packed into chunks whose padded size
``rows × longest row`` stays within ``max_tokens_per_chunk`` (rows sorted by length inside the
step to keep padding low, or in the iteration's sample order when prompts are shared, so that
a prompt's samples land in the same chunks; the order and make-up of chunks inside a step do
not change its gradient).
Under data parallelism each rank holds a contiguous block of the rows (``owners``: the rows it
generated, re-cut to balance tokens by :mod:`lppo.iteration.balance`): a step's rows are
the same as in one process (the shuffle runs over the iteration's sample order, whatever the
rank count), each rank packs the step's rows it owns into chunks, and every rank is padded with
empty, zero-weight chunks up to the same count, so no collective ever waits on a missing chunk.
Without owners (every rank can read every row) the step's chunks are dealt round-robin.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lppo.iteration.data_settings import DataSettings
from lppo.types import Normalizers, RowMeta, StepPlan, iteration_label


class DropBudgetExceeded(RuntimeError):
    """More samples were lost in an iteration than ``drop_budget`` allows."""


class NoValidRows(RuntimeError):
    """An iteration has no row with a valid token: nothing can be trained."""


def check_untrained(lost: int, budget: int, iteration: int) -> None:
    """An iteration dynamic sampling left with no group: its ``lost`` samples vs the budget.

    Every group's rewards were equal, so the iteration trains nothing. Its samples (the
    groups it would have trained, ``prompts_per_iteration × samples_per_prompt``, plus
    samples lost before the store) count against ``data.drop_budget`` like any lost sample:
    past it the iteration fails (a failed iteration, counted by
    ``model.ppo.max_failed_iterations``); within it the iteration is warned about and logged
    (``rollout/untrained``).

    Raises:
        DropBudgetExceeded: ``lost`` exceeds ``budget``.
    """
    what = (
        "dynamic sampling kept no prompt group (every group's rewards were equal), so the "
        f"iteration trains nothing; its {lost} samples count as lost"
    )
    if lost > budget:
        raise DropBudgetExceeded(
            f"{what} and exceed data.drop_budget={budget}. Give the task rewards that differ "
            "within a group (another task or threshold, more model.rollout.samples_per_prompt "
            "or model.rollout.dynamic_sampling_rounds); to skip such iterations raise "
            f"data.drop_budget to {lost} or model.ppo.max_failed_iterations."
        )
    warnings.warn(
        f"{iteration_label(iteration)}: {what} (within data.drop_budget={budget}).",
        RuntimeWarning,
        stacklevel=3,
    )


@dataclass(frozen=True)
class EpochPlan:
    """One rank's plan of one phase epoch.

    Attributes:
        steps: one :class:`StepPlan` per optimizer step (``minibatches`` of them).
        valid_rows: ids of the rows trained this epoch (every rank; each id in its owner's
            store), in shuffled order.
        invalid_rows: ids of rows without a valid token (never trained, still released),
            every rank's.
        dropped: samples lost before the store (rollout failures) reported by the caller.
    """

    steps: tuple[StepPlan, ...]
    valid_rows: tuple[int, ...]
    invalid_rows: tuple[int, ...]
    dropped: int

    @property
    def padding_fraction(self) -> float:
        """Mean padding fraction over the epoch's steps."""
        return sum(s.padding_fraction for s in self.steps) / max(len(self.steps), 1)


@dataclass(frozen=True)
class RowLayout:
    """Every row of an iteration over the data-parallel ranks, in the iteration's sample order.

    Attributes:
        meta: lengths and valid tokens of each row; ``meta.ids[k]`` is row ``k``'s id in the
            store of the rank that holds it.
        owners: the data-parallel rank holding each row (all 0 in one process).
    """

    meta: RowMeta
    owners: tuple[int, ...]

    @classmethod
    def gather(cls, parts: Sequence[RowMeta]) -> RowLayout:
        """The layout of every rank's rows (``parts[r]``: rank ``r``'s, in its sample order).

        Ranks generate contiguous blocks of prompts in rank order, so concatenating their rows
        in rank order gives the iteration's sample order.
        """
        return cls(
            meta=RowMeta(
                ids=tuple(i for m in parts for i in m.ids),
                lengths=tuple(n for m in parts for n in m.lengths),
                valid_tokens=tuple(n for m in parts for n in m.valid_tokens),
            ),
            owners=tuple(r for r, m in enumerate(parts) for _ in m.ids),
        )


def _seed(*parts: object) -> int:
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


class ChunkPlanner:
    """Plans token-budget chunks, shuffled minibatches and data-parallel shards.

    Args:
        settings: the data group's settings (budgets, drop budget, fixed rows per rank,
            shuffle, seed), validated when they were built.
        world_size: data-parallel size.
        rank: this process's data-parallel rank.
        sample_order: pack each step's rows in the iteration's sample order, not by length
            (``data.share_prompts``: a prompt's samples are adjacent in that order).

    Attributes:
        max_tokens_per_chunk: padded-token budget of a chunk of a training pass.
        max_tokens_per_score_chunk: padded-token budget of a chunk of a no-grad pass
            (``plan(..., no_grad=True)``), resolved from the settings.

    Raises:
        ValueError: ``rank`` and ``world_size`` are inconsistent.
    """

    def __init__(
        self, settings: DataSettings, world_size: int = 1, rank: int = 0, sample_order: bool = False
    ) -> None:
        settings.check_run(world_size=world_size, rank=rank)
        self.settings = settings
        self.sample_order = sample_order
        self.world_size = world_size
        self.rank = rank
        self.max_tokens_per_chunk = settings.max_tokens_per_chunk
        self.max_tokens_per_score_chunk = settings.score_budget

    # ------------------------------------------------------------------ public
    def plan(
        self,
        meta: RowMeta,
        epoch: int = 0,
        minibatches: int = 1,
        phase: str = "train",
        iteration: int = 0,
        dropped: int = 0,
        owners: Sequence[int] | None = None,
        no_grad: bool = False,
    ) -> EpochPlan:
        """Plan one epoch of one phase for this rank.

        Args:
            meta: lengths and valid-token counts of every row of the iteration (all ranks), in
                the iteration's sample order (the shuffle is over positions in this order, so
                the same rows in the same order give the same plan whatever ``ids`` they have).
            epoch: phase epoch (part of the shuffle seed).
            minibatches: optimizer steps in the epoch.
            phase: phase name (part of the shuffle seed), e.g. ``"actor"``.
            iteration: RL iteration (part of the shuffle seed).
            dropped: samples lost before reaching the store, on all ranks (count against the
                drop budget).
            owners: the data-parallel rank holding each row of ``meta`` (its ``ids`` are ids of
                that rank's store): each rank's chunks are packed from its own rows only.
                ``None``: every rank can read every row and chunks are dealt round-robin.
            no_grad: pack chunks within ``max_tokens_per_score_chunk`` (passes without
                gradients, which keep no activations).

        Returns:
            The :class:`EpochPlan`.

        Raises:
            DropBudgetExceeded: invalid rows plus ``dropped`` exceed the drop budget.
            NoValidRows: no row has a valid token.
            ValueError: a row longer than the chunk budget, fewer valid rows than steps, or
                ``owners`` of the wrong length.
        """
        keys = range(len(meta.ids))
        if owners is not None and len(owners) != len(meta.ids):
            raise ValueError(f"{len(owners)} owners for {len(meta.ids)} rows")
        budget = self._budget(meta, no_grad)
        valid = [k for k in keys if meta.valid_tokens[k] > 0]
        invalid = tuple(meta.ids[k] for k in keys if meta.valid_tokens[k] == 0)
        self._check_counts(len(meta.ids), len(valid), len(invalid), dropped, iteration, minibatches)
        order = self._shuffled(valid, phase, iteration, epoch)
        steps = [
            self._plan_step(rows, meta, owners, epoch, k, budget)
            for k, rows in enumerate(self._minibatches(order, owners, minibatches))
        ]
        return EpochPlan(
            steps=tuple(steps),
            valid_rows=tuple(meta.ids[k] for k in order),
            invalid_rows=invalid,
            dropped=dropped,
        )

    # ----------------------------------------------------------------- helpers
    def _budget(self, meta: RowMeta, no_grad: bool) -> int:
        """The chunk budget of this pass; every row must fit in it."""
        budget = self.max_tokens_per_score_chunk if no_grad else self.max_tokens_per_chunk
        longest = max(meta.lengths, default=0)
        if longest > budget:
            worst = meta.ids[meta.lengths.index(longest)]
            key = "max_tokens_per_score_chunk" if no_grad else "max_tokens_per_chunk"
            raise ValueError(
                f"row {worst} has {longest} tokens, above data.{key}={budget}; raise "
                f"data.{key} to at least {longest}."
            )
        return budget

    def _shuffled(self, valid: list[int], phase: str, iteration: int, epoch: int) -> list[int]:
        """``valid`` in this epoch's order: a permutation seeded by the epoch's identity."""
        if not self.settings.shuffle:
            return list(valid)
        seed = _seed(self.settings.seed, phase, iteration, epoch)
        gen = torch.Generator().manual_seed(seed)
        return [valid[i] for i in torch.randperm(len(valid), generator=gen).tolist()]

    def _check_counts(
        self, rows: int, valid: int, invalid: int, dropped: int, iteration: int, minibatches: int
    ) -> None:
        lost, budget = invalid + dropped, self.settings.drop_budget
        if lost > budget:
            raise DropBudgetExceeded(
                f"{lost} samples lost this iteration ({invalid} invalid rows, {dropped} "
                f"dropped before the store) exceed data.drop_budget={budget}; raise "
                "data.drop_budget or fix the rollouts that produce empty / masked responses."
            )
        if not valid:
            raise NoValidRows(
                f"none of the {rows} rows of {iteration_label(iteration)} has a valid "
                "response token; nothing can be trained (check response masking, overlong "
                "filtering and the rollout engine)."
            )
        if minibatches < 1:
            raise ValueError(f"minibatches={minibatches} must be >= 1.")
        world = self.world_size
        if valid < minibatches * (world if self.settings.fixed_rows_per_rank else 1):
            raise ValueError(
                f"{valid} valid rows cannot fill {minibatches} minibatches; lower the "
                "number of minibatches or collect more rows per iteration."
            )
        if self.settings.fixed_rows_per_rank and valid % (world * minibatches) != 0:
            raise ValueError(
                f"{valid} valid rows are not divisible by {world} ranks x "
                f"{minibatches} minibatches while data.fixed_rows_per_rank=true."
            )

    def _minibatches(
        self, order: list[int], owners: Sequence[int] | None, minibatches: int
    ) -> list[list[int]]:
        """The rows of each optimizer step: contiguous pieces of the shuffled order.

        With ``fixed_rows_per_rank`` and owned rows, each rank's own rows (in shuffled order)
        are split instead, so every rank holds the same number of rows of every step.
        """
        if owners is None or not self.settings.fixed_rows_per_rank or self.world_size == 1:
            return _split(order, minibatches)
        own = [[k for k in order if owners[k] == r] for r in range(self.world_size)]
        if len({len(rows) for rows in own}) > 1:
            raise ValueError(
                f"data.fixed_rows_per_rank=true needs every rank to hold the same number of "
                f"valid rows, got {[len(rows) for rows in own]} per rank; make "
                "model.rollout.prompts_per_iteration / model.rollout.prompts_per_block a "
                "multiple of the number of ranks, or set data.fixed_rows_per_rank=false."
            )
        parts = [_split(rows, minibatches) for rows in own]
        return [[k for p in parts for k in p[m]] for m in range(minibatches)]

    def _plan_step(
        self,
        rows: list[int],
        meta: RowMeta,
        owners: Sequence[int] | None,
        epoch: int,
        minibatch: int,
        budget: int,
    ) -> StepPlan:
        """This rank's chunks of one step (``rows`` are positions in ``meta``)."""
        world, length = self.world_size, meta.lengths
        if owners is not None:
            per_rank = [
                self._pack([k for k in rows if owners[k] == r], length, budget)
                for r in range(world)
            ]
        elif self.settings.fixed_rows_per_rank:
            per_rank = [self._pack(share, length, budget) for share in _split(rows, world)]
        else:
            chunks = self._pack(rows, length, budget)
            per_rank = [chunks[r::world] for r in range(world)]
        width = max(len(c) for c in per_rank)
        mine = per_rank[self.rank] + [()] * (width - len(per_rank[self.rank]))
        slots = sum(len(c) * max(length[k] for k in c) for cs in per_rank for c in cs)
        used = sum(length[k] for k in rows)
        return StepPlan(
            chunks=tuple(tuple(meta.ids[k] for k in c) for c in mine),
            normalizers=Normalizers(
                valid_tokens=sum(meta.valid_tokens[k] for k in rows), valid_rows=len(rows)
            ),
            epoch=epoch,
            minibatch=minibatch,
            padding_fraction=1.0 - used / slots if slots else 0.0,
        )

    def _pack(self, rows: list[int], length: Sequence[int], budget: int) -> list[tuple[int, ...]]:
        """Greedy packing (longest first, or in sample order): ``rows × longest ≤ budget``."""
        ordered = sorted(rows) if self.sample_order else sorted(rows, key=lambda i: -length[i])
        chunks: list[tuple[int, ...]] = []
        current: list[int] = []
        longest = 0
        for i in ordered:
            if current and (len(current) + 1) * max(longest, length[i]) > budget:
                chunks.append(tuple(current))
                current, longest = [], 0
            current.append(i)
            longest = max(longest, length[i])
        if current:
            chunks.append(tuple(current))
        return chunks


def _split(items: list[int], parts: int) -> list[list[int]]:
    """Split ``items`` into ``parts`` contiguous pieces whose sizes differ by at most one."""
    base, extra = divmod(len(items), parts)
    out, start = [], 0
    for p in range(parts):
        size = base + (1 if p < extra else 0)
        out.append(items[start : start + size])
        start += size
    return out
