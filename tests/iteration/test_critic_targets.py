"""``model.ppo.old_values: critic``: the critic's first epoch values the rows, exactly.

The score phase then runs no critic forward pass; the old values, advantages and returns it
writes, the iteration's metrics and the trained weights equal those of ``old_values: score``
to round-off.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_ddp import WORKER, finish_all, start

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
from lppo.types import ADVANTAGES, RETURNS, VALUES
from lppo.validation import SettingError


def spec(seed: int) -> HFCausalLM:
    return HFCausalLM(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=seed)


class Targets(PPOCallback):
    """The stored targets when the actor starts, and every iteration's metrics."""

    def __init__(self) -> None:
        self.columns: list[dict[str, list[torch.Tensor]]] = []
        self.stats: list[dict[str, float]] = []

    def on_phase_epoch_start(self, ctx) -> None:
        if ctx.phase == "actor" and ctx.epoch == 0:
            self.columns.append(ctx.store.read(ctx.row_ids, [VALUES, ADVANTAGES, RETURNS]))

    def on_iteration_end(self, ctx, result) -> None:
        self.stats.append(result.rollout.as_dict())


def fit(root: Path, **ppo):
    system = PPOSystem(
        actor=ActorModule(spec(0), lr=1e-3),
        critic=CriticModule(spec(1), lr=1e-3),
        task=CopyTask(),
        rollout=RolloutSettings(prompts_per_iteration=8, samples_per_prompt=2, max_new_tokens=5),
        ppo=PPOConfig(kl_coef=0.05, critic_epochs=2, actor_epochs=2, **ppo),
        num_threads=1,
    )
    seen = Targets()
    trainer = PPOTrainer(
        max_epochs=3,
        default_root_dir=str(root),
        accelerator="cpu",
        callbacks=[seen],
        enable_checkpointing=False,
    )
    trainer.fit(system, datamodule=ReplayDataModule(max_tokens_per_chunk=24))
    return system, seen


def params(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])


def test_first_epoch_values_equal_the_score_pass_and_train_the_same(tmp_path: Path) -> None:
    base, base_seen = fit(tmp_path / "score", old_values="score")
    scored: list[int] = []
    score = CriticModule.score

    def counting(self, chunk):
        scored.append(len(chunk.row_ids))
        return score(self, chunk)

    CriticModule.score = counting
    try:
        fused, seen = fit(tmp_path / "critic", old_values="critic")
    finally:
        CriticModule.score = score
    assert scored == []  # no critic forward pass in the score phase
    assert len(seen.columns) == len(base_seen.columns) == 3
    for it in range(3):
        for name in (VALUES, ADVANTAGES, RETURNS):
            got, want = seen.columns[it][name], base_seen.columns[it][name]
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        for key in ("kl_mean", "reward_mean"):
            assert seen.stats[it][key] == pytest.approx(base_seen.stats[it][key], abs=1e-6)
    torch.testing.assert_close(params(fused.critic), params(base.critic), rtol=0, atol=1e-5)
    # The advantages agree to round-off; Adam's per-element normalization can scale that up
    # to a few 1e-5 where a gradient is near zero (as in test_score_phase: 1e-4).
    torch.testing.assert_close(params(fused.actor), params(base.actor), rtol=0, atol=1e-4)


def test_an_unknown_old_values_is_rejected() -> None:
    with pytest.raises(SettingError, match=r"old_values='epoch'; use 'auto', 'score' or 'critic'"):
        PPOConfig(old_values="epoch")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("ppo", "match"),
    [
        ({"critic_minibatches": 2}, r"critic_minibatches=2"),
        ({"disable_dropout": False}, r"disable_dropout=false"),
    ],
)
def test_settings_it_cannot_be_exact_with_are_rejected(ppo: dict, match: str) -> None:
    with pytest.raises(SettingError, match=rf"old_values=critic would not .*{match}"):
        PPOController(
            actor=ActorModule(spec(0)),
            critic=CriticModule(spec(1)),
            data=ReplayDataModule(),
            config=PPOConfig(**{"old_values": "critic", **ppo}),
        )


