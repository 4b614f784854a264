"""Engine/trainer mismatch metrics are logged every iteration; the correction runs end to end."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from lppo.algorithms import OffPolicyCorrection
from lppo.config import PPOConfig
from lppo.iteration.data import ReplayDataModule
from lppo.iteration.hooks import PPOCallback
from lppo.modules import ActorModule, CriticModule
from lppo.modules.models import HFCausalLM
from lppo.run.system import PPOSystem, RolloutSettings
from lppo.run.trainer import PPOTrainer
from lppo.tasks import CopyTask

MISMATCH = ("mismatch_kl", "mismatch_max_abs_log_ratio", "mismatch_outside_fraction")


class Results(PPOCallback):
    def __init__(self):
        self.results = []

    def on_iteration_end(self, ctx, result):
        self.results.append(result)


def fit(tmp_path: Path, off_policy: OffPolicyCorrection, iterations: int = 2):
    spec = dict(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    model = PPOSystem(
        actor=ActorModule(HFCausalLM(**spec, seed=0), lr=1e-2, off_policy=off_policy),
        critic=CriticModule(HFCausalLM(**spec, seed=1), lr=1e-3),
        task=CopyTask(),
        rollout=RolloutSettings(prompts_per_iteration=4, samples_per_prompt=2, max_new_tokens=4),
        ppo=PPOConfig(actor_epochs=2),
        num_threads=1,
    )
    results = Results()
    trainer = PPOTrainer(max_epochs=iterations, default_root_dir=str(tmp_path), callbacks=[results])
    trainer.fit(model, datamodule=ReplayDataModule(max_tokens_per_chunk=24))
    return results.results, trainer


def logged_rows(trainer) -> list[dict[str, str]]:
    path = Path(trainer.logger.log_dir) / "metrics.csv"
    with path.open() as f:
        return [row for row in csv.DictReader(f) if row.get("rollout/mismatch_kl")]


def test_hf_engine_mismatch_is_logged_and_tiny(tmp_path):
    results, trainer = fit(tmp_path, OffPolicyCorrection())
    for result in results:
        for key in MISMATCH:
            assert math.isfinite(getattr(result.rollout, key)), key
        # The HF engine shares the actor's weights: generate's cached, left-padded forward and
        # the trainer's recomputation differ only by float32 round-off.
        assert 0 <= result.rollout.mismatch_kl < 1e-8
        assert result.rollout.mismatch_max_abs_log_ratio < 1e-4
        assert result.rollout.mismatch_outside_fraction == 0.0
        assert "is_weight_mean" not in result.phase_steps("actor")[0].metrics
    rows = logged_rows(trainer)
    assert len(rows) == len(results)
    for row, result in zip(rows, results, strict=True):
        for key in MISMATCH:
            assert float(row[f"rollout/{key}"]) == pytest.approx(getattr(result.rollout, key))


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_correction_runs_end_to_end(tmp_path, mode):
    results, _ = fit(tmp_path, OffPolicyCorrection(mode, cap=2.0))
    for result in results:
        for step in result.phase_steps("actor"):
            assert step.stepped
            # μ ≈ π_old here, so every weight is ≈ 1 and none is outside the bounds.
            assert step.metrics["is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
            assert step.metrics["is_outside_fraction"] == 0.0
