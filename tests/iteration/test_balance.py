"""Token balancing over data-parallel ranks (lppo.iteration.balance): the cuts, and rows moved
between the stores of three gloo ranks, planned exactly as one process plans them."""

from __future__ import annotations

import pytest
import torch
from _builders import random_rows
from hypothesis import given
from hypothesis import strategies as st

from lppo.iteration.balance import Moves, balance_metrics, balanced_owners, rank_loads
from lppo.iteration.data import ReplayDataModule
from lppo.iteration.planner import RowLayout
from lppo.parallel import ProcessGroup
from lppo.replay import MemoryReplayStore
from lppo.types import INPUT_IDS, RowMeta


def blocks(sizes: list[int]) -> tuple[int, ...]:
    return tuple(r for r, n in enumerate(sizes) for _ in range(n))


def test_heavy_first_rank_gives_its_last_rows_to_the_next():
    lengths = [9, 9, 9, 9, 3, 3, 3, 3]
    owners = blocks([4, 4])  # 36 vs 12 tokens
    new = balanced_owners(lengths, owners, 2)
    assert new == blocks([3, 5])  # 27 vs 21: the nearest row boundary to 24
    assert rank_loads(lengths, new, 2) == [27, 21]


def test_metrics_count_moved_rows_and_the_busiest_ranks_excess():
    meta = RowMeta(ids=(0, 1, 2, 3), lengths=(9, 9, 3, 3), valid_tokens=(1, 1, 1, 1))
    generated = RowLayout(meta=meta, owners=(0, 0, 0, 1))
    rows = RowLayout(meta=meta, owners=(0, 1, 1, 1))
    assert balance_metrics(generated, rows, 2) == {"moved_rows": 2.0, "rank_token_imbalance": 0.25}


def test_balanced_rows_do_not_move():
    lengths = [5, 5, 6, 4]
    assert balanced_owners(lengths, blocks([2, 2]), 2) == blocks([2, 2])
    # a re-cut just as good (here: the same max) is not worth a move either
    assert balanced_owners([4, 6, 5, 5], blocks([2, 2]), 2) == blocks([2, 2])


def test_one_rank_no_rows_and_interleaved_owners_are_left_alone():
    assert balanced_owners([3, 9], (0, 0), 1) == (0, 0)
    assert balanced_owners([], (), 2) == ()
    assert balanced_owners([9, 1, 9, 1], (0, 1, 0, 1), 2) == (0, 1, 0, 1)


@given(
    lengths=st.lists(st.integers(1, 50), min_size=1, max_size=40),
    world=st.integers(1, 5),
    data=st.data(),
)
def test_cuts_are_contiguous_and_never_worse(lengths, world, data):
    cuts = sorted(
        data.draw(st.lists(st.integers(0, len(lengths)), min_size=world - 1, max_size=world - 1))
    )
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, len(lengths)], strict=True)]
    owners = blocks(sizes)
    new = balanced_owners(lengths, owners, world)
    assert len(new) == len(lengths) and list(new) == sorted(new) and set(new) <= set(range(world))
    before, after = rank_loads(lengths, owners, world), rank_loads(lengths, new, world)
    assert sum(after) == sum(lengths)
    assert max(after) <= max(before)
    if new != owners:  # re-cut: each block within about one row of the mean
        assert max(after) - sum(lengths) / world <= max(lengths)


# ------------------------------------------------------------------ three gloo ranks
SIZES = (7, 3, 2)  # rows generated per rank: rank 0 holds far more tokens
WORLD = len(SIZES)


