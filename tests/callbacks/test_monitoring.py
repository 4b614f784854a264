"""Monitoring callbacks: metrics logger, reward curve, run summary, progress display."""

from __future__ import annotations

import csv
import glob
import json
import math
import os

import lightning.pytorch as pl
import pytest
import torch
from _builders import random_rows, stored, tiny_backbone, tiny_lm
from lightning.pytorch.loggers import CSVLogger
from lppo.callbacks import PPOMetricsLogger, PPOProgress, RewardCurve, RunSummary, lifecycle
from lppo.callbacks.reward_plot import band

from lppo.config import PPOConfig
from lppo.iteration.controller import PPOController
from lppo.iteration.data import ReplayDataModule
from lppo.iteration.hooks import IterationContext, PPOCallback
from lppo.modules import ActorModule, CriticModule
from lppo.replay import MemoryReplayStore
from lppo.run.log import RunLog
from lppo.types import (
    INPUT_IDS,
    RESPONSE_MASK,
    REWARD,
    IterationResult,
    Rollout,
    RolloutStats,
    StepStats,
)

CRITIC_EPOCHS = 3
ACTOR_EPOCHS = 2
ACTOR_MINIBATCHES = 2
ITERATIONS = 3

STABLE_NAMES = [
    "iteration",
    "rollout/reward_mean",
    "rollout/reward_std",
    "rollout/response_length_mean",
    "rollout/invalid_rows",
    "rollout/dropped_rows",
    "rollout/kl_mean",
    "critic/loss",
    "critic/grad_norm",
    "critic/explained_variance",
    "critic/clip_fraction",
    "critic/value_mean",
    "critic/return_mean",
    "critic/lr",
    "critic/stepped",
    "critic/epoch",
    "critic/minibatch",
    "critic/chunks_skipped",
    "actor/loss",
    "actor/grad_norm",
    "actor/clip_fraction",
    "actor/approx_kl",
    "actor/entropy",
    "actor/lr",
    "actor/stepped",
    "actor/epoch",
    "actor/minibatch",
    "actor/chunks_skipped",
    "perf/tokens_per_second/rollout",
    "perf/tokens_per_second/critic",
    "perf/tokens_per_second/actor",
    "perf/seconds/rollout",
    "perf/seconds/critic",
    "perf/seconds/actor",
    "perf/peak_memory_bytes",
]


class System(pl.LightningModule):
    """Stands in for PPOSystem."""

    def __init__(self) -> None:
        super().__init__()
        self.iteration_index = 0
        self.run_log = RunLog()


def make_rollout(n: int, seed: int) -> Rollout:
    cols = random_rows(n, seed, max_len=10)
    return Rollout(
        input_ids=cols[INPUT_IDS],
        response_mask=cols[RESPONSE_MASK],
        gen_logprobs=[torch.zeros(len(t)) for t in cols[INPUT_IDS]],
        reward=torch.stack(cols[REWARD]).float() + 0.1 * seed,
        prompt_index=torch.arange(n),
    )


def make_controller(callbacks=()) -> PPOController:
    data = ReplayDataModule(max_tokens_per_chunk=30)
    config = PPOConfig(
        critic_epochs=CRITIC_EPOCHS, actor_epochs=ACTOR_EPOCHS, actor_minibatches=ACTOR_MINIBATCHES
    )
    actor = ActorModule(tiny_lm(), lr=1e-3)
    critic = CriticModule(tiny_backbone(), lr=1e-3)
    return PPOController(actor, critic, data, config, callbacks=[*callbacks, *lifecycle(callbacks)])


def run_iteration(controller: PPOController, iteration: int) -> IterationResult:
    rollout = make_rollout(4, seed=iteration)
    result = controller.run_iteration(stored(controller, rollout), iteration)
    # The training loop adds the rollout phase (generation) timing and token count.
    result.seconds["rollout"] = 0.25
    result.tokens["rollout"] = sum(len(t) for t in rollout.input_ids)
    return result


@pytest.fixture(scope="module")
def controller() -> PPOController:
    return make_controller()


@pytest.fixture(scope="module")
def results(controller) -> list[IterationResult]:
    return [run_iteration(controller, i) for i in range(ITERATIONS)]


