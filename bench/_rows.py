"""The benchmark's rows: deterministic random rows, and a replay store filled with them."""

from __future__ import annotations

import gc
import random
from collections.abc import Iterator, Mapping, Sequence

import torch
from _memory import anon_bytes

from lppo.replay import MemoryReplayStore
from lppo.types import INPUT_IDS, RESPONSE_MASK, RETURNS, VALUES, RowMeta

#: The columns every row has, in the order they are put into the store.
FIELDS = (INPUT_IDS, RESPONSE_MASK, VALUES, RETURNS)

Row = dict[str, torch.Tensor]


def gen_row(rng: random.Random, gen: torch.Generator, vocab: int) -> Row:
    """One row: prompt 16–64 + response 16–448 tokens; float fields 0 off the response."""
    p, r = rng.randint(16, 64), rng.randint(16, 448)
    n = p + r
    ids = torch.randint(0, vocab, (n,), generator=gen, dtype=torch.int64)
    mask = torch.zeros(n, dtype=torch.bool)
    mask[p:] = True
    values = torch.randn(n, generator=gen) * 0.5
    returns = values + torch.randn(n, generator=gen) * 0.3
    return {
        INPUT_IDS: ids,
        RESPONSE_MASK: mask,
        VALUES: torch.where(mask, values, 0.0),
        RETURNS: torch.where(mask, returns, 0.0),
    }


def iter_rows(n_rows: int, seed: int, vocab: int) -> Iterator[Row]:
    """Deterministic rows; the first k rows are the same for any ``n_rows >= k``."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n_rows):
        yield gen_row(rng, gen, vocab)


def row_meta(rows: Mapping[int, Row]) -> RowMeta:
    """What ``store.meta()`` would answer for ``rows``, without a store (floor variant)."""
    return RowMeta(
        ids=tuple(rows),
        lengths=tuple(int(r[INPUT_IDS].shape[0]) for r in rows.values()),
        valid_tokens=tuple(int(r[RESPONSE_MASK].sum()) for r in rows.values()),
    )


def columns_of(rows: Mapping[int, Row], ids: Sequence[int]) -> dict[str, list[torch.Tensor]]:
    """Rows ``ids`` as replay columns (``name -> one tensor per row``), as a store reads them."""
    return {name: [rows[i][name] for i in ids] for name in FIELDS}


def _put_rows(store: MemoryReplayStore, rows: Iterator[Row]) -> int:
    """Put ``rows`` one at a time (ids 0, 1, ...), as a rollout would; return their raw bytes."""
    raw = 0
    for i, row in enumerate(rows):
        raw += sum(t.numel() * t.element_size() for t in row.values())
        store.put([i], {k: [v] for k, v in row.items()})
    return raw


def _warm_up_store(seed: int, vocab: int) -> None:
    """Put, read and release 8 rows on a throwaway store.

    The store's code paths, torch's kernels and their caches are then touched before the
    measured store is filled, so its measured growth is its data, not first-use overhead.
    """
    warm = MemoryReplayStore()
    _put_rows(warm, iter_rows(8, seed, vocab))
    warm.read(list(range(8)), list(FIELDS))
    warm.release(list(range(8)))


def fill_store(n_rows: int, seed: int, vocab: int) -> tuple[MemoryReplayStore, dict[str, int]]:
    """Put ``n_rows`` rows into a fresh ``MemoryReplayStore`` one at a time.

    Returns:
        The store, and its byte counts: ``raw_bytes`` (Σ numel·element_size of the tensors
        put), ``store_nbytes`` (``store.nbytes()``) and ``store_rss_delta`` (growth of the
        process's anonymous resident memory while putting them).
    """
    _warm_up_store(seed + 1, vocab)
    store = MemoryReplayStore()
    gc.collect()
    rss_before = anon_bytes()
    raw = _put_rows(store, iter_rows(n_rows, seed, vocab))
    gc.collect()
    info = {
        "raw_bytes": raw,
        "store_nbytes": store.nbytes(),
        "store_rss_delta": anon_bytes() - rss_before,
    }
    return store, info
