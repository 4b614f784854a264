"""``model.ppo.old_logprobs: engine``: the engine's forward pass gives π_old, exactly.

An engine that samples from the actor's own module computes π's logits at every sampled
token; at the sampling temperature and before top-p / top-k they are the log-probs the actor
scores as π_old, up to round-off. ``auto`` picks ``engine`` where the actor's first epoch
cannot give π_old (a KL penalty in the reward, several minibatches, ...) and the engine can.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from _builders import sliding_window_model
from test_old_logprobs import assert_trained_alike, counted_scores, fit, spec

from lppo.config import PPOConfig
from lppo.estimators import GRPO
from lppo.iteration.chunks import collate
from lppo.iteration.controller import PPOController
from lppo.iteration.data import ReplayDataModule
from lppo.iteration.old_logprobs import RowSource, engine_obstacles, resolve_old_logprobs
from lppo.modules import ActorModule
from lppo.modules.lora import LoRA
from lppo.modules.tokenizer import build_char_tokenizer
from lppo.rollout import HFGenerateEngine, RolloutSettings
from lppo.tasks import CopyTask
from lppo.types import GEN_LOGPROBS, INPUT_IDS, OLD_LOGPROBS, RESPONSE_MASK
from lppo.validation import SettingError

TASK = CopyTask(min_length=1, max_length=12)
TOK = build_char_tokenizer(TASK.vocabulary())
LIVE = RowSource(staleness=0, precision="32-true", shards_weights=False)


def built(module: ActorModule) -> ActorModule:
    module.configure_model(len(TOK), TOK.pad_token_id, TOK.bos_token_id, TOK.eos_token_id)
    return module


@pytest.mark.parametrize("knobs", [{}, {"prefill_tokens": None, "cache": "dynamic"}])
def test_the_engines_policy_logprobs_are_what_the_actor_scores(knobs) -> None:
    """π's log-probs from generate equal actor.score on the rows, under top-p and top-k too."""
    policy = built(ActorModule(spec(3)))
    policy.temperature = 0.7  # PPOSystem sets it from model.rollout.temperature
    engine = HFGenerateEngine(batch_size=6, **knobs)
    sampling = RolloutSettings(max_new_tokens=8, temperature=0.7, top_p=0.8, top_k=5)
    engine.setup(policy.policy(), TOK, sampling)
    engine.return_policy_logprobs = True
    out = engine.generate(TASK.sample_prompts(10, random.Random(2)), samples_per_prompt=2)
    assert out.policy_logprobs is not None
    chunk = collate(
        range(len(out)),
        {
            INPUT_IDS: out.input_ids,
            RESPONSE_MASK: out.response_mask,
            OLD_LOGPROBS: out.policy_logprobs,
            GEN_LOGPROBS: out.gen_logprobs,
        },
    )
    with torch.no_grad():
        scored = policy.score(chunk)
    assert chunk.old_logprobs is not None and chunk.gen_logprobs is not None
    mask = chunk.response_mask
    torch.testing.assert_close(chunk.old_logprobs[mask], scored[mask], rtol=0, atol=2e-5)
    assert (chunk.gen_logprobs[mask] - scored[mask]).abs().max() > 0.05  # μ is not π here


@pytest.mark.parametrize(
    ("critic", "ppo"),
    [(True, {"kl_coef": 0.1}), (False, {"actor_minibatches": 2})],
    ids=["gae-kl", "grpo-minibatches"],
)
def test_auto_takes_pi_old_from_the_engine_and_trains_as_recompute(tmp_path, critic, ppo) -> None:
    """Top-p 0.9: μ differs from π, and the mismatch is measured alike."""
    base = fit(tmp_path / "recompute", critic, "recompute", top_p=0.9, **ppo)
    with counted_scores() as scored:
        fused = fit(tmp_path / "engine", critic, "auto", top_p=0.9, **ppo)
    system = fused[0]
    assert system.controller is not None
    assert system.controller.config.old_logprobs == "engine"
    assert system.engine.return_policy_logprobs  # type: ignore[attr-defined]
    assert id(system.actor) not in scored  # no π_old forward pass in the score phase
    assert base[1].stats[0]["mismatch_kl"] > 0
    assert_trained_alike(fused, base, atol=1e-5)


