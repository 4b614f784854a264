"""lppo's GRPO against TRL 1.16.0's ``GRPOTrainer`` on a real model: held-out accuracy over time.

Usage (from the repository root, with lppo's venv; the full race, for an idle machine)::

    .venv/bin/python bench/real_model_race.py
    .venv/bin/python bench/real_model_race.py --samples-budget 5120 --eval-every 640 \\
        --heldout 500 --json runs/bench/real_model_race.json

A quick check (minutes: 2 iterations of 2 prompts × 4 samples per side, 16 problems)::

    .venv/bin/python bench/real_model_race.py --prompts-per-iteration 2 \\
        --samples-per-prompt 4 --samples-budget 16 --eval-every 8 --heldout 16 \\
        --json /tmp/race_small.json

The model is SmolLM2-135M-Instruct as ``examples/smollm2/convert.py`` writes it (``--model``),
the task ``examples/smollm2/smollm2_task.py``'s ``ChatArithmeticTask`` (operators ``+-*``,
operands 0–99, the template of ``examples/smollm2/grpo.yaml``): training problems from its
``train`` side, evaluation problems from its ``heldout`` side (disjoint by construction). The
script draws both once (:func:`write_spec`, seeds ``--seed`` / ``--heldout-seed``) and hands
every side the same spec file; installs TRL into its own venv (``--trl-grpo-venv``, default
``.venv-trl-grpo``, with ``-c constraints.txt`` so torch stays the pinned CPU build); runs
each variant in its own process (``--schedule alone``: one after another, nothing else
resident; ``turns``: all at once, taking turns iteration by iteration, ``_turns``); and
evaluates every checkpoint afterwards with one function (``_race_eval.evaluate``).

Work, identical on both sides (``_race_lppo`` and ``_race_trl`` list how each side is set):
the spec's problems in order, ``--prompts-per-iteration`` × ``--samples-per-prompt``
completions per iteration (the GRPO group), at most ``--max-new-tokens`` new tokens at
``--temperature``, each prompt one user turn of the chat template; reward 1 when the last
integer of the completion is the answer; group-scaled advantages; no KL; the clipped surrogate
(``--clip-low`` / ``--clip-high``) over the tokens; ``--minibatches`` AdamW steps per
iteration at ``--lr``, constant, gradient norm clipped to 1; fp32, ``--threads`` threads.
Each side's workers digest the prompt token ids of every iteration's rows
(``_race_common.prompt_digest``); the table says whether the run digests match TRL's.

Measured per side: wall-clock from the process's first line to the end of each iteration
(imports, model loading and the training loop; checkpoint writes and waits for a turn left
out); trained samples; peak RSS (this process's high-water mark, checkpoint writes left out,
plus its children's, polled). Every ``--eval-every`` samples the policy is written as a
Hugging Face directory with the clock stopped; after the run, the greedy held-out accuracy of
each (``--heldout`` problems) is measured in this process, the same problems, decoding and
scoring for all, and the directory is deleted (``--keep-checkpoints`` keeps them).

Variants: ``trl``; ``lppo-default`` (lppo's defaults on ``grpo.yaml``'s recipe); ``lppo``
(``--lppo`` settings, :data:`LEAN`: lean on memory). Goals (issue #46): ``lppo`` reaches TRL's
final accuracy in ≤ 0.7× TRL's wall-clock, ends at or above it for the same samples, with peak
memory at or below TRL's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import _race_common as common  # noqa: E402
import _race_report as report  # noqa: E402
import trl_side_by_side as ppo_bench  # noqa: E402

TRL_VERSION = "1.16.0"
TEMPLATE = "What is {a} {word} {b}? Answer with just the number."
#: The ``lppo`` variant's settings, chosen to keep lppo's peak memory below TRL's.
#: ``rollback=0``: no per-step copy of the parameters and the AdamW state (3 × 135M floats,
#: 1.6 GB, copied at every optimizer step). ``chunk_tokens=512``: training chunks of TRL's
#: micro-batch (8 rows of ≤ 46 + 16 tokens), since a chunk's activations (about 1.2 MB per
#: token over SmolLM2's 30 layers) set the peak: ``grpo.yaml``'s 2048-token chunks hold about
#: 2.4 GB of them. Measured (docs/benchmarks/real-models.md): 3.9 GB peak against the
#: defaults' 6.5 GB, at 7 % more time (smaller chunks, more passes).
LEAN = ["rollback=0", "chunk_tokens=512"]


def draw(split: str, n: int, seed: str) -> list[dict[str, Any]]:
    """``n`` problems of ``ChatArithmeticTask``'s ``split`` side, as plain dictionaries."""
    sys.path.insert(0, os.path.join(REPO, "examples", "smollm2"))
    from smollm2_task import ChatArithmeticTask

    task = ChatArithmeticTask(template=TEMPLATE, max_value=99, operators="+-*", split=split)
    prompts = task.sample_prompts(n, random.Random(seed))
    return [{**p.metadata, "text": p.text, "answer": p.answer} for p in prompts]


