"""Conformance suite of the ``ReplayStore`` and ``InspectableStore`` protocols, every backend.

Written only against :mod:`lppo.replay.base`; add a backend with one line in ``BACKENDS``.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import pytest
import torch
from _tq import tq_store
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

from lppo.replay import InspectableStore, MemoryReplayStore, ReplayError, ReplayStore
from lppo.types import GEN_LOGPROBS, INPUT_IDS, OLD_LOGPROBS, RESPONSE_MASK, REWARD

BACKENDS = [
    pytest.param(MemoryReplayStore, id="memory"),
    # Real Ray + TransferQueue, started once per session (tests/_tq.py).
    pytest.param(tq_store, id="transfer_queue", marks=pytest.mark.distributed),
]


class Store(ReplayStore, InspectableStore, Protocol):
    """What the suite tests: both protocols (every backend implements both)."""


SCHEMA = (INPUT_IDS, RESPONSE_MASK, GEN_LOGPROBS, REWARD, "prompt_index", "tags")
LENGTHS = {0: 5, 1: 2, 2: 9, 3: 1, 4: 7}


@pytest.fixture(params=BACKENDS)
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    s = request.param()
    yield s
    s.close()


@pytest.fixture
def other(request: pytest.FixtureRequest, store: Store) -> Iterator[Store]:
    """A second, empty store of the same backend as ``store``."""
    s = request.node.callspec.params["store"]()
    yield s
    s.close()


# --------------------------------------------------------------------------- helpers


def make_row(i: int, length: int) -> dict[str, torch.Tensor]:
    """One row with token-level, row-level and an extra rank-2 token-level column."""
    g = torch.Generator().manual_seed(1000 + i)
    mask = torch.rand(length, generator=g) > 0.4
    mask[0] = False
    return {
        INPUT_IDS: torch.randint(0, 50_000, (length,), generator=g),
        RESPONSE_MASK: mask,
        GEN_LOGPROBS: -torch.rand(length, generator=g) * mask,
        REWARD: torch.rand((), generator=g),
        "prompt_index": torch.tensor(i // 2),
        "tags": torch.randint(0, 7, (length, 3), generator=g, dtype=torch.int32),
    }


def make_cols(ids: Sequence[int], lengths: Mapping[int, int] | None = None) -> dict[str, list]:
    lengths = lengths or LENGTHS
    rows = [make_row(i, lengths.get(i, 3 + i % 5)) for i in ids]
    return {name: [r[name] for r in rows] for name in SCHEMA}


def filled(store: Store) -> Store:
    """Rows 0..4, ``old_logprobs`` written on 0 and 2, row 3 claimed, row 9 put then released."""
    store.put(list(LENGTHS), make_cols(list(LENGTHS)))
    store.write([0, 2], {OLD_LOGPROBS: [torch.zeros(LENGTHS[0]), torch.ones(LENGTHS[2])]})
    store.claim([3], "actor")
    store.put([9], make_cols([9]))
    store.release([9])
    return store


def clone_state(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, Mapping):
        return {k: clone_state(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(clone_state(v) for v in x)
    return x


def assert_same(a: Any, b: Any, path: str = "state") -> None:
    """Exact structural equality: dict key order, tensor dtype / shape / values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, Mapping):
        assert isinstance(b, Mapping) and list(a) == list(b), f"{path}: {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for k, (u, v) in enumerate(zip(a, b, strict=True)):
            assert_same(u, v, f"{path}[{k}]")
    else:
        assert a == b and type(a) is type(b), f"{path}: {a!r} != {b!r}"


def observe(store: Store) -> dict[str, Any]:
    """Everything observable through the protocol, for before / after comparisons."""
    meta = store.meta()
    names = list(store.columns())
    reads = {
        i: {n: store.read([i], [n])[n][0] for n in names if store.has(n, [i])} for i in meta.ids
    }
    return {
        "state": clone_state(store.state_dict()),
        "meta": meta,
        "columns": store.columns(),
        "claimed": store.claimed(),
        "len": len(store),
        "nbytes": store.nbytes(),
        "reads": reads,
    }


def assert_unchanged(store: Store, exc: type[BaseException], fn: Callable[[], Any]) -> None:
    before = observe(store)
    with pytest.raises(exc):
        fn()
    assert_same(before, observe(store))


