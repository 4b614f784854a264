"""ChunkPlanner: token budgets, exact coverage, rank alignment, seeds and configuration errors."""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import lppo.iteration.data
from lppo.iteration.data import ReplayDataModule
from lppo.iteration.data_settings import SCORE_CHUNK_FACTOR, DataSettings
from lppo.iteration.planner import (
    ChunkPlanner,
    DropBudgetExceeded,
    EpochPlan,
    NoValidRows,
    RowLayout,
)
from lppo.types import RowMeta

RUN_KEYS = ("world_size", "rank", "max_row_length", "rows_per_iteration", "minibatches")


def configured_planner(**kwargs: Any) -> ChunkPlanner:
    """A planner built as setup builds it: settings, then the run's shape, then the planner."""
    run = {k: kwargs.pop(k) for k in RUN_KEYS if k in kwargs}
    data = ReplayDataModule(**kwargs)
    data.configure(**run)
    return data.planner


def make_meta(lengths: list[int], valid: list[int], ids: list[int] | None = None) -> RowMeta:
    ids = list(range(len(lengths))) if ids is None else ids
    return RowMeta(ids=tuple(ids), lengths=tuple(lengths), valid_tokens=tuple(valid))


def plan_all_ranks(world: int, meta: RowMeta, **kw: object) -> list[EpochPlan]:
    """One plan per rank, each from its own planner (as every process would do)."""
    ctor = {k: kw.pop(k) for k in ("budget", "seed", "shuffle", "drop_budget", "fixed") if k in kw}
    return [
        ChunkPlanner(
            DataSettings(
                ctor.get("budget", 64),
                seed=ctor.get("seed", 0),
                shuffle=ctor.get("shuffle", True),
                drop_budget=ctor.get("drop_budget", 0),
                fixed_rows_per_rank=ctor.get("fixed", False),
            ),
            world_size=world,
            rank=r,
        ).plan(meta, **kw)
        for r in range(world)
    ]


@st.composite
def scenarios(draw: st.DrawFn) -> dict:
    n = draw(st.integers(1, 40))
    lengths = draw(st.lists(st.integers(1, 24), min_size=n, max_size=n))
    valid = [draw(st.integers(0, length)) for length in lengths]
    if not any(valid):
        valid[0] = 1
    # Unordered, non-contiguous ids: the planner must not assume 0..n-1.
    ids = draw(st.lists(st.integers(0, 10_000), min_size=n, max_size=n, unique=True))
    n_valid = sum(v > 0 for v in valid)
    return {
        "meta": make_meta(lengths, valid, ids),
        "budget": max(lengths) + draw(st.integers(0, 60)),
        "world": draw(st.integers(1, 4)),
        "minibatches": draw(st.integers(1, min(4, n_valid))),
        "seed": draw(st.integers(0, 1000)),
        "epoch": draw(st.integers(0, 3)),
        "dropped": draw(st.integers(0, 2)),
    }


