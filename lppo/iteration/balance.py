"""Token balancing of the data-parallel ranks: rows move between ranks after the rollout.

Each rank generates a contiguous block of the iteration's prompts, so the ranks hold equal
numbers of samples but unequal numbers of tokens (responses differ in length), and every
collective of the iteration waits for the rank with the most. After the rollout the rows are
re-cut into contiguous blocks of the sample order with token totals as close to equal as the
row boundaries allow (:func:`balanced_owners`), and the rows whose block changed move to their
new rank (:func:`move_rows`).

Why it is exact: the planner shuffles and splits positions of the iteration's sample order,
which no move changes (blocks stay contiguous and in rank order), so every step trains the
same rows as without balancing, only some on another rank; group baselines and whitening are
reduced over the ranks already. A shared store (every rank reads every row) moves nothing: the
rows change owner only.

Rows are released exactly once, by :class:`~lppo.callbacks.RowRetention`: a rank keeps the
rows it sent among its iteration's rows (released with them at the end) and adds the rows it
received, which it put into its own store.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from lppo.iteration.planner import RowLayout
from lppo.parallel import ProcessGroup
from lppo.replay.base import ReplayStore

__all__ = ["Moves", "balance_metrics", "balanced_owners", "move_rows", "rank_loads"]


def rank_loads(lengths: Sequence[int], owners: Sequence[int], world: int) -> list[int]:
    """Tokens each of ``world`` ranks holds: ``loads[r] = Σ lengths[k]`` over ``owners[k] == r``."""
    loads = [0] * world
    for n, r in zip(lengths, owners, strict=True):
        loads[r] += n
    return loads


def balance_metrics(generated: RowLayout, rows: RowLayout, world: int) -> dict[str, float]:
    """What balancing did, for the iteration's log.

    Returns:
        ``moved_rows`` (rows whose rank changed) and ``rank_token_imbalance`` (the busiest
        rank's tokens over the mean, minus 1, after the moves).
    """
    loads = rank_loads(rows.meta.lengths, rows.owners, world)
    mean = sum(loads) / world
    moved = sum(a != b for a, b in zip(generated.owners, rows.owners, strict=True))
    return {
        "moved_rows": float(moved),
        "rank_token_imbalance": max(loads) / mean - 1.0 if mean else 0.0,
    }


def balanced_owners(lengths: Sequence[int], owners: Sequence[int], world: int) -> tuple[int, ...]:
    """Owners of rows in contiguous blocks of near-equal tokens, or ``owners`` if no better.

    Cut ``k`` (``k = 1 … world − 1``) is the row boundary whose token prefix sum is nearest to
    ``k · T / world`` (``T`` = all tokens; ties go to the earlier boundary), so no block is
    further from ``T / world`` than about one row. The cuts are taken only when they lower the
    busiest rank's tokens; otherwise (and for owners not in contiguous rank order, or one
    rank) ``owners`` is returned unchanged, so balanced rows never move.

    Args:
        lengths: ``[n]`` tokens of each row, in sample order.
        owners: ``[n]`` current rank of each row.
        world: number of ranks.

    Returns:
        ``[n]`` the new rank of each row, non-decreasing.
    """
    if world == 1 or not lengths or list(owners) != sorted(owners):
        return tuple(owners)
    prefix = list(itertools.accumulate(lengths, initial=0))
    total, cuts = prefix[-1], [0]
    for k in range(1, world):
        target = total * k / world
        i = bisect.bisect_left(prefix, target, lo=cuts[-1])
        if i > cuts[-1] and (i == len(prefix) or target - prefix[i - 1] <= prefix[i] - target):
            i -= 1
        cuts.append(i)
    cuts.append(len(lengths))
    new = tuple(r for r in range(world) for _ in range(cuts[r + 1] - cuts[r]))
    if max(rank_loads(lengths, new, world)) < max(rank_loads(lengths, owners, world)):
        return new
    return tuple(owners)


@dataclass(frozen=True)
class Moves:
    """What balancing did on this rank.

    Attributes:
        owned: ids of the rows this rank trains, in sample order (ids of its own store; with
            a shared store, of the shared one).
        received: ids of the rows this rank put into its store from other ranks (they join
            its iteration's rows, to be released with them).
        sent: rows this rank sent to other ranks.
    """

    owned: tuple[int, ...]
    received: tuple[int, ...] = ()
    sent: int = 0


def move_rows(
    store: ReplayStore,
    rows: RowLayout,
    owners: Sequence[int],
    names: Sequence[str],
    group: ProcessGroup,
) -> Moves:
    """Give every row of ``rows`` to its rank in ``owners``, moving its columns if it changes.

    Collective over ``group`` when rows move between local stores: each rank reads the
    columns ``names`` of the rows it sends, sends them (:meth:`ProcessGroup.exchange_objects`)
    and puts the rows it receives, in sample order (if a put fails, every received row is
    discarded).

    Args:
        store: this rank's replay store.
        rows: every rank's rows as generated (:meth:`RowLayout.gather`).
        owners: the new rank of each row (:func:`balanced_owners`).
        names: the row schema: every column the rows were put with.
        group: the data-parallel ranks.

    Returns:
        This rank's :class:`Moves`.

    Raises:
        ValueError: this rank must send rows but ``names`` is empty.
    """
    me, ids = group.rank, rows.meta.ids
    if store.shared or tuple(owners) == rows.owners:  # every rank reads every row
        return Moves(owned=tuple(i for i, r in zip(ids, owners, strict=True) if r == me))
    moving = [(k, a, b) for k, (a, b) in enumerate(zip(rows.owners, owners, strict=True)) if a != b]
    # Only a sender reads columns (a rank that put no rows names none, and may receive).
    if not names and any(a == me for _, a, _ in moving):
        raise ValueError(
            "rows must move between data-parallel ranks to balance their tokens, but the "
            "rollout names none of their columns (StoredRollout.columns is empty); put rows "
            "with lppo.replay.rollout_rows.put_rollout, or set data.balance_ranks=false."
        )
    pairs = sorted({(a, b) for _, a, b in moving})
    outgoing = {
        b: store.read([ids[k] for k, a, d in moving if a == me and d == b], names)
        for a, b in pairs
        if a == me
    }
    incoming = group.exchange_objects(pairs, outgoing)
    new_ids: dict[int, int] = {}
    try:
        for src in sorted(incoming):
            positions = [k for k, a, b in moving if a == src and b == me]
            fresh = store.allocate(len(positions))
            new_ids.update(zip(positions, fresh, strict=True))
            store.put(fresh, incoming[src])
    except BaseException:  # nothing received is left behind: the iteration never saw it
        store.discard(list(new_ids.values()))
        raise
    owned = tuple(new_ids.get(k, ids[k]) for k, r in enumerate(owners) if r == me)
    sent = sum(a == me for _, a, _ in moving)
    return Moves(owned=owned, received=tuple(new_ids.values()), sent=sent)
