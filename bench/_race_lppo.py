"""lppo's side of the real-model race (runs in lppo's venv, or one with vLLM for ``engine=vllm``).

Usage: ``python _race_lppo.py SPEC OUT_DIR [KEY=VALUE ...]`` (SPEC from
``real_model_race.write_spec``). A real ``lppo.PPOTrainer.fit`` of
``examples/smollm2/grpo.yaml``'s recipe, built in Python: SmolLM2-135M-Instruct, the
``ChatArithmeticTask`` prompts through the chat template (the HF engine's ``chat_template``),
``estimators.GRPO(scale_by_std=True)``, no critic, no KL, one actor epoch of
``minibatches`` optimizer steps, ``ClippedPPO(clip_low, clip_high)``, AdamW at ``lr``
(lppo's defaults: no weight decay, gradient norm clipped to 1, constant rate). The task serves
the spec's training problems in order (:class:`SpecTask`), so both sides train on the same
prompts. Settings (lppo's default where left out):

- ``chunk_tokens``: ``data.max_tokens_per_chunk`` (default 2048, as ``grpo.yaml``);
  ``score_chunk_tokens``: ``data.max_tokens_per_score_chunk``;
- ``rollback``: ``1`` / ``0``, the actor's ``rollback_non_finite`` (a copy of parameters and
  optimizer state per step);
- ``old_logprobs``: ``model.ppo.old_logprobs``; ``trim_prompt``: ``1`` / ``0``;
- ``vocab_chunk``: the actor's ``vocab_chunk`` (``0``: the materialized log-softmax, lppo's
  default before 2026-12-07; ``auto``; or entries per slice);
- ``max_staleness``: asynchronous rollouts (``model.rollout.max_staleness``; the actor's
  ``off_policy: auto`` then truncates the importance weights at 2);
- ``lora_r``, ``lora_alpha``: LoRA adapters on every linear layer of the blocks;
- ``engine``: ``hf`` (``HFGenerateEngine``) or ``vllm`` (``VLLMEngine``, float32; needs a
  venv with vLLM: ``--lppo-python``).

Prints one JSON line (``_race_common.Recorder.result``); after every iteration whose sample
count is due, the policy is exported (``lppo.run.export.export_policy``) with the clock paused.
"""

from __future__ import annotations

import os
import random
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _race_common as common  # noqa: E402

KNOWN = {
    "chunk_tokens",
    "score_chunk_tokens",
    "rollback",
    "old_logprobs",
    "trim_prompt",
    "vocab_chunk",
    "max_staleness",
    "lora_r",
    "lora_alpha",
    "engine",
}


def spec_task(spec: dict[str, Any]) -> Any:
    """A ``ChatArithmeticTask`` that serves the spec's training problems, in order."""
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples", "smollm2"))
    from smollm2_task import ChatArithmeticTask

    from lppo.tasks import Prompt

    class SpecTask(ChatArithmeticTask):
        """The race's training problems in the spec's order; a cursor is its state."""

        def __init__(self) -> None:
            super().__init__(
                template=spec["template"],
                max_value=spec["max_value"],
                operators=spec["operators"],
                split="train",
            )
            self.served = [self.make_prompt(p["a"], p["op"], p["b"]) for p in spec["train"]]
            if [p.text for p in self.served] != [p["text"] for p in spec["train"]]:
                raise SystemExit("the task's template does not give the spec's prompt texts")
            self.cursor = 0

        def sample_prompts(self, n: int, generator: random.Random) -> list[Prompt]:
            if self.cursor + n > len(self.served):
                raise SystemExit(f"the spec holds {len(self.served)} problems, asked past them")
            out = self.served[self.cursor : self.cursor + n]
            self.cursor += n
            return [Prompt(p.text, p.answer, dict(p.metadata)) for p in out]

        def sample_texts(self) -> list[str]:
            return [t for p in self.served for t in (p.text, p.answer)]

        def state_dict(self) -> dict[str, Any]:
            return {"cursor": self.cursor}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.cursor = int(state["cursor"])

    return SpecTask()


def engine_of(spec: dict[str, Any], opts: dict[str, str]) -> Any:
    """The rollout engine: the HF engine with the chat template, or vLLM's."""
    if opts.get("engine", "hf") == "vllm":
        from lppo.rollout import VLLMEngine

        return VLLMEngine(dtype="float32", chat_template=True)
    from lppo.rollout import HFGenerateEngine

    return HFGenerateEngine(chat_template=True)