class OwnLogits(ActorModule):
    """A user's actor with its own forward (π may not be what the engine samples from)."""

    def logits(self, chunk, start=0):
        return super().logits(chunk, start)


class OwnPolicy(ActorModule):
    """A user's actor that hands the engine another module."""

    def policy(self):
        return super().policy()


def sliding_window_actor() -> ActorModule:
    module = ActorModule(spec(0))
    module.model = sliding_window_model(len(TOK))
    return module


class OwnEngine:
    """A user's engine that does not say whether its log-probs are π's."""


def case(
    engine: object = None,
    actor: ActorModule | None = None,
    rows: RowSource = LIVE,
    **ppo: object,
) -> list[str]:
    policy = actor if actor is not None else built(ActorModule(spec(0)))
    engine = engine if engine is not None else HFGenerateEngine()
    return engine_obstacles(engine, policy, PPOConfig(**ppo), rows)  # type: ignore[arg-type]


def test_the_engine_gives_pi_old_only_where_that_is_exact() -> None:
    assert case() == []
    assert case(OwnEngine()) == ["OwnEngine does not give π's own log-probs"]
    assert case(actor=built(OwnLogits(spec(0)))) == ["OwnLogits overrides logits"]
    assert case(actor=built(OwnPolicy(spec(0)))) == ["OwnPolicy overrides policy"]
    lora = built(ActorModule(spec(0), lora=LoRA(r=4, alpha=8)))
    assert case(actor=lora) == ["the engine samples from a copy of the actor's model (LoRA merge)"]
    assert case(actor=sliding_window_actor()) == [
        "the policy has a DynamicSlidingWindowLayer layer (only full attention is exact)"
    ]
    assert case(disable_dropout=False) == ["model.ppo.disable_dropout=false"]
    assert case(actor=built(ActorModule(spec(0, "float64")))) == [
        "generate rounds the float64 policy's logits to float32"
    ]
    rows = {
        "model.rollout.max_staleness=1 (rows of older weights)": {"staleness": 1},
        "trainer.precision=bf16-mixed (generate runs without autocast)": {
            "precision": "bf16-mixed"
        },
        "trainer.strategy shards the weights": {"shards_weights": True},
    }
    for reason, changed in rows.items():
        assert case(rows=dataclasses.replace(LIVE, **changed)) == [reason]


def controller(config: PPOConfig, engine: list[str] | None) -> PPOController:
    actor = ActorModule(spec(0))
    resolved = resolve_old_logprobs(config, GRPO(), actor, engine)
    return PPOController(
        actor, None, ReplayDataModule(), resolved, ActorModule(spec(2)), estimator=GRPO()
    )


def test_auto_prefers_the_first_epoch_then_the_engine_then_a_pass(caplog) -> None:
    assert controller(PPOConfig(), []).config.old_logprobs == "actor"
    kl = PPOConfig(kl_coef=0.1)
    with caplog.at_level("INFO"):
        ctl = controller(kl, [])
    assert ctl.config.old_logprobs == "engine"
    assert ctl.scorer.actor not in ctl.scorer.models  # no π_old forward pass
    assert "old_logprobs=auto: engine (not the first epoch: model.ppo.kl_coef=0.1" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO"):
        assert controller(kl, ["OwnEngine does not give"]).config.old_logprobs == "recompute"
    assert "kl_coef=0.1 (the KL reward reads π_old); OwnEngine does not give" in caplog.text
    # Built without PPOSystem, the controller knows no engine: recompute.
    assert controller(kl, None).config.old_logprobs == "recompute"
    for given in (kl, PPOConfig()):  # explicit: checked, whether or not actor would apply
        explicit = dataclasses.replace(given, old_logprobs="engine")
        assert controller(explicit, []).config.old_logprobs == "engine"
        with pytest.raises(SettingError, match=r"old_logprobs=engine would not .*OwnEngine do"):
            controller(explicit, ["OwnEngine does not give"])