def assert_rows_equal(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w)


# --------------------------------------------------------------------------- row ids


def test_allocate_hands_out_fresh_ids(store: Store, other: Store) -> None:
    assert isinstance(store.shared, bool)
    first = store.allocate(3)
    assert len(first) == 3 and len(set(first)) == 3 and len(store) == 0
    store.put(list(first), make_cols(list(first)))
    second = store.allocate(2)
    assert not set(second) & set(first)
    store.release(list(first))
    # Released ids are never handed out again, nor ids a caller put by hand.
    store.put([1000], make_cols([1000]))
    third = store.allocate(4)
    assert not set(third) & {*first, *second, 1000}
    assert store.allocate(0) == ()
    with pytest.raises(ValueError):
        store.allocate(-1)
    # The id counter survives a checkpoint.
    other.load_state_dict(store.state_dict())
    assert not set(other.allocate(5)) & {*first, *second, *third, 1000}


# --------------------------------------------------------------------------- put / read


def test_satisfies_protocol(store: Store) -> None:
    assert isinstance(store, ReplayStore) and isinstance(store, InspectableStore)
    assert issubclass(ReplayError, Exception)
    assert len(store) == 0 and store.meta().ids == () and store.nbytes() == 0


def test_put_read_variable_length(store: Store) -> None:
    ids = list(LENGTHS)
    cols = make_cols(ids)
    store.put(ids, cols)
    assert len(store) == len(ids)
    out = store.read(ids, list(SCHEMA))
    assert list(out) == list(SCHEMA)
    for name in SCHEMA:
        assert_rows_equal(out[name], cols[name])
    assert store.columns() == {
        INPUT_IDS: (torch.int64, 1),
        RESPONSE_MASK: (torch.bool, 1),
        GEN_LOGPROBS: (torch.float32, 1),
        REWARD: (torch.float32, 0),
        "prompt_index": (torch.int64, 0),
        "tags": (torch.int32, 2),
    }


def test_read_any_subset_any_order(store: Store) -> None:
    ids = list(LENGTHS)
    cols = make_cols(ids)
    store.put(ids, cols)
    order = [4, 1, 3]
    out = store.read(order, ["tags", REWARD, INPUT_IDS])
    assert list(out) == ["tags", REWARD, INPUT_IDS]
    for name in out:
        assert_rows_equal(out[name], [cols[name][ids.index(i)] for i in order])
    assert store.read([2], []) == {}
    assert store.read([], [INPUT_IDS]) == {INPUT_IDS: []}


def test_put_is_isolated_from_caller_mutation(store: Store) -> None:
    big = torch.arange(1000)
    cols = make_cols([0, 1])
    cols[INPUT_IDS] = [big[:5], big[10:12]]
    want = [t.clone() for t in cols[INPUT_IDS]]
    store.put([0, 1], cols)
    big.zero_()
    for t in cols[GEN_LOGPROBS]:
        t.fill_(7.0)
    assert_rows_equal(store.read([0, 1], [INPUT_IDS])[INPUT_IDS], want)
    assert store.read([0], [GEN_LOGPROBS])[GEN_LOGPROBS][0].ne(7.0).all()
    # Stored packed: the 1000-element parent is not held.
    expected = sum(t.numel() * t.element_size() for name in SCHEMA for t in cols[name])
    assert store.nbytes() == expected


def test_nbytes_tracks_rows(store: Store) -> None:
    store.put([0, 1], make_cols([0, 1]))
    n = store.nbytes()
    store.write([0], {"v": [torch.zeros(LENGTHS[0], dtype=torch.float64)]})
    assert store.nbytes() == n + LENGTHS[0] * 8
    store.release([0])
    assert 0 < store.nbytes() < n
    store.clear()
    assert store.nbytes() == 0


# --------------------------------------------------------------------------- write


