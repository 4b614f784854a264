"""End-to-end iteration time by phase: one process vs Ray rollout workers vs two ranks.

Runs ``lppo fit`` on the same config three ways, one after the other in this run: in one
process (in-process Hugging Face generate), with generation in ``--workers`` Ray actor workers
(``lppo.rollout.RayWorkersEngine``), and on two gloo ranks (``trainer.strategy=ppo_ddp``, each
rank generating its own prompt blocks). Each fit logs ``perf/seconds/<phase>`` per iteration;
the table shows the median over the iterations after the first (warm-up, Ray start) and over
``--rounds`` interleaved rounds, and the ratio of each total to the one-process total.
Generation and training are the same amount of work in all three (same prompts per iteration,
same steps), so the ratios measure how the work is spread. Two-rank times are rank 0's.

    .venv/bin/python bench/iteration_time.py   # --iterations 6 --prompts 32 --rounds 2
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("rollout", "collect", "score", "advantages", "critic", "actor")


def variants(workers: int) -> dict[str, list[str]]:
    """CLI overrides of each variant (on top of configs/tiny.yaml)."""
    return {
        "one process": [],
        f"Ray workers x{workers}": [
            "--model.engine=lppo.rollout.RayWorkersEngine",
            f"--model.engine.init_args.num_workers={workers}",
        ],
        "two ranks (ppo_ddp)": ["--trainer.strategy=ppo_ddp", "--trainer.devices=2"],
    }


def fit(name: str, extra: list[str], args: argparse.Namespace, run: Path) -> dict[str, float]:
    """Run one fit; median seconds per phase over iterations 1.. (iteration 0 is warm-up)."""
    cmd = [
        sys.executable,
        "-m",
        "lppo.run.cli",
        "fit",
        f"--config={ROOT / 'configs' / 'tiny.yaml'}",
        f"--trainer.max_epochs={args.iterations}",
        f"--trainer.default_root_dir={run}",
        f"--model.rollout.prompts_per_iteration={args.prompts}",
        f"--model.rollout.prompts_per_block={args.prompts // 2}",
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    subprocess.run(cmd, check=True, env=env, cwd=run.parent, stdout=subprocess.DEVNULL)
    with open(run / "version_0" / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("perf/seconds/rollout")]
    later = rows[1:] or rows
    return {
        p: statistics.median(
            float(r[f"perf/seconds/{p}"]) for r in later if r.get(f"perf/seconds/{p}")
        )
        for p in PHASES
        if any(r.get(f"perf/seconds/{p}") for r in later)
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):  # interleaved, so a change in machine load hits all
            for k, (name, extra) in enumerate(variants(args.workers).items()):
                run = fit(name, extra, args, Path(tmp) / f"run{r}-{k}")
                runs.setdefault(name, []).append(run)
    results = {
        name: {p: statistics.median(x[p] for x in xs) for p in xs[0]} for name, xs in runs.items()
    }
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    base = sum(results["one process"].values())
    head = "| variant | " + " | ".join(PHASES) + " | total s/iter | vs one process |"
    print(head)
    print("|" + " --- |" * (len(PHASES) + 3))
    for name, sec in results.items():
        total = sum(sec.values())
        cells = " | ".join(f"{sec.get(p, 0.0):.2f}" for p in PHASES)
        print(f"| {name} | {cells} | {total:.2f} | {total / base:.2f}x |")


if __name__ == "__main__":
    main()
