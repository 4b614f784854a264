"""Evaluation during training: metrics, logging axis, undisturbed training, resume, settings."""

from __future__ import annotations

import csv
import json
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from lppo.callbacks import Evaluation, PPOMetricsLogger, RewardCurve, RunSummary
from lppo.callbacks.evaluation import evaluation_metrics, pass_at_k, wilson_interval

from lppo.config import PPOConfig
from lppo.iteration.data import ReplayDataModule
from lppo.modules import ActorModule, CriticModule
from lppo.modules.models import HFCausalLM
from lppo.rollout import RewardError
from lppo.run.cli import PPOCLI, run
from lppo.run.log import RunLog
from lppo.run.system import PPOSystem, RolloutSettings
from lppo.run.trainer import PPOTrainer
from lppo.tasks import CopyTask
from lppo.tasks.base import Prompt

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"
EVAL_PROMPTS = 6
EVAL_K = 3


def fit(root: Path, iterations: int, *extra: str) -> PPOCLI:
    return run(
        [
            "fit",
            "--config",
            str(TINY),
            "--trainer.max_epochs",
            str(iterations),
            "--model.rollout.prompts_per_iteration",
            "4",
            "--model.rollout.samples_per_prompt",
            "2",
            "--trainer.default_root_dir",
            str(root),
            *extra,
        ]
    )


EVALUATION = (
    "--trainer.callbacks+=lppo.callbacks.Evaluation",
    "--trainer.callbacks.every_n_iterations=2",
    f"--trainer.callbacks.num_prompts={EVAL_PROMPTS}",
    f"--trainer.callbacks.samples_per_prompt={EVAL_K}",
)


def evaluation_of(cli: PPOCLI) -> Evaluation:
    (cb,) = [c for c in cli.trainer.callbacks if isinstance(c, Evaluation)]
    return cb


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def params(system: PPOSystem) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in system.state_dict().items()}


def without_seconds(history: list[dict[str, float]]) -> list[dict[str, float]]:
    return [{k: v for k, v in h.items() if k != "seconds"} for h in history]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("evaluation")
    plain = fit(root / "plain", 3)
    evaluated = fit(root / "evaluated", 3, *EVALUATION)
    return {"root": root, "plain": plain, "evaluated": evaluated}


# --------------------------------------------------------------------------- the metrics
def test_pass_at_k_against_hand_computed_values() -> None:
    # 1 - C(n - c, k) / C(n, k)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)
    assert pass_at_k(5, 2, 1) == pytest.approx(2 / 5)  # pass@1 is c / n
    assert pass_at_k(10, 3, 4) == pytest.approx(1 - 35 / 210)
    assert pass_at_k(4, 0, 2) == 0.0
    assert pass_at_k(4, 3, 2) == 1.0  # fewer than k wrong samples: always a correct one
    assert pass_at_k(4, 1, 4) == 1.0  # k = n: any correct sample
    for n, c, k in ((4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)):
        with pytest.raises(ValueError, match="pass_at_k"):
            pass_at_k(n, c, k)


def test_evaluation_metrics_against_a_hand_computed_example() -> None:
    # 3 prompts × 3 samples; correct samples per prompt: 1, 0, 3 (NaN is never correct).
    rewards = [1.0, 0.0, 0.5, 0.2, math.nan, 0.0, 1.0, 1.0, 1.0]
    lengths = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    metrics = evaluation_metrics(rewards, lengths, 3)
    assert metrics == pytest.approx(
        {
            "reward_mean": 4.7 / 8,  # over the finite rewards
            "accuracy": 4 / 9,
            "pass@1": (1 / 3 + 0 + 1) / 3,
            "pass@3": (1 + 0 + 1) / 3,
            "pass@1_ci95_low": wilson_interval(4 / 9, 3)[0],
            "pass@1_ci95_high": wilson_interval(4 / 9, 3)[1],
            "response_length_mean": 5.0,
        }
    )
    assert set(evaluation_metrics([1.0, 0.0], [1, 1], 1)) == {
        "reward_mean",
        "accuracy",
        "pass@1",
        "pass@1_ci95_low",
        "pass@1_ci95_high",
        "response_length_mean",
    }
    with pytest.raises(ValueError, match="samples_per_prompt=2"):
        evaluation_metrics([1.0, 0.0, 1.0], [1, 1, 1], 2)