def test_write_new_column_for_subset(store: Store) -> None:
    store.put(list(LENGTHS), make_cols(list(LENGTHS)))
    vals = [torch.randn(LENGTHS[1]), torch.randn(LENGTHS[4])]
    store.write([4, 1], {OLD_LOGPROBS: vals[::-1]})
    assert store.columns()[OLD_LOGPROBS] == (torch.float32, 1)
    assert store.has(OLD_LOGPROBS, [1, 4]) and store.has(OLD_LOGPROBS, [])
    assert not store.has(OLD_LOGPROBS, [0, 1])
    assert_rows_equal(store.read([1, 4], [OLD_LOGPROBS])[OLD_LOGPROBS], vals)
    with pytest.raises(KeyError):
        store.read([0], [OLD_LOGPROBS])
    with pytest.raises(KeyError):
        store.read([0], ["never_written"])


def test_write_columns_for_all_rows(store: Store) -> None:
    ids = list(LENGTHS)
    store.put(ids, make_cols(ids))
    values = [torch.randn(LENGTHS[i], dtype=torch.float64) for i in ids]
    score = [torch.tensor(float(i)) for i in ids]
    store.write(ids, {"values": values, "score": score})
    assert store.has("values", ids) and store.has("score", ids)
    assert store.columns()["score"] == (torch.float32, 0)
    out = store.read(ids[::-1], ["score", "values"])
    assert_rows_equal(out["values"], values[::-1])
    assert_rows_equal(out["score"], score[::-1])


def test_overwrite(store: Store) -> None:
    store.put([0, 1], make_cols([0, 1]))
    new = torch.full((LENGTHS[1],), -3.0)
    store.write([1], {GEN_LOGPROBS: [new]})
    assert_rows_equal(store.read([1], [GEN_LOGPROBS])[GEN_LOGPROBS], [new])
    store.write([1], {OLD_LOGPROBS: [torch.zeros(LENGTHS[1])]})
    store.write([1], {OLD_LOGPROBS: [torch.ones(LENGTHS[1])]})
    assert store.read([1], [OLD_LOGPROBS])[OLD_LOGPROBS][0].eq(1).all()
    new.zero_()  # the caller's later mutation does not reach the store
    assert store.read([1], [GEN_LOGPROBS])[GEN_LOGPROBS][0].eq(-3.0).all()


def test_written_columns_are_not_in_row_schema(store: Store) -> None:
    store.put([0], make_cols([0]))
    store.write([0], {OLD_LOGPROBS: [torch.zeros(LENGTHS[0])]})
    store.put([1], make_cols([1]))  # the schema does not grow with written columns
    assert not store.has(OLD_LOGPROBS, [1])


# --------------------------------------------------------------------------- meta / has


class _TensorSpy(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Any] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append(func)
        return func(*args, **(kwargs or {}))


def test_meta_without_tensor_reads(store: Store) -> None:
    ids = list(LENGTHS)
    cols = make_cols(ids)
    store.put(ids, cols)
    valid = {i: int(m.sum()) for i, m in zip(ids, cols[RESPONSE_MASK], strict=True)}
    with _TensorSpy() as spy:
        all_meta = store.meta()
        some = store.meta([3, 0, 3])
    assert spy.calls == []
    assert all_meta.ids == tuple(sorted(ids))
    assert all_meta.lengths == tuple(LENGTHS[i] for i in sorted(ids))
    assert all_meta.valid_tokens == tuple(valid[i] for i in sorted(ids))
    assert some.ids == (3, 0, 3)
    assert some.lengths == (LENGTHS[3], LENGTHS[0], LENGTHS[3])
    assert some.valid_tokens == (valid[3], valid[0], valid[3])
    assert store.meta([]).ids == ()


def test_meta_after_response_mask_overwrite(store: Store) -> None:
    store.put([0, 2], make_cols([0, 2]))
    mask = torch.zeros(LENGTHS[2], dtype=torch.bool)
    mask[3:6] = True
    store.write([2], {RESPONSE_MASK: [mask]})
    mask[:] = True  # later caller mutation is not seen
    with _TensorSpy() as spy:
        meta = store.meta([2])
    assert spy.calls == []
    assert meta.valid_tokens == (3,) and meta.lengths == (LENGTHS[2],)


def test_meta_zero_valid_without_response_mask(store: Store) -> None:
    store.put([5, 6], {INPUT_IDS: [torch.arange(4), torch.arange(2)]})
    meta = store.meta()
    assert meta.ids == (5, 6) and meta.lengths == (4, 2) and meta.valid_tokens == (0, 0)


