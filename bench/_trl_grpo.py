"""One TRL 1.16.0 ``GRPOTrainer`` run of the GRPO side-by-side benchmark (runs in its venv).

Usage: ``python _trl_grpo.py ROOT SETUP N ITERATIONS THREADS SAMPLES`` (ROOT from
``_trl_assets``). Prints one JSON line: per-iteration seconds of generation / scoring /
training / total, the work done (prompts, samples, generated tokens, optimizer steps) and the
peak RSS. The settings (:func:`grpo_config`) make TRL's work lppo's: ``N`` prompts of
``SAMPLES`` completions each per iteration, exactly 64 new tokens each (``min_new_tokens`` 64
= ``max_completion_length``), temperature 1, no reference model (``beta`` 0), the shared random
reward model as the only reward, one generation batch of all ``N × SAMPLES`` rows used once
(``num_iterations`` 1) for one optimizer step (``gradient_accumulation_steps`` micro-batches
of 8 rows; no gradient checkpointing, lppo has none), loss normalized over the batch's tokens
(``loss_type="dapo"``, lppo's ``token_mean``), fp32 on the CPU. Phases are timed by
wrapping the trainer's own methods: generation is ``_generate``; scoring is the rest of
``_generate_and_score_completions``
(reward model, advantages); training runs from there to ``on_step_end``. Nothing of TRL's own
computation is changed.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _turns
from _trl_assets import TRAINER_ARGS, load_prompts, peak_rss_mb

#: Rows per micro-batch, as the PPO bench (lppo: 640-token chunks = 8 × 80).
MICRO_BATCH = 8
NEW_TOKENS = 64


def grpo_config(out: str, n: int, iterations: int, samples: int) -> Any:
    """``GRPOConfig`` doing lppo's GRPO work: one optimizer step over ``n × samples`` rows."""
    from trl import GRPOConfig

    rows = n * samples
    if rows % MICRO_BATCH:
        raise SystemExit(f"N x SAMPLES = {rows} must be a multiple of {MICRO_BATCH}")
    return GRPOConfig(
        output_dir=out,
        per_device_train_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=rows // MICRO_BATCH,
        steps_per_generation=rows // MICRO_BATCH,
        num_generations=samples,
        num_iterations=1,
        max_steps=iterations,
        max_completion_length=NEW_TOKENS,
        generation_kwargs={"min_new_tokens": NEW_TOKENS},
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        gradient_checkpointing=False,
        shuffle_dataset=False,
        **TRAINER_ARGS,
    )


def time_phases(trainer: Any, current: dict[str, float]) -> None:
    """Wrap ``trainer._generate`` and ``_generate_and_score_completions`` to stamp ``current``."""
    generate, prepare = trainer._generate, trainer._generate_and_score_completions

    def timed_generate(*args: Any, **kwargs: Any) -> Any:
        current["gen_start"] = time.perf_counter()
        out = generate(*args, **kwargs)
        current["gen_end"] = time.perf_counter()
        current["tokens"] = current.get("tokens", 0) + sum(len(c) for c in out[1])
        return out

    def timed_prepare(*args: Any, **kwargs: Any) -> Any:
        _turns.begin()  # an iteration starts with its generation batch
        current["start"] = time.perf_counter()
        out = prepare(*args, **kwargs)
        current["train_start"] = time.perf_counter()
        return out

    trainer._generate = timed_generate
    trainer._generate_and_score_completions = timed_prepare


def rows_of(marks: list[dict[str, float]]) -> list[dict[str, float]]:
    """Per-iteration phase seconds from the stamps."""
    return [
        {
            "generation": m["gen_end"] - m["gen_start"],
            "scoring": m["train_start"] - m["gen_end"],
            "training": m["end"] - m["train_start"],
            "total": m["end"] - m["start"],
        }
        for m in marks
    ]


def main() -> None:
    """Run the trainer and print the JSON line."""
    root, setup, n, iterations, threads, samples = sys.argv[1:7]
    n, iterations, threads, samples = int(n), int(iterations), int(threads), int(samples)
    import torch

    torch.set_num_threads(threads)
    import transformers
    from datasets import Dataset
    from trl import GRPOTrainer

    marks: list[dict[str, float]] = []
    current: dict[str, float] = {}

    class Marks(transformers.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            marks.append({**current, "end": time.perf_counter()})
            current.clear()
            _turns.next_turn()

    tok = transformers.AutoTokenizer.from_pretrained(os.path.join(root, "tokenizer"))
    tok.padding_side = "left"
    policy = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(root, "policy"))
    reward = transformers.AutoModelForSequenceClassification.from_pretrained(
        os.path.join(root, "reward"), num_labels=1
    )
    texts = [" ".join(f"w{i - 4}" for i in ids) for ids in load_prompts(root, setup, n)]
    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=reward,
        args=grpo_config(tempfile.mkdtemp(prefix="trl-grpo-bench-"), n, iterations, samples),
        train_dataset=Dataset.from_dict({"prompt": texts}),
        processing_class=tok,
        reward_processing_classes=tok,
        callbacks=[Marks()],
    )
    time_phases(trainer, current)
    trainer.train()
    steps = trainer.state.global_step
    work = {"prompts": n, "samples": samples, "tokens": [m["tokens"] for m in marks]}
    work["optimizer_steps"] = steps / max(len(marks), 1)
    result = {"side": "trl", "iterations": rows_of(marks), "work": work}
    print(json.dumps({**result, "peak_rss_mb": peak_rss_mb(), "ranks": 1}))


if __name__ == "__main__":
    main()
