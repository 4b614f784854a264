"""Per-rank memory and iteration time of the parallel layouts: ppo_ddp, ppo_fsdp, LoRA on each.

Usage (from the repository root; LoRA needs the ``[lora]`` extra)::

    .venv/bin/python bench/layouts.py                                  # ~99M-parameter Llama
    .venv/bin/python bench/layouts.py --hidden 64 --layers 2 --heads 4 --ffn 128   # quick

Each variant is a fresh 2-rank CPU fit (``bench/_layout_worker.py``: Lightning re-runs that
script for rank 1) of the same PPO run, same seeds: a random Llama actor and critic (hidden
768, 14 layers, 12 heads, MLP 2048: ~99M parameters each with the copy task's character
vocabulary, float32), GAE, KL in the reward (``kl_coef`` 0.05, so a frozen reference exists),
4 prompts x 2 samples, 6 new tokens, prompts in blocks of one (each rank generates two), one
critic and one actor step per iteration, 3 iterations, ``model.num_threads`` 1 per process.
Variants: **ddp** (``ppo_ddp``, full fine-tuning), **fsdp** (``ppo_fsdp``, full fine-tuning),
**lora_ddp** and **lora_fsdp** (LoRA of rank ``--lora-rank`` on the attention projections of
actor and critic; the critic's value head trains fully); ``--variants fsdp_chunk`` adds
``ppo_fsdp`` with ``FSDPLayout(reduce_every_chunk=True)``.

Per rank: local bytes (a ``DTensor`` counts its own shard) of the actor's and the critic's
parameters, gradients at their peak (the larger of: at the end of a step's chunks, before the
layout reduces them — FSDP's pending unsharded gradients included — and right after the
reduction) and optimizer state; the reference's own parameters (not shared with the actor);
the engine's merged copy (LoRA); the whole-process peak RSS (``ru_maxrss``, model build
included) and the peak RSS of iterations 2-3 (``VmHWM`` reset after the warm-up); the mean
wall seconds of iterations 2-3, per phase, and the layout's own calls (gathers of full
weights, gradient reduction with FSDP's synced zero-weight pass, idle chunks). Prints markdown
tables and writes every rank's record to ``--json``. A variant that fails is reported with
its error (and whatever its ranks recorded before failing).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _layout_worker import VARIANTS, add_run_args, run_args

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_layout_worker.py"
MiB = 1024 * 1024
ROLES = ("actor", "critic")


def run_variant(variant: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Run one variant's 2-rank fit; its ranks' records, or its error."""
    out = root / variant
    cmd = [sys.executable, str(WORKER), "--variant", variant, "--out", str(out)]
    cmd += run_args(args)
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    log = proc.stdout + proc.stderr
    out.mkdir(parents=True, exist_ok=True)
    (out / "log.txt").write_text(log)
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    result: dict[str, Any] = {"variant": variant, "rc": proc.returncode, "ranks": ranks}
    result["wall_s"] = time.perf_counter() - t
    if proc.returncode:
        result["error"] = first_error(log)
    print(f"{variant}: rc {proc.returncode}, {result['wall_s']:.0f} s", file=sys.stderr)
    return result


def first_error(log: str) -> str:
    """The raising frame and the exception line of the first traceback (else the last line)."""
    lines = [re.sub(r"^\[rank\d+\]: ", "", ln) for ln in log.splitlines() if ln.strip()]
    for i, line in enumerate(lines):
        if "Error:" in line and not line.startswith(" "):
            frame = [ln.strip() for ln in lines[max(0, i - 4) : i] if ln.strip().startswith("File")]
            return (frame[-1] + " -> " if frame else "") + line.strip()
    return lines[-1] if lines else "no output"


def summarize(rank: dict[str, Any]) -> dict[str, float]:
    """One rank's figures: bytes per part, model+optimizer total, peaks, mean seconds."""
    s: dict[str, float] = {}
    for r in ROLES:
        grads = max(rank["grad_peak"].get(r, 0), rank[f"{r}_trainable"])
        s[f"{r}_state"] = rank[f"{r}_params"] + grads + rank[f"{r}_optimizer"]
        s[f"{r}_grads"] = grads
    s["params"] = rank["actor_params"] + rank["critic_params"]
    s["grads"] = s["actor_grads"] + s["critic_grads"]
    s["optimizer"] = rank["actor_optimizer"] + rank["critic_optimizer"]
    s["reference"] = rank["reference_params"]
    s["engine_copy"] = rank["engine_copy"]
    s["total"] = s["actor_state"] + s["critic_state"] + s["reference"] + s["engine_copy"]
    s["peak_rss"] = rank["peak_rss"]
    s["steady_rss"] = rank["steady_peak_rss"]
    timed = rank["iterations"][1:]  # the first iteration is the warm-up
    s["seconds"] = statistics.mean(i["seconds"] for i in timed) if timed else float("nan")
    for key in ("rollout", "score", "critic", "actor"):
        s[key] = statistics.mean(i["phases"].get(key, 0.0) for i in timed) if timed else 0.0
    for key in ("gather", "reduce_gradients", "idle_chunk"):
        s[key] = statistics.mean(i["layout"].get(key, 0.0) for i in timed) if timed else 0.0
    return s