def test_has(store: Store) -> None:
    filled(store)
    assert store.has(INPUT_IDS, [0, 1, 2, 3, 4])
    assert store.has(OLD_LOGPROBS, [2, 0])
    assert not store.has(OLD_LOGPROBS, [0, 1])
    assert not store.has("nope", [0])
    assert store.has("nope", [])


# --------------------------------------------------------------------------- claim / release


def test_claim_release_clear_len(store: Store) -> None:
    store.put(list(LENGTHS), make_cols(list(LENGTHS)))
    assert store.claimed() == {}
    store.claim([1, 3], "actor")
    store.claim([0], "critic")
    assert store.claimed() == {1: "actor", 3: "actor", 0: "critic"}
    store.release([3, 4])
    assert len(store) == 3
    assert store.claimed() == {1: "actor", 0: "critic"}
    assert store.meta().ids == (0, 1, 2)
    store.clear()
    assert len(store) == 0 and store.claimed() == {} and store.meta().ids == ()
    assert INPUT_IDS in store.columns()  # schema kept
    with pytest.raises(KeyError):
        store.read([0], [INPUT_IDS])
    with pytest.raises(KeyError):
        store.put([7], {INPUT_IDS: [torch.arange(3)]})  # schema kept after clear
    store.put([0, 3], make_cols([0, 3]))  # cleared ids are reusable
    assert len(store) == 2


def test_release_exactly_once(store: Store) -> None:
    store.put([0, 1], make_cols([0, 1]))
    store.release([0])
    assert_unchanged(store, KeyError, lambda: store.release([0]))
    assert_unchanged(store, KeyError, lambda: store.read([0], [INPUT_IDS]))
    assert_unchanged(store, KeyError, lambda: store.meta([0]))
    assert_unchanged(store, KeyError, lambda: store.write([0], {"x": [torch.tensor(1)]}))
    assert not store.has(INPUT_IDS, [0])


def test_discard_deletes_what_ids_hold_and_skips_the_rest(store: Store) -> None:
    store.put([0, 1, 2], make_cols([0, 1, 2]))
    store.claim([1], "actor")
    store.release([2])
    store.discard([1, 2, 7, 0])  # live (claimed or not), released, never put
    assert len(store) == 0 and store.claimed() == {} and store.nbytes() == 0
    assert_unchanged(store, KeyError, lambda: store.release([0]))
    store.discard([])
    store.put([4], make_cols([4]))
    assert_unchanged(store, ValueError, lambda: store.discard([4, 4]))
    store.put([1], make_cols([1]))  # a discarded id is released: it may be put again
    assert store.meta().ids == (1, 4)


def test_reuse_released_id_but_not_live(store: Store) -> None:
    store.put([0, 1], make_cols([0, 1]))
    store.claim([0], "actor")
    store.release([0])
    fresh = make_cols([0], {0: 11})
    store.put([0], fresh)
    assert store.meta([0]).lengths == (11,)
    assert store.claimed() == {}
    assert_rows_equal(store.read([0], [INPUT_IDS])[INPUT_IDS], fresh[INPUT_IDS])
    assert_unchanged(store, KeyError, lambda: store.put([1], make_cols([1])))
    assert_unchanged(store, KeyError, lambda: store.put([2, 0], make_cols([2, 0])))


# --------------------------------------------------------------------------- state dict


def _roundtrip(src: Store, dst: Store) -> None:
    before = observe(src)
    state = src.state_dict()
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    dst.load_state_dict(loaded)
    assert_same(before, observe(src))
    assert_same(before, observe(dst))
    assert_same(clone_state(state), dst.state_dict())


def test_state_dict_roundtrip(store: Store, other: Store) -> None:
    filled(store)
    store.write([1], {RESPONSE_MASK: [torch.tensor([False, True])]})
    fresh = other
    _roundtrip(store, fresh)
    # Claims, released ids and the schema survive the round trip.
    with pytest.raises(RuntimeError):
        fresh.claim([3], "critic")
    with pytest.raises(KeyError):
        fresh.release([9])
    with pytest.raises(KeyError):
        fresh.put([8], {INPUT_IDS: [torch.arange(2)]})
    with pytest.raises(TypeError):
        fresh.write([1], {OLD_LOGPROBS: [torch.zeros(LENGTHS[1], dtype=torch.float64)]})
    fresh.put([9], make_cols([9]))
    assert fresh.meta().valid_tokens[1] == 1