@given(scenarios())
def test_plan_invariants(s: dict) -> None:
    meta: RowMeta = s["meta"]
    length = dict(zip(meta.ids, meta.lengths, strict=True))
    valid_tokens = dict(zip(meta.ids, meta.valid_tokens, strict=True))
    valid_ids = {i for i in meta.ids if valid_tokens[i] > 0}
    invalid_ids = tuple(i for i in meta.ids if valid_tokens[i] == 0)
    plans = plan_all_ranks(
        s["world"],
        meta,
        budget=s["budget"],
        seed=s["seed"],
        drop_budget=len(invalid_ids) + s["dropped"],
        epoch=s["epoch"],
        minibatches=s["minibatches"],
        phase="actor",
        iteration=7,
        dropped=s["dropped"],
    )
    # Every rank agrees on the epoch-level facts.
    for p in plans:
        assert p.valid_rows == plans[0].valid_rows
        assert p.invalid_rows == invalid_ids
        assert p.dropped == s["dropped"]
        assert len(p.steps) == s["minibatches"]
    assert sorted(plans[0].valid_rows) == sorted(valid_ids)

    seen: Counter[int] = Counter()
    step_sizes = []
    for k in range(s["minibatches"]):
        steps = [p.steps[k] for p in plans]
        # Same chunk count on every rank (empty tuples pad), same normalizers and metadata.
        assert len({st_.num_chunks for st_ in steps}) == 1
        assert len({st_.normalizers for st_ in steps}) == 1
        assert len({st_.padding_fraction for st_ in steps}) == 1
        assert all(st_.epoch == s["epoch"] and st_.minibatch == k for st_ in steps)
        rows = [i for st_ in steps for c in st_.chunks for i in c]
        assert len(rows) == len(set(rows))  # no row twice in a step
        seen.update(rows)
        step_sizes.append(len(rows))
        # Normalizers are the global sums over every rank's chunks.
        norm = steps[0].normalizers
        assert norm.valid_tokens == sum(valid_tokens[i] for i in rows)
        assert norm.valid_rows == len(rows)
        # Padding fraction over every real chunk of the step, all ranks.
        slots = used = 0
        for st_ in steps:
            for c in st_.chunks:
                if not c:
                    continue
                longest = max(length[i] for i in c)
                # Token budget: rows × longest row.
                assert len(c) * longest <= s["budget"]
                slots += len(c) * longest
                used += sum(length[i] for i in c)
        assert steps[0].padding_fraction == pytest.approx(1.0 - used / slots, abs=1e-12)
    # Every valid row exactly once per epoch; invalid rows never trained.
    assert set(seen) == valid_ids
    assert all(n == 1 for n in seen.values())
    # Minibatches are near-equal in rows.
    assert max(step_sizes) - min(step_sizes) <= 1
    # Steps split the shuffled order contiguously.
    flat = []
    for k in range(s["minibatches"]):
        step_rows = {i for p in plans for c in p.steps[k].chunks for i in c}
        segment = plans[0].valid_rows[len(flat) : len(flat) + len(step_rows)]
        assert set(segment) == step_rows
        flat.extend(segment)
    assert tuple(flat) == plans[0].valid_rows
    assert plans[0].padding_fraction == pytest.approx(
        sum(st_.padding_fraction for st_ in plans[0].steps) / len(plans[0].steps)
    )