def test_wilson_interval_against_published_values() -> None:
    # Newcombe (1998), Statistics in Medicine 17:857, table I: 81/263 -> 0.2553 .. 0.3662;
    # 15/148 -> 0.0624 .. 0.1605; 0/20 -> 0 .. 0.1611; 1/29 -> 0.0061 .. 0.1718.
    for c, n, low, high in (
        (81, 263, 0.2553, 0.3662),
        (15, 148, 0.0624, 0.1605),
        (0, 20, 0.0, 0.1611),
        (1, 29, 0.0061, 0.1718),
    ):
        assert wilson_interval(c / n, n) == pytest.approx((low, high), abs=1e-4)
    low, high = wilson_interval(1.0, 500)
    assert high == 1.0 and 0.99 < low < 1.0  # never past 1, never collapsed
    assert wilson_interval(0.3, 2000)[1] - wilson_interval(0.3, 2000)[0] < 0.05


# --------------------------------------------------------------------------- the fit
def test_metrics_appear_in_metrics_csv_at_the_right_iterations(runs: dict[str, Any]) -> None:
    evaluation = evaluation_of(runs["evaluated"])
    assert (evaluation.every_n_iterations, evaluation.num_prompts) == (2, EVAL_PROMPTS)
    rows = read_csv(runs["root"] / "evaluated" / "version_0" / "metrics.csv")
    steps = [int(r["step"]) for r in rows]
    assert steps == list(range(len(rows)))  # one axis with PPOMetricsLogger's rows
    names = ["reward_mean", "accuracy", "pass@1", f"pass@{EVAL_K}", "response_length_mean"]
    evals = [r for r in rows if r["eval/reward_mean"] != ""]
    # every 2nd iteration and the last one (numbered from 1 in every file)
    assert [int(r["iteration"]) for r in evals] == [2, 3]
    assert [h["iteration"] for h in evaluation.history] == [2, 3]
    for row, entry in zip(evals, evaluation.history, strict=True):
        assert int(row["step"]) == entry["step"]
        # right after the iteration's own row (rollout/*), before the next iteration's rows
        previous = rows[int(row["step"]) - 1]
        assert previous["rollout/reward_mean"] != "" and previous["iteration"] == row["iteration"]
        for name in names:
            assert float(row[f"eval/{name}"]) == pytest.approx(entry[name])
        assert 0.0 <= entry["accuracy"] <= entry[f"pass@{EVAL_K}"] <= 1.0
        assert entry["pass@1"] == pytest.approx(entry["accuracy"])
        assert 0.0 <= entry["reward_mean"] <= 1.0 and entry["response_length_mean"] > 0
        assert float(row["eval/seconds"]) > 0
    # the plot and the summary pick the evaluation up
    curve = next(c for c in runs["evaluated"].trainer.callbacks if isinstance(c, RewardCurve))
    assert curve.eval_points == {"eval": evaluation.points()}
    summary = json.loads((runs["root"] / "evaluated" / "summary.json").read_text())
    assert summary["evaluation"]["eval"]["iteration"] == 3
    last = evaluation.history[-1]
    assert summary["evaluation"]["eval"]["accuracy"] == pytest.approx(last["accuracy"])


def test_training_trajectory_is_bitwise_unchanged(runs: dict[str, Any]) -> None:
    plain, evaluated = params(runs["plain"].model), params(runs["evaluated"].model)
    assert plain.keys() == evaluated.keys()
    for key in plain:
        assert torch.equal(plain[key], evaluated[key]), key
    rewards = []
    for name in ("plain", "evaluated"):
        rows = read_csv(runs["root"] / name / "version_0" / "metrics.csv")
        rewards.append([r["rollout/reward_mean"] for r in rows if r["rollout/reward_mean"]])
    assert rewards[0] == rewards[1] and len(rewards[0]) == 3


