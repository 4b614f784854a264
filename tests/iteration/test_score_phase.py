"""The score phase's speed knobs keep the math: engine log-probs as π_old, a no-grad budget.

Also: the planner's padding fraction is logged, and ``enable_checkpointing=False`` switches
the per-iteration checkpoint off.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from lppo.config import PPOConfig
from lppo.iteration.data import ReplayDataModule
from lppo.iteration.hooks import PPOCallback
from lppo.iteration.score_phase import _reward_range
from lppo.modules import ActorModule, CriticModule
from lppo.modules.models import HFCausalLM
from lppo.parallel import ProcessGroup
from lppo.run.system import PPOSystem, RolloutSettings
from lppo.run.trainer import PPOTrainer
from lppo.tasks import CopyTask
from lppo.types import GEN_LOGPROBS, OLD_LOGPROBS, REF_LOGPROBS, RESPONSE_MASK, VALUES


def spec(seed: int) -> HFCausalLM:
    return HFCausalLM(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=seed)


class ScoredColumns(PPOCallback):
    """Copies the scored columns out of the store before the critic trains."""

    def __init__(self) -> None:
        self.columns: list[dict[str, list[torch.Tensor]]] = []

    def on_phase_epoch_start(self, ctx) -> None:
        if ctx.phase == "critic" and ctx.epoch == 0:
            names = [GEN_LOGPROBS, OLD_LOGPROBS, REF_LOGPROBS, VALUES, RESPONSE_MASK]
            self.columns.append(ctx.store.read(ctx.row_ids, names))


def fit(root: Path, iterations: int = 1, data: dict | None = None, **ppo):
    system = PPOSystem(
        actor=ActorModule(spec(0), lr=1e-3),
        critic=CriticModule(spec(1), lr=1e-3),
        task=CopyTask(),
        rollout=RolloutSettings(prompts_per_iteration=8, samples_per_prompt=2, max_new_tokens=5),
        # score: these tests read the score phase's values (auto values rows in the critic)
        ppo=PPOConfig(kl_coef=0.05, **{"old_values": "score", **ppo}),
        num_threads=1,
    )
    seen = ScoredColumns()
    trainer = PPOTrainer(
        max_epochs=iterations,
        default_root_dir=str(root),
        accelerator="cpu",
        callbacks=[seen],
        enable_checkpointing=False,
    )
    trainer.fit(system, datamodule=ReplayDataModule(**{"max_tokens_per_chunk": 24, **(data or {})}))
    return system, seen.columns, trainer


def params(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])


def test_engine_logprobs_equal_the_recomputed_ones_to_round_off(tmp_path: Path) -> None:
    _, columns, _ = fit(tmp_path / "recompute", iterations=2)
    for cols in columns:  # both iterations: the engine samples from the trainer's weights
        for gen, old, mask in zip(
            cols[GEN_LOGPROBS], cols[OLD_LOGPROBS], cols[RESPONSE_MASK], strict=True
        ):
            assert mask.any()
            torch.testing.assert_close(gen[mask], old[mask].float(), rtol=0, atol=2e-5)


def test_reusing_engine_logprobs_skips_one_forward_and_trains_the_same(tmp_path: Path) -> None:
    base, base_cols, _ = fit(tmp_path / "recompute", iterations=2)
    calls: list[int] = []
    score = ActorModule.score

    def counting(self, chunk):
        calls.append(id(self))
        return score(self, chunk)

    ActorModule.score = counting
    try:
        reuse, cols, _ = fit(tmp_path / "rollout", iterations=2, old_logprobs="rollout")
    finally:
        ActorModule.score = score
    assert id(reuse.actor) not in calls and id(reuse.reference) in calls  # no π_old forward
    for it in range(2):
        for gen, old, mask in zip(
            cols[it][GEN_LOGPROBS], cols[it][OLD_LOGPROBS], cols[it][RESPONSE_MASK], strict=True
        ):
            assert torch.equal(old, torch.where(mask, gen, torch.zeros_like(gen)))
    # Same samples, and the same training up to the round-off between the two log-probs.
    for a, b in zip(base_cols[0][REF_LOGPROBS], cols[0][REF_LOGPROBS], strict=True):
        assert torch.equal(a, b)
    torch.testing.assert_close(params(reuse.actor), params(base.actor), rtol=0, atol=1e-4)
    torch.testing.assert_close(params(reuse.critic), params(base.critic), rtol=0, atol=1e-4)


def test_old_logprobs_setting_is_validated() -> None:
    with pytest.raises(ValueError, match=r"model\.ppo\.old_logprobs='engines'"):
        PPOConfig(old_logprobs="engines")  # type: ignore[arg-type]


def test_a_larger_no_grad_budget_scores_the_same_rows_alike(tmp_path: Path) -> None:
    _, small, _ = fit(tmp_path / "small", data={"max_tokens_per_score_chunk": None})
    _, large, _ = fit(tmp_path / "large", data={"max_tokens_per_score_chunk": 4096})
    for name in (OLD_LOGPROBS, REF_LOGPROBS, VALUES):
        for a, b in zip(small[0][name], large[0][name], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_no_grad_budget_below_the_longest_row_fails_at_setup(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"data\.max_tokens_per_score_chunk=4 is below"):
        fit(tmp_path, data={"max_tokens_per_score_chunk": 4})


def test_padding_fraction_is_logged_and_checkpointing_can_be_off(tmp_path: Path) -> None:
    _, _, trainer = fit(tmp_path)
    assert not (tmp_path / "checkpoints").exists()
    assert not trainer.checkpoint_callbacks
    [metrics] = list(tmp_path.glob("version_*/metrics.csv"))
    rows = [r for r in csv.DictReader(metrics.open()) if r.get("perf/padding_fraction/actor")]
    assert len(rows) == 1
    for phase in ("score", "critic", "actor"):
        assert 0.0 <= float(rows[0][f"perf/padding_fraction/{phase}"]) < 1.0


def test_the_rollout_reports_the_range_of_its_finite_rewards() -> None:
    rewards = torch.tensor([0.2, float("nan"), 0.9, float("-inf"), 0.4], dtype=torch.float64)
    assert _reward_range(rewards, ProcessGroup()) == {"reward_min": 0.2, "reward_max": 0.9}
    assert _reward_range(torch.tensor([float("nan")]), ProcessGroup()) == {}