def all_rows() -> dict[str, list[torch.Tensor]]:
    cols = random_rows(sum(SIZES), seed=4, min_len=4, max_len=30)
    cols["prompt_index"] = [torch.tensor(i // 2) for i in range(sum(SIZES))]
    return cols


def _rank(rank: int, init: str, out: str) -> None:
    """Put this rank's block of the rows, balance, record layout, moves, columns and plans."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        group = ProcessGroup(WORLD, rank)
        cols = all_rows()
        first = sum(SIZES[:rank])
        mine = {k: v[first : first + SIZES[rank]] for k, v in cols.items()}
        data = ReplayDataModule(max_tokens_per_chunk=64, store=MemoryReplayStore(), seed=2)
        data.configure(world_size=WORLD, rank=rank, group=group)
        # ids that differ from one process's (stores own their ids): the plan must not care
        store = data.store
        store.allocate(10 * rank + 3)
        ids = store.allocate(SIZES[rank])
        store.put(ids, mine)
        generated = data.layout(ids, group)
        rows, moves = data.balance(generated, tuple(cols), group)
        plans = [data.plan(rows, "actor", 0, epoch, minibatches=2) for epoch in range(2)]
        torch.save(
            {
                "generated": generated.owners,
                "owners": rows.owners,
                "lengths": rows.meta.lengths,
                "moves": moves,
                "owned": {i: store.read([i], list(cols)) for i in moves.owned},
                "live": store.meta().ids,
                "steps": [
                    [[store.read([i], [INPUT_IDS])[INPUT_IDS][0] for i in c] for c in s.chunks]
                    for plan in plans
                    for s in plan.steps
                ],
            },
            f"{out}.{rank}",
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_rows_move_to_balance_tokens_and_train_as_one_process_plans(tmp_path):
    import torch.multiprocessing as mp

    out = str(tmp_path / "rank")
    mp.spawn(_rank, args=(f"file://{tmp_path / 'init'}", out), nprocs=WORLD, join=True)
    got = [torch.load(f"{out}.{r}", weights_only=False) for r in range(WORLD)]
    cols = all_rows()
    lengths = [len(t) for t in cols[INPUT_IDS]]

    # Every rank sees the same layout: the rows' order and lengths unchanged, owners re-cut.
    assert all(g["owners"] == got[0]["owners"] for g in got)
    assert got[0]["lengths"] == tuple(lengths)
    assert got[0]["generated"] == blocks(list(SIZES))
    assert got[0]["owners"] == balanced_owners(lengths, blocks(list(SIZES)), WORLD)
    before = rank_loads(lengths, got[0]["generated"], WORLD)
    after = rank_loads(lengths, got[0]["owners"], WORLD)
    assert max(after) < max(before)

    # Each rank trains its new block, every column as generated; sent rows stay live (they are
    # released with the rank's rows), received ones were put into its store.
    owners = got[0]["owners"]
    moved = sum(a != b for a, b in zip(got[0]["generated"], owners, strict=True))
    assert moved > 0
    assert sum(g["moves"].sent for g in got) == sum(len(g["moves"].received) for g in got) == moved
    for r, g in enumerate(got):
        positions = [k for k, o in enumerate(owners) if o == r]
        assert len(g["owned"]) == len(positions)
        for k, i in zip(positions, g["moves"].owned, strict=True):
            for name, values in cols.items():
                assert torch.equal(g["owned"][i][name][0], values[k]), (r, k, name)
        assert len(g["live"]) == SIZES[r] + len(g["moves"].received)

    # The plans train, step by step, exactly the rows one process plans (only ranks differ).
    one = ReplayDataModule(max_tokens_per_chunk=64, store=MemoryReplayStore(), seed=2)
    ids = one.store.allocate(len(lengths))
    one.store.put(ids, cols)
    single = one.layout(ids)
    steps = [
        s for epoch in range(2) for s in one.plan(single, "actor", 0, epoch, minibatches=2).steps
    ]
    for k, step in enumerate(steps):
        want = sorted(cols[INPUT_IDS][ids.index(i)].tolist() for c in step.chunks for i in c)
        have = sorted(t.tolist() for g in got for c in g["steps"][k] for t in c)
        assert have == want, k
        assert len({len(g["steps"][k]) for g in got}) == 1  # equal chunk counts


def test_balance_off_or_fixed_rows_keep_the_generating_rank():
    meta = RowMeta(ids=(0, 1, 2, 3), lengths=(9, 9, 1, 1), valid_tokens=(1, 1, 1, 1))
    rows = RowLayout(meta=meta, owners=(0, 0, 1, 1))
    for kwargs in ({"balance_ranks": False}, {"fixed_rows_per_rank": True}):
        data = ReplayDataModule(max_tokens_per_chunk=64, **kwargs)
        assert balanced_owners(meta.lengths, rows.owners, 2) != rows.owners
        # rank 0 of two without a process group: any collective would fail
        new, moves = data.balance(rows, (), ProcessGroup(size=2, rank=0))
        assert new is rows and moves == Moves(owned=(0, 1))


def test_rows_that_must_move_without_their_columns_named_are_refused():
    meta = RowMeta(ids=(0, 1, 2, 3), lengths=(9, 9, 1, 1), valid_tokens=(1, 1, 1, 1))
    rows = RowLayout(meta=meta, owners=(0, 0, 1, 1))
    data = ReplayDataModule(max_tokens_per_chunk=64)
    with pytest.raises(ValueError, match=r"StoredRollout\.columns.*data\.balance_ranks=false"):
        data.balance(rows, (), ProcessGroup(size=2, rank=0))  # before any collective
