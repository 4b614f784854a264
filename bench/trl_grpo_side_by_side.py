"""lppo's GRPO vs TRL 1.16.0's ``GRPOTrainer`` on the same work, interleaved, per phase.

Usage (from the repository root, with lppo's venv; the full measurement, for an idle machine)::

    .venv/bin/python bench/trl_grpo_side_by_side.py
    .venv/bin/python bench/trl_grpo_side_by_side.py --prompts 16 64 256 --variable-prompts 64 \\
        --iterations 4 --rounds 2 --json runs/bench/trl_grpo.json

At a real vocabulary (SmolLM2's 49,152 entries; assets under ``/tmp/lppo-trl-bench-v49152``)::

    .venv/bin/python bench/trl_grpo_side_by_side.py --vocab 49152 --prompts 64 \\
        --setups equal --json runs/bench/trl_grpo_v49152.json

A quick check (minutes)::

    .venv/bin/python bench/trl_grpo_side_by_side.py --prompts 16 --variable-prompts 16 \\
        --iterations 2 --json /tmp/trl_grpo_small.json

The script installs TRL 1.16.0 into its own virtual environment (``--trl-grpo-venv``, default
``.venv-trl-grpo``; with ``-c constraints.txt``, so torch stays the local 2.13.0 CPU build),
writes the shared inputs once (``_trl_assets``: tokenizer of ``--vocab`` entries, random Llama
policy of hidden size 256 (4.7M parameters at 1,024 entries), random reward model, prompts),
then for every setting runs each variant in its own process;
the variants take turns iteration by iteration, the order reversed every round (``_turns``,
``trl_side_by_side.run_schedule``), and the report has the medians over the timed iterations
(the first iteration of each process is a warm-up).

Work, identical on both sides, reported in the table: ``N`` prompts per iteration, ``--samples``
completions each (TRL ``num_generations``; lppo ``rollout.samples_per_prompt``), exactly 64
new tokens (TRL ``min_new_tokens`` = ``max_completion_length`` = 64; lppo ``ignore_eos``),
temperature 1, no reference (KL 0: TRL ``beta=0``, lppo's default ``kl_coef``), group-normalized
advantages of the shared reward model's score (TRL ``scale_rewards="group"``; lppo
``estimators.GRPO``), the clipped surrogate (ε 0.2) normalized over the batch's tokens (TRL
``loss_type="dapo"``; lppo ``token_mean``), one optimizer step per iteration over all rows (TRL
``num_iterations=1``, ``steps_per_generation`` = ``gradient_accumulation_steps`` = rows / 8
micro-batches of ``per_device_train_batch_size=8``; lppo one actor epoch of one minibatch in
640-token chunks = 8 × 80), no gradient checkpointing, fp32, ``--threads`` intra-op threads.
Setups: ``equal`` (every prompt 16 tokens) and ``variable`` (8–128 tokens; TRL left-pads, lppo
packs). Not matched: TRL needs no old log-probs pass with one use of a batch (it takes the
current ones, detached); ``lppo-default`` does the same, exactly (``old_logprobs: auto``: the
actor's first epoch), the tuned ``lppo`` takes the rollout's (``old_logprobs=rollout``). TRL
also scores re-tokenized text, lppo the tokens.

Variants: ``trl``; ``lppo-default`` (lppo's critic-free defaults: ``estimators.GRPO``,
``ClippedPPO``); ``lppo`` (``--lppo`` settings: the PPO bench's ``TUNED`` ones that apply
without a critic).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import _trl_assets  # noqa: E402
import trl_side_by_side as ppo_bench  # noqa: E402

#: ``TUNED`` of the PPO bench without the critic's settings.
TUNED_GRPO = [o for o in ppo_bench.TUNED if not o.startswith("old_values")]
TRL_VERSION = "1.16.0"


def command(variant: str, args: argparse.Namespace, trl_python: str, setup: str, n: int) -> list:
    """The worker command line of ``variant`` for one setting."""
    common = [args.root, setup, str(n), str(args.iterations), str(args.threads)]
    if variant == "trl":
        return [trl_python, os.path.join(HERE, "_trl_grpo.py"), *common, str(args.samples)]
    opts = ["estimator=grpo", f"samples={args.samples}", f"chunk_tokens={args.chunk_tokens}"]
    opts += args.lppo if variant == "lppo" else []
    return [sys.executable, os.path.join(HERE, "_trl_lppo.py"), *common, *opts]


def work_of(raw: dict) -> dict:
    """The work one run did per iteration: prompts, samples, generated tokens, optimizer steps."""
    work = raw["work"]
    return {
        "prompts": work["prompts"],
        "samples": work["samples"],
        "tokens": statistics.median(work["tokens"]),
        "optimizer_steps": work["optimizer_steps"],
    }


def phase_medians(runs: list[dict]) -> dict[str, float]:
    """Per-phase medians over a variant's runs (their work left out)."""
    return ppo_bench.medians([{k: v for k, v in r.items() if k != "work"} for r in runs])