@given(scenarios())
def test_fixed_rows_per_rank_gives_equal_row_counts(s: dict) -> None:
    meta: RowMeta = s["meta"]
    world, mb = s["world"], s["minibatches"]
    # Fixed rows per rank allows no drop budget: keep a multiple of world × minibatches of the
    # valid rows and nothing else.
    keep = [i for i, v in zip(meta.ids, meta.valid_tokens, strict=True) if v > 0]
    per = world * mb
    keep = keep[: len(keep) // per * per]
    if not keep:
        keep_meta = make_meta([3] * per, [1] * per)
    else:
        idx = [meta.ids.index(i) for i in keep]
        keep_meta = RowMeta(
            ids=tuple(keep),
            lengths=tuple(meta.lengths[j] for j in idx),
            valid_tokens=tuple(meta.valid_tokens[j] for j in idx),
        )
    plans = plan_all_ranks(
        world, keep_meta, budget=s["budget"], fixed=True, minibatches=mb, seed=s["seed"]
    )
    n = len(keep_meta.ids)
    for k in range(mb):
        counts = [sum(len(c) for c in p.steps[k].chunks) for p in plans]
        assert counts == [n // per] * world
        assert len({p.steps[k].num_chunks for p in plans}) == 1
        assert plans[0].steps[k].normalizers.valid_rows == n // mb


def test_invalid_rows_are_excluded_and_reported() -> None:
    meta = make_meta([5, 6, 7, 8], [2, 0, 3, 0], ids=[10, 11, 12, 13])
    plan = ChunkPlanner(DataSettings(64, drop_budget=2)).plan(meta)
    assert plan.invalid_rows == (11, 13)
    assert sorted(plan.valid_rows) == [10, 12]
    assert sorted(i for c in plan.steps[0].chunks for i in c) == [10, 12]
    assert plan.steps[0].normalizers.valid_tokens == 5
    assert plan.steps[0].normalizers.valid_rows == 2


def test_padding_chunks_keep_ranks_aligned() -> None:
    # Budget 10 and rows of length 10: one row per chunk, 5 chunks over 4 ranks.
    meta = make_meta([10] * 5, [1] * 5)
    plans = plan_all_ranks(4, meta, budget=10)
    chunks = [p.steps[0].chunks for p in plans]
    assert [len(c) for c in chunks] == [2, 2, 2, 2]
    assert sum(c.count(()) for c in chunks) == 3
    assert sorted(i for cs in chunks for c in cs for i in c) == list(range(5))
    # More ranks than chunks: some ranks train only a padding chunk.
    plans = plan_all_ranks(4, make_meta([10, 10], [1, 1]), budget=10)
    assert [p.steps[0].chunks for p in plans].count(((),)) == 2


def test_hand_packing_and_padding_fraction() -> None:
    # Budget 12; rows longest first: 6, 6 → (2×6 = 12) | 4, 3, 2 → (3×4 = 12) | nothing left.
    meta = make_meta([4, 6, 2, 6, 3], [1] * 5)
    plan = ChunkPlanner(DataSettings(12, shuffle=False)).plan(meta)
    step = plan.steps[0]
    assert [sorted(c) for c in step.chunks] == [[1, 3], [0, 2, 4]]
    used, slots = 4 + 6 + 2 + 6 + 3, 12 + 12
    assert step.padding_fraction == pytest.approx(1 - used / slots)
    assert plan.valid_rows == (0, 1, 2, 3, 4)  # shuffle=False keeps id order


def test_minibatches_split_near_equally() -> None:
    meta = make_meta([5] * 10, [2] * 10)
    plan = ChunkPlanner(DataSettings(100, seed=3)).plan(meta, minibatches=3)
    sizes = [sum(len(c) for c in s.chunks) for s in plan.steps]
    assert sorted(sizes) == [3, 3, 4]
    assert [s.normalizers.valid_rows for s in plan.steps] == sizes
    assert [s.normalizers.valid_tokens for s in plan.steps] == [2 * n for n in sizes]
    assert [s.minibatch for s in plan.steps] == [0, 1, 2]
    rows = [i for s in plan.steps for c in s.chunks for i in c]
    assert sorted(rows) == list(range(10))


def test_seeded_shuffle_is_deterministic() -> None:
    meta = make_meta([5] * 30, [1] * 30)

    def order(seed: int = 0, **kw: object) -> tuple[int, ...]:
        return ChunkPlanner(DataSettings(200, seed=seed)).plan(meta, **kw).valid_rows

    base = order(epoch=1, phase="actor", iteration=4)
    assert order(epoch=1, phase="actor", iteration=4) == base
    assert sorted(base) == list(range(30))
    assert base != tuple(range(30))
    assert order(epoch=2, phase="actor", iteration=4) != base
    assert order(epoch=1, phase="critic", iteration=4) != base
    assert order(epoch=1, phase="actor", iteration=5) != base
    assert order(seed=1, epoch=1, phase="actor", iteration=4) != base
    # The rank does not take part in the shuffle.
    other = ChunkPlanner(DataSettings(200), world_size=3, rank=2).plan(
        meta, epoch=1, phase="actor", iteration=4
    )
    assert other.valid_rows == base
    # Chunks follow the shuffle: the same seed gives the same chunks.
    a = ChunkPlanner(DataSettings(20, seed=9)).plan(meta, epoch=3, minibatches=2)
    b = ChunkPlanner(DataSettings(20, seed=9)).plan(meta, epoch=3, minibatches=2)
    assert a == b


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_tokens_per_chunk": 10, "max_row_length": 11}, r"data\.max_tokens_per_chunk=10.*11"),
        ({"max_tokens_per_chunk": 0}, r"data\.max_tokens_per_chunk=0"),
        (
            {"max_tokens_per_chunk": 64, "fixed_rows_per_rank": True, "drop_budget": 1},
            r"data\.drop_budget=1.*data\.fixed_rows_per_rank",
        ),
        (
            {
                "max_tokens_per_chunk": 64,
                "fixed_rows_per_rank": True,
                "world_size": 2,
                "minibatches": 3,
                "rows_per_iteration": 10,
            },
            r"samples_per_prompt = 10 is not divisible.*2 x 3 = 6.*data\.fixed_rows_per_rank",
        ),
        ({"max_tokens_per_chunk": 64, "drop_budget": -1}, r"data\.drop_budget=-1"),
        ({"max_tokens_per_chunk": 64, "minibatches": 0}, r"minibatches=0"),
        ({"max_tokens_per_chunk": 64, "world_size": 2, "rank": 2}, r"rank=2 world_size=2"),
        ({"max_tokens_per_chunk": 64, "world_size": 0}, r"world_size=0"),
    ],
)
def test_construction_errors_name_the_keys(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        configured_planner(**kwargs)


def test_valid_constructions() -> None:
    configured_planner(max_tokens_per_chunk=10, max_row_length=10)
    configured_planner(
        max_tokens_per_chunk=64,
        fixed_rows_per_rank=True,
        world_size=2,
        minibatches=3,
        rows_per_iteration=12,
    )
    # Divisibility only matters with fixed rows per rank.
    configured_planner(
        max_tokens_per_chunk=64, world_size=2, minibatches=3, rows_per_iteration=10, drop_budget=2
    )


def test_row_longer_than_budget_raises() -> None:
    meta = make_meta([4, 13, 5], [1, 1, 1], ids=[0, 7, 2])
    with pytest.raises(ValueError, match=r"row 7 has 13 tokens.*max_tokens_per_chunk=12"):
        ChunkPlanner(DataSettings(12)).plan(meta)


def test_drop_budget_exceeded() -> None:
    meta = make_meta([4, 4, 4], [1, 0, 0])
    with pytest.raises(DropBudgetExceeded, match=r"2 invalid rows, 0 dropped.*drop_budget=1"):
        ChunkPlanner(DataSettings(64, drop_budget=1)).plan(meta)
    with pytest.raises(DropBudgetExceeded, match=r"3 samples lost.*drop_budget=2"):
        ChunkPlanner(DataSettings(64, drop_budget=2)).plan(meta, dropped=1)
    # Exactly at the budget is fine.
    plan = ChunkPlanner(DataSettings(64, drop_budget=3)).plan(meta, dropped=1)
    assert plan.dropped == 1 and plan.invalid_rows == (1, 2)
    # Dropped samples alone count too.
    with pytest.raises(DropBudgetExceeded):
        ChunkPlanner(DataSettings(64)).plan(make_meta([4], [1]), dropped=1)


def test_no_valid_rows() -> None:
    with pytest.raises(NoValidRows, match="iteration 6"):
        ChunkPlanner(DataSettings(64, drop_budget=3)).plan(
            make_meta([4, 4, 4], [0, 0, 0]), iteration=5
        )
    with pytest.raises(NoValidRows):
        ChunkPlanner(DataSettings(64)).plan(make_meta([], []))


def test_fewer_valid_rows_than_minibatches() -> None:
    meta = make_meta([4, 4, 4], [1, 1, 0])
    with pytest.raises(ValueError, match=r"2 valid rows cannot fill 3 minibatches"):
        ChunkPlanner(DataSettings(64, drop_budget=1)).plan(meta, minibatches=3)
    with pytest.raises(ValueError, match="minibatches=0"):
        ChunkPlanner(DataSettings(64, drop_budget=1)).plan(meta, minibatches=0)
    # Fixed rows per rank needs a multiple of world × minibatches valid rows.
    with pytest.raises(ValueError, match="not divisible"):
        ChunkPlanner(DataSettings(64, fixed_rows_per_rank=True), world_size=2).plan(
            make_meta([4] * 3, [1] * 3)
        )


# ------------------------------------------------------------ the data group's settings


def test_the_no_grad_budget_is_four_training_budgets_by_default() -> None:
    assert DataSettings(max_tokens_per_chunk=640).score_budget == SCORE_CHUNK_FACTOR * 640 == 2560
    assert (
        DataSettings(max_tokens_per_chunk=640, max_tokens_per_score_chunk=None).score_budget == 640
    )
    assert DataSettings(max_tokens_per_score_chunk=100).score_budget == 100
    with pytest.raises(ValueError, match=r"data\.max_tokens_per_score_chunk='big'.*auto: 4 x"):
        DataSettings(max_tokens_per_score_chunk="big")  # type: ignore[arg-type]
    planner = ChunkPlanner(DataSettings(max_tokens_per_chunk=64))
    assert planner.max_tokens_per_score_chunk == 256


@pytest.mark.parametrize(
    ("settings", "run", "key"),
    [
        ({"max_tokens_per_chunk": 0}, {}, "data.max_tokens_per_chunk=0"),
        ({"max_tokens_per_chunk": 1.5}, {}, "data.max_tokens_per_chunk=1.5"),
        ({"max_tokens_per_chunk": float("nan")}, {}, "data.max_tokens_per_chunk=nan"),
        ({"max_tokens_per_score_chunk": 0}, {}, "data.max_tokens_per_score_chunk=0"),
        ({"drop_budget": -1}, {}, "data.drop_budget=-1"),
        ({"seed": -1}, {}, "data.seed=-1"),
        ({"fixed_rows_per_rank": True, "drop_budget": 1}, {}, "data.drop_budget=1"),
        ({"max_tokens_per_chunk": 8}, {"max_row_length": 9}, "data.max_tokens_per_chunk=8"),
        (
            {"max_tokens_per_score_chunk": 8},
            {"max_row_length": 9},
            "data.max_tokens_per_score_chunk=8",
        ),
        (
            {"fixed_rows_per_rank": True},
            {"world_size": 2, "rank": 1, "rows_per_iteration": 3},
            "data.fixed_rows_per_rank=true",
        ),
    ],
)
def test_every_data_setting_error_names_its_key(
    settings: dict[str, Any], run: dict[str, Any], key: str
) -> None:
    """Settings alone fail when the data module is built; the run's shape, at configure."""
    with pytest.raises(ValueError, match=re.escape(key)):
        DataSettings(**settings).check_run(**run)
    with pytest.raises(ValueError, match=re.escape(key)):
        ReplayDataModule(**settings).configure(**run)
    if run:  # only the run's shape is wrong: building the module still succeeds
        ReplayDataModule(**settings)


def test_the_data_module_builds_its_planner_once(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[ChunkPlanner] = []

    class CountedPlanner(ChunkPlanner):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(lppo.iteration.data, "ChunkPlanner", CountedPlanner)
    meta = make_meta([4] * 6, [1] * 6)
    layout = RowLayout(meta=meta, owners=(0,) * 6)
    data = ReplayDataModule(max_tokens_per_chunk=32, seed=4, drop_budget=1, shuffle=False)
    assert built == []  # settings only: no planner before setup
    settings = data.settings
    assert (settings.max_tokens_per_chunk, settings.seed, settings.drop_budget) == (32, 4, 1)
    assert (settings.shuffle, settings.fixed_rows_per_rank) == (False, False)
    data.configure(world_size=2, rank=1, max_row_length=8, rows_per_iteration=6, minibatches=2)
    assert len(built) == 1 and (built[0].world_size, built[0].rank) == (2, 1)
    assert built[0].settings is data.settings
    for phase in ("score", "critic", "actor"):
        data.plan(layout, phase, iteration=0, minibatches=2)
    assert len(built) == 1 and data.planner is built[0]
    # Without setup (a controller built by hand), one single-process planner on first use.
    plain = ReplayDataModule(max_tokens_per_chunk=32)
    plain.plan(layout, "actor", iteration=0)
    plain.plan(layout, "actor", iteration=0, epoch=1)
    assert len(built) == 2 and plain.planner is built[1] and built[1].world_size == 1