def test_at_start_evaluates_the_initial_policy_without_changing_training(
    runs: dict[str, Any], tmp_path: Path
) -> None:
    started = fit(tmp_path / "started", 3, *EVALUATION, "--trainer.callbacks.at_start=true")
    evaluation = evaluation_of(started)
    assert [h["iteration"] for h in evaluation.history] == [0, 2, 3]
    first = evaluation.history[0]
    assert first["step"] == 0 and 0.0 <= first["pass@1_ci95_low"] <= first["pass@1"]
    assert first["pass@1"] <= first["pass@1_ci95_high"] <= 1.0
    # the initial policy's samples are those of a fresh evaluation callback's first look
    later = evaluation_of(runs["evaluated"]).history
    assert [h["iteration"] for h in later] == [2, 3]
    plain, after = params(runs["plain"].model), params(started.model)
    for key in plain:
        assert torch.equal(plain[key], after[key]), key
    for mine, theirs in zip(evaluation.history[1:], later, strict=True):
        assert without_seconds([mine])[0] | {"step": 0} == without_seconds([theirs])[0] | {
            "step": 0
        }


def test_a_multi_turn_evaluation_logs_its_episodes(tmp_path: Path) -> None:
    """The entry carries the episode metrics of the very generation it scored."""
    cli = run(
        [
            "fit",
            "--config",
            str(ROOT / "configs" / "multiturn.yaml"),
            "--trainer.max_epochs=1",
            "--model.rollout.prompts_per_iteration=4",
            "--model.rollout.samples_per_prompt=2",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.callbacks+=lppo.callbacks.Evaluation",
            f"--trainer.callbacks.num_prompts={EVAL_PROMPTS}",
            "--trainer.callbacks.samples_per_prompt=1",
            "--trainer.callbacks.greedy=true",
        ]
    )
    evaluation = evaluation_of(cli)
    (entry,) = evaluation.history
    assert evaluation.prompts is not None
    again = cli.model.rollout_source.evaluate(evaluation.prompts, 1, evaluation.seed, greedy=True)
    assert again.output.episodes is not None and again.output.episodes.episodes == EVAL_PROMPTS
    expected = again.output.episodes.metrics()
    assert expected["turns_per_episode"] >= 1
    for name, value in expected.items():
        assert entry[name] == value or (math.isnan(entry[name]) and math.isnan(value)), name
    with (Path(cli.trainer.logger.log_dir) / "metrics.csv").open() as f:
        logged = [r for r in csv.DictReader(f) if r.get("eval/turns_per_episode")]
    assert [float(r["eval/turns_per_episode"]) for r in logged] == [entry["turns_per_episode"]]


