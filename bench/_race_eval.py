"""The one held-out evaluation of the real-model race, applied to every side's checkpoints.

Greedy decoding with ``transformers``' ``generate`` (no lppo, no TRL code), ``max_new_tokens``
new tokens, each problem one user turn of the chat template (``add_generation_prompt``;
encoded without the tokenizer's own special tokens, as lppo's engines encode a chat prompt),
left-padded batches in the spec's order, scored by ``_race_common.reward`` (the last integer of
the completion against the answer). The same problems, batches, decoding and scoring for every
checkpoint of every side; the checkpoints hold only the policy's weights, the tokenizer is the
base model's.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _race_common as common


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` as one user turn of the chat template, ready for the answer."""
    messages = [{"role": "user", "content": text}]
    templated = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(templated, add_special_tokens=False)["input_ids"])


def greedy_completions(
    model: Any, tokenizer: Any, prompts: list[list[int]], max_new_tokens: int, batch: int
) -> list[str]:
    """Greedy completions of ``prompts`` (token ids) in left-padded batches of ``batch``."""
    import torch

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out: list[str] = []
    for start in range(0, len(prompts), batch):
        rows = prompts[start : start + batch]
        width = max(len(r) for r in rows)
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        with torch.no_grad():
            gen = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=pad,
                eos_token_id=tokenizer.eos_token_id,
            )
        texts = tokenizer.batch_decode(gen[:, width:], skip_special_tokens=True)
        out.extend(texts)
    return out


def evaluate(
    model_dir: str, spec: dict[str, Any], batch: int = 64, threads: int | None = None
) -> dict[str, Any]:
    """Greedy held-out accuracy of the policy in ``model_dir`` on the spec's problems.

    Returns:
        ``accuracy``, ``correct``, ``n``, ``eval_seconds`` and two sample completions.
    """
    import torch
    import transformers

    if threads:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    tokenizer = transformers.AutoTokenizer.from_pretrained(spec["model"])
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    problems = spec["heldout"]
    prompts = [encode(tokenizer, p["text"]) for p in problems]
    texts = greedy_completions(model, tokenizer, prompts, spec["max_new_tokens"], batch)
    scores = [common.reward(p["answer"], t) for p, t in zip(problems, texts, strict=True)]
    correct = int(sum(scores))
    return {
        "accuracy": correct / len(problems),
        "correct": correct,
        "n": len(problems),
        "eval_seconds": time.perf_counter() - t0,
        "examples": [[problems[i]["text"], texts[i]] for i in range(min(2, len(texts)))],
    }