def write_spec(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """Draw the problems and write the spec every side reads; returns its path and content."""
    rows = args.prompts_per_iteration * args.samples_per_prompt
    for name in ("samples_budget", "eval_every"):
        if getattr(args, name) % rows:
            raise SystemExit(f"--{name.replace('_', '-')} must be a multiple of {rows} rows")
    iterations = args.samples_budget // rows
    spec = {
        "model": os.path.abspath(args.model),
        "template": TEMPLATE,
        "max_value": 99,
        "operators": "+-*",
        "prompts_per_iteration": args.prompts_per_iteration,
        "samples_per_prompt": args.samples_per_prompt,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "lr": args.lr,
        "clip_low": args.clip_low,
        "clip_high": args.clip_high,
        "minibatches": args.minibatches,
        "iterations": iterations,
        "samples_budget": args.samples_budget,
        "eval_every": args.eval_every,
        "seed": args.seed,
        "threads": args.threads,
        "train": draw("train", iterations * args.prompts_per_iteration, f"train-{args.seed}"),
        "heldout": draw("heldout", args.heldout, f"heldout-{args.heldout_seed}"),
    }
    os.makedirs(args.root, exist_ok=True)
    path = os.path.join(args.root, "spec.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    return path, spec


def command(variant: str, args: argparse.Namespace, spec_path: str, trl_python: str) -> list[str]:
    """The worker command line of ``variant``."""
    out = os.path.join(args.root, variant)
    if variant == "trl":
        return [trl_python, os.path.join(HERE, "_race_trl.py"), spec_path, out, *args.trl]
    opts = args.lppo if variant == "lppo" else []
    return [args.lppo_python, os.path.join(HERE, "_race_lppo.py"), spec_path, out, *opts]


def evaluate_run(name: str, run: dict[str, Any], spec: dict, args: argparse.Namespace) -> None:
    """Add the held-out accuracy to every checkpointed point of ``run``; delete the checkpoint."""
    import _race_eval

    for point in run["points"]:
        path = point.pop("checkpoint", None)
        if path is None:
            continue
        point.update(_race_eval.evaluate(path, spec, args.eval_batch, args.threads))
        print(
            f"  {name} {point['samples']} samples: accuracy {point['accuracy']:.3f} "
            f"(evaluated in {point['eval_seconds']:.0f} s)",
            file=sys.stderr,
        )
        if not args.keep_checkpoints:
            shutil.rmtree(path, ignore_errors=True)


def run_variants(args: argparse.Namespace, spec_path: str, spec: dict, trl_python: str) -> dict:
    """Every variant's run, evaluated (``alone``: each evaluated before the next starts)."""
    cmds = {v: command(v, args, spec_path, trl_python) for v in args.variants}
    runs: dict[str, dict[str, Any]] = {}
    batches = [cmds] if args.schedule == "turns" else [{v: c} for v, c in cmds.items()]
    for batch in batches:
        t0 = time.time()
        for variant, run in ppo_bench.run_paired(batch, args.timeout).items():
            last = run["points"][-1]
            print(
                f"{variant}: {last['samples']} samples in {last['seconds']:.1f} s "
                f"(process {time.time() - t0:.0f} s), peak RSS {run['peak_rss_mb']:.0f} MB",
                file=sys.stderr,
            )
            evaluate_run(variant, run, spec, args)
            runs[variant] = run
    return {v: runs[v] for v in args.variants}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    default_model = os.path.join(REPO, "examples", "smollm2", "SmolLM2-135M-Instruct")
    p.add_argument("--model", default=default_model, help="Hugging Face directory")
    p.add_argument("--variants", nargs="+", default=["trl", "lppo", "lppo-default"])
    p.add_argument("--samples-budget", type=int, default=5120, help="trained samples per side")
    p.add_argument("--eval-every", type=int, default=640, help="samples between evaluations")
    p.add_argument("--heldout", type=int, default=500, help="held-out problems evaluated")
    p.add_argument("--prompts-per-iteration", type=int, default=16)
    p.add_argument("--samples-per-prompt", type=int, default=8, help="the GRPO group")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--clip-low", type=float, default=0.2)
    p.add_argument("--clip-high", type=float, default=0.28)
    p.add_argument("--minibatches", type=int, default=2, help="optimizer steps per iteration")
    p.add_argument("--seed", type=int, default=0, help="training problems and both trainers")
    p.add_argument("--heldout-seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lppo", nargs="*", default=LEAN, help="KEY=VALUE settings of 'lppo'")
    p.add_argument("--lppo-python", default=sys.executable, help="python of lppo's side")
    p.add_argument("--trl", nargs="*", default=[], help="KEY=VALUE settings of 'trl'")
    p.add_argument("--eval-batch", type=int, default=64)
    p.add_argument("--schedule", choices=["alone", "turns"], default="alone")
    p.add_argument("--root", default="/tmp/lppo-race", help="spec and checkpoints")
    p.add_argument("--keep-checkpoints", action="store_true")
    p.add_argument("--trl-grpo-venv", default=os.path.join(REPO, ".venv-trl-grpo"))
    p.add_argument("--json", default=os.path.join(REPO, "runs", "bench", "real_model_race.json"))
    p.add_argument("--png", default=None, help="default: the JSON's path with .png")
    p.add_argument("--timeout", type=float, default=6 * 3600, help="per schedule batch, s")
    return p.parse_args(argv)


def main() -> None:
    """Draw the problems, run and evaluate every variant, print the table, write JSON and PNG."""
    args = parse_args()
    started = time.time()
    spec_path, spec = write_spec(args)
    trl_python = ""
    if "trl" in args.variants:
        trl_python = ppo_bench.ensure_trl_venv(args.trl_grpo_venv, TRL_VERSION)
    import _race_eval

    base = _race_eval.evaluate(spec["model"], spec, args.eval_batch, args.threads)
    print(f"base model: accuracy {base['accuracy']:.3f}", file=sys.stderr)
    runs = run_variants(args, spec_path, spec, trl_python)
    trl = runs.get("trl")
    summaries = [report.summary(name, run, base, trl) for name, run in runs.items()]
    digests = {
        "train_problems": common.problems_digest(spec["train"]),
        "heldout_problems": common.problems_digest(spec["heldout"]),
    }
    settings = {k: v for k, v in spec.items() if k not in ("train", "heldout")}
    png = args.png or os.path.splitext(args.json)[0] + ".png"
    rows = spec["prompts_per_iteration"] * spec["samples_per_prompt"]
    title = (
        f"SmolLM2-135M-Instruct, arithmetic: {spec['prompts_per_iteration']} prompts × "
        f"{spec['samples_per_prompt']} samples ({rows}/iteration), {args.threads} threads"
    )
    report.plot(png, runs, base, title)
    doc = {"trl": TRL_VERSION, "settings": settings, "digests": digests, "base": base}
    doc.update(lppo_settings=args.lppo, trl_settings=args.trl, summaries=summaries, runs=runs)
    report.write_json(args.json, doc)
    print(
        f"`{' '.join(['python', 'bench/real_model_race.py', *sys.argv[1:]])}` (lppo settings: "
        f"{' '.join(args.lppo) or 'defaults'}; {args.threads} threads; "
        f"{time.time() - started:.0f} s)\n"
    )
    print(
        f"problems: train {digests['train_problems'][:12]}, held-out "
        f"{digests['heldout_problems'][:12]}; base model accuracy {base['accuracy']:.3f}\n"
    )
    print(report.table(summaries))
    print(f"\n{args.json}\n{png}")


if __name__ == "__main__":
    main()