def test_state_dict_roundtrip_empty_and_direct(store: Store, other: Store) -> None:
    _roundtrip(store, other)
    filled(store)
    other.load_state_dict(store.state_dict())  # replaces previous content
    assert_same(observe(store), observe(other))
    store.clear()
    other.load_state_dict(store.state_dict())
    assert_same(observe(store), observe(other))


# --------------------------------------------------------------------------- bad inputs


def _cols_with(ids: Sequence[int], **changes: Any) -> dict[str, list]:
    cols = make_cols(ids)
    for name, value in changes.items():
        if value is None:
            del cols[name]
        else:
            cols[name] = value
    return cols


f32, i64 = torch.float32, torch.int64
BAD_CALLS: list[tuple[str, type[BaseException], Callable[[Store], Any]]] = [
    # put
    (
        "put-token-length",
        ValueError,
        lambda s: s.put(
            [5, 6],
            _cols_with([5, 6], **{GEN_LOGPROBS: [torch.zeros(LENGTHS.get(5, 3)), torch.zeros(1)]}),
        ),
    ),
    (
        "put-list-length",
        ValueError,
        lambda s: s.put([5, 6], _cols_with([5, 6], **{REWARD: [torch.tensor(1.0)]})),
    ),
    ("put-no-input-ids", ValueError, lambda s: s.put([5], _cols_with([5], input_ids=None))),
    ("put-duplicate-ids", ValueError, lambda s: s.put([5, 5], make_cols([5, 5]))),
    ("put-live-id", KeyError, lambda s: s.put([5, 2], make_cols([5, 2]))),
    ("put-missing-column", KeyError, lambda s: s.put([5], _cols_with([5], tags=None))),
    ("put-extra-column", KeyError, lambda s: s.put([5], _cols_with([5], extra=[torch.tensor(1)]))),
    (
        "put-written-column",
        KeyError,
        lambda s: s.put([5], _cols_with([5], **{OLD_LOGPROBS: [torch.zeros(8)]})),
    ),
    (
        "put-wrong-dtype",
        TypeError,
        lambda s: s.put(
            [5, 6],
            _cols_with(
                [5, 6], **{REWARD: [torch.tensor(1.0), torch.tensor(1.0, dtype=torch.float64)]}
            ),
        ),
    ),
    (
        "put-wrong-rank",
        TypeError,
        lambda s: s.put([5], _cols_with([5], **{REWARD: [torch.zeros(1)]})),
    ),
    (
        "put-input-ids-dtype",
        TypeError,
        lambda s: s.put([5], _cols_with([5], **{INPUT_IDS: [torch.zeros(8, dtype=torch.int32)]})),
    ),
    (
        "put-input-ids-rank",
        TypeError,
        lambda s: s.put([5], _cols_with([5], **{INPUT_IDS: [torch.zeros(1, 8, dtype=i64)]})),
    ),
    ("put-not-tensor", TypeError, lambda s: s.put([5], _cols_with([5], **{REWARD: [1.0]}))),
    # write
    ("write-unknown-id", KeyError, lambda s: s.write([1, 42], {"x": [torch.tensor(1)] * 2})),
    ("write-released-id", KeyError, lambda s: s.write([1, 9], {"x": [torch.tensor(1)] * 2})),
    ("write-input-ids", KeyError, lambda s: s.write([1], {INPUT_IDS: [torch.arange(2)]})),
    (
        "write-token-length",
        ValueError,
        lambda s: s.write(
            [1, 2], {OLD_LOGPROBS: [torch.zeros(LENGTHS[1]), torch.zeros(LENGTHS[2] + 1)]}
        ),
    ),
    ("write-list-length", ValueError, lambda s: s.write([1, 2], {"x": [torch.tensor(1)]})),
    ("write-duplicate-ids", ValueError, lambda s: s.write([1, 1], {"x": [torch.tensor(1)] * 2})),
    (
        "write-wrong-dtype",
        TypeError,
        lambda s: s.write([1], {OLD_LOGPROBS: [torch.zeros(LENGTHS[1], dtype=torch.float64)]}),
    ),
    (
        "write-wrong-rank",
        TypeError,
        lambda s: s.write([1], {OLD_LOGPROBS: [torch.zeros(LENGTHS[1], 1)]}),
    ),
    (
        "write-schema-col-dtype",
        TypeError,
        lambda s: s.write([1], {REWARD: [torch.tensor(1, dtype=i64)]}),
    ),
    (
        "write-new-col-mixed",
        TypeError,
        lambda s: s.write(
            [1, 2], {"x": [torch.zeros(LENGTHS[1], dtype=f32), torch.zeros(LENGTHS[2], dtype=i64)]}
        ),
    ),
    (
        "write-mask-dtype",
        TypeError,
        lambda s: s.write([1], {RESPONSE_MASK: [torch.ones(LENGTHS[1], dtype=i64)]}),
    ),
    (
        "write-partly-bad",
        ValueError,
        lambda s: s.write(
            [1, 2],
            {
                GEN_LOGPROBS: [torch.zeros(LENGTHS[1]), torch.zeros(LENGTHS[2])],
                "y": [torch.zeros(LENGTHS[1]), torch.zeros(1)],
            },
        ),
    ),
    # read / meta
    ("read-unknown", KeyError, lambda s: s.read([0, 42], [INPUT_IDS])),
    ("read-released", KeyError, lambda s: s.read([9], [INPUT_IDS])),
    ("read-missing-column", KeyError, lambda s: s.read([0, 1], [OLD_LOGPROBS])),
    ("meta-unknown", KeyError, lambda s: s.meta([0, 42])),
    # claim / release
    ("claim-claimed", RuntimeError, lambda s: s.claim([0, 3], "critic")),
    ("claim-unknown", KeyError, lambda s: s.claim([0, 42], "critic")),
    ("claim-released", KeyError, lambda s: s.claim([9], "critic")),
    ("claim-duplicate-ids", ValueError, lambda s: s.claim([0, 0], "critic")),
    ("release-released", KeyError, lambda s: s.release([0, 9])),
    ("release-unknown", KeyError, lambda s: s.release([0, 42])),
    ("release-duplicate-ids", ValueError, lambda s: s.release([0, 0])),
]


