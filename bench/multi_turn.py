"""Multi-turn rollouts: trajectory throughput per engine and turn count, and training cost.

From the repository root, in the main venv (the vLLM workers run in ``--vllm-python``)::

    PYTHONPATH=. .venv/bin/python bench/multi_turn.py --vllm-python .venv-vllm/bin/python
    PYTHONPATH=. .venv/bin/python bench/multi_turn.py --models tiny --rounds 3   # quicker

Part 1, **trajectory throughput**: ``MultiTurnEngine`` episodes of exactly 1, 2 and 4 turns
(``_turn_env.FixedTurnsEnvironment``: an 8-token observation after every turn but the last,
at most 16 new tokens per turn) on the tiny random Llama of ``configs/vllm.yaml`` (32 prompts x
4 samples) and a ~50M-parameter one (4 prompts x 4 samples), with the Hugging Face engine and
the vLLM engine at its CPU block size (128) and at blocks of 32 (so its prefix cache can serve
the short contexts). Trajectory tokens (policy + observation tokens of the rows) per second of
``generate``, median of ``--repeats`` calls after a warm-up, each engine and model in its own
fresh process (``_mt_rollout.py``), the engines alternating; 1 torch thread each.

Part 2, **training cost** (``_mt_iteration.py``): the controller's phases (collect, score,
advantages, critic, actor) over rows of one length laid out as single-turn rows and as
multi-turn rows (observation holes in the mask), in one process, interleaved.

Progress goes to stderr, the markdown report to stdout.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

ENGINES = ("hf", "vllm", "vllm-b32")
LABELS = {"hf": "Hugging Face", "vllm": "vLLM (block 128)", "vllm-b32": "vLLM (block 32)"}
SIZES = {"tiny": (32, 4), "50M": (4, 4)}  # prompts, samples per prompt


def worker_env() -> dict[str, str]:
    """This checkout's lppo first on the path; vLLM in-process with 1 GiB of KV cache."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{HERE}")
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def run_worker(python: str, kind: str, extra: list[str]) -> dict[str, Any] | str:
    """Run ``kind`` in a fresh process; its JSON result, or the tail of its error."""
    cmd = [python, __file__, "--worker", kind, *extra]
    done = subprocess.run(
        cmd, env=worker_env(), cwd=ROOT, capture_output=True, text=True, check=False
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = [ln for ln in done.stderr.splitlines() if ln.strip()][-3:]
        return f"exit {done.returncode}: " + " / ".join(tail)[-400:]
    return json.loads(lines[-1])


def rollout_args(model: str, engine: str, args: argparse.Namespace) -> list[str]:
    prompts, samples = SIZES[model]
    return [
        *("--engine", engine, "--model", model, "--threads", str(args.threads)),
        *("--prompts", str(prompts), "--samples", str(samples)),
        *("--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats)),
        *("--observation-tokens", str(args.observation_tokens)),
        *("--max-tokens", str(args.max_tokens), "--turns", *map(str, args.turns)),
    ]


def vllm_available(python: str) -> str:
    """``""`` when ``python`` imports vLLM, else why not."""
    if not Path(python).exists():
        return f"{python} not found"
    cmd = [python, "-c", "import vllm"]
    done = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True, check=False)
    lines = done.stderr.strip().splitlines()
    return "" if done.returncode == 0 else (lines[-1] if lines else f"exit {done.returncode}")


def part_one(args: argparse.Namespace) -> tuple[dict, str]:
    """Every (model, engine) worker; the engines alternate, their order flips per model."""
    missing = vllm_available(args.vllm_python)
    engines = [e for e in ENGINES if e == "hf" or not missing]
    results: dict[tuple[str, str], Any] = {}
    for m, model in enumerate(args.models):
        for engine in engines if m % 2 == 0 else engines[::-1]:
            print(f"[bench] rollout {engine} {model}", file=sys.stderr, flush=True)
            python = sys.executable if engine == "hf" else args.vllm_python
            results[model, engine] = run_worker(
                python, "rollout", rollout_args(model, engine, args)
            )
    return results, missing


def table_one(results: dict, missing: str, args: argparse.Namespace) -> None:
    print(
        f"\n### Trajectory throughput (≤ {args.new_tokens} new tokens per turn, "
        f"{args.observation_tokens}-token observations, {args.threads} thread)\n"
    )
    print(
        "| model | rows | engine | turns | traj tok/s | generate s | s per turn "
        "| observation share | prefix-cache hits | vs HF |"
    )
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for (model, engine), res in sorted(results.items(), key=lambda x: (x[0][0] != "tiny", x[0])):
        if isinstance(res, str):
            print(f"| {model} | | {LABELS[engine]} | | failed: {res} | | | | | |")
            continue
        for k, r in res["turns"].items():
            hf = results.get((model, "hf"))
            base = hf["turns"][k]["tokens_per_s"] if isinstance(hf, dict) else None
            vs = f"{r['tokens_per_s'] / base:.2f}" if base else "–"
            hit = "–" if r["cache_hit"] is None else f"{100 * r['cache_hit']:.0f}%"
            print(
                f"| {model} | {r['rows']} | {LABELS[engine]} | {k} | {r['tokens_per_s']:.0f} "
                f"| {r['generate_s']:.2f} | {r['generate_s'] / int(k):.2f} "
                f"| {100 * r['observation_share']:.0f}% | {hit} | {vs} |"
            )
    setups = [
        f"{LABELS[e]} {m}: {r['setup_s']:.1f} s"
        for (m, e), r in results.items()
        if isinstance(r, dict) and e != "hf"
    ]
    if setups:
        print(f"\nvLLM setup: {', '.join(setups)}.")
    if missing:
        print(f"\nvLLM rows skipped: {args.vllm_python} cannot import vllm ({missing}).")


def table_two(res: dict[str, Any] | str, args: argparse.Namespace) -> None:
    from _mt_iteration import PHASES, VARIANTS

    print(
        f"\n### Training cost per iteration: {args.rows} rows of the same length, "
        f"{args.rounds} interleaved rounds after a warm-up\n"
    )
    if isinstance(res, str):
        print(f"failed: {res}")
        return
    print(
        f"Row length {res['length']} tokens: prompt {args.prompt_tokens}, then 4 turns of "
        f"{args.turn_tokens} with {args.observation_tokens}-token observations between them.\n"
    )
    cols = " | ".join(PHASES)
    print(
        f"| layout | trained tokens/row | {cols} | training s | multi / this, wall "
        "| CPU s | multi / this, CPU |"
    )
    print("| --- | ---: |" + " ---: |" * len(PHASES) + " ---: | --- | ---: | --- |")
    multi = res[VARIANTS[-1]]
    for v in VARIANTS:
        r = res[v]
        cells = " | ".join(f"{r['phases'][p]:.3f}" for p in PHASES)
        print(
            f"| {v} | {r['trained_tokens']} | {cells} | {statistics.median(r['totals']):.3f} "
            f"| {spread(multi['totals'], r['totals'])} | {statistics.median(r['cpu']):.3f} "
            f"| {spread(multi['cpu'], r['cpu'])} |"
        )
    print("\nRatios: median over the rounds (min–max), each round's multi-turn time over this.")


def spread(num: list[float], den: list[float]) -> str:
    """Median (min–max) of the per-round ratios ``num / den``."""
    ratios = [a / b for a, b in zip(num, den, strict=True)]
    return f"{statistics.median(ratios):.3f} ({min(ratios):.3f}–{max(ratios):.3f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--models", nargs="+", default=["tiny", "50M"], choices=list(SIZES))
    p.add_argument("--turns", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--observation-tokens", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", type=int, default=128, help="part 2: rows per iteration")
    p.add_argument("--rounds", type=int, default=8, help="part 2: timed rounds")
    p.add_argument("--skip", choices=["rollout", "iteration"], help="leave one part out")
    p.add_argument("--worker", choices=["rollout", "iteration"])
    p.add_argument("--engine", choices=ENGINES)
    p.add_argument("--model", choices=list(SIZES))
    p.add_argument("--prompts", type=int)
    p.add_argument("--samples", type=int)
    args = p.parse_args()
    # part 2's row layout (configs/multiturn.yaml-sized model)
    args.prompt_tokens, args.turn_tokens, args.hidden, args.layers = 8, 16, 64, 2
    args.chunk_tokens = 512
    if args.worker == "rollout":
        from _mt_rollout import worker

        print(json.dumps(worker(args)))
        return
    if args.worker == "iteration":
        from _mt_iteration import run

        args.turns = 4
        print(json.dumps(run(args)))
        return
    report(args)


def report(args: argparse.Namespace) -> None:
    command = "python bench/multi_turn.py " + " ".join(sys.argv[1:])
    one = part_one(args) if args.skip != "rollout" else None
    two = None
    if args.skip != "iteration":
        print("[bench] iteration layouts", file=sys.stderr, flush=True)
        extra = [
            "--rows",
            str(args.rows),
            "--rounds",
            str(args.rounds),
            "--threads",
            str(args.threads),
        ]
        two = run_worker(sys.executable, "iteration", extra)
    today = datetime.date.today().isoformat()
    load = os.getloadavg()[0]
    print(f"`{command}`, {today}, {os.cpu_count()} cores (load average {load:.1f} at the end)")
    if one is not None:
        table_one(*one, args)
    if two is not None:
        table_two(two, args)


if __name__ == "__main__":
    main()