def actor_of(spec: dict[str, Any], opts: dict[str, str]) -> Any:
    """The actor: the pretrained model, ClippedPPO, AdamW at the spec's rate."""
    from lppo.algorithms import ClippedPPO
    from lppo.modules import ActorModule
    from lppo.modules.lora import LoRA
    from lppo.modules.models import HFCausalLM

    kwargs: dict[str, Any] = {}
    if "rollback" in opts:
        kwargs["rollback_non_finite"] = opts["rollback"] == "1"
    if "trim_prompt" in opts:
        kwargs["trim_prompt"] = opts["trim_prompt"] == "1"
    if "vocab_chunk" in opts:
        value = opts["vocab_chunk"]
        kwargs["vocab_chunk"] = value if value == "auto" else int(value)
    if "lora_r" in opts:
        r = int(opts["lora_r"])
        kwargs["lora"] = LoRA(r=r, alpha=float(opts.get("lora_alpha", 2 * r)))
    return ActorModule(
        HFCausalLM(pretrained_path=spec["model"]),
        lr=spec["lr"],
        objective=ClippedPPO(clip_low=spec["clip_low"], clip_high=spec["clip_high"]),
        **kwargs,
    )


def build_system(spec: dict[str, Any], opts: dict[str, str]) -> Any:
    """The ``PPOSystem`` of the recipe with ``opts`` applied."""
    from lppo import PPOSystem
    from lppo.config import PPOConfig
    from lppo.estimators import GRPO
    from lppo.rollout import RolloutSettings

    ppo: dict[str, Any] = {"kl_coef": 0.0, "actor_epochs": 1}
    ppo["actor_minibatches"] = spec["minibatches"]
    if "old_logprobs" in opts:
        ppo["old_logprobs"] = opts["old_logprobs"]
    return PPOSystem(
        actor=actor_of(spec, opts),
        critic=None,
        task=spec_task(spec),
        engine=engine_of(spec, opts),
        estimator=GRPO(scale_by_std=True),
        rollout=RolloutSettings(
            prompts_per_iteration=spec["prompts_per_iteration"],
            samples_per_prompt=spec["samples_per_prompt"],
            max_new_tokens=spec["max_new_tokens"],
            temperature=spec["temperature"],
            max_staleness=int(opts.get("max_staleness", "0")),
        ),
        ppo=PPOConfig(**ppo),
        tokenizer_path=spec["model"],
        seed=spec["seed"],
        num_threads=spec["threads"],
    )


def race_callback(recorder: common.Recorder) -> Any:
    """The callback that feeds ``recorder``: rows' prompt digest, tokens, reward, exports."""
    from lppo.iteration.hooks import PPOCallback
    from lppo.run.export import export_policy
    from lppo.types import INPUT_IDS, RESPONSE_MASK

    class Race(PPOCallback):
        def __init__(self) -> None:
            self.digest = ""
            self.extras: dict[str, float] = {}

        def on_rollout_end(self, ctx: Any) -> None:
            cols = ctx.store.read(ctx.row_ids, [INPUT_IDS, RESPONSE_MASK])
            prompts = []
            for ids, mask in zip(cols[INPUT_IDS], cols[RESPONSE_MASK], strict=True):
                start = int(mask.nonzero()[0]) if bool(mask.any()) else len(ids)
                prompts.append(ids[:start].tolist())
            self.digest = common.prompt_digest(prompts)

        def on_iteration_end(self, ctx: Any, result: Any) -> None:
            self.extras = {
                "generated_tokens": int(result.tokens.get("rollout", 0)),
                "reward_mean": float(result.rollout.reward_mean),
            }

        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            recorder.iteration_end(
                self.digest, self.extras, lambda path: export_policy(pl_module, path)
            )

    return Race()


def main() -> None:
    """Fit, then print the JSON line."""
    spec, recorder, opts = common.start(sys.argv, KNOWN)
    os.environ["OMP_NUM_THREADS"] = str(spec["threads"])
    import torch
    from lightning.pytorch import seed_everything

    from lppo import PPOTrainer
    from lppo.iteration.data import ReplayDataModule

    torch.set_num_threads(spec["threads"])
    seed_everything(spec["seed"], verbose=False)
    data: dict[str, Any] = {"max_tokens_per_chunk": int(opts.get("chunk_tokens", "2048"))}
    if "score_chunk_tokens" in opts:
        data["max_tokens_per_score_chunk"] = int(opts["score_chunk_tokens"])
    trainer = PPOTrainer(
        max_epochs=spec["iterations"],
        accelerator="cpu",
        devices=1,
        default_root_dir=os.path.join(recorder.out_dir, "run"),
        logger=False,
        enable_checkpointing=False,
        callbacks=[race_callback(recorder)],
    )
    trainer.fit(build_system(spec, opts), datamodule=ReplayDataModule(drop_budget=0, **data))
    common.emit(recorder.result("lppo", opts))


if __name__ == "__main__":
    main()