@pytest.mark.parametrize(("exc", "call"), [pytest.param(e, c, id=n) for n, e, c in BAD_CALLS])
def test_bad_call_raises_and_changes_nothing(
    store: Store, exc: type[BaseException], call: Callable[[Store], Any]
) -> None:
    filled(store)
    assert_unchanged(store, exc, lambda: call(store))


FIRST_PUT_BAD: list[tuple[str, type[BaseException], dict[str, list]]] = [
    ("input-ids-int32", TypeError, {INPUT_IDS: [torch.arange(3, dtype=torch.int32)]}),
    ("input-ids-rank0", TypeError, {INPUT_IDS: [torch.tensor(3)]}),
    ("mask-not-bool", TypeError, {INPUT_IDS: [torch.arange(3)], RESPONSE_MASK: [torch.ones(3)]}),
    (
        "mask-length",
        ValueError,
        {INPUT_IDS: [torch.arange(3)], RESPONSE_MASK: [torch.ones(2, dtype=torch.bool)]},
    ),
    (
        "mixed-dtype",
        TypeError,
        {INPUT_IDS: [torch.arange(3)] * 2, "r": [torch.tensor(1.0), torch.tensor(1)]},
    ),
    (
        "mixed-rank",
        TypeError,
        {INPUT_IDS: [torch.arange(3)] * 2, "r": [torch.tensor(1.0), torch.ones(3)]},
    ),
]


@pytest.mark.parametrize(("exc", "cols"), [pytest.param(e, c, id=n) for n, e, c in FIRST_PUT_BAD])
def test_bad_first_put_fixes_nothing(
    store: Store, exc: type[BaseException], cols: dict[str, list]
) -> None:
    n = len(cols[INPUT_IDS])
    assert_unchanged(store, exc, lambda: store.put(list(range(n)), cols))
    assert store.columns() == {}
    store.put([0], {INPUT_IDS: [torch.arange(2)], "other": [torch.tensor(1.0)]})
    assert set(store.columns()) == {INPUT_IDS, "other"}


