"""Packed storage of ``MemoryReplayStore``: segments, compaction, freeing, bounded ``nbytes``.

Backend-specific (the protocol leaves ``nbytes``' exact accounting to the backend); the
conformance suite covers the behaviour every backend shares.
"""

from __future__ import annotations

import io
import random
from itertools import pairwise

import pytest
import torch

from lppo.replay import MemoryReplayStore
from lppo.replay._ids import IdRanges
from lppo.types import INPUT_IDS, RESPONSE_MASK

F32 = 4


def nb(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def rows(n: int, seed: int = 0, lo: int = 20, hi: int = 200) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(lo, hi)
        mask = torch.rand(length, generator=g) > 0.3
        out.append(
            {
                INPUT_IDS: torch.randint(0, 1000, (length,), generator=g),
                RESPONSE_MASK: mask,
                "values": torch.randn(length, generator=g),
            }
        )
    return out


def put_all(store: MemoryReplayStore, ids: list[int], data: list[dict]) -> None:
    store.put(ids, {k: [r[k] for r in data] for k in (INPUT_IDS, RESPONSE_MASK)})


def chunks(ids: list[int], size: int, seed: int) -> list[list[int]]:
    ids = list(ids)
    random.Random(seed).shuffle(ids)
    return [ids[i : i + size] for i in range(0, len(ids), size)]


def test_one_call_is_stored_exact() -> None:
    store = MemoryReplayStore()
    data = rows(50)
    put_all(store, list(range(50)), data)
    assert store.nbytes() == sum(nb(r[k]) for r in data for k in (INPUT_IDS, RESPONSE_MASK))


def test_release_all_frees_everything() -> None:
    store = MemoryReplayStore()
    data = rows(40)
    put_all(store, list(range(40)), data)
    store.write(list(range(40)), {"values": [r["values"] for r in data]})
    store.release(list(range(0, 40, 2)))
    assert store.nbytes() > 0
    store.release(list(range(1, 40, 2)))
    assert len(store) == 0 and store.nbytes() == 0
    put_all(store, [0], data[:1])  # released ids come back, on a fresh layout
    assert store.nbytes() == nb(data[0][INPUT_IDS]) + nb(data[0][RESPONSE_MASK])


def test_overwriting_every_row_of_a_segment_frees_it() -> None:
    store = MemoryReplayStore()
    data = rows(8, lo=50, hi=50)  # equal lengths: each half is exactly half of a segment
    ids = list(range(8))
    put_all(store, ids, data)
    base = store.nbytes()
    store.write(ids, {"values": [r["values"] for r in data]})  # a new column: exact
    col = 8 * 50 * F32
    assert store.nbytes() == base + col
    values = store._data["values"]
    (first,) = values.segs
    store.write(ids[:4], {"values": [r["values"] + 1 for r in data[:4]]})
    # the first segment is half dead (not more): kept, beside a new tail with room to spare
    assert first in values.segs and values.segs[first].live == 4 * 50
    held = store.nbytes()
    assert held > base + col + col // 2
    store.write(ids[4:], {"values": [r["values"] + 1 for r in data[4:]]})
    # no live run left in the first segment: freed; the second half went to the tail's room
    assert first not in values.segs and len(values.segs) == 1
    assert store.nbytes() == held - col
    got = store.read(ids, ["values"])["values"]
    assert all(torch.equal(g, r["values"] + 1) for g, r in zip(got, data, strict=True))


def test_more_than_half_dead_segment_is_compacted() -> None:
    store = MemoryReplayStore()
    data = rows(4, lo=30, hi=30)
    put_all(store, [0, 1, 2, 3], data)
    store.write([0, 1, 2, 3], {"values": [r["values"] for r in data]})
    store.release([0, 2])  # half of every segment dead: nothing compacted yet
    assert store.nbytes() == 4 * 30 * (8 + 1 + F32)
    store.release([3])  # three quarters dead: every segment compacted to row 1 alone
    assert store.nbytes() == 30 * (8 + 1 + F32)
    out = store.read([1], [INPUT_IDS, RESPONSE_MASK, "values"])
    for name in out:
        assert torch.equal(out[name][0], data[1][name])
    assert store.meta([1]).valid_tokens == (int(data[1][RESPONSE_MASK].sum()),)


def test_one_row_puts_are_packed_within_ten_percent() -> None:
    store = MemoryReplayStore()
    data = rows(600, lo=80, hi=500)
    raw = 0
    for i, r in enumerate(data):
        store.put([i], {k: [v] for k, v in r.items()})
        raw += sum(nb(v) for v in r.values())
    assert raw <= store.nbytes() <= 1.1 * raw
    for name in (INPUT_IDS, "values"):
        col = store._data[name]
        assert len(col.segs) < 100  # a few flat tensors, not one per row
    got = store.read([599, 0, 300], [INPUT_IDS, "values"])
    for name, tensors in got.items():
        for t, i in zip(tensors, [599, 0, 300], strict=True):
            assert torch.equal(t, data[i][name])


@pytest.mark.parametrize("one_by_one", [False, True])
def test_nbytes_bounded_across_iterations(one_by_one: bool) -> None:
    """put -> values, advantages twice, returns (chunk by chunk) -> release, repeated."""
    store = MemoryReplayStore()
    n = 400
    data = rows(n, seed=3)
    raw = sum(nb(r[k]) for r in data for k in (INPUT_IDS, RESPONSE_MASK)) + sum(
        3 * nb(r["values"]) for r in data
    )
    peaks, after = [], []
    for it in range(6):
        ids = list(range(it * n, (it + 1) * n))
        if one_by_one:
            for i, r in zip(ids, data, strict=True):
                put_all(store, [i], [r])
        else:
            put_all(store, ids, data)
        peak = 0
        for name, seed in (("values", 1), ("advantages", 2), ("advantages", 3), ("returns", 4)):
            for c in chunks(list(range(n)), 16, seed + it):
                store.write([ids[j] for j in c], {name: [data[j]["values"] * seed for j in c]})
                peak = max(peak, store.nbytes())
        assert store.nbytes() <= 1.1 * raw  # every column fully written once more: packed
        got = store.read(ids[:3], ["advantages"])["advantages"]
        assert all(torch.equal(g, r["values"] * 3) for g, r in zip(got, data[:3], strict=True))
        peaks.append(peak)
        store.release(ids)
        after.append(store.nbytes())
    assert after == [0] * 6
    assert max(peaks) <= min(2 * raw, 1.1 * min(peaks))  # other write orders, no growth


def test_sliding_window_stays_bounded() -> None:
    """Rows released in put order while new ones come: held bytes track the live bytes."""
    store = MemoryReplayStore()
    data = rows(400, seed=5)
    live: list[int] = []
    for i, r in enumerate(data):
        store.put([i], {k: [v] for k, v in r.items()})
        store.write([i], {"extra": [r["values"] * 2]})
        live.append(i)
        if len(live) > 100:
            store.release([live.pop(0)])
        live_bytes = sum(sum(nb(v) for v in data[j].values()) + nb(data[j]["values"]) for j in live)
        assert store.nbytes() <= 2 * live_bytes + 4 * (16 << 10)
    got = store.read(live[-2:], ["extra"])["extra"]
    assert all(torch.equal(g, data[j]["values"] * 2) for g, j in zip(got, live[-2:], strict=True))


def test_reads_are_fresh_and_state_views_never_change() -> None:
    store = MemoryReplayStore()
    data = rows(10, lo=5, hi=9)
    ids = list(range(10))
    put_all(store, ids, data)
    store.write(ids, {"values": [r["values"].requires_grad_() for r in data]})
    first = store.read(ids, [INPUT_IDS, "values"])
    assert not any(t.requires_grad for t in first["values"])
    for t in first[INPUT_IDS]:
        t.fill_(-1)
    again = store.read(ids, [INPUT_IDS])[INPUT_IDS]
    assert all(torch.equal(a, r[INPUT_IDS]) for a, r in zip(again, data, strict=True))

    state = store.state_dict()
    frozen = {n: [t.clone() for t in c["segments"]] for n, c in state["data"].items()}
    store.write(ids, {"values": [torch.zeros(r["values"].shape[0]) for r in data]})
    store.write(ids[:3], {"more": [torch.ones(()) for _ in range(3)]})
    store.release(ids[:7])  # compaction and freeing
    for name, tensors in frozen.items():
        for t, u in zip(tensors, state["data"][name]["segments"], strict=True):
            assert torch.equal(t, u)
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    back = MemoryReplayStore()
    back.load_state_dict(torch.load(buf, weights_only=True))
    got = back.read(ids, ["values"])["values"]
    assert all(torch.equal(g, r["values"]) for g, r in zip(got, data, strict=True))


def test_empty_rows_survive_freeing_of_their_neighbours() -> None:
    store = MemoryReplayStore()
    lengths = [0, 3, 0, 4, 0]
    store.put(list(range(5)), {INPUT_IDS: [torch.arange(n) for n in lengths]})
    store.write([0, 1, 2], {"v": [torch.zeros(n) for n in lengths[:3]]})
    store.release([1, 3])  # every non-empty run gone; the empty ones keep their segments
    out = store.read([0, 2, 4], [INPUT_IDS])[INPUT_IDS]
    assert [t.shape for t in out] == [torch.Size([0])] * 3
    assert [t.shape for t in store.read([0, 2], ["v"])["v"]] == [torch.Size([0])] * 2
    store.release([0, 2, 4])
    assert store.nbytes() == 0


def test_rank2_rows_with_varying_trailing_shapes() -> None:
    store = MemoryReplayStore()
    tags = [torch.arange(6, dtype=torch.int32).reshape(3, 2), torch.ones(2, 5, dtype=torch.int32)]
    store.put([0, 1], {INPUT_IDS: [torch.arange(3), torch.arange(2)], "tags": tags})
    store.write([1], {"tags": [torch.full((2, 1), 7, dtype=torch.int32)]})
    store.release([0])
    got = store.read([1], ["tags"])["tags"][0]
    assert got.shape == (2, 1) and got.eq(7).all()
    (tags,) = store._data["tags"].segs.values()  # row 0's segment freed, row 1's old run too
    assert tags.live == tags.used == 2


def test_tables_widen_past_int32() -> None:
    store = MemoryReplayStore()
    put_all(store, [0, 1], rows(2))
    col = store._data[INPUT_IDS]
    col._next = 2**31 + 5  # the next segment id no longer fits an int32 table
    store.put([2], {INPUT_IDS: [torch.arange(4)], RESPONSE_MASK: [torch.ones(4, dtype=torch.bool)]})
    assert col.seg.typecode == "q"
    store.release([0, 1])
    assert torch.equal(store.read([2], [INPUT_IDS])[INPUT_IDS][0], torch.arange(4))
    other = MemoryReplayStore()
    other.load_state_dict(store.state_dict())
    assert torch.equal(other.read([2], [INPUT_IDS])[INPUT_IDS][0], torch.arange(4))


def test_inconsistent_layout_is_rejected_without_change() -> None:
    store = MemoryReplayStore()
    put_all(store, [0, 1], rows(2))
    good = store.state_dict()
    target = MemoryReplayStore()
    put_all(target, [5], rows(1, seed=9))
    before = target.state_dict()
    bad = dict(good, data=dict(good["data"]))
    bad["data"][INPUT_IDS] = dict(good["data"][INPUT_IDS], start=torch.tensor([0, 10**6]))
    with pytest.raises(ValueError):
        target.load_state_dict(bad)
    bad["data"][INPUT_IDS] = dict(good["data"][INPUT_IDS], capacity=[-1])
    with pytest.raises(ValueError):
        target.load_state_dict(bad)
    assert target.state_dict()["ids"] == before["ids"] == [5]
    assert target.nbytes() == sum(nb(t) for t in before["data"][INPUT_IDS]["segments"]) + sum(
        nb(t) for t in before["data"][RESPONSE_MASK]["segments"]
    )


def test_released_ids_are_kept_as_ranges() -> None:
    store = MemoryReplayStore()
    data = rows(50, lo=3, hi=6)
    for it in range(4):  # ids handed out in sequence, as the controller does
        ids = list(range(it * 50, (it + 1) * 50))
        put_all(store, ids, data)
        store.release(ids[::2])
        store.release(ids[1::2])
    assert store.state_dict()["released"] == [[0, 200]]
    put_all(store, [70], data[:1])  # reusing a released id splits its range
    store.clear()
    assert store.state_dict()["released"] == [[0, 200]]
    with pytest.raises(KeyError, match="released"):
        store.release([199])
    with pytest.raises(KeyError, match="unknown"):
        store.release([200])


def test_id_ranges_match_a_set() -> None:
    rng = random.Random(0)
    ranges, model = IdRanges(), set()
    for _ in range(3000):
        i = rng.randrange(-20, 60)
        if rng.random() < 0.6:
            ranges.add(i)
            model.add(i)
        else:
            ranges.discard(i)
            model.discard(i)
        pairs = ranges.ranges()
        assert {j for lo, hi in pairs for j in range(lo, hi)} == model
        assert all(hi < lo2 for (_, hi), (lo2, _) in pairwise(pairs))
        assert all((j in ranges) == (j in model) for j in range(-22, 62))
    assert IdRanges.from_ranges([[5, 7], [0, 5]]).ranges() == [[0, 7]]
    with pytest.raises(ValueError):
        IdRanges.from_ranges([[0, 5], [4, 6]])
    with pytest.raises(ValueError):
        IdRanges.from_ranges([[3, 3]])
