"""The seams: engines, estimators and tasks chosen by class_path; one source per setting."""

from __future__ import annotations

import csv
import json
import math
import time
from pathlib import Path

import pytest
import torch
from _seams import BatchOnlyTask, CopyingEngine, CountingGAE, ForgetfulEngine
from test_cli import fit_args

from lppo.config import PPOConfig
from lppo.iteration.data import ReplayDataModule
from lppo.modules import ActorModule, CriticModule
from lppo.modules.models import HFCausalLM
from lppo.rollout import RolloutSettings, StaleWeightsError
from lppo.run.cli import run
from lppo.run.system import PPOSystem
from lppo.run.trainer import PPOTrainer


def spec(seed: int) -> HFCausalLM:
    return HFCausalLM(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, seed=seed)


def fit(root: Path, iterations: int = 2, **kwargs) -> PPOSystem:
    system = PPOSystem(
        actor=ActorModule(spec(0), lr=3e-3),
        critic=CriticModule(spec(1), lr=3e-3),
        rollout=RolloutSettings(prompts_per_iteration=4, samples_per_prompt=2, max_new_tokens=4),
        num_threads=1,
        **{"task": BatchOnlyTask(), "ppo": PPOConfig(actor_minibatches=2), **kwargs},
    )
    trainer = PPOTrainer(max_epochs=iterations, default_root_dir=str(root), accelerator="cpu")
    trainer.fit(system, datamodule=ReplayDataModule(max_tokens_per_chunk=64))
    return system


def params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_engine_from_yaml_class_path_is_the_one_used(tmp_path: Path) -> None:
    engine = json.dumps({"class_path": "_seams.CopyingEngine", "init_args": {"batch_size": 3}})
    cli = run(fit_args(tmp_path, "--model.engine", engine, iterations=2))
    system = cli.model
    assert type(system.engine) is CopyingEngine and system.engine.batch_size == 3
    assert system.engine.generate_calls == 2
    # After every actor phase the engine was told the new weights version, and holds them.
    assert system.engine.syncs == [4, 8]  # 2 actor epochs x 2 minibatches per iteration
    assert system.engine.weights_version == system.actor.weights_version == 8
    for a, b in zip(system.engine.model.parameters(), system.actor.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_an_engine_holding_a_copy_samples_exactly_what_the_shared_one_does(tmp_path) -> None:
    shared = fit(tmp_path / "shared", iterations=3)
    copied = fit(tmp_path / "copied", iterations=3, engine=CopyingEngine())
    assert copied.engine.model is not copied.actor.model
    assert copied.engine.syncs == [2, 4, 6]
    # Same rollouts every iteration (a stale copy would diverge after the first): same weights.
    want, got = params(shared.actor), params(copied.actor)
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_an_engine_that_does_not_sync_is_refused(tmp_path: Path) -> None:
    with pytest.raises(StaleWeightsError, match="stale weights"):
        fit(tmp_path, iterations=2, engine=ForgetfulEngine())


def test_loading_weights_makes_the_engine_resync() -> None:
    actor = ActorModule(spec(0))
    actor.configure_model(16, 0, 1, 2)
    before = actor.weights_version
    actor.load_state_dict(actor.state_dict())
    assert actor.weights_version == before + 1


def test_sampling_temperature_has_one_source(tmp_path: Path) -> None:
    cli = run(fit_args(tmp_path, "--model.rollout.temperature", "0.7"))
    assert cli.model.actor.temperature == 0.7
    assert cli.model.engine.sampling.temperature == 0.7
    with pytest.raises(TypeError):
        ActorModule(spec(0), temperature=0.7)  # not a knob of its own any more
    with pytest.raises(SystemExit):  # nor on the command line
        run(fit_args(tmp_path, "--model.actor.init_args.temperature", "0.7"))
    with pytest.raises(ValueError, match=r"model\.rollout\.temperature=0"):
        RolloutSettings(temperature=0.0)


def test_rewards_go_through_one_batch_call(tmp_path: Path) -> None:
    system = fit(tmp_path, iterations=2)
    assert system.task.batches == [8, 8]


def test_estimator_from_yaml_class_path_is_used(tmp_path: Path) -> None:
    estimator = json.dumps({"class_path": "_seams.CountingGAE", "init_args": {"lam": 0.9}})
    cli = run(fit_args(tmp_path, "--model.estimator", estimator, iterations=2))
    assert type(cli.model.estimator) is CountingGAE
    assert cli.model.estimator.calls == 2 and cli.model.estimator.lam == 0.9
    with open(Path(cli.trainer.logger.log_dir) / "metrics.csv", newline="") as f:
        logged = [r["rollout/estimator_calls"] for r in csv.DictReader(f)]
    assert [float(v) for v in logged if v] == [1.0, 2.0]  # its metrics reach the loggers


def test_float64_end_to_end_through_the_cli(tmp_path: Path) -> None:
    cli = run(fit_args(tmp_path, "--trainer.precision", "64-true", iterations=2))
    assert {p.dtype for p in cli.model.parameters()} == {torch.float64}
    logger = next(cb for cb in cli.trainer.callbacks if type(cb).__name__ == "PPOMetricsLogger")
    assert [h["iteration"] for h in logger.history] == [1, 2]
    assert all(math.isfinite(h["reward_mean"]) for h in logger.history)
    assert all(math.isfinite(h["actor_loss"]) for h in logger.history)


def test_critic_free_run_builds_no_critic(tmp_path: Path) -> None:
    cli = run(
        fit_args(
            tmp_path,
            "--model.critic",
            "null",
            "--model.estimator",
            "lppo.estimators.RLOO",
            iterations=2,
        )
    )
    system = cli.model
    assert system.critic is None
    assert not any(name.startswith("critic.") for name, _ in system.named_parameters())
    logger = next(cb for cb in cli.trainer.callbacks if type(cb).__name__ == "PPOMetricsLogger")
    assert [h["iteration"] for h in logger.history] == [1, 2]
    assert all(math.isnan(h["critic_loss"]) for h in logger.history)
    assert cli.trainer.global_step == 2 * 2 * 2  # actor epochs x minibatches per iteration


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--model.critic", "null"], "model.critic is null but model.estimator=GAE needs"),
        (["--model.estimator", "lppo.estimators.GRPO"], "set model.critic: null"),
    ],
)
def test_critic_and_estimator_must_agree(tmp_path: Path, extra, fragment) -> None:
    with pytest.raises(ValueError, match=fragment):
        run(fit_args(tmp_path, *extra))


