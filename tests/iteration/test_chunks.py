"""Collating replay rows into padded chunks and streaming a step's chunks."""

from __future__ import annotations

import torch
from _builders import filled_store, random_rows

from lppo.iteration.chunks import (
    NAMED_COLUMNS,
    collate,
    iter_chunks,
    pad_rows,
    padding_chunk,
    read_chunk,
)
from lppo.iteration.data_settings import DataSettings
from lppo.iteration.planner import ChunkPlanner
from lppo.types import (
    ADVANTAGES,
    GEN_LOGPROBS,
    INPUT_IDS,
    OLD_LOGPROBS,
    REF_LOGPROBS,
    RESPONSE_MASK,
    RETURNS,
    REWARD,
    VALUES,
    Normalizers,
    StepPlan,
)

ALL_NAMED = [OLD_LOGPROBS, ADVANTAGES, VALUES, RETURNS, REWARD]


def hand_columns() -> dict[str, list[torch.Tensor]]:
    lengths = [2, 4, 3]
    return {
        INPUT_IDS: [torch.arange(1, n + 1) * 10 + b for b, n in enumerate(lengths)],
        RESPONSE_MASK: [
            torch.tensor([False, True]),
            torch.tensor([False, True, False, True]),
            torch.tensor([False, False, True]),
        ],
        VALUES: [
            torch.full((n,), float(b + 1), dtype=torch.float64) for b, n in enumerate(lengths)
        ],
        REWARD: [torch.tensor(0.5), torch.tensor(1.5), torch.tensor(-2.0)],
        "prompt_index": [torch.tensor(7), torch.tensor(8), torch.tensor(9)],
        "pair": [torch.ones(n, 2, dtype=torch.float32) * (b + 1) for b, n in enumerate(lengths)],
    }


def test_collate_pads_right_and_maps_columns() -> None:
    cols = hand_columns()
    chunk = collate((5, 3, 9), cols)
    assert chunk.row_ids == (5, 3, 9)
    assert not chunk.is_padding
    assert chunk.input_ids.shape == (3, 4) and chunk.input_ids.dtype == torch.int64
    assert chunk.input_ids.tolist() == [[10, 20, 0, 0], [11, 21, 31, 41], [12, 22, 32, 0]]
    assert chunk.attention_mask.dtype == torch.bool
    assert chunk.attention_mask.tolist() == [
        [True, True, False, False],
        [True, True, True, True],
        [True, True, True, False],
    ]
    assert chunk.response_mask.dtype == torch.bool
    assert chunk.response_mask.tolist() == [
        [False, True, False, False],
        [False, True, False, True],
        [False, False, True, False],
    ]
    # Named token-level column: padded with zeros, dtype kept.
    assert chunk.values is not None and chunk.values.dtype == torch.float64
    assert chunk.values.tolist() == [[1, 1, 0, 0], [2, 2, 2, 2], [3, 3, 3, 0]]
    # Named row-level column: stacked to [B].
    assert chunk.reward is not None and chunk.reward.tolist() == [0.5, 1.5, -2.0]
    # Columns that were not read stay None.
    assert chunk.old_logprobs is None and chunk.advantages is None and chunk.returns is None
    assert chunk.ref_logprobs is None
    # Unknown columns land in extras: row-level stacked, token-level padded (trailing dims kept).
    assert set(chunk.extras) == {"prompt_index", "pair"}
    assert chunk.extras["prompt_index"].tolist() == [7, 8, 9]
    pair = chunk.extras["pair"]
    assert pair.shape == (3, 4, 2) and pair.dtype == torch.float32
    assert pair[0].tolist() == [[1, 1], [1, 1], [0, 0], [0, 0]]
    assert pair[2, :3].eq(3).all() and pair[2, 3].eq(0).all()
    assert chunk.num_tokens == 9
    assert chunk.num_valid_tokens == 4


def test_every_named_column_maps_to_its_attribute() -> None:
    cols = hand_columns()
    n = [len(t) for t in cols[INPUT_IDS]]
    base = {INPUT_IDS: cols[INPUT_IDS], RESPONSE_MASK: cols[RESPONSE_MASK]}
    for name, attr in NAMED_COLUMNS.items():
        col = (
            [torch.tensor(float(i)) for i in range(3)]
            if name == REWARD
            else [torch.full((k,), float(i + 1)) for i, k in enumerate(n)]
        )
        chunk = collate((0, 1, 2), {**base, name: col})
        got = getattr(chunk, attr)
        assert got is not None, name
        assert not chunk.extras
        if name == REWARD:
            assert got.tolist() == [0.0, 1.0, 2.0]
        else:
            assert got.shape == (3, 4)
            assert got.sum().item() == 1 * 2 + 2 * 4 + 3 * 3
    assert set(NAMED_COLUMNS) == {
        OLD_LOGPROBS,
        GEN_LOGPROBS,
        REF_LOGPROBS,
        VALUES,
        ADVANTAGES,
        RETURNS,
        REWARD,
    }