def test_empty_calls_change_nothing(store: Store) -> None:
    before = observe(store)
    store.put([], {INPUT_IDS: []})
    store.write([], {"x": []})
    store.release([])
    store.claim([], "actor")
    assert_same(before, observe(store))
    store.put([0], make_cols([0]))  # the empty put did not fix the schema


# --------------------------------------------------------------------------- property test

N_IDS = 8
ROW_COLS = (INPUT_IDS, RESPONSE_MASK, REWARD)
OPS = st.sampled_from(["put", "write_tok", "write_row", "release", "bad_release", "clear"])


@pytest.mark.parametrize("factory", BACKENDS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_ops_match_model(factory: Callable[[], Store], data: st.DataObject) -> None:
    store = factory()
    try:
        _random_ops(store, data)
    finally:
        store.close()


def _random_ops(store: Store, data: st.DataObject) -> None:
    model: dict[int, dict[str, torch.Tensor]] = {}
    released: set[int] = set()
    for _ in range(data.draw(st.integers(1, 15), label="n_ops")):
        op = data.draw(OPS, label="op")
        live = sorted(model)
        if op == "put":
            free = [i for i in range(N_IDS) if i not in model]
            if not free:
                continue
            ids = data.draw(st.lists(st.sampled_from(free), min_size=1, unique=True))
            rows = {}
            for i in ids:
                n = data.draw(st.integers(0, 6))
                bits = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
                rows[i] = {
                    INPUT_IDS: torch.arange(n, dtype=torch.int64) + 100 * i,
                    RESPONSE_MASK: torch.tensor(bits, dtype=torch.bool).reshape(n),
                    REWARD: torch.tensor(data.draw(st.floats(-5, 5, width=32))),
                }
            store.put(ids, {c: [rows[i][c] for i in ids] for c in ROW_COLS})
            model.update(rows)
            released -= set(ids)
        elif op in ("write_tok", "write_row") and live:
            ids = data.draw(st.lists(st.sampled_from(live), unique=True))
            name = "tok" if op == "write_tok" else "row"
            vals = [
                torch.full((model[i][INPUT_IDS].shape[0],), float(k))
                if name == "tok"
                else torch.tensor(k, dtype=torch.int64)
                for k, i in enumerate(ids)
            ]
            store.write(ids, {name: vals})
            for i, v in zip(ids, vals, strict=True):
                model[i][name] = v
        elif op == "release" and live:
            ids = data.draw(st.lists(st.sampled_from(live), min_size=1, unique=True))
            store.release(ids)
            for i in ids:
                del model[i]
            released |= set(ids)
        elif op == "bad_release" and released:
            gone = data.draw(st.sampled_from(sorted(released)))
            ids = [*live[:1], gone]
            with pytest.raises(KeyError):
                store.release(ids)
        elif op == "clear":
            store.clear()
            released |= set(model)
            model.clear()

        assert len(store) == len(model)
        meta = store.meta()
        assert meta.ids == tuple(sorted(model))
        assert meta.lengths == tuple(model[i][INPUT_IDS].shape[0] for i in meta.ids)
        assert meta.valid_tokens == tuple(int(model[i][RESPONSE_MASK].sum()) for i in meta.ids)
        for i, row in model.items():
            got = store.read([i], list(row))
            for name, want in row.items():
                assert_rows_equal(got[name], [want])
            for name in ("tok", "row"):
                assert store.has(name, [i]) == (name in row)


def test_error_messages_name_the_culprit(store: Store) -> None:
    filled(store)
    with pytest.raises(KeyError, match="42"):
        store.read([0, 42], [INPUT_IDS])
    with pytest.raises(KeyError, match=OLD_LOGPROBS):
        store.read([1], [OLD_LOGPROBS])
    with pytest.raises(TypeError, match=r"(?s)1.*old_logprobs.*float32.*float64"):
        store.write([1], {OLD_LOGPROBS: [torch.zeros(LENGTHS[1], dtype=torch.float64)]})
    with pytest.raises(ValueError, match=r"(?s)2.*old_logprobs.*9.*4"):
        store.write([2], {OLD_LOGPROBS: [torch.zeros(4)]})
    with pytest.raises(KeyError, match="tags"):
        store.put([5], _cols_with([5], tags=None))
    with pytest.raises(RuntimeError, match="3"):
        store.claim([3], "critic")
