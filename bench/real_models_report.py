"""The curves and the table of ``docs/benchmarks/real-models.md`` from finished recipe runs.

Reads each run directory's ``version_0/metrics.csv`` and ``summary.json`` (written by
``lppo fit --config examples/smollm2/grpo.yaml`` or ``ppo.yaml``) and writes one PNG: held-out
greedy accuracy with its Wilson 95 % interval against the iteration (left) and the training
reward (right), one line per run; prints the markdown table of before / after.

Usage (from the repository root, after the recipes ran)::

    .venv/bin/python bench/real_models_report.py runs/smollm2-grpo runs/smollm2-ppo \\
        --png docs/benchmarks/real_models.png
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from typing import Any


def read_run(run_dir: Path) -> dict[str, Any]:
    """The held-out evaluations, the training rewards and the summary of one run."""
    versions = sorted(run_dir.glob("version_*/metrics.csv"))
    if not versions:
        raise SystemExit(f"{run_dir}: no version_*/metrics.csv; run the recipe first")
    with versions[-1].open() as f:
        rows = list(csv.DictReader(f))
    evals = [
        {
            "iteration": int(r["iteration"]),
            "accuracy": float(r["eval/pass@1"]),
            "low": float(r["eval/pass@1_ci95_low"]),
            "high": float(r["eval/pass@1_ci95_high"]),
        }
        for r in rows
        if r.get("eval/pass@1")
    ]
    rewards = [
        (int(r["iteration"]), float(r["rollout/reward_mean"]))
        for r in rows
        if r.get("rollout/reward_mean")
    ]
    peaks = [float(r["perf/peak_memory_bytes"]) for r in rows if r.get("perf/peak_memory_bytes")]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "name": run_dir.name,
        "evals": evals,
        "rewards": rewards,
        "summary": summary,
        "peak": max(peaks, default=None),
    }


def table(runs: list[dict[str, Any]]) -> str:
    """Markdown: held-out accuracy before and after, its interval, iterations, wall time."""
    lines = [
        "| run | iterations | held-out accuracy before [95 % CI] | after [95 % CI] | "
        "wall time | peak memory |",
        "| --- | ---: | --- | --- | ---: | ---: |",
    ]
    for run in runs:
        first, last = run["evals"][0], run["evals"][-1]
        s = run["summary"]
        peak = run["peak"]
        lines.append(
            f"| {run['name']} | {s['iterations']} | {first['accuracy']:.1%} "
            f"[{first['low']:.1%}, {first['high']:.1%}] | {last['accuracy']:.1%} "
            f"[{last['low']:.1%}, {last['high']:.1%}] | {s['wall_seconds'] / 60:.1f} min | "
            + (f"{peak / 2**30:.1f} GiB |" if peak else "n/a |")
        )
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    """Held-out accuracy (with its interval) and training reward against the iteration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for run in runs:
        it = [e["iteration"] for e in run["evals"]]
        acc = [e["accuracy"] for e in run["evals"]]
        err = [
            [a - e["low"] for a, e in zip(acc, run["evals"], strict=True)],
            [e["high"] - a for a, e in zip(acc, run["evals"], strict=True)],
        ]
        left.errorbar(it, acc, yerr=err, marker="o", ms=4, capsize=3, label=run["name"])
        right.plot(*zip(*run["rewards"], strict=True), lw=1, label=run["name"])
    left.set(xlabel="iteration (0: before training)", ylabel="held-out greedy accuracy")
    left.set_title("SmolLM2-135M-Instruct, 500 held-out problems")
    right.set(xlabel="iteration", ylabel="training reward (partial credit 0.5)")
    right.set_title("training reward per iteration")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    """Read the runs, print the table, write the PNG."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="run directories")
    p.add_argument("--png", type=Path, default=Path("real_models.png"))
    args = p.parse_args(argv)
    runs = [read_run(r) for r in args.runs]
    plot(runs, args.png)
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