class WalkingTask(CopyTask):
    """A stateful task: walks a fixed pool of prompts (the generator is ignored)."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = super().sample_prompts(50, random.Random(5))
        self.position = 0

    def sample_prompts(self, n: int, generator: random.Random) -> list[Prompt]:
        del generator
        prompts = [self.pool[(self.position + i) % len(self.pool)] for i in range(n)]
        self.position += n
        return prompts

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state.get("position", 0))


def python_fit(root: Path, callbacks: list[pl.Callback]) -> PPOSystem:
    def spec(seed: int) -> HFCausalLM:
        return HFCausalLM(
            hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, seed=seed
        )

    system = PPOSystem(
        actor=ActorModule(spec(0), lr=3e-3),
        critic=CriticModule(spec(1), lr=3e-3),
        task=WalkingTask(),
        rollout=RolloutSettings(prompts_per_iteration=4, samples_per_prompt=2, max_new_tokens=4),
        ppo=PPOConfig(critic_epochs=1, actor_minibatches=2),
        num_threads=1,
    )
    trainer = PPOTrainer(
        max_epochs=3, default_root_dir=str(root), accelerator="cpu", callbacks=callbacks
    )
    trainer.fit(system, datamodule=ReplayDataModule(max_tokens_per_chunk=40))
    return system


def test_training_with_a_stateful_task_is_bitwise_unchanged(tmp_path: Path) -> None:
    evaluation = Evaluation(every_n_iterations=1, num_prompts=7, samples_per_prompt=2)
    evaluated = python_fit(tmp_path / "evaluated", [evaluation])
    plain = python_fit(tmp_path / "plain", [])
    assert [h["iteration"] for h in evaluation.history] == [1, 2, 3]
    assert evaluated.task.position == plain.task.position == 3 * 4  # type: ignore[attr-defined]
    assert evaluation.prompts == plain.task.pool[:7]  # type: ignore[attr-defined]
    expected = params(plain)
    for key, value in params(evaluated).items():
        assert torch.equal(value, expected[key]), key


def test_resume_keeps_the_history(runs: dict[str, Any]) -> None:
    root = runs["root"] / "split"
    first = fit(root, 2, *EVALUATION)
    assert [h["iteration"] for h in evaluation_of(first).history] == [2]  # the last one
    resumed = fit(root, 3, *EVALUATION, "--ckpt_path", "last")
    straight = evaluation_of(runs["evaluated"]).history
    assert without_seconds(evaluation_of(resumed).history) == without_seconds(straight)
    later = read_csv(root / "version_1" / "metrics.csv")
    assert [int(r["iteration"]) for r in later if r["eval/reward_mean"]] == [3]
    plain = params(runs["plain"].model)
    for key, value in params(resumed.model).items():
        assert torch.equal(value, plain[key]), key


@pytest.mark.distributed
def test_only_rank_zero_evaluates_under_ppo_ddp(tmp_path: Path) -> None:
    # A subprocess: Lightning's DDP launcher re-runs the command for rank 1.
    command = [sys.executable, "-m", "lppo.run.cli", "fit", "--config", str(TINY)]
    command += ["--trainer.max_epochs", "2", "--trainer.default_root_dir", str(tmp_path)]
    command += ["--model.rollout.prompts_per_iteration", "4", "--data.max_tokens_per_chunk", "24"]
    command += ["--trainer.strategy", "ppo_ddp", "--trainer.devices", "2", *EVALUATION[:3]]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_csv(tmp_path / "version_0" / "metrics.csv")
    assert [int(r["iteration"]) for r in rows if r["eval/reward_mean"]] == [2]
    assert [int(r["step"]) for r in rows] == list(range(len(rows)))


# --------------------------------------------------------------------------- in isolation
def stub_trainer(global_zero: bool = True, callbacks: list[Any] | None = None) -> Any:
    return SimpleNamespace(is_global_zero=global_zero, callbacks=callbacks or [], loggers=[])


def test_evaluation_restores_modes_and_rngs_and_skips_other_ranks(runs: dict[str, Any]) -> None:
    system: PPOSystem = runs["plain"].model
    system.run_log = RunLog()  # evaluated in isolation: a fresh axis (its rows take its steps)
    evaluation = Evaluation(num_prompts=3, samples_per_prompt=2)
    assert evaluation.evaluate(stub_trainer(global_zero=False), system, 0) is None
    assert evaluation.history == [] and evaluation.prompts is None
    system.actor.train()
    system.actor.model.eval()  # a mixed state must come back as it was
    modes = [m.training for m in system.actor.modules()]
    torch_state, python_state = torch.get_rng_state(), random.getstate()
    entry = evaluation.evaluate(stub_trainer(), system, 5)
    assert entry is not None and entry["iteration"] == 6 and entry["step"] == 0
    assert [m.training for m in system.actor.modules()] == modes
    assert torch.equal(torch.get_rng_state(), torch_state) and random.getstate() == python_state
    assert evaluation.evaluate(stub_trainer(), system, 5) is None  # already evaluated
    system.run_log = RunLog()
    again = Evaluation(num_prompts=3, samples_per_prompt=2).evaluate(stub_trainer(), system, 5)
    assert without_seconds([again]) == without_seconds([entry])  # fixed seed: reproducible


def test_greedy_decoding_ignores_the_seed(runs: dict[str, Any]) -> None:
    system: PPOSystem = runs["plain"].model
    entries = []
    for seed in (0, 1):
        system.run_log = RunLog()  # each evaluation on its own
        evaluation = Evaluation(num_prompts=4, samples_per_prompt=1, seed=3, greedy=True)
        evaluation.setup(stub_trainer(callbacks=[evaluation]), system, "fit")
        evaluation.seed = seed  # same prompts, another generation seed
        entries.append(evaluation.evaluate(stub_trainer(), system, 0))
    assert without_seconds(entries[:1]) == without_seconds(entries[1:])


class BrokenTask(CopyTask):
    def rewards(self, prompts: list[Prompt], completions: list[str]) -> list[float]:
        raise RuntimeError("judge offline")


def test_a_failing_reward_names_the_evaluation(runs: dict[str, Any]) -> None:
    evaluation = Evaluation(num_prompts=2, samples_per_prompt=1, task=BrokenTask(), prefix="held")
    runs["plain"].model.run_log = RunLog()
    with pytest.raises(RewardError, match=r"held after iteration 5: BrokenTask\.rewards raised"):
        evaluation.evaluate(stub_trainer(), runs["plain"].model, 4)
    assert evaluation.history == []


class CountingTask(CopyTask):
    """A stateful task: every prompt drawn advances ``drawn``."""

    def __init__(self) -> None:
        super().__init__()
        self.drawn = 0

    def sample_prompts(self, n: int, generator: random.Random) -> list[Prompt]:
        self.drawn += n
        return super().sample_prompts(n, generator)

    def state_dict(self) -> dict[str, Any]:
        return {"drawn": self.drawn}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.drawn = int(state.get("drawn", 0))


def test_prompts_are_drawn_once_and_leave_a_stateful_task_as_it_was() -> None:
    task = CountingTask()
    task.drawn = 7
    evaluation = Evaluation(num_prompts=5, seed=11)
    prompts = evaluation.draw_prompts(task)
    assert task.drawn == 7
    assert prompts == CopyTask().sample_prompts(5, random.Random(11))
    system = SimpleNamespace(task=task, run_log=RunLog())  # setup: the task and the run log
    evaluation.setup(stub_trainer(callbacks=[evaluation]), system, "fit")  # type: ignore[arg-type]
    first = evaluation.prompts
    evaluation.setup(stub_trainer(callbacks=[evaluation]), system, "fit")  # type: ignore[arg-type]
    assert evaluation.prompts is first and task.drawn == 7


# --------------------------------------------------------------------------- settings
@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"every_n_iterations": 0}, "trainer.callbacks[Evaluation].init_args.every_n_iterations=0"),
        ({"num_prompts": 0}, "trainer.callbacks[Evaluation].init_args.num_prompts=0"),
        (
            {"samples_per_prompt": -1},
            "trainer.callbacks[Evaluation].init_args.samples_per_prompt=-1",
        ),
        ({"greedy": True, "samples_per_prompt": 4}, "Evaluation.samples_per_prompt=1"),
        ({"prefix": "eval/x"}, "Evaluation.prefix='eval/x'"),
    ],
)
def test_bad_settings_raise_value_error_naming_the_key(kwargs: dict[str, Any], key: str) -> None:
    with pytest.raises(ValueError, match=re.escape(key)):
        Evaluation(**kwargs)


def test_bad_settings_against_the_run_raise_at_setup() -> None:
    # Greedy decoding is no longer refused for any engine: every engine takes greedy=
    # (tests/rollout/test_engines.py; through Ray workers: tests/rollout/test_ray_workers.py).
    system = SimpleNamespace(task=CopyTask())
    a, b = Evaluation(), Evaluation()
    with pytest.raises(ValueError, match=r"Evaluation\.prefix='eval'"):
        a.setup(stub_trainer(callbacks=[a, b]), system, "fit")  # type: ignore[arg-type]
    assert Evaluation(prefix="x").state_key != Evaluation().state_key


# --------------------------------------------------------------------------- the plot
def test_reward_curve_and_summary_show_the_evaluation(tmp_path: Path) -> None:
    evaluation = Evaluation()
    module = pl.LightningModule()
    module.run_log = RunLog()  # type: ignore[attr-defined]  # what PPOSystem owns
    for entry in (
        {"iteration": 1, "step": 3, "reward_mean": 0.25, "accuracy": 0.5, "pass@1": 0.5},
        {"iteration": 3, "step": 9, "reward_mean": 0.75, "accuracy": 1.0, "pass@1": 1.0},
    ):
        module.run_log.add_evaluation("eval", entry)  # type: ignore[attr-defined]
    curve, summary = RewardCurve(), RunSummary(print_summary=False)
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        logger=CSVLogger(tmp_path),
        callbacks=[evaluation, curve, summary, PPOMetricsLogger()],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    curve.points = [(i, 0.1 * i, 0.05, 0.0, 1.0) for i in range(4)]
    for cb in (curve, summary):
        cb.on_train_end(trainer, module)
    assert curve.eval_points == {"eval": [(1, 0.25), (3, 0.75)]}
    assert (tmp_path / "reward_curve.png").read_bytes()[:4] == b"\x89PNG"
    content = json.loads((tmp_path / "summary.json").read_text())
    assert content["evaluation"]["eval"]["reward_mean"] == 0.75
    assert "eval (evaluation)" in RunSummary.format(content)
