"""Iteration-boundary checkpoints: a resumed run ends exactly where an uninterrupted one does."""

from __future__ import annotations

import pytest
import torch

from lppo.config import PPOConfig
from lppo.envs import HiddenDigitEnvironment, HiddenDigitTask
from lppo.errors import IterationError
from lppo.iteration.data import ReplayDataModule
from lppo.iteration.hooks import PPOCallback
from lppo.modules import ActorModule, CriticModule
from lppo.modules.models import HFCausalLM
from lppo.rollout import HFGenerateEngine, MultiTurnEngine
from lppo.run.digests import write_digest
from lppo.run.system import PPOSystem, RolloutSettings
from lppo.run.trainer import PPOTrainer
from lppo.tasks import CopyTask

pytestmark = pytest.mark.slow


def spec(seed: int, hidden: int = 32) -> HFCausalLM:
    return HFCausalLM(
        hidden_size=hidden, num_layers=1, num_heads=2, intermediate_size=64, seed=seed
    )


def fit(
    root,
    iterations,
    ckpt_path=None,
    callbacks=(),
    critic_warmup=0,
    lr=3e-3,
    hidden=32,
    engine=None,
    task=None,
    **ppo,
):
    system = PPOSystem(
        actor=ActorModule(spec(0, hidden), lr=lr),
        critic=CriticModule(spec(1), lr=3e-3),
        task=task or CopyTask(),
        engine=engine,
        rollout=RolloutSettings(prompts_per_iteration=4, samples_per_prompt=3, max_new_tokens=4),
        ppo=PPOConfig(
            critic_epochs=2,
            actor_minibatches=2,
            kl_coef=0.05,
            critic_warmup_iterations=critic_warmup,
            **ppo,
        ),
        num_threads=1,
    )
    trainer = PPOTrainer(
        max_epochs=iterations,
        default_root_dir=str(root),
        accelerator="cpu",
        callbacks=list(callbacks),
    )
    trainer.fit(system, datamodule=ReplayDataModule(max_tokens_per_chunk=40), ckpt_path=ckpt_path)
    return trainer, system


def params(system):
    return {k: v.detach().clone() for k, v in system.state_dict().items()}


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


class FailOnce(PPOCallback):
    """Raises inside iteration ``at``'s actor phase (after critic steps were taken)."""

    def __init__(self, at: int):
        self.at = at

    def on_chunk_end(self, ctx, result):
        if ctx.iteration == self.at and ctx.phase == "actor":
            raise RuntimeError("simulated worker crash")


def test_stop_and_resume_equals_uninterrupted(tmp_path):
    trainer, straight = fit(tmp_path / "straight", 3, critic_warmup=1)
    assert trainer.global_step == 2 * 2  # iterations 1 and 2 take 2 actor steps each
    fit(tmp_path / "split", 2, critic_warmup=1)
    assert (tmp_path / "split" / "checkpoints" / "last.ckpt").exists()
    trainer, resumed = fit(tmp_path / "split", 3, ckpt_path="last", critic_warmup=1)
    assert trainer.global_step == 4
    assert_same(params(straight), params(resumed))
    # Each launch logs into its own version folder: the first launch's metrics survive.
    first = (tmp_path / "split" / "version_0" / "metrics.csv").read_text().splitlines()
    second = (tmp_path / "split" / "version_1" / "metrics.csv").read_text().splitlines()
    assert len(first) > 1 and len(second) > 1


def test_a_resumed_multi_turn_run_equals_the_uninterrupted_one(tmp_path):
    def episodes():
        env = HiddenDigitEnvironment(call_reward=0.25)
        return {
            "engine": MultiTurnEngine(HFGenerateEngine(), env, max_turns=2, max_tokens=12),
            "task": HiddenDigitTask(),
        }

    _, straight = fit(tmp_path / "straight", 3, **episodes())
    fit(tmp_path / "split", 2, **episodes())
    _, resumed = fit(tmp_path / "split", 3, ckpt_path="last", **episodes())
    assert_same(params(straight), params(resumed))
    log = (tmp_path / "straight" / "version_0" / "metrics.csv").read_text()
    assert "rollout/tool_calls_per_episode" in log


def test_crash_mid_iteration_restarts_that_iteration(tmp_path):
    _, straight = fit(tmp_path / "straight", 3)
    with pytest.raises(IterationError, match="iteration 3, phase actor"):
        fit(tmp_path / "crash", 3, callbacks=[FailOnce(at=2)])
    # The crashed iteration's rows were released and the last checkpoint is iteration 1's.
    _, resumed = fit(tmp_path / "crash", 3, ckpt_path="last")
    assert_same(params(straight), params(resumed))


class PoisonActorGrads(PPOCallback):
    """Makes every actor step's gradient NaN, so OptimizerStep skips the step."""

    def on_chunk_end(self, ctx, result):
        if ctx.phase == "actor":
            for p in ctx.module.parameters():
                if p.grad is not None:
                    p.grad.fill_(float("nan"))


def test_the_per_run_skipped_step_budget_survives_a_resume(tmp_path):
    budget = {"max_skipped_steps": 3, "max_consecutive_skipped_steps": 10}
    # Iteration 1 skips its 2 actor steps (2 of 3 allowed) and is checkpointed.
    with pytest.warns(RuntimeWarning, match="actor step skipped"):
        fit(tmp_path, 1, callbacks=[PoisonActorGrads()], **budget)
    # The resumed run's first skipped step is the run's third, its second is one too many.
    with pytest.warns(RuntimeWarning), pytest.raises(IterationError, match="max_skipped_steps=3"):
        fit(tmp_path, 2, ckpt_path="last", callbacks=[PoisonActorGrads()], **budget)


def test_a_checkpoint_from_before_the_run_log_resumes_its_axis_and_counters(tmp_path):
    """Then the axis lived in PPOMetricsLogger's state and the counters beside the callbacks."""
    trainer, _ = fit(tmp_path / "run", 2)
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)
    log = checkpoint.pop("lppo_run_log")
    callbacks = checkpoint["callbacks"]
    callbacks["PPOMetricsLogger"] = {"step": log["step"], "history": log["history"]}
    step_state = callbacks.pop("OptimizerStep")
    step_state["total"] = 3  # as if three steps had been skipped
    checkpoint["lppo_builtin_callbacks"] = {"OptimizerStep": step_state}
    checkpoint["lppo_failed_iterations"] = 1
    old = tmp_path / "old.ckpt"
    torch.save(checkpoint, old)
    write_digest(old)  # lppo's checkpoint, edited to the old layout
    trainer, system = fit(tmp_path / "run", 3, ckpt_path=str(old))
    assert [h["iteration"] for h in system.run_log.history] == [1, 2, 3]
    assert system.run_log.history[2]["step"] > log["step"]  # the axis went on, not over
    assert system.run_log.failed == 1
    (skips,) = [cb for cb in trainer.callbacks if type(cb).__name__ == "OptimizerStep"]
    assert skips.total == 3
