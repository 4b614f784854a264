"""``model.ppo.old_logprobs: actor``: the actor's first epoch computes π_old, exactly.

The score phase then runs no actor forward pass; the π_old that epoch stores (and the second
epoch reads), the mismatch metrics and the trained weights equal those of ``recompute`` to
round-off. ``auto`` (the default) picks ``actor`` wherever that holds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lppo.algorithms.off_policy import OffPolicyCorrection
from lppo.config import PPOConfig
from lppo.estimators import GAE, GRPO
from lppo.iteration.controller import PPOController
from lppo.iteration.data import ReplayDataModule
from lppo.iteration.hooks import PPOCallback
from lppo.modules import ActorModule, CriticModule
from lppo.modules.models import HFCausalLM
from lppo.run.system import PPOSystem, RolloutSettings
from lppo.run.trainer import PPOTrainer
from lppo.tasks import CopyTask
from lppo.types import OLD_LOGPROBS
from lppo.validation import SettingError

MISMATCH = ("mismatch_kl", "mismatch_max_abs_log_ratio", "mismatch_outside_fraction")


def spec(seed: int, dtype: str = "float32") -> HFCausalLM:
    return HFCausalLM(
        hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=seed, dtype=dtype
    )


class OldLogprobs(PPOCallback):
    """π_old as stored when the actor's second epoch starts, and every iteration's metrics."""

    def __init__(self) -> None:
        self.columns: list[list[torch.Tensor]] = []
        self.stats: list[dict[str, float]] = []

    def on_phase_epoch_start(self, ctx) -> None:
        if ctx.phase == "actor" and ctx.epoch == 1:
            self.columns.append(ctx.store.read(ctx.row_ids, [OLD_LOGPROBS])[OLD_LOGPROBS])

    def on_iteration_end(self, ctx, result) -> None:
        self.stats.append(result.rollout.as_dict())


def fit(
    root: Path, critic: bool, mode: str, top_p: float = 1.0, **ppo: object
) -> tuple[PPOSystem, OldLogprobs]:
    cap = OffPolicyCorrection(mode="truncate", cap=1.5)  # the IS weights read π_old too
    system = PPOSystem(
        actor=ActorModule(spec(0), lr=1e-3, off_policy=cap),
        critic=CriticModule(spec(1), lr=1e-3) if critic else None,
        estimator=GAE() if critic else GRPO(),
        task=CopyTask(),
        rollout=RolloutSettings(
            prompts_per_iteration=8, samples_per_prompt=2, max_new_tokens=5, top_p=top_p
        ),
        ppo=PPOConfig(actor_epochs=2, old_logprobs=mode, **ppo),  # type: ignore[arg-type]
        num_threads=1,
    )
    seen = OldLogprobs()
    trainer = PPOTrainer(
        max_epochs=3,
        default_root_dir=str(root),
        accelerator="cpu",
        callbacks=[seen],
        enable_checkpointing=False,
    )
    trainer.fit(system, datamodule=ReplayDataModule(max_tokens_per_chunk=24))
    return system, seen


@contextlib.contextmanager
def counted_scores() -> Iterator[list[int]]:
    """The ids of the actors whose ``score`` (a π_old forward pass) ran inside the block."""
    scored: list[int] = []
    score = ActorModule.score

    def counting(self, chunk):
        scored.append(id(self))
        return score(self, chunk)

    ActorModule.score = counting  # type: ignore[method-assign]
    try:
        yield scored
    finally:
        ActorModule.score = score  # type: ignore[method-assign]


def assert_trained_alike(
    fused: tuple[PPOSystem, OldLogprobs], base: tuple[PPOSystem, OldLogprobs], atol: float
) -> None:
    """π_old as stored, the mismatch metrics and the trained actor agree to ``atol``."""
    (system, seen), (base_system, base_seen) = fused, base
    assert len(seen.columns) == len(base_seen.columns) == 3
    for it in range(3):
        for a, b in zip(seen.columns[it], base_seen.columns[it], strict=True):
            torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=1e-5)
        for key in (*MISMATCH, "reward_mean"):
            assert seen.stats[it][key] == pytest.approx(base_seen.stats[it][key], abs=atol), key
    torch.testing.assert_close(params(system.actor), params(base_system.actor), rtol=0, atol=1e-5)


def params(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])


@pytest.mark.parametrize("critic", [False, True], ids=["grpo", "gae"])
def test_first_epoch_logprobs_equal_the_score_pass_and_train_the_same(tmp_path, critic) -> None:
    base = fit(tmp_path / "recompute", critic, "recompute")
    with counted_scores() as scored:
        fused = fit(tmp_path / "actor", critic, "auto")
    assert fused[0].controller.config.old_logprobs == "actor"
    assert id(fused[0].actor) not in scored  # no π_old forward pass in the score phase
    assert_trained_alike(fused, base, atol=1e-6)
    if critic:
        torch.testing.assert_close(
            params(fused[0].critic), params(base[0].critic), rtol=0, atol=1e-5
        )


class OwnLoss(ActorModule):
    """A user's actor with its own loss (it may read ``chunk.old_logprobs``)."""

    def chunk_loss(self, chunk, sums):
        return super().chunk_loss(chunk, sums)


class OwnEstimate(GRPO):
    """A user's GRPO with its own ``estimate`` (it may read π_old)."""

    def estimate(self, inputs):
        return super().estimate(inputs)


CASES = [
    ({}, GRPO(), ActorModule, "actor", None),
    ({"kl_coef": 0.1}, GRPO(), ActorModule, "recompute", r"kl_coef=0\.1 \(the KL reward"),
    ({"actor_minibatches": 2}, GRPO(), ActorModule, "recompute", r"actor_minibatches=2"),
    ({"disable_dropout": False}, GRPO(), ActorModule, "recompute", r"disable_dropout=false"),
    ({"critic_warmup_iterations": 1}, GAE(), ActorModule, "recompute", r"warmup_iterations=1"),
    ({}, GRPO(), OwnLoss, "recompute", r"OwnLoss overrides chunk_loss"),
    ({}, OwnEstimate(), ActorModule, "recompute", r"OwnEstimate has its own estimate"),
    ({"old_logprobs": "recompute"}, GRPO(), ActorModule, "recompute", None),
    ({"old_logprobs": "rollout"}, GRPO(), ActorModule, "rollout", None),
]


@pytest.mark.parametrize(("ppo", "estimator", "actor", "want", "reason"), CASES)
def test_auto_takes_old_logprobs_from_the_actor_wherever_that_is_exact(
    ppo, estimator, actor, want, reason
) -> None:
    """auto is actor where it applies, recompute elsewhere; an explicit actor is checked."""
    critic = CriticModule(spec(1)) if estimator.uses_critic else None
    reference = ActorModule(spec(2)) if ppo.get("kl_coef", 0) > 0 else None

    def build(config: PPOConfig) -> PPOController:
        return PPOController(
            actor(spec(0)), critic, ReplayDataModule(), config, reference, estimator=estimator
        )

    assert PPOConfig().old_logprobs == "auto"
    ctl = build(PPOConfig(**ppo))
    assert ctl.config.old_logprobs == want
    assert (ctl.scorer.actor in ctl.scorer.models) == (want == "recompute")
    if reason is not None:  # an explicit actor names why it would not be exact
        with pytest.raises(SettingError, match=rf"old_logprobs=actor would not .*{reason}"):
            build(PPOConfig(**{**ppo, "old_logprobs": "actor"}))