ROWS = [
    ("actor params + grads (peak) + optimizer", "actor_state", MiB, 1),
    ("critic params + grads (peak) + optimizer", "critic_state", MiB, 1),
    ("of which gradients at peak (both)", "grads", MiB, 1),
    ("of which optimizer state (both)", "optimizer", MiB, 1),
    ("reference's own parameters", "reference", MiB, 1),
    ("engine's merged copy (LoRA)", "engine_copy", MiB, 1),
    ("**model + optimizer total**", "total", MiB, 1),
    ("peak RSS, whole process", "peak_rss", MiB, 0),
    ("peak RSS, iterations 2-3", "steady_rss", MiB, 0),
    ("**s / iteration** (mean of 2-3)", "seconds", 1, 2),
]
PHASES = ["rollout", "score", "critic", "actor", "gather", "reduce_gradients", "idle_chunk"]


def report(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    """Markdown: per-rank figures, ratios against ddp, time per phase, goals, errors."""
    done = {v: r for v, r in results.items() if r["rc"] == 0 and len(r["ranks"]) == 2}
    per = {v: [summarize(k) for k in r["ranks"]] for v, r in done.items()}
    params = next((r["ranks"][0]["parameters"] for r in results.values() if r["ranks"]), 0)
    lines = [f"`python bench/layouts.py {' '.join(sys.argv[1:])}`", ""]
    lines.append(
        f"{params / 1e6:.1f}M parameters per model (actor, critic), float32; MiB per rank."
    )
    lines += [
        "",
        "| per rank (MiB, s) | " + " | ".join(f"{v} r{i}" for v in per for i in (0, 1)) + " |",
    ]
    lines.append("| --- |" + " ---: |" * (2 * len(per)))
    for label, key, unit, digits in ROWS:
        cells = [f"{s[key] / unit:,.{digits}f}" for v in per for s in per[v]]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", ratio_table(per), "", phase_table(per), "", *goals(per)]
    for v, r in results.items():
        if v not in done:
            lines.append(f"- **{v} failed** (rc {r['rc']}): `{r.get('error', 'no record')}`")
            for rank in r["ranks"]:  # what the rank recorded after its last complete iteration
                s = summarize(rank)
                lines.append(
                    f"  - rank {rank['rank']} after iteration {rank['completed_iteration'] + 1}: "
                    f"model + optimizer {s['total'] / MiB:,.1f} MiB (gradients at peak "
                    f"{s['grads'] / MiB:,.1f}, optimizer {s['optimizer'] / MiB:,.1f}, reference "
                    f"{s['reference'] / MiB:,.1f}), peak RSS {s['peak_rss'] / MiB:,.0f} MiB"
                )
    return "\n".join(lines)


def worst(per: dict[str, list[dict[str, float]]], v: str, key: str) -> float:
    return max(s[key] for s in per[v])


def ratio_table(per: dict[str, list[dict[str, float]]]) -> str:
    """Each variant over ddp, per-rank maxima."""
    others = [v for v in per if v != "ddp"]
    if "ddp" not in per or not others:
        return ""
    lines = ["| max over ranks, / ddp | " + " | ".join(others) + " |"]
    lines.append("| --- |" + " ---: |" * len(others))
    for label, key in [
        ("model + optimizer total", "total"),
        ("parameters (actor + critic)", "params"),
        ("gradients at peak", "grads"),
        ("optimizer state", "optimizer"),
        ("reference's own parameters", "reference"),
        ("peak RSS, iterations 2-3", "steady_rss"),
        ("s / iteration", "seconds"),
    ]:
        base = worst(per, "ddp", key)
        cells = [f"{worst(per, v, key) / base:.3f}" if base else "-" for v in others]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def phase_table(per: dict[str, list[dict[str, float]]]) -> str:
    """Rank 0's mean seconds per phase and in the layout's own calls (inside the phases)."""
    lines = ["| rank 0, s (mean of 2-3) | " + " | ".join(PHASES) + " | total |"]
    lines.append("| --- |" + " ---: |" * (len(PHASES) + 1))
    for v, ranks in per.items():
        cells = [f"{ranks[0][k]:.2f}" for k in [*PHASES, "seconds"]]
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def goals(per: dict[str, list[dict[str, float]]]) -> list[str]:
    """The targets of the layout work, checked against what was measured."""
    out = []

    def check(name: str, value: float, limit: float) -> None:
        verdict = "met" if value <= limit else "NOT met"
        out.append(f"- {name}: {value:.3f} (target <= {limit}) — {verdict}")

    if "ddp" not in per:
        return out
    if "fsdp" in per:
        check("fsdp / ddp model + optimizer per rank", _r(per, "fsdp", "total"), 0.55)
        check("fsdp / ddp s / iteration", _r(per, "fsdp", "seconds"), 1.3)
    if "lora_ddp" in per:
        check("lora_ddp / ddp optimizer state", _r(per, "lora_ddp", "optimizer"), 0.05)
        ref = worst(per, "lora_ddp", "reference")
        out.append(f"- lora_ddp reference's own parameters: {ref / MiB:.1f} MiB (target 0)")
    return out


def _r(per: dict[str, list[dict[str, float]]], v: str, key: str) -> float:
    return worst(per, v, key) / worst(per, "ddp", key)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS[:4]))
    add_run_args(p)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per variant")
    p.add_argument("--json", type=Path, default=Path("runs/bench/layouts.json"))
    return p.parse_args()


def main() -> None:
    args = parse()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    root = Path(tempfile.mkdtemp(prefix="lppo-layouts-"))
    results = {v: run_variant(v, args, root) for v in args.variants}
    text = report(results, args)
    print(text)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count()}
    meta["machine"] = platform.platform()
    payload = {"args": vars(args) | {"json": str(args.json)}, **meta, "results": results}
    args.json.write_text(json.dumps(payload, indent=1))
    print(f"\nrecords: {args.json}; logs: {root}", file=sys.stderr)


if __name__ == "__main__":
    main()