def test_pad_rows() -> None:
    out = pad_rows([torch.tensor([1, 2]), torch.tensor([3])], 4)
    assert out.tolist() == [[1, 2, 0, 0], [3, 0, 0, 0]]
    assert out.dtype == torch.int64


def test_read_chunk_follows_the_ids_given() -> None:
    cols = random_rows(6, seed=1)
    store = filled_store(cols)
    order = (4, 0, 5)
    chunk = read_chunk(store, order, [VALUES, REWARD, INPUT_IDS])
    assert chunk.row_ids == order
    width = max(len(cols[INPUT_IDS][i]) for i in order)
    assert chunk.input_ids.shape == (3, width)
    for b, i in enumerate(order):
        n = len(cols[INPUT_IDS][i])
        assert torch.equal(chunk.input_ids[b, :n], cols[INPUT_IDS][i])
        assert not chunk.attention_mask[b, n:].any() and chunk.attention_mask[b, :n].all()
        assert torch.equal(chunk.response_mask[b, :n], cols[RESPONSE_MASK][i])
        assert not chunk.response_mask[b, n:].any()
        assert chunk.values is not None
        assert torch.equal(chunk.values[b, :n], cols[VALUES][i])
        assert (chunk.values[b, n:] == 0).all()
        assert chunk.reward is not None and chunk.reward[b] == cols[REWARD][i]
    assert chunk.advantages is None and chunk.old_logprobs is None and not chunk.extras


def test_read_chunk_written_and_extra_columns() -> None:
    cols = random_rows(4, seed=2)
    cols["prompt_index"] = [torch.tensor(i // 2) for i in range(4)]
    store = filled_store(cols)
    ref = [torch.full((len(t),), -1.0, dtype=torch.float64) for t in cols[INPUT_IDS]]
    store.write([0, 1, 2, 3], {REF_LOGPROBS: ref})
    chunk = read_chunk(store, [3, 1], [REF_LOGPROBS, "prompt_index"])
    assert chunk.ref_logprobs is not None
    assert chunk.ref_logprobs[0, : len(ref[3])].eq(-1).all()
    assert chunk.extras["prompt_index"].tolist() == [1, 0]


class CountingStore:
    """Wraps a store and records every read, to check chunks are read lazily."""

    def __init__(self, store: object) -> None:
        self.store = store
        self.reads: list[tuple[int, ...]] = []

    def read(self, ids: list[int], names: list[str]) -> dict[str, list[torch.Tensor]]:
        self.reads.append(tuple(ids))
        return self.store.read(ids, names)


def test_iter_chunks_streams_and_pads() -> None:
    cols = random_rows(5, seed=3)
    store = CountingStore(filled_store(cols))
    plan = StepPlan(
        chunks=((2, 0), (), (4,), ()),
        normalizers=Normalizers(valid_tokens=10, valid_rows=3),
    )
    it = iter_chunks(store, plan, ALL_NAMED)  # type: ignore[arg-type]
    assert store.reads == []
    first = next(it)
    assert store.reads == [(2, 0)]
    assert first.row_ids == (2, 0) and not first.is_padding
    assert torch.equal(first.input_ids[0, : len(cols[INPUT_IDS][2])], cols[INPUT_IDS][2])
    second = next(it)
    assert second.is_padding and second.row_ids == ()
    assert second.input_ids.shape == (0, 0) and second.response_mask.shape == (0, 0)
    assert second.num_valid_tokens == 0 and second.num_tokens == 0
    assert store.reads == [(2, 0)]  # padding chunks read nothing
    rest = list(it)
    assert [c.row_ids for c in rest] == [(4,), ()]
    assert [c.is_padding for c in rest] == [False, True]
    assert store.reads == [(2, 0), (4,)]


def test_padding_chunk_shape() -> None:
    chunk = padding_chunk()
    assert chunk.is_padding and chunk.row_ids == ()
    assert chunk.input_ids.dtype == torch.int64
    assert chunk.attention_mask.dtype == torch.bool and chunk.response_mask.dtype == torch.bool
    assert chunk.old_logprobs is None and chunk.extras == {}


def test_planner_and_chunks_cover_every_valid_token_once() -> None:
    """End to end: planned chunks of every rank read back exactly the step's valid tokens."""
    cols = random_rows(17, seed=4, invalid_rows=2)
    store = filled_store(cols)
    meta = store.meta()
    budget = max(meta.lengths) * 2
    total_valid = sum(int(m.sum()) for m in cols[RESPONSE_MASK])
    for world in (1, 3):
        tokens = 0
        rows: list[int] = []
        for rank in range(world):
            planner = ChunkPlanner(
                DataSettings(budget, seed=5, drop_budget=2), world_size=world, rank=rank
            )
            epoch = planner.plan(meta, minibatches=2)
            for step in epoch.steps:
                for chunk in iter_chunks(store, step, ALL_NAMED):
                    assert chunk.input_ids.numel() <= budget
                    tokens += chunk.num_valid_tokens
                    rows.extend(chunk.row_ids)
        assert tokens == total_valid
        assert sorted(rows) == list(range(2, 17))