@pytest.fixture
def with_progress(controller):
    """Attach a progress callback to the shared controller for one test."""
    added: list[PPOProgress] = []

    def attach(progress: PPOProgress) -> PPOController:
        controller.callbacks.append(progress)
        added.append(progress)
        return controller

    yield attach
    for progress in added:
        controller.callbacks.remove(progress)


def make_trainer(tmp_path, callbacks, logger=None) -> pl.Trainer:
    return pl.Trainer(
        default_root_dir=tmp_path,
        logger=logger if logger is not None else CSVLogger(tmp_path),
        max_epochs=ITERATIONS,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )


def context(trainer: pl.Trainer, iteration: int, run_log: RunLog | None = None):
    log = run_log if run_log is not None else RunLog()
    return IterationContext(
        iteration=iteration, store=MemoryReplayStore(), trainer=trainer, run_log=log
    )


def drive(trainer: pl.Trainer, system: System, results, start: int = 0, stop: int | None = None):
    """Call the end-of-iteration hook as the controller would, one iteration per epoch."""
    for result in results[start:stop]:
        system.iteration_index = result.iteration
        for cb in trainer.callbacks:
            if isinstance(cb, PPOCallback):
                cb.on_iteration_end(context(trainer, result.iteration, system.run_log), result)


def read_csv(trainer: pl.Trainer) -> list[dict[str, str]]:
    path = os.path.join(trainer.loggers[0].log_dir, "metrics.csv")
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_metrics_logger_writes_every_step(tmp_path, results):
    logger_cb = PPOMetricsLogger()
    trainer = make_trainer(tmp_path, [logger_cb])
    system = System()
    drive(trainer, system, results)

    rows = read_csv(trainer)
    header = set(rows[0])
    missing = [name for name in STABLE_NAMES if name not in header]
    assert not missing, missing

    steps = [int(r["step"]) for r in rows]
    assert steps == list(range(len(rows)))  # monotonic, one step per row
    assert all(r["iteration"] != "" for r in rows)

    per_iter_steps = CRITIC_EPOCHS + ACTOR_EPOCHS * ACTOR_MINIBATCHES
    assert len(rows) == ITERATIONS * (per_iter_steps + 1)
    for it in range(ITERATIONS):
        mine = [r for r in rows if int(r["iteration"]) == it + 1]  # numbered from 1
        critic = [r for r in mine if r["critic/loss"] != ""]
        actor = [r for r in mine if r["actor/loss"] != ""]
        summary = [r for r in mine if r["rollout/reward_mean"] != ""]
        assert [int(float(r["critic/epoch"])) for r in critic] == list(range(CRITIC_EPOCHS))
        assert len(actor) == ACTOR_EPOCHS * ACTOR_MINIBATCHES
        assert sorted(
            (int(float(r["actor/epoch"])), int(float(r["actor/minibatch"]))) for r in actor
        ) == [(e, m) for e in range(ACTOR_EPOCHS) for m in range(ACTOR_MINIBATCHES)]
        assert len(summary) == 1
        row = summary[0]
        result = results[it]
        assert float(row["rollout/reward_mean"]) == pytest.approx(result.rollout.reward_mean)
        assert float(row["perf/tokens_per_second/actor"]) == pytest.approx(
            result.tokens["actor"] / result.seconds["actor"]
        )
        # generated by the controller itself: no generator report, the phase's own seconds
        assert float(row["perf/tokens_per_second/rollout"]) == pytest.approx(
            result.tokens["rollout"] / result.seconds["rollout"]
        )
        assert float(row["perf/seconds/score"]) == pytest.approx(result.seconds["score"])
        assert float(row["perf/peak_memory_bytes"]) > 0
        stats = result.phase_steps("critic")[0]
        first = critic[0]
        assert float(first["critic/loss"]) == pytest.approx(stats.metrics["loss"])
        assert float(first["critic/grad_norm"]) == pytest.approx(stats.grad_norm)
        assert float(first["critic/stepped"]) == 1.0

    # Calling the hook again for the same iteration logs nothing new.
    logger_cb.on_iteration_end(context(trainer, results[-1].iteration, system.run_log), results[-1])
    assert len(read_csv(trainer)) == len(rows)

    assert [h["iteration"] for h in logger_cb.history] == list(range(1, ITERATIONS + 1))
    assert logger_cb.history[0]["reward_mean"] == pytest.approx(results[0].rollout.reward_mean)
    assert math.isfinite(logger_cb.history[-1]["critic_loss"])
    assert math.isfinite(logger_cb.history[-1]["actor_loss"])


