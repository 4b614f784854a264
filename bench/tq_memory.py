"""Trainer peak memory vs rows per iteration with the TransferQueue backend (should be flat).

Per row count, in a fresh trainer process: a local Ray + TransferQueue is started; a Ray task
(another process, as a rollout worker would) generates the rows (prompt 16-64 + response
16-448 tokens, the rows of ``bench/critic_epoch.py``) and puts them into the shared
``TransferQueueReplayStore``; the trainer then runs one streamed critic epoch (plan from the
store's metadata, each chunk read from TransferQueue and padded only when reached,
``CriticModule.begin / train_chunk / finish``). Reported: the trainer's peak RSS beyond its
baseline taken after warm-up (``VmHWM`` reset), and the whole-process peak.

    .venv/bin/python bench/tq_memory.py                 # --rows 256 1024 4096
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def produce(store, iter_rows, n_rows: int, seed: int, vocab: int, batch: int) -> int:
    """In a Ray worker: generate the rows and put them; returns the raw bytes put."""
    total, rows = 0, []
    for row in iter_rows(n_rows, seed, vocab):
        rows.append(row)
        if len(rows) == batch:
            total += _put(store, rows)
            rows = []
    if rows:
        total += _put(store, rows)
    store.close()
    return total


def _put(store, rows) -> int:
    ids = list(store.allocate(len(rows)))
    store.put(ids, {k: [r[k] for r in rows] for k in rows[0]})
    return sum(t.numel() * t.element_size() for r in rows for t in r.values())


def worker(args: argparse.Namespace) -> dict:
    import _rows
    import ray
    import torch
    from _memory import PeakProbe, status_kib
    from _variants import build_backbone, epoch_streamed, make_critic

    from lppo.iteration.data_settings import DataSettings
    from lppo.iteration.planner import ChunkPlanner
    from lppo.replay import TransferQueueReplayStore
    from lppo.runtime.ray_runtime import RaySettings, configure_ray

    torch.set_num_threads(2)
    configure_ray(RaySettings(temp_dir=tempfile.mkdtemp(prefix="lppo-mem-", dir="/tmp")))
    store = TransferQueueReplayStore()
    try:
        len(store)  # start Ray + TransferQueue here
        ray.cloudpickle.register_pickle_by_value(_rows)  # the worker has no bench/ on its path
        task = ray.remote(num_cpus=1)(produce)
        t = time.perf_counter()
        raw = ray.get(task.remote(store, _rows.iter_rows, args.worker, 0, 1024, 256))
        put_s = time.perf_counter() - t
        planner = ChunkPlanner(DataSettings(max_tokens_per_chunk=8192, seed=0))
        critic = make_critic(build_backbone(64, 2, 4, 1024, 0))
        epoch_streamed(critic, planner, store, epoch=0, max_chunks=2)  # warm-up
        probe = PeakProbe()
        probe.start()
        t = time.perf_counter()
        stats = epoch_streamed(critic, planner, store, epoch=0)
        epoch_s = time.perf_counter() - t
        beyond = probe.peak_beyond()
        return {
            "rows": args.worker,
            "raw_mb": raw / 1e6,
            "rows_in_store": len(store),
            "peak_beyond_mib": beyond / 2**20,
            "peak_rss_mib": status_kib("VmHWM") / 1024,
            "put_s": put_s,
            "epoch_s": epoch_s,
            "loss": stats.metrics["loss"],
        }
    finally:
        store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    results = []
    for n in args.rows:
        out = subprocess.run(
            [sys.executable, __file__, "--worker", str(n)], capture_output=True, text=True
        )
        if out.returncode != 0:
            raise SystemExit(out.stdout[-2000:] + out.stderr[-4000:])
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(results[-1], flush=True)
    print("| rows | MB put (by a Ray task) | trainer peak beyond baseline | trainer peak RSS |")
    print("| ---: | ---: | ---: | ---: |")
    for r in results:
        print(
            f"| {r['rows']} | {r['raw_mb']:.1f} | {r['peak_beyond_mib']:.1f} MiB "
            f"| {r['peak_rss_mib']:.0f} MiB |"
        )
    first, last = results[0], results[-1]
    growth = last["peak_beyond_mib"] / first["peak_beyond_mib"] - 1
    rss = last["peak_rss_mib"] / first["peak_rss_mib"] - 1
    print(
        f"{first['rows']} -> {last['rows']} rows: peak beyond baseline {growth:+.1%}, "
        f"whole-process peak RSS {rss:+.1%}"
    )


if __name__ == "__main__":
    main()
