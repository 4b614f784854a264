"""The "sanity check" of prime-rl (arXiv 2510.26788) on SmolLM2-135M-Instruct with lppo's GRPO.

On problems the base model solves 20-80 % of the time, a reliable RL algorithm pushes training
accuracy above 95 %. This benchmark:

1. screens ``--candidates`` training-side problems of ``examples/smollm2/grpo.yaml``'s task
   (two-operand arithmetic in words, operands 0-99, ``+ - ×``), ``--samples`` samples each at
   the recipe's temperature and response limit, through lppo's ``HFGenerateEngine``;
2. keeps the first ``--keep`` whose pass rate lies in ``[--low, --high]``;
3. trains the recipe (GRPO, its batch, learning rate and optimizer; the reward without partial
   credit, so an iteration's reward mean is its training accuracy) on exactly those problems,
   until accuracy holds at ``--target`` for ``--patience`` iterations or ``--max-iterations``;
4. writes the curve (``sanity_check.png``), the screened problems and the per-iteration
   accuracy (``sanity_check.json``) into ``--out``.

Usage (from the repository root, after ``examples/smollm2/convert.py``; ~20 min on 2 cores)::

    .venv/bin/python bench/sanity_check.py --out runs/bench/sanity

A quick check (minutes)::

    .venv/bin/python bench/sanity_check.py --candidates 16 --samples 4 --keep 4 \\
        --low 0 --high 1 --max-iterations 2 --out /tmp/sanity
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
EXAMPLE = REPO / "examples" / "smollm2"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(EXAMPLE))

RECIPE = EXAMPLE / "grpo.yaml"
MODEL = EXAMPLE / "SmolLM2-135M-Instruct"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--candidates", type=int, default=256, help="problems screened")
    p.add_argument("--samples", type=int, default=16, help="samples per screened problem")
    p.add_argument("--keep", type=int, default=32, help="problems trained on")
    p.add_argument("--low", type=float, default=0.2, help="lowest base pass rate kept")
    p.add_argument("--high", type=float, default=0.8, help="highest base pass rate kept")
    p.add_argument("--target", type=float, default=0.95, help="training accuracy to reach")
    p.add_argument("--patience", type=int, default=3, help="iterations it must hold")
    p.add_argument("--max-iterations", type=int, default=40)
    p.add_argument("--seed", type=int, default=0, help="seed of the screened problems")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "bench" / "sanity")
    return p.parse_args(argv)


def recipe() -> dict[str, Any]:
    """``examples/smollm2/grpo.yaml`` as a dict, the model read from :data:`MODEL`."""
    config = yaml.safe_load(RECIPE.read_text())
    model = config["model"]
    model["tokenizer_path"] = str(MODEL)
    model["actor"]["init_args"]["model"]["init_args"]["pretrained_path"] = str(MODEL)
    return config


def screen(config: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each candidate problem with its base pass rate over ``args.samples`` samples.

    Returns:
        ``[{"problem": "47-18", "text": ..., "pass_rate": 0.25}, ...]``, in draw order.
    """
    import torch
    from smollm2_task import ChatArithmeticTask
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lppo.rollout import HFGenerateEngine, RolloutSettings

    torch.set_num_threads(config["model"]["num_threads"])
    task = ChatArithmeticTask(**config["model"]["task"]["init_args"])
    rollout = config["model"]["rollout"]
    engine = HFGenerateEngine(chat_template=True)
    engine.setup(
        AutoModelForCausalLM.from_pretrained(MODEL).eval(),
        AutoTokenizer.from_pretrained(MODEL),
        RolloutSettings(
            max_new_tokens=rollout["max_new_tokens"], temperature=rollout["temperature"]
        ),
    )
    prompts = task.sample_prompts(args.candidates, random.Random(args.seed))
    rows, batch = [], max(1, 128 // args.samples)  # 128 sequences per generate call
    for start in range(0, len(prompts), batch):
        part = prompts[start : start + batch]
        out = engine.generate(part, args.samples, seed=args.seed + start)
        repeated = [prompt for prompt in part for _ in range(args.samples)]  # grouped by prompt
        rewards = task.rewards(repeated, out.completions)
        for i, prompt in enumerate(part):
            right = sum(r >= 1.0 for r in rewards[i * args.samples : (i + 1) * args.samples])
            meta = prompt.metadata
            rows.append(
                {
                    "problem": f"{meta['a']}{meta['op']}{meta['b']}",
                    "text": prompt.text,
                    "pass_rate": right / args.samples,
                }
            )
        print(f"screened {len(rows)}/{len(prompts)}", flush=True)
    return rows


def train(config: dict[str, Any], problems: list[str], args: argparse.Namespace) -> list[float]:
    """Train the recipe on ``problems`` alone; the training accuracy of every iteration."""
    import csv

    from lppo.run.cli import run

    trainer, model = config["trainer"], config["model"]
    trainer.update(max_epochs=args.max_iterations, default_root_dir=str(args.out / "run"))
    trainer["callbacks"] = [
        {
            "class_path": "_sanity_stop.StopAtAccuracy",
            "init_args": {"target": args.target, "patience": args.patience},
        }
    ]
    model["task"]["init_args"].update(problems=problems, partial_weight=0.0)
    path = args.out / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    cli = run(["fit", "--config", str(path)])
    with (Path(cli.trainer.logger.log_dir) / "metrics.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r.get("rollout/reward_mean")]
    return [float(r["rollout/reward_mean"]) for r in rows]


def plot(accuracy: list[float], target: float, path: Path) -> None:
    """Training accuracy per iteration against the target line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(accuracy) + 1), accuracy, marker="o", ms=3, label="lppo GRPO")
    ax.axhline(target, color="grey", ls="--", lw=1, label=f"target {target:.0%}")
    ax.set(xlabel="iteration", ylabel="training accuracy", ylim=(0, 1.02))
    ax.set_title("SmolLM2-135M-Instruct on problems it solved 20-80 % of the time", fontsize=10)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    """Screen, train, report; 1 when too few problems pass the screen."""
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    config = recipe()
    clock = time.perf_counter()
    screened = screen(config, args)
    kept = [r for r in screened if args.low <= r["pass_rate"] <= args.high][: args.keep]
    screen_s = time.perf_counter() - clock
    print(
        f"{len(kept)} of {len(screened)} problems have a base pass rate in "
        f"[{args.low}, {args.high}] ({screen_s:.0f} s)"
    )
    if not kept:
        return 1
    clock = time.perf_counter()
    accuracy = train(config, [r["problem"] for r in kept], args)
    reached = next((i + 1 for i, a in enumerate(accuracy) if a >= args.target), None)
    report = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "command": " ".join([sys.executable, *sys.argv]),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "base_pass_rate_mean": sum(r["pass_rate"] for r in kept) / len(kept),
        "problems": kept,
        "accuracy": accuracy,
        "first_iteration_at_target": reached,
        "screen_seconds": screen_s,
        "train_seconds": time.perf_counter() - clock,
    }
    (args.out / "sanity_check.json").write_text(json.dumps(report, indent=2))
    plot(accuracy, args.target, args.out / "sanity_check.png")
    print(
        json.dumps(
            {k: report[k] for k in ("base_pass_rate_mean", "accuracy", "first_iteration_at_target")}
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
