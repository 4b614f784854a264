"""``trim_prompt``: the trimmed last block gives the full forward's outputs and gradients.

Float64 random Llama models, right-padded chunks whose rows start their responses at different
positions; every module's trimmed result is compared with its own untrimmed forward on the
same weights, and a whole fit with every module trimmed trains the weights the untrimmed fit
trains.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from lppo.config import PPOConfig
from lppo.iteration.data import ReplayDataModule
from lppo.layouts.base import ParallelContext
from lppo.layouts.fsdp import FSDPLayout
from lppo.modules import ActorModule, CriticModule, RewardModel
from lppo.modules.lora import LoRA
from lppo.modules.models import HFCausalLM
from lppo.modules.tail import (
    TailBlock,
    check_trimmable,
    response_start,
    trimmed,
)
from lppo.run.system import PPOSystem, RolloutSettings
from lppo.run.trainer import PPOTrainer
from lppo.tasks import CopyTask
from lppo.types import Chunk
from lppo.validation import SettingError

VOCAB = 50


def spec(seed: int = 0, attn: str = "sdpa", heads: int = 4) -> HFCausalLM:
    return HFCausalLM(
        hidden_size=32,
        num_layers=3,
        num_heads=heads,
        intermediate_size=48,
        dtype="float64",
        seed=seed,
        attn_implementation=attn,
    )


def llama(seed: int = 0, attn: str = "sdpa") -> nn.Module:
    return spec(seed, attn).build(VOCAB, 0, 1, 2)


def chunk(prompts: tuple[int, ...] = (7, 4, 9), responses: tuple[int, ...] = (5, 6, 3)) -> Chunk:
    """Rows of ``prompt + response`` random tokens, right-padded to the longest."""
    gen = torch.Generator().manual_seed(3)
    width = max(p + r for p, r in zip(prompts, responses, strict=True))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    attention = torch.zeros(ids.shape, dtype=torch.bool)
    response = torch.zeros(ids.shape, dtype=torch.bool)
    for b, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ids[b, : p + r] = torch.randint(3, VOCAB, (p + r,), generator=gen)
        attention[b, : p + r] = True
        response[b, p : p + r] = True
    return Chunk(tuple(range(len(prompts))), ids, attention, response)


def grads(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in module.parameters() if p.grad is not None])


def test_response_start_is_one_before_the_earliest_response_token() -> None:
    assert response_start(chunk().response_mask) == 3
    assert response_start(torch.zeros((2, 5), dtype=torch.bool)) == 0
    first = torch.zeros((1, 4), dtype=torch.bool)
    first[0, 0] = True
    assert response_start(first) == 0


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_actor_logprobs_entropy_and_gradients_equal_the_full_forward(attn: str) -> None:
    # The tail block always uses SDPA in the model's dtype; HF's eager softmax is float32.
    tol = 1e-12 if attn == "sdpa" else 1e-7
    full = ActorModule(llama(attn=attn))
    trim = ActorModule(llama(attn=attn), trim_prompt=True)
    trim.configure_model()
    c = chunk()
    lf, ef = full.token_logprobs(c, with_entropy=True)
    lt, et = trim.token_logprobs(c, with_entropy=True)
    mask = c.response_mask
    assert lt.shape == lf.shape == et.shape == mask.shape
    torch.testing.assert_close(lt[mask], lf[mask], rtol=0, atol=tol)
    torch.testing.assert_close(et[mask], ef[mask], rtol=0, atol=tol)
    assert bool((lt[:, : response_start(mask) + 1] == 0).all())
    (lf[mask].sum() + ef[mask].sum()).backward()
    (lt[mask].sum() + et[mask].sum()).backward()
    torch.testing.assert_close(grads(trim), grads(full), rtol=0, atol=tol * 100)


def test_critic_values_and_gradients_equal_the_full_forward() -> None:
    full = CriticModule(llama(1).base_model)
    trim = CriticModule(llama(1).base_model, trim_prompt=True)
    c = chunk()
    vf, vt = full.values(c), trim.values(c)
    mask = c.response_mask
    torch.testing.assert_close(vt[mask], vf[mask], rtol=0, atol=1e-12)
    vf[mask].pow(2).sum().backward()
    vt[mask].pow(2).sum().backward()
    torch.testing.assert_close(grads(trim), grads(full), rtol=0, atol=1e-10)


def test_reward_scores_equal_the_full_forward() -> None:
    def build(trim_prompt: bool) -> RewardModel:
        model = RewardModel(spec(2), normalize=False, trim_prompt=trim_prompt)
        model.configure_model(VOCAB, 0, 1, 2)
        return model

    c = chunk(prompts=(7, 4, 9, 12), responses=(5, 6, 3, 1))
    torch.testing.assert_close(build(True).score(c), build(False).score(c), rtol=0, atol=1e-12)


def test_trimmed_puts_the_last_block_back_even_on_error() -> None:
    model = llama()
    body = model.base_model
    last = body.layers[-1]
    names = [n for n, _ in model.named_parameters()]
    with pytest.raises(ZeroDivisionError), trimmed(body, 3):
        assert isinstance(body.layers[-1], TailBlock)
        _ = 1 / 0
    assert body.layers[-1] is last
    assert [n for n, _ in model.named_parameters()] == names


def test_unsupported_models_are_rejected_naming_the_key() -> None:
    gpt2 = HFCausalLM(architecture="gpt2", hidden_size=16, num_heads=2).build(VOCAB, 0, 1, 2)
    with pytest.raises(SettingError, match=r"model.actor.init_args.trim_prompt=true.*gpt2"):
        check_trimmable(gpt2.base_model, "model.actor.init_args.trim_prompt")
    with pytest.raises(SettingError, match="trim_prompt"):
        ActorModule(gpt2, trim_prompt=True).configure_model()
    flex = llama()
    flex.config._attn_implementation = "flex_attention"
    with pytest.raises(SettingError, match="attn_implementation='flex_attention'"):
        check_trimmable(flex.base_model, "model.critic.init_args.trim_prompt")


class OwnLogits(ActorModule):
    """A user's actor whose ``logits(chunk)`` predates the trimmed forward's ``start``."""

    def logits(self, chunk):
        return super().logits(chunk)


def test_auto_trims_wherever_it_applies_and_says_why_not_elsewhere(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The default, trim_prompt=auto: on for a plain Llama, off (logged) for GPT-2 and LoRA."""
    small = {"hidden_size": 16, "num_heads": 2, "num_layers": 2, "intermediate_size": 32}
    on = ActorModule(HFCausalLM(**small))
    on.configure_model(VOCAB, 0, 1, 2)
    assert on.trim_prompt_setting == "auto" and on.trim_prompt is True
    critic = CriticModule(HFCausalLM(**small))
    critic.configure_model(VOCAB, 0, 1, 2)
    assert critic.trim_prompt is True
    reward = RewardModel(HFCausalLM(**small))
    reward.configure_model(VOCAB, 0, 1, 2)
    assert reward.trim_prompt is True
    with caplog.at_level("INFO"):
        gpt2 = ActorModule(HFCausalLM(architecture="gpt2", **small))
        gpt2.configure_model(VOCAB, 0, 1, 2)
        adapted = CriticModule(HFCausalLM(**small), lora=LoRA())
        adapted.configure_model(VOCAB, 0, 1, 2)
        own = OwnLogits(HFCausalLM(**small))
        own.configure_model(VOCAB, 0, 1, 2)
    assert gpt2.trim_prompt is False and adapted.trim_prompt is False and own.trim_prompt is False
    assert "trim_prompt=auto: off (OwnLogits.logits(chunk) takes no start)" in caplog.text
    assert "model.actor.init_args.trim_prompt=auto: off (" in caplog.text
    assert "model_type='gpt2'" in caplog.text
    assert "model.critic.init_args.trim_prompt=auto: off (LoRA: PEFT wraps" in caplog.text
    with pytest.raises(SettingError, match=r"trim_prompt=true with .*lora"):
        CriticModule(HFCausalLM(**small), lora=LoRA(), trim_prompt=True)