class _BadRewards(BatchOnlyTask):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode

    def rewards(self, prompts, completions):
        if self.mode == "raise":
            raise KeyError("no such verifier")
        if self.mode == "raise_one":
            # Only the last prompt breaks the verifier: the error must name a sample of it.
            self.bad = getattr(self, "bad", prompts[-1].text)
            if any(p.text == self.bad for p in prompts):
                raise KeyError(f"no verifier for {self.bad!r}")
            return [0.0] * len(completions)
        if self.mode == "count":
            return [0.0] * (len(completions) - 1)
        if self.mode == "type":
            return ["1.0"] + [0.0] * (len(completions) - 1)
        if self.mode == "exit":  # user code ending the process must fail the iteration only
            raise SystemExit(0)
        if self.mode == "interrupt":  # raised by the code, not by a Ctrl-C
            raise KeyboardInterrupt("gave up")
        if self.mode == "huge":  # no float holds it
            return [10**400] * len(completions)
        if self.mode == "hang":
            time.sleep(3600)
        return 0.5


@pytest.mark.parametrize(
    ("mode", "fragment"),
    [
        (
            "raise",
            r"_BadRewards\.rewards raised KeyError: 'no such verifier' \(sample 1 of 8: prompt",
        ),
        ("raise_one", r"raised KeyError: .* \(sample \d of 8: prompt '.+', completion '.*'\)"),
        ("count", r"returned 7 rewards for 8 samples"),
        ("type", r"returned str '1\.0' for sample 1 of 8 \(prompt '.+', completion"),
        ("scalar", r"returned float for a batch of 8 samples \(first prompt .+\); return"),
        ("exit", r"raised SystemExit: 0 \(sample 1 of 8: prompt '.+', completion"),
        ("interrupt", r"raised KeyboardInterrupt: gave up \(sample 1 of 8: prompt '.+'"),
        ("huge", r"returned int 10+\.\.\. \(401 characters\) for sample 1 of 8 \(prompt"),
        (
            "hang",
            r"did not return within model\.ppo\.reward_timeout_s=0\.5 s and was stopped on a "
            r"batch of 8 samples \(first prompt '.+'\); make the reward faster",
        ),
    ],
)
def test_a_broken_reward_function_fails_clearly(tmp_path: Path, mode, fragment) -> None:
    from lppo.errors import IterationError

    ppo = PPOConfig(actor_minibatches=2, reward_timeout_s=0.5)
    with pytest.raises(IterationError, match=rf"iteration 1, phase rollout: .*{fragment}"):
        fit(tmp_path, iterations=1, task=_BadRewards(mode), ppo=ppo)
