"""Replay put/get throughput (MB/s): embedded store vs TransferQueue backend vs raw TQ client.

The same rows (prompt 16-64 + response 16-448 tokens; input_ids int64, response_mask bool,
gen_logprobs / old_logprobs / values float32, reward float32 per row) go into each variant in
put batches of ``--put-rows`` (a rollout's worth) and come back in chunks of ``--get-rows``
rows in a shuffled order (what the chunk stream does). Variants, each on one Ray + TQ started
once, interleaved repeat by repeat:

* ``memory``: ``MemoryReplayStore.put`` / ``read``;
* ``tq_backend``: ``TransferQueueReplayStore.put`` / ``read`` (validation, catalog, TQ);
* ``tq_raw``: TransferQueue's own client on the same rows: ``kv_batch_put`` of the same
  jagged TensorDict the backend builds / ``kv_batch_get`` of the same keys and fields, then
  split into the same per-row tensors the backend returns (``values().split(offsets)``);
  ``tq_raw_td``: the same gets, left as the TensorDict of jagged tensors TQ returns.

MB = raw bytes of the tensors (10**6). Overhead = raw / backend MB/s - 1 (median and best run),
against ``tq_raw`` (same rows out).

    .venv/bin/python bench/replay_throughput.py            # --rows 4096 --repeats 9
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
import uuid

import torch

from lppo.replay import MemoryReplayStore, TransferQueueReplayStore
from lppo.replay._tq_fields import field, rows_of
from lppo.runtime.ray_runtime import RaySettings, configure_ray
from lppo.types import GEN_LOGPROBS, INPUT_IDS, OLD_LOGPROBS, RESPONSE_MASK, REWARD, VALUES

NAMES = (INPUT_IDS, RESPONSE_MASK, GEN_LOGPROBS, OLD_LOGPROBS, VALUES, REWARD)


def make_rows(n: int, seed: int = 0) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    cols: dict[str, list[torch.Tensor]] = {k: [] for k in NAMES}
    for _ in range(n):
        prompt = int(torch.randint(16, 65, (1,), generator=g))
        length = prompt + int(torch.randint(16, 449, (1,), generator=g))
        mask = torch.zeros(length, dtype=torch.bool)
        mask[prompt:] = True
        cols[INPUT_IDS].append(torch.randint(0, 50_000, (length,), generator=g))
        cols[RESPONSE_MASK].append(mask)
        for name in (GEN_LOGPROBS, OLD_LOGPROBS, VALUES):
            cols[name].append(torch.randn(length, generator=g))
        cols[REWARD].append(torch.rand((), generator=g))
    return cols


def nbytes(cols: dict[str, list[torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for ts in cols.values() for t in ts)


def batches(n: int, size: int) -> list[list[int]]:
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)]


def run_store(store, cols, put_rows: int, gets: list[list[int]]) -> tuple[float, float]:
    n = len(cols[INPUT_IDS])
    ids = list(store.allocate(n))
    t0 = time.perf_counter()
    for b in batches(n, put_rows):
        store.put([ids[i] for i in b], {k: [cols[k][i] for i in b] for k in NAMES})
    t1 = time.perf_counter()
    for g in gets:
        store.read([ids[i] for i in g], NAMES)
    t2 = time.perf_counter()
    store.release(ids)
    return t1 - t0, t2 - t1


def run_raw(cols, put_rows: int, gets: list[list[int]], split: bool) -> tuple[float, float]:
    import transfer_queue as tq
    from tensordict import TensorDict

    n, part = len(cols[INPUT_IDS]), f"bench-raw-{uuid.uuid4().hex[:8]}"
    ranks = {k: cols[k][0].dim() for k in NAMES}
    t0 = time.perf_counter()
    for b in batches(n, put_rows):
        fields = {k: field([cols[k][i] for i in b], ranks[k]) for k in NAMES}
        tq.kv_batch_put(
            keys=[str(i) for i in b], partition_id=part, fields=TensorDict(fields, [len(b)])
        )
    t1 = time.perf_counter()
    for g in gets:
        td = tq.kv_batch_get(keys=[str(i) for i in g], partition_id=part, select_fields=list(NAMES))
        if split:
            {k: rows_of(td[k]) for k in NAMES}
    t2 = time.perf_counter()
    tq.kv_clear(keys=[str(i) for i in range(n)], partition_id=part)
    return t1 - t0, t2 - t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--put-rows", type=int, default=256)
    ap.add_argument("--get-rows", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(2)
    cols = make_rows(args.rows)
    mb = nbytes(cols) / 1e6
    order = list(range(args.rows))
    random.Random(0).shuffle(order)
    gets = [order[i : i + args.get_rows] for i in range(0, args.rows, args.get_rows)]
    temp_dir = tempfile.mkdtemp(prefix="lppo-bench-", dir="/tmp")
    configure_ray(RaySettings(temp_dir=temp_dir))
    tq_store = TransferQueueReplayStore()
    t0 = time.perf_counter()
    len(tq_store)  # start Ray + TransferQueue
    print(f"Ray + TransferQueue start: {time.perf_counter() - t0:.1f} s; {mb:.1f} MB of rows")
    variants = {
        "memory": lambda: run_store(MemoryReplayStore(), cols, args.put_rows, gets),
        "tq_backend": lambda: run_store(tq_store, cols, args.put_rows, gets),
        "tq_raw": lambda: run_raw(cols, args.put_rows, gets, split=True),
        "tq_raw_td": lambda: run_raw(cols, args.put_rows, gets, split=False),
    }
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
    try:
        for fn in variants.values():  # warm-up (connections, allocator)
            fn()
        for _ in range(args.repeats):
            for name, fn in variants.items():
                times[name].append(fn())
    finally:
        tq_store.close()
    stats = {
        "median": lambda xs: statistics.median(xs),
        "best": lambda xs: max(xs),  # least disturbed by other processes on a shared machine
    }
    print(f"rows {args.rows}, put batches {args.put_rows} rows, get chunks {args.get_rows} rows")
    print(f"| variant | put MB/s median / best | get MB/s median / best |  ({args.repeats} runs)")
    print("| --- | ---: | ---: |")
    put = {s: {k: f([mb / p for p, _ in v]) for k, v in times.items()} for s, f in stats.items()}
    get = {s: {k: f([mb / g for _, g in v]) for k, v in times.items()} for s, f in stats.items()}
    for k in variants:
        print(
            f"| {k} | {put['median'][k]:.1f} / {put['best'][k]:.1f} "
            f"| {get['median'][k]:.1f} / {get['best'][k]:.1f} |"
        )
    for s in stats:
        p, g = put[s], get[s]
        print(
            f"backend overhead over the raw client ({s}): "
            f"put {p['tq_raw'] / p['tq_backend'] - 1:+.1%}, "
            f"get {g['tq_raw'] / g['tq_backend'] - 1:+.1%}"
        )


if __name__ == "__main__":
    main()