def row(setup: str, n: int, name: str, runs: list[dict], base: dict | None) -> str:
    """One markdown row: work, phase medians, ratios against TRL, peak RSS."""
    s = phase_medians(runs)
    w = runs[0]["work"]
    cells = [setup, str(n), name, str(w["samples"]), f"{w['tokens']:.0f}"]
    cells += [f"{w['optimizer_steps']:g}"]
    cells += [f"{s[k]:.2f}" for k in ("generation", "scoring", "training", "total")]
    ratio, phases = "", ""
    if base is not None and name != "trl":
        ratio = f"**{s['total'] / base['total']:.2f}**"
        phases = " / ".join(f"{s[k] / base[k]:.2f}" for k in ("generation", "scoring", "training"))
    cells += [ratio, phases, f"{statistics.median(r['peak_rss_mb'] for r in runs):.0f}"]
    return "| " + " | ".join(cells) + " |"


def report(results: dict) -> str:
    """The markdown table; ratios are against ``trl`` of the same setting."""
    lines = [
        "| setup | prompts | variant | samples/prompt | generated tokens/iter "
        "| optimizer steps/iter | generation s | scoring s | training s | iteration s "
        "| × TRL (iteration) "
        "| × TRL gen / score / train | peak RSS MB |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for (setup, n), variants in results.items():
        base = phase_medians(variants["trl"]) if "trl" in variants else None
        lines += [row(setup, n, name, runs, base) for name, runs in variants.items()]
    return "\n".join(lines)


def run_setting(args: argparse.Namespace, trl_python: str, setup: str, n: int) -> dict:
    """Every round of one setting: each variant's summarized runs (with their work)."""
    out: dict[str, list[dict]] = {v: [] for v in args.variants}
    for r in range(args.rounds):
        order = args.variants if r % 2 == 0 else args.variants[::-1]
        cmds = {v: command(v, args, trl_python, setup, n) for v in order}
        for variant, raw in ppo_bench.run_schedule(cmds, args).items():
            summary = {**ppo_bench.summarize(raw), "work": work_of(raw)}
            summary.pop("padding", None)
            out[variant].append(summary)
            print(f"{setup} {n} {variant}: {summary['total']:.2f}s/iter", file=sys.stderr)
    return out


def write_json(path: str, results: dict, args: argparse.Namespace) -> None:
    """The results with the date, ``os.cpu_count()`` and the settings."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    doc = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "threads": args.threads,
        "vocab": args.vocab,
        "trl": TRL_VERSION,
        "lppo_settings": args.lppo,
        "argv": sys.argv[1:],
        "settings": [
            {"setup": s, "prompts": n, "variants": variants} for (s, n), variants in results.items()
        ],
    }
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prompts", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--variable-prompts", type=int, nargs="+", default=[64])
    p.add_argument("--setups", nargs="+", default=["equal", "variable"])
    p.add_argument("--variants", nargs="+", default=["trl", "lppo", "lppo-default"])
    p.add_argument("--samples", type=int, default=4, help="samples per prompt")
    p.add_argument("--iterations", type=int, default=3, help="per process, first is warm-up")
    p.add_argument("--rounds", type=int, default=1, help="processes per variant and setting")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--chunk-tokens", type=int, default=640)
    p.add_argument("--lppo", nargs="*", default=TUNED_GRPO, help="KEY=VALUE settings of 'lppo'")
    p.add_argument("--vocab", type=int, default=_trl_assets.VOCAB, help="tokenizer entries")
    p.add_argument("--root", default=None, help="assets (default /tmp/lppo-trl-bench[-vV])")
    p.add_argument("--trl-grpo-venv", default=os.path.join(REPO, ".venv-trl-grpo"))
    p.add_argument("--json", default=os.path.join(REPO, "runs", "bench", "trl_grpo.json"))
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--schedule", choices=["turns", "alone"], default="turns")
    args = p.parse_args(argv)
    if args.root is None:
        tail = "" if args.vocab == _trl_assets.VOCAB else f"-v{args.vocab}"
        args.root = f"/tmp/lppo-trl-bench{tail}"
    return args


def main() -> None:
    """Run every setting, print the table, write the JSON."""
    args = parse_args()
    uses_trl = "trl" in args.variants
    trl_python = ppo_bench.ensure_trl_venv(args.trl_grpo_venv, TRL_VERSION) if uses_trl else ""
    settings = [
        (s, n)
        for s in args.setups
        for n in (args.prompts if s == "equal" else args.variable_prompts)
    ]
    _trl_assets.build(args.root, sorted({n for _, n in settings}), args.setups, args.vocab)
    started = time.time()
    results = {(s, n): run_setting(args, trl_python, s, n) for s, n in settings}
    print(
        f"`{' '.join(['python', 'bench/trl_grpo_side_by_side.py', *sys.argv[1:]])}` "
        f"(lppo settings: {' '.join(args.lppo) or 'defaults'}; {args.threads} threads; "
        f"{time.time() - started:.0f} s)\n"
    )
    print(report(results))
    write_json(args.json, results, args)


if __name__ == "__main__":
    main()