def test_rollout_rate_is_per_second_of_generation_not_of_the_wait():
    # with stale rollouts the trainer waits 0.01 s for rows generated in 2 s meanwhile
    result = IterationResult(
        0,
        RolloutStats(),
        [],
        seconds={"rollout": 0.01},
        tokens={"rollout": 600},
        generation={"wait": 0.01, "generation": 2.0, "overlap": 1.99, "generator_idle": 0.0},
    )
    row = PPOMetricsLogger.iteration_row(result)
    assert row["perf/tokens_per_second/rollout"] == pytest.approx(300.0)
    assert row["perf/seconds/rollout"] == pytest.approx(0.01)
    assert row["perf/generation/overlap"] == pytest.approx(1.99)


def test_metrics_logger_resume_continues_step_axis(tmp_path, results):
    first = PPOMetricsLogger()
    trainer = make_trainer(tmp_path / "a", [first])
    system = System()
    drive(trainer, system, results, stop=2)
    state = system.run_log.state_dict()
    rows_before = read_csv(trainer)
    assert state["step"] == len(rows_before)
    assert len(state["history"]) == 2

    resumed, system2 = PPOMetricsLogger(), System()
    system2.run_log.load_state_dict(state)
    trainer2 = make_trainer(tmp_path / "b", [resumed])
    drive(trainer2, system2, results, start=2)
    rows_after = read_csv(trainer2)
    steps = [int(r["step"]) for r in rows_after]
    assert steps[0] == state["step"]
    assert steps == list(range(state["step"], state["step"] + len(rows_after)))
    assert [h["iteration"] for h in resumed.history] == [1, 2, 3]


def test_metrics_logger_handles_skipped_step(tmp_path):
    step = StepStats(
        role="critic",
        epoch=0,
        minibatch=0,
        stepped=False,
        grad_norm=float("inf"),
        lr=1e-3,
        chunks_trained=2,
        chunks_skipped=1,
        valid_tokens=10,
        valid_rows=2,
        tokens=20,
        metrics={"value_loss": 0.5},
    )
    result = IterationResult(
        iteration=0,
        rollout=RolloutStats(reward_mean=1.0, reward_std=0.0),
        steps=[step],
        seconds={"critic": 0.0},
        tokens={"critic": 20},
    )
    cb = PPOMetricsLogger()
    trainer = make_trainer(tmp_path, [cb])
    cb.on_iteration_end(context(trainer, 0), result)
    rows = read_csv(trainer)
    assert float(rows[0]["critic/loss"]) == 0.5  # falls back to value_loss
    assert float(rows[0]["critic/stepped"]) == 0.0
    assert float(rows[0]["critic/chunks_skipped"]) == 1.0
    assert math.isnan(float(rows[1]["rollout/kl_mean"]))
    assert float(rows[1]["perf/tokens_per_second/critic"]) == 0.0


