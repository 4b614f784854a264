"""The real-model race's two trainers updating from the same rows, compared weight by weight.

Usage (from the repository root, with lppo's venv; a few minutes per iteration)::

    .venv/bin/python bench/race_update.py [--seed 1] [--iterations 1] [--json ...]

The race (``bench/real_model_race.py``) has TRL's ``GRPOTrainer`` and lppo's GRPO sample with
different random streams, so their curves differ by sampling noise as well as by their
updates. This takes the sampling out: lppo runs ``--iterations`` iterations of the race's
recipe (16 prompts × 8 samples, 2 optimizer steps each, rows in sample order) and keeps its
rows; TRL then trains as many iterations on exactly those rows (``_update_trl.py`` replays
them in place of its generation, and its shuffle keeps the same order, so both trainers' steps
take the same 64 rows). Both start from the same weights; with more than one iteration the
optimizer state carried between iterations is compared too. Printed and written to
``--json``:

- every weight's update ``Δ = θ_after − θ_before`` on each side: the norms, their ratio, the
  cosine between the two updates, the fraction of entries whose update has the same sign,
  and the tensors where the two differ most;
- what the updates do to the policy on the trained rows: the change of the mean response
  log-prob of the rows with positive and with negative advantage, and the mean per-token KL
  from the starting policy;
- each side's logged metrics (TRL's loss, gradient norm and clip ratios; lppo's step
  statistics);
- whether lppo's first-iteration rows follow the starting policy (:func:`sampler_check`), the
  one thing the race's sides do not share besides the random stream.

The rows' rewards are the race's verifier on both sides; TRL recomputes the advantages from
them (``scale_rewards="group"``), and the JSON holds lppo's for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import real_model_race as race  # noqa: E402
import trl_side_by_side as ppo_bench  # noqa: E402


def load(path: str) -> Any:
    """A float32 Hugging Face causal LM from ``path``, in eval mode."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def weight_updates(base: Any, lppo: Any, trl: Any, worst: int = 8) -> dict[str, Any]:
    """Compare the two updates tensor by tensor and as one vector."""
    import torch

    before = dict(base.named_parameters())
    after = {"lppo": dict(lppo.named_parameters()), "trl": dict(trl.named_parameters())}
    dot = sq_l = sq_t = sq_diff = same_sign = moved = 0.0
    per_tensor = []
    for name, theta in before.items():
        d_l = (after["lppo"][name] - theta).detach().double()
        d_t = (after["trl"][name] - theta).detach().double()
        dot += float((d_l * d_t).sum())
        sq_l += float((d_l * d_l).sum())
        sq_t += float((d_t * d_t).sum())
        sq_diff += float(((d_l - d_t) ** 2).sum())
        both = (d_l != 0) | (d_t != 0)
        moved += float(both.sum())
        same_sign += float((torch.sign(d_l) == torch.sign(d_t))[both].sum())
        norm_t = float(d_t.norm())
        rel = float((d_l - d_t).norm()) / norm_t if norm_t else float("inf")
        per_tensor.append(
            {"name": name, "lppo_norm": float(d_l.norm()), "trl_norm": norm_t, "rel_diff": rel}
        )
    per_tensor.sort(key=lambda t: -t["rel_diff"])
    return {
        "lppo_norm": sq_l**0.5,
        "trl_norm": sq_t**0.5,
        "norm_ratio_lppo_over_trl": (sq_l / sq_t) ** 0.5 if sq_t else float("inf"),
        "cosine": dot / (sq_l * sq_t) ** 0.5 if sq_l and sq_t else float("nan"),
        "rel_diff": (sq_diff / sq_t) ** 0.5 if sq_t else float("inf"),
        "same_sign_fraction": same_sign / moved if moved else float("nan"),
        "worst_tensors": per_tensor[:worst],
    }


def response_logits(model: Any, rows: list[dict[str, Any]], batch: int = 16) -> Iterator[Any]:
    """For each row, ``(logits, targets)``: ``[response, vocab]`` float64 logits predicting
    its response tokens, and those tokens ``[response]``.

    Rows are right-padded to the longest row and run ``batch`` at a time, so every forward
    has one shape: a new shape per row grows the CPU kernels' caches by megabytes each.
    """
    import torch

    longest = max(len(r["prompt"]) + len(r["response"]) for r in rows)
    with torch.no_grad():
        for first in range(0, len(rows), batch):
            part = rows[first : first + batch]
            ids = torch.zeros(len(part), longest, dtype=torch.long)
            mask = torch.zeros(len(part), longest, dtype=torch.long)
            for k, row in enumerate(part):
                seq = row["prompt"] + row["response"]
                ids[k, : len(seq)] = torch.tensor(seq)
                mask[k, : len(seq)] = 1
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            for k, row in enumerate(part):
                start, end = len(row["prompt"]) - 1, len(row["prompt"]) + len(row["response"]) - 1
                yield logits[k, start:end].double(), ids[k, start + 1 : end + 1]


def response_logprobs(model: Any, rows: list[dict[str, Any]]) -> list[Any]:
    """Per-token log-probs (float64) of each row's response under ``model``."""
    import torch

    out = []
    for logits, targets in response_logits(model, rows):
        out.append(torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0])
    return out


