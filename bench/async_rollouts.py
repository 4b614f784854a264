"""Asynchronous rollouts: iteration time, tokens/s and peak memory for s = 0, 1, 2, side by side.

Runs ``lppo fit`` on ``configs/tiny.yaml`` in two settings, each variant in its own fresh
process, one after another (never two at once), the variants of a setting interleaved:

- **long**: few rows, long responses (4 prompts × 2 samples, exactly 512 new tokens with
  ``ignore_eos``, chunks of 1024 tokens; the tiny models), where generation is about half of
  the synchronous iteration;
- **short**: ``configs/tiny.yaml``'s own rollout (32 prompts × 4 samples, at most 6 new tokens).

Variants: the synchronous run (``max_staleness: 0``; 1 torch thread, and 2 threads: the other
way to use the second core), the background rollout process (``ProcessRunner``, 1 + 1 threads)
at s = 1 and 2, a thread with the in-process Hugging Face engine (``ThreadRunner``: it shares
the GIL with the trainer), and one Ray rollout worker (``RayWorkersEngine``; at s > 0 driven by
``ThreadRunner``) at s = 0, 1, 2; optional (``--only``): ``process-s1-2t``, the background
process with 2 + 2 threads (what a config without ``model.num_threads`` gets on 2 cores). The
synchronous 1-thread run goes first and last of each setting, so drift shows.

Per variant: the mean wall time of an iteration (between consecutive iteration ends, leaving
out the first ``--warmup`` and the last ``--cooldown``, which have nothing to overlap), its
ratio to the same engine's s = 0 run, the generation share, the generator's busy / overlapped /
idle seconds and the trainer's wait (``perf/generation/*``), response tokens per second of
iteration and of the generator, the trainer's peak RSS (``perf/peak_memory_bytes``), the peak
RSS of the generating processes and of all the fit's descendants (sampled every 0.5 s), the
cores other processes kept busy meanwhile, and the fit's whole wall time (start-up included).

    .venv/bin/python bench/async_rollouts.py            # ≈ 5-9 min on 2 idle cores
    .venv/bin/python bench/async_rollouts.py --settings long --only sync process-s1 process-s1-2t
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from _async_probe import (  # noqa: E402
    CLOCK_ENV,
    MachineLoad,
    TreeProbe,
    read_clock,
    wait_for_quiet,
)
from _async_report import print_report  # noqa: E402

SETTINGS: dict[str, list[str]] = {
    "long": [
        "--model.rollout.prompts_per_iteration=4",
        "--model.rollout.prompts_per_block=4",
        "--model.rollout.samples_per_prompt=2",
        "--model.rollout.max_new_tokens=512",
        "--model.rollout.ignore_eos=true",
        "--data.max_tokens_per_chunk=1024",
    ],
    "short": [],  # configs/tiny.yaml's own: 32 prompts × 4 samples, ≤ 6 new tokens
}
RAY = [
    "--model.engine=lppo.rollout.RayWorkersEngine",
    "--model.engine.init_args.num_workers=1",
    "--trainer.ray.num_cpus=4",
]
THREAD = ["--model.runner=lppo.rollout.ThreadRunner"]
TWO_THREADS = ["--model.num_threads=2"]  # the ProcessRunner's default follows the trainer


@dataclass(frozen=True)
class Variant:
    """One fit: a name, its lag, its engine family, its threads and its CLI overrides."""

    key: str
    label: str
    staleness: int
    engine: str  # "hf" or "ray": the ratio column divides by this engine's s = 0 run
    threads: str
    extra: tuple[str, ...] = ()
    optional: bool = False  # run only when named in --only


VARIANTS: dict[str, list[Variant]] = {
    "long": [
        Variant("sync", "synchronous, inline", 0, "hf", "1"),
        Variant("process-s1", "ProcessRunner", 1, "hf", "1 + 1"),
        Variant("sync-2t", "synchronous, inline", 0, "hf", "2", tuple(TWO_THREADS)),
        Variant("process-s2", "ProcessRunner", 2, "hf", "1 + 1"),
        Variant("thread-s1", "ThreadRunner, HF engine", 1, "hf", "1 + 1 (one pool)", tuple(THREAD)),
        Variant("process-s1-2t", "ProcessRunner", 1, "hf", "2 + 2", tuple(TWO_THREADS), True),
        Variant("ray-s0", "Ray worker ×1, inline", 0, "ray", "1 + 1", tuple(RAY)),
        Variant("ray-s1", "Ray worker ×1, ThreadRunner", 1, "ray", "1 + 1", tuple(RAY)),
        Variant("ray-s2", "Ray worker ×1, ThreadRunner", 2, "ray", "1 + 1", tuple(RAY)),
        Variant("sync-again", "synchronous, inline (again)", 0, "hf", "1"),
    ],
    "short": [
        Variant("sync", "synchronous, inline", 0, "hf", "1"),
        Variant("process-s1", "ProcessRunner", 1, "hf", "1 + 1"),
        Variant("thread-s1", "ThreadRunner, HF engine", 1, "hf", "1 + 1 (one pool)", tuple(THREAD)),
        Variant("ray-s0", "Ray worker ×1, inline", 0, "ray", "1 + 1", tuple(RAY)),
        Variant("ray-s1", "Ray worker ×1, ThreadRunner", 1, "ray", "1 + 1", tuple(RAY)),
        Variant("sync-again", "synchronous, inline (again)", 0, "hf", "1"),
    ],
}


def fit_command(setting: str, variant: Variant, iterations: int, run: Path) -> list[str]:
    """The ``lppo fit`` command line of one variant (the run directory comes last)."""
    return [
        sys.executable,
        "-m",
        "lppo.run.cli",
        "fit",
        f"--config={ROOT / 'configs' / 'tiny.yaml'}",
        *SETTINGS[setting],
        *variant.extra,
        f"--model.rollout.max_staleness={variant.staleness}",
        f"--trainer.max_epochs={iterations}",
        "--trainer.enable_checkpointing=false",
        "--trainer.callbacks+=_async_probe.IterationClock",
        f"--trainer.default_root_dir={run}",
    ]


def fit(setting: str, variant: Variant, args: argparse.Namespace, run: Path) -> dict[str, Any]:
    """Run one fit in a fresh process; its per-iteration metrics, clock, memory and load."""
    run.mkdir(parents=True)
    clock = run / "clock.jsonl"
    env = {
        **os.environ,
        CLOCK_ENV: str(clock),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
        "RAY_AUTH_MODE": "disabled",
    }
    load = MachineLoad()
    with open(run / "fit.log", "w") as log:
        proc = subprocess.Popen(
            fit_command(setting, variant, args.iterations, run),
            env=env,
            cwd=run,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        probe = TreeProbe(proc.pid)
        code = proc.wait()
        probe.stop()
    if code != 0:
        tail = (run / "fit.log").read_text()[-3000:]
        raise RuntimeError(f"{setting}/{variant.key} exited with {code}:\n{tail}")
    with open(run / "version_0" / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("perf/seconds/rollout")]
    return {
        "rows": rows,
        "iteration_s": read_clock(str(clock)),
        "others_peak": probe.others_peak,
        "root_peak": probe.root_peak,
        "generators_peak": probe.generators_peak,
        **load.result(probe.cpu_s()),
    }


def measure(args: argparse.Namespace, tmp: Path) -> dict[str, dict[str, dict[str, Any]]]:
    """Every selected variant of every selected setting, one fit at a time."""
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for setting in args.settings:
        for variant in VARIANTS[setting]:
            selected = variant.key in args.only if args.only else not variant.optional
            if not selected:
                continue
            waited = wait_for_quiet(args.quiet_wait)
            started = time.perf_counter()
            out = fit(setting, variant, args, tmp / setting / variant.key)
            out["variant"], out["waited_s"] = variant, waited
            results.setdefault(setting, {})[variant.key] = out
            print(
                f"{setting}/{variant.key}: {time.perf_counter() - started:.0f} s "
                f"(others' load {out['others_cores']:.2f} cores)",
                file=sys.stderr,
                flush=True,
            )
    return results


def main() -> None:
    """Parse the command line, run the fits, print the markdown report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument(
        "--only", nargs="*", default=[], help="variant keys to run (default: all but optional)"
    )
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="first iterations left out")
    parser.add_argument(
        "--cooldown", type=int, default=2, help="last iterations left out (nothing to overlap)"
    )
    parser.add_argument(
        "--quiet-wait", type=float, default=0.0, help="most seconds to wait for an idle machine"
    )
    parser.add_argument("--keep", type=Path, default=None, help="keep the run folders here")
    args = parser.parse_args()
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
        results = measure(args, args.keep)
    else:
        with tempfile.TemporaryDirectory(prefix="lppo-async-") as tmp:
            results = measure(args, Path(tmp))
    header = {
        "date": datetime.date.today().isoformat(),
        "cpus": os.cpu_count(),
        "load_before": load0,
        "wall_s": time.perf_counter() - t0,
        "command": " ".join(["bench/async_rollouts.py", *sys.argv[1:]]),
        "warmup": args.warmup,
        "cooldown": args.cooldown,
        "waited_s": sum(r["waited_s"] for res in results.values() for r in res.values()),
    }
    print_report(results, header)


if __name__ == "__main__":
    main()
