"""Benchmark: one critic epoch, streamed (lppo) vs merged payload vs a plain PyTorch floor.

Not a test: it prints a markdown report. Every (row count, variant, round) runs in its own fresh
subprocess so the peak RSS it reports is clean. Usage::

    .venv/bin/python bench/critic_epoch.py [--rows 256 1024 4096] [--repeats 3]

Variants (identical rows, identical model weights, identical chunks of ``--chunk-tokens`` padded
tokens, identical clipped value loss normalized by the global valid-token count, one AdamW step
with grad-norm clip 1.0 at the end of the epoch):

* ``streamed``: rows in a ``MemoryReplayStore``; ``ChunkPlanner`` plans the step;
  ``CriticModule.begin -> train_chunk(c) for c in iter_chunks(...) -> finish``. Each chunk is
  read from the store and padded only when reached.
* ``merged``: the same store and plan, but every row is first read and padded to the global
  longest row into ONE batch (the merged payload: input_ids, attention_mask, response_mask,
  values, returns), which is held for the whole epoch. Micro-batches are slices of that padded
  batch with the same row groups as the plan, each sliced to its own longest row (so the
  compute is the same as streamed; only the data path and its memory differ), trained through
  the same ``CriticModule.train_chunk``.
* ``floor``: no lppo machinery in the loop: the identical chunks are pre-padded (by lppo's
  ``collate``) before timing (not counted in time or in peak memory), then a bare loop:
  backbone + value head forward, clipped value loss as masked sum / global token count,
  backward; clip + AdamW step at the end.

Memory: peak RSS of the training part only: the kernel's high-water mark (``VmHWM``) is reset
through ``/proc/self/clear_refs`` right after the rows are in the store (floor: the chunks are
pre-padded) and the model is built; the reported number is ``VmHWM - VmRSS(at reset)``, i.e.
training-process peak beyond the store. Falls back to a 5 ms psutil poller if the reset is
not available.

This file parses the command line and runs the worker processes; the rest lives next to it:
``_worker.py`` (one measurement, inside a worker), ``_rows.py`` (rows and the filled store),
``_variants.py`` (model and the three epochs), ``_memory.py`` (peak RSS and CPU-load probes),
``_results.py`` (statistics over the runs) and ``_report.py`` (the markdown).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from _memory import wait_for_quiet
from _report import print_intro, print_report, progress_line
from _results import BUSY, VARIANTS, Result, Results

#: Flags passed on to every worker process as they were given.
WORKER_FLAGS = (
    "threads",
    "chunk_tokens",
    "hidden",
    "layers",
    "heads",
    "vocab",
    "seed",
    "epochs",
    "paired_budget",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (the hidden ``--worker`` / ``--n-rows`` are for worker processes)."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument(
        "--repeats", type=int, default=3, help="rounds; each runs every variant in a fresh process"
    )
    p.add_argument("--epochs", type=int, default=1, help="timed epochs per subprocess")
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--chunk-tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=3.0,
        help="before each run, wait up to this many s for other processes to idle",
    )
    p.add_argument(
        "--paired-budget",
        type=float,
        default=20.0,
        help="the paired run repeats its epoch (≤ 5 times) while under this many seconds",
    )
    p.add_argument(
        "--retry-budget",
        type=float,
        default=90.0,
        help="seconds of extra runs allowed to replace runs slowed by other processes",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="cProfile one streamed epoch at the largest row count (automatic when slow)",
    )
    p.add_argument("--worker", choices=(*VARIANTS, "paired"), help=argparse.SUPPRESS)
    p.add_argument("--n-rows", type=int, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def run_worker(
    args: argparse.Namespace, variant: str, n_rows: int, profile: bool = False
) -> Result:
    """Measure ``variant`` at ``n_rows`` rows in a fresh process, so its peak RSS is its own."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", variant, "--n-rows", str(n_rows)]
    for name in WORKER_FLAGS:
        cmd += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    if profile:
        cmd.append("--profile")
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        sys.stderr.write(out.stdout + out.stderr)
        raise SystemExit(f"worker {variant} rows={n_rows} failed (rc {out.returncode})")
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


class Session:
    """Every (row count, variant, round) in its own worker, plus retries of contended runs.

    Attributes:
        results: what the workers returned.
        waited: seconds spent waiting for other processes to idle.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.results = Results(args.rows)
        self.waited = 0.0
        self._retry_end: float | None = None  # set when the first retry starts

    def run_all(self) -> None:
        """Rounds with the variant order rotated, the paired run, then retries per row count."""
        for n in self.args.rows:
            for r in range(self.args.repeats):
                for v in VARIANTS[r % 3 :] + VARIANTS[: r % 3]:
                    self.one(n, v, f"round {r + 1}")
            self.one(n, "paired", "")
            for v in (*VARIANTS, "paired"):
                for _ in range(2):  # replace contended best runs while the retry budget lasts
                    if self.results.contended(n, v) and self._may_retry():
                        self.one(n, v, "retry")

    def one(self, n: int, variant: str, tag: str) -> None:
        """Wait for a quiet machine, run one worker, record and log its result."""
        self.waited += wait_for_quiet(self.args.quiet_wait, BUSY)
        res = run_worker(self.args, variant, n)
        self.results.add(n, variant, res)
        print(progress_line(n, tag, variant, res), file=sys.stderr, flush=True)

    def _may_retry(self) -> bool:
        """Whether the retry budget (counted from the first retry) has time left."""
        if self._retry_end is None:
            self._retry_end = time.perf_counter() + self.args.retry_budget
        return time.perf_counter() < self._retry_end


def main() -> None:
    """Worker mode: measure one run and print it as JSON. Otherwise: the whole benchmark."""
    args = parse_args()
    if args.worker:
        # Only worker processes need lppo, transformers and the model.
        from _worker import worker

        print("RESULT " + json.dumps(worker(args)))
        return

    t_start = time.perf_counter()
    print_intro(args)
    session = Session(args)
    session.run_all()
    pp = print_report(session.results, session.waited, args.quiet_wait)
    slow = [n for n in args.rows if pp[n].ratio > 1.05]
    if slow or args.profile:
        n = slow[-1] if slow else args.rows[-1]
        why = "paired streamed/floor > 1.05" if slow else "--profile"
        print(f"\n## cProfile of one streamed epoch at {n} rows ({why})\n")
        res = run_worker(args, "streamed", n, profile=True)
        print("```\n" + res["profile"] + "```")
    print(f"\nTotal bench time: {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