def sampler_check(model: Any, rows: list[dict[str, Any]]) -> dict[str, float]:
    """Whether ``rows`` were sampled from ``model`` at temperature 1, independently in a group.

    Over the sampled tokens, the mean of ``-log p(token) - H(p)`` is 0 for a faithful sampler
    (below 0: too greedy, above: too random); the standard error is over tokens. Within each
    group (rows of one prompt), the share of pairs of rows whose first tokens agree is
    ``sum p^2`` of the first token's distribution for independent draws.
    """
    import torch

    gaps: list[float] = []
    first_tokens: dict[tuple[int, ...], list[int]] = {}
    first_agree: dict[tuple[int, ...], float] = {}
    for row, (logits, targets) in zip(rows, response_logits(model, rows), strict=True):
        logp = torch.log_softmax(logits, dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)
        gaps += (-logp.gather(-1, targets[:, None])[:, 0] - entropy).tolist()
        key = tuple(row["prompt"])
        first_tokens.setdefault(key, []).append(int(targets[0]))
        first_agree[key] = float((logp[0].exp() ** 2).sum())
    pairs = agree = expected = 0.0
    for key, tokens in first_tokens.items():
        n = len(tokens)
        pairs += n * (n - 1) / 2
        agree += sum(tokens[i] == tokens[j] for i in range(n) for j in range(i + 1, n))
        expected += n * (n - 1) / 2 * first_agree[key]
    gap = torch.tensor(gaps, dtype=torch.float64)
    return {
        "tokens": len(gaps),
        "mean_nll_minus_entropy": float(gap.mean()),
        "standard_error": float(gap.std() / len(gaps) ** 0.5),
        "first_token_pairs_agreeing": agree / pairs if pairs else float("nan"),
        "first_token_pairs_agreeing_if_independent": expected / pairs if pairs else float("nan"),
    }


def policy_change(base: Any, models: dict[str, Any], rows: list[dict[str, Any]]) -> dict:
    """What each update does on the trained rows: log-prob shift by advantage sign, and KL."""
    import torch

    before = response_logprobs(base, rows)
    result = {}
    for name, model in models.items():
        after = response_logprobs(model, rows)
        shift = {"positive": [], "negative": []}
        for row, b, a in zip(rows, before, after, strict=True):
            if row["advantage"]:
                key = "positive" if row["advantage"] > 0 else "negative"
                shift[key].append(float((a - b).mean()))
        ratio = torch.cat([a - b for a, b in zip(after, before, strict=True)])
        # k3 estimate of KL(start || new) on the rows' tokens: E[r - 1 - log r], r = p_new / p_start
        kl = float((ratio.exp() - 1 - ratio).mean())
        result[name] = {
            f"mean_logprob_shift_{sign}_advantage": sum(v) / max(len(v), 1)
            for sign, v in shift.items()
        }
        result[name]["kl_from_start_k3"] = kl
    return result


def parse_args() -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    model = os.path.join(REPO, "examples", "smollm2", "SmolLM2-135M-Instruct")
    p.add_argument("--model", default=model)
    p.add_argument("--seed", type=int, default=1, help="seed 0's first iteration has no reward")
    p.add_argument("--iterations", type=int, default=1)
    p.add_argument("--root", default="/tmp/lppo-race-update")
    p.add_argument("--trl-grpo-venv", default=os.path.join(REPO, ".venv-trl-grpo"))
    p.add_argument("--trl-shuffle", action="store_true", help="let TRL shuffle the rows")
    p.add_argument(
        "--reuse", action="store_true", help="compare the sides already trained under --root"
    )
    p.add_argument("--json", default=os.path.join(REPO, "runs", "bench", "race_update.json"))
    return p.parse_args()


def main() -> None:
    """Run both sides on the same rows, compare, print and write the JSON."""
    args = parse_args()
    spec_args = race.parse_args(
        ["--model", args.model, "--seed", str(args.seed), "--root", args.root, "--heldout", "1"]
    )
    per_iteration = spec_args.prompts_per_iteration * spec_args.samples_per_prompt
    spec_args.samples_budget = spec_args.eval_every = per_iteration * args.iterations
    spec_path, spec = race.write_spec(spec_args)
    trl_python = ppo_bench.ensure_trl_venv(args.trl_grpo_venv, race.TRL_VERSION)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    lppo_dir, trl_dir = os.path.join(args.root, "lppo"), os.path.join(args.root, "trl")
    run = [sys.executable, os.path.join(HERE, "_update_lppo.py"), spec_path, lppo_dir]
    if not (args.reuse and os.path.exists(os.path.join(lppo_dir, "metrics.json"))):
        subprocess.run(run, check=True, env=env)
    rows_path = os.path.join(lppo_dir, "rows.json")
    sides = {"lppo": lppo_dir, "trl": trl_dir}
    shuffle = f"shuffle={int(args.trl_shuffle)}"
    run = [trl_python, os.path.join(HERE, "_update_trl.py"), spec_path, rows_path, trl_dir, shuffle]
    if not (args.reuse and os.path.exists(os.path.join(trl_dir, "metrics.json"))):
        subprocess.run(run, check=True, env=env)
    with open(rows_path) as f:
        rows = json.load(f)
    base = load(spec["model"])
    models = {side: load(os.path.join(root, "policy")) for side, root in sides.items()}
    metrics = {}
    for side, root in sides.items():
        with open(os.path.join(root, "metrics.json")) as f:
            metrics[side] = json.load(f)
    doc = {
        "command": " ".join(["python", "bench/race_update.py", *sys.argv[1:]]),
        "iterations": args.iterations,
        "rows": len(rows),
        "reward_mean": sum(r["reward"] for r in rows) / len(rows),
        "weights": weight_updates(base, models["lppo"], models["trl"]),
        "policy": policy_change(base, models, rows),
        "sampler": sampler_check(base, rows[:per_iteration]),
        "metrics": metrics,
        "advantages_lppo": [r["advantage"] for r in rows],
    }
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1)
    shown = ("iterations", "rows", "reward_mean", "weights", "policy", "sampler")
    print(json.dumps({k: doc[k] for k in shown}, indent=1))
    print(args.json)


if __name__ == "__main__":
    main()