def test_reward_curve_and_summary(tmp_path, results, capsys):
    curve = RewardCurve()
    summary = RunSummary()
    trainer = make_trainer(tmp_path, [curve, summary])
    system = System()
    for cb in (curve, summary):
        cb.setup(trainer, system, "fit")
        cb.on_train_start(trainer, system)
    drive(trainer, system, results, stop=2)

    # Resume mid-run from the callbacks' state.
    curve2, summary2 = RewardCurve(), RunSummary()
    curve2.load_state_dict(curve.state_dict())
    summary2.load_state_dict(summary.state_dict())
    trainer2 = make_trainer(tmp_path, [curve2, summary2])
    for cb in (curve2, summary2):
        cb.setup(trainer2, system, "fit")
        cb.on_train_start(trainer2, system)
    drive(trainer2, system, results, start=2)
    for cb in (summary2, curve2):  # summary first: it must still find the curve's path
        cb.on_train_end(trainer2, system)

    png = tmp_path / "reward_curve.png"
    assert curve2.path == str(png)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 1000
    assert [p[0] for p in curve2.points] == [0, 1, 2]

    content = json.loads((tmp_path / "summary.json").read_text())
    rewards = [r.rollout.reward_mean for r in results]
    assert content["iterations"] == ITERATIONS
    assert content["max_iterations"] == ITERATIONS
    assert content["reward_first"] == pytest.approx(rewards[0])
    assert content["reward_last"] == pytest.approx(rewards[-1])
    assert content["reward_first_mean"] == pytest.approx(sum(rewards) / 3)
    assert content["reward_last_mean"] == pytest.approx(sum(rewards) / 3)
    assert content["wall_seconds"] >= 0
    generated = sum(r.tokens["rollout"] for r in results)  # kept across the resume
    assert generated > 0 and content["response_tokens"] == generated
    assert content["tokens_per_second"] == pytest.approx(generated / content["wall_seconds"])
    assert content["reward_curve"] == str(png)
    assert content["metrics_csv"] == os.path.join(trainer2.loggers[0].log_dir, "metrics.csv")
    assert "checkpoints" in content and "dirpath" in content["checkpoints"]

    out = capsys.readouterr().out
    assert "lppo run summary" in out
    assert "iterations      : 3" in out
    assert f"tokens          : {generated} generated, " in out
    assert "reward_curve.png" in out
    assert "metrics.csv" in out


def test_progress_prints_position_and_iteration_line(tmp_path, capsys, with_progress):
    progress = PPOProgress(tty=False)
    trainer = make_trainer(tmp_path, [progress])
    system = System()
    progress.setup(trainer, system, "fit")
    controller = with_progress(progress)
    result = run_iteration(controller, 0)  # the iteration line comes from on_iteration_end

    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3  # quiet without a TTY: one line per phase + the iteration line
    assert lines[0].startswith(f"iteration 1/{ITERATIONS} | phase critic | epoch 3/3 | chunk ")
    assert lines[1].startswith(f"iteration 1/{ITERATIONS} | phase actor | epoch 2/2 | chunk ")
    assert "reward" in lines[2] and "critic loss" in lines[2] and "actor loss" in lines[2]
    assert f"{result.rollout.reward_mean:.4g}" in lines[2]
    assert lines[2].rstrip().endswith("s")


def test_progress_tty_redraws_in_place(tmp_path, capsys, with_progress):
    progress = PPOProgress(tty=True, refresh_seconds=0.0)
    trainer = make_trainer(tmp_path, [progress])
    system = System()
    progress.setup(trainer, system, "fit")
    run_iteration(with_progress(progress), 0)

    out = capsys.readouterr().out
    assert "\r" in out
    assert out.count("\n") == 1  # only the iteration line ends a line
    assert "iteration 1/3 | phase critic | epoch 1/3" in out
    assert "iteration 1/3 | phase actor | epoch 2/2 | minibatch 2/2 | chunk 1" in out


def test_wandb_offline_run_file(tmp_path, monkeypatch, results):
    pytest.importorskip("wandb")
    from lightning.pytorch.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "data"))
    logger = WandbLogger(offline=True, save_dir=str(tmp_path), project="lppo-test")
    cb = PPOMetricsLogger()
    trainer = make_trainer(tmp_path, [cb], logger=logger)
    try:
        drive(trainer, System(), results)
    finally:
        logger.experiment.finish()
    files = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1
    assert os.path.getsize(files[0]) > 0
    assert cb.run_log.step == ITERATIONS * (CRITIC_EPOCHS + ACTOR_EPOCHS * ACTOR_MINIBATCHES + 1)


def test_the_reward_band_stays_within_the_observed_rewards():
    nan = float("nan")
    lows, highs = band([(0, 0.9, 0.3, 0.2, 1.0), (1, 0.1, 0.3, 0.0, 0.5), (2, 0.5, nan, 0.0, 1.0)])
    assert lows == pytest.approx([0.6, 0.0, 0.5])
    assert highs == pytest.approx([1.0, 0.4, 0.5])