class CriticFreeGAE(GAE):
    """Per-row targets but no critic: nobody would run the first critic epoch."""

    uses_critic = False


@pytest.mark.parametrize("estimator", [GRPO(), CriticFreeGAE()])
def test_an_estimator_without_per_row_value_targets_is_rejected(estimator) -> None:
    name = type(estimator).__name__
    with pytest.raises(ValueError, match=rf"model\.estimator={name} has no per-row value targets"):
        PPOController(
            actor=ActorModule(spec(0)),
            critic=None,
            data=ReplayDataModule(),
            config=PPOConfig(old_values="critic"),
            estimator=estimator,
        )


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_value_their_own_rows_in_the_first_epoch_like_one_process(tmp_path):
    """float64: two ranks under old_values=critic (each values and whitens over its own rows,
    moments reduced over both) end where one process under old_values=score ends."""
    single, dp = tmp_path / "single", tmp_path / "dp"
    single.mkdir()
    dp.mkdir()
    jobs = [
        [str(WORKER), "--devices=2", f"--out={dp}", "--dtype=float64", "--old-values=critic"],
        [str(WORKER), "--devices=1", f"--out={single}", "--dtype=float64"],
    ]
    finish_all([start(args, tmp_path) for args in jobs], jobs)
    one = json.loads((single / "rank0.json").read_text())
    for r in range(2):
        rec = json.loads((dp / f"rank{r}.json").read_text())
        assert (rec["world_size"], rec["global_step"], rec["rows_left"]) == (2, 4, 0)
        assert rec["global_step"] == one["global_step"]
    want = torch.load(single / "state0.pt")
    got = [torch.load(dp / f"state{r}.pt") for r in range(2)]
    for name, value in want.items():
        assert torch.equal(got[0][name], got[1][name]), name
        torch.testing.assert_close(got[0][name], value, rtol=1e-10, atol=1e-12)


class OwnLoss(CriticModule):
    """A user's critic with its own loss (it need not read ``chunk.targets``)."""

    def chunk_loss(self, chunk, sums):
        return super().chunk_loss(chunk, sums)


class OwnEstimate(GAE):
    """A user's GAE with its own ``estimate`` (the first critic epoch would not call it)."""

    def estimate(self, inputs):
        return super().estimate(inputs)


@pytest.mark.parametrize(
    ("ppo", "estimator", "critic", "want"),
    [
        ({}, GAE(), CriticModule, "critic"),
        ({"critic_minibatches": 2}, GAE(), CriticModule, "score"),
        ({"disable_dropout": False}, GAE(), CriticModule, "score"),
        ({}, GAE(), OwnLoss, "score"),
        ({}, OwnEstimate(), CriticModule, "score"),
        ({}, GRPO(), None, "score"),
        ({"old_values": "score"}, GAE(), CriticModule, "score"),
    ],
)
def test_auto_values_rows_in_the_critic_wherever_that_is_exact(ppo, estimator, critic, want):
    """The default, old_values=auto, is critic where it applies and score elsewhere."""
    module = critic(spec(1)) if critic is not None else None
    ctl = PPOController(
        actor=ActorModule(spec(0)),
        critic=module,
        data=ReplayDataModule(),
        config=PPOConfig(**ppo),
        estimator=estimator,
    )
    assert PPOConfig().old_values == "auto"
    assert ctl.config.old_values == want
    if module is not None:  # the score phase values the rows unless the critic does
        assert (ctl.scorer.critic is None) == (want == "critic")


def test_a_critic_kept_for_a_critic_free_estimator_is_a_setting_error() -> None:
    """lppo fit prints it as its short block (lppo.errors.explain), not a traceback."""
    from lppo.errors import explain
    from lppo.iteration.critic_targets import check_critic

    with pytest.raises(SettingError, match=r"model.estimator=GRPO is critic-free") as error:
        check_critic(CriticModule(spec(1)), GRPO())
    assert explain(error.value) is not None
    with pytest.raises(SettingError, match=r"model.critic is null but model.estimator=GAE"):
        check_critic(None, GAE())
