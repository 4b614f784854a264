"""TRL's side of the real-model race: ``GRPOTrainer`` of TRL 1.16.0 (runs in the TRL venv).

Usage: ``python _race_trl.py SPEC OUT_DIR [KEY=VALUE ...]`` (SPEC from
``real_model_race.write_spec``); settings: ``micro_batch`` (``per_device_train_batch_size``,
default 8, TRL's; at most one optimizer step's rows) and ``gradient_checkpointing`` (``1`` /
``0``, default ``0``: lppo has none).

:func:`grpo_config` makes TRL's work lppo's: each generation batch is ``prompts_per_iteration``
prompts × ``samples_per_prompt`` completions (``num_generations``), the spec's problems in order
(``shuffle_dataset=False``), as one user turn of the chat template (conversational prompts), at
most ``max_new_tokens`` new tokens at ``temperature`` (top-p 1, top-k 0), used once
(``num_iterations`` 1) for ``minibatches`` optimizer steps; no reference model (``beta`` 0),
group-scaled advantages (``scale_rewards="group"``), the clipped surrogate
(``epsilon`` / ``epsilon_high`` = ``clip_low`` / ``clip_high``) over the tokens
(``loss_type="dapo"``), AdamW at ``lr`` with a constant rate (no weight decay, gradient norm 1:
TRL's defaults, lppo's too), fp32 on the CPU. The reward is ``_race_common.reward``, the task's
verifier. Prints one JSON line (``_race_common.Recorder.result``); after every iteration whose
sample count is due, ``model.save_pretrained`` writes the policy with the clock paused.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _race_common as common  # noqa: E402
from _trl_assets import TRAINER_ARGS  # noqa: E402

KNOWN = {"micro_batch", "gradient_checkpointing"}


def grpo_config(spec: dict[str, Any], opts: dict[str, str]) -> Any:
    """``GRPOConfig`` doing the recipe's work, ``minibatches`` steps per generation batch."""
    from trl import GRPOConfig

    rows = spec["prompts_per_iteration"] * spec["samples_per_prompt"]
    per_step = rows // spec["minibatches"]
    micro = min(int(opts.get("micro_batch", "8")), per_step)
    if rows % spec["minibatches"] or per_step % micro:
        raise SystemExit(f"{rows} rows / {spec['minibatches']} steps / micro-batch {micro}")
    return GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="race-trl-"),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=per_step // micro,
        steps_per_generation=rows // micro,
        num_generations=spec["samples_per_prompt"],
        num_iterations=1,
        max_steps=spec["iterations"] * spec["minibatches"],
        max_completion_length=spec["max_new_tokens"],
        temperature=spec["temperature"],
        top_p=1.0,
        top_k=0,
        beta=0.0,
        epsilon=spec["clip_low"],
        epsilon_high=spec["clip_high"],
        loss_type="dapo",
        scale_rewards="group",
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        gradient_checkpointing=opts.get("gradient_checkpointing", "0") == "1",
        shuffle_dataset=False,
        **{**TRAINER_ARGS, "seed": spec["seed"]},
    )


def build_trainer(spec: dict[str, Any], args: Any, reward: Any, callbacks: list[Any]) -> Any:
    """``GRPOTrainer`` on the spec's model (float32) and training problems, as chat prompts."""
    import torch
    import transformers
    from datasets import Dataset
    from trl import GRPOTrainer

    tok = transformers.AutoTokenizer.from_pretrained(spec["model"])
    tok.padding_side = "left"
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    problems = spec["train"]
    dataset = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": p["text"]}] for p in problems],
            "answer": [p["answer"] for p in problems],
        }
    )
    return GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,
        processing_class=tok,
        callbacks=callbacks,
    )


def watch(trainer: Any, current: dict[str, Any]) -> None:
    """Wrap ``trainer._generate`` to keep the batch's prompt ids and completion lengths."""
    generate = trainer._generate

    def recorded(*args: Any, **kwargs: Any) -> Any:
        out = generate(*args, **kwargs)
        current["digest"] = common.prompt_digest(out[0])
        current["generated_tokens"] = sum(len(c) for c in out[1])
        return out

    trainer._generate = recorded


def main() -> None:
    """Train, then print the JSON line."""
    spec, recorder, opts = common.start(sys.argv, KNOWN)
    import torch

    torch.set_num_threads(spec["threads"])
    import transformers

    current: dict[str, Any] = {}

    def correct(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
        scores = [
            common.reward(a, c[0]["content"]) for a, c in zip(answer, completions, strict=True)
        ]
        current.setdefault("rewards", []).extend(scores)
        return scores

    class Race(transformers.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step % spec["minibatches"]:
                return
            rewards = current.pop("rewards", [])
            extras = {
                "generated_tokens": current["generated_tokens"],
                "reward_mean": sum(rewards) / max(len(rewards), 1),
            }
            recorder.iteration_end(current["digest"], extras, kwargs["model"].save_pretrained)

    trainer = build_trainer(spec, grpo_config(spec, opts), correct, [Race()])
    watch(trainer, current)
    trainer.train()
    common.emit(recorder.result("trl", opts))


if __name__ == "__main__":
    main()