def test_a_layout_that_shards_weights_switches_auto_off_and_refuses_true() -> None:
    """Under ppo_fsdp the trimmed block would bypass the per-block all-gather."""
    small = {"hidden_size": 16, "num_heads": 2, "num_layers": 2, "intermediate_size": 32}
    auto, explicit = ActorModule(HFCausalLM(**small)), CriticModule(HFCausalLM(**small))
    explicit.trim_prompt_setting = True
    for module in (auto, explicit):
        module.configure_model(VOCAB, 0, 1, 2)
        assert module.trim_prompt is True
        module.parallel = ParallelContext(layout=FSDPLayout())  # the run's, as PPOSystem hands it
    auto.configure_model(VOCAB, 0, 1, 2)
    assert auto.trim_prompt is False
    with pytest.raises(SettingError, match=r"critic.init_args.trim_prompt=true under FSDPLayout"):
        explicit.configure_model(VOCAB, 0, 1, 2)


def fit(root: Path, trim: bool) -> PPOSystem:
    small = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64}
    system = PPOSystem(
        actor=ActorModule(HFCausalLM(**small, seed=0), lr=1e-3, trim_prompt=trim),
        critic=CriticModule(HFCausalLM(**small, seed=1), lr=1e-3, trim_prompt=trim),
        reward_model=RewardModel(HFCausalLM(**small, seed=2), trim_prompt=trim),
        task=CopyTask(),
        rollout=RolloutSettings(prompts_per_iteration=8, samples_per_prompt=2, max_new_tokens=5),
        ppo=PPOConfig(kl_coef=0.05, critic_epochs=2, actor_epochs=2),
        num_threads=1,
    )
    trainer = PPOTrainer(
        max_epochs=2, default_root_dir=str(root), accelerator="cpu", enable_checkpointing=False
    )
    trainer.fit(system, datamodule=ReplayDataModule(max_tokens_per_chunk=48))
    return system


def test_a_fit_with_every_module_trimmed_trains_the_same_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    full = fit(tmp_path / "full", False)
    starts: list[int] = []
    forward = TailBlock.forward

    def counted(self: TailBlock, *args, **kwargs) -> torch.Tensor:
        starts.append(self.start)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(TailBlock, "forward", counted)
    trim = fit(tmp_path / "trim", True)
    assert starts and min(starts) > 0  # the trimmed fit did trim
    for a, b in ((full.actor, trim.actor), (full.critic, trim.critic)):
        for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
            torch.testing.assert_close(q, p, rtol=0, atol=1e-5, msg=name)
