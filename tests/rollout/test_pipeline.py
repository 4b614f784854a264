"""Asynchronous rollouts with a fixed lag: bitwise equal to their synchronous oracle."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from _async_helpers import (
    Jitter,
    Provenance,
    SlowCopyTask,
    assert_same,
    fit,
    params,
    pid_alive,
)

from lppo.errors import IterationError
from lppo.iteration.hooks import PPOCallback
from lppo.rollout import InlineRunner, ProcessRunner
from lppo.rollout.pipeline import RolloutPipeline

pytestmark = pytest.mark.slow


class Trace(PPOCallback):
    """Records ``(event, iteration)``: rollout taken, iteration ended; and the pipeline's
    admissions and generations, through a recording runner."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def on_rollout_end(self, ctx):
        self.events.append(("trained-on", ctx.iteration))


class TracedInline(InlineRunner):
    def __init__(self, events: list) -> None:
        super().__init__()
        self.events = events

    def submit(self, job):
        self.events.append(("admitted", job.iteration))

    def result(self, job):
        self.events.append(("generate", job.iteration))
        return super().result(job)


def test_lag_zero_generates_after_publication_and_equals_the_process_runner(tmp_path, monkeypatch):
    events: list = []
    published = RolloutPipeline.publish

    def publish(self, iteration):
        events.append(("published", iteration))
        published(self, iteration)

    monkeypatch.setattr(RolloutPipeline, "publish", publish)
    _, inline = fit(tmp_path / "inline", 3, staleness=0, runner=TracedInline(events))
    # iteration t + 1 is admitted and generated only after t's weights are published
    for t in range(2):
        assert events.index(("published", t)) < events.index(("admitted", t + 1))
        assert events.index(("published", t)) < events.index(("generate", t + 1))
    # as in a synchronous run, nothing is drawn beyond the last iteration: no job waits in
    # the checkpoint and the task's position counts the three iterations that ran
    assert inline.rollouts.pending == {}
    assert inline.rollouts.state_dict()["jobs"] == []
    assert ("admitted", 3) not in events and ("generate", 3) not in events
    _, process = fit(tmp_path / "process", 3, staleness=0, runner=ProcessRunner())
    assert_same(params(inline), params(process))


@pytest.mark.parametrize("staleness", [1, 2])
def test_stale_rollouts_equal_the_synchronous_oracle(tmp_path, staleness):
    oracle_rows, rows = Provenance(), Provenance()
    _, oracle = fit(
        tmp_path / "oracle", 5, staleness, runner=InlineRunner(), callbacks=(oracle_rows,)
    )
    _, run = fit(tmp_path / "async", 5, staleness, runner=ProcessRunner(), callbacks=(rows,))
    assert_same(params(oracle), params(run))
    # every row of iteration t was sampled from the version published after t - s - 1
    assert rows.rows == oracle_rows.rows
    for t, pairs in rows.rows.items():
        assert pairs == {(t, max(0, t - staleness))}
    # the lag is exactly s once the first s iterations have passed
    assert [r["staleness"] for r in run.run_log.history] == [min(t, staleness) for t in range(5)]


def test_the_background_process_generates_in_a_float64_run_s_dtype(tmp_path):
    """``trainer.precision 64-true`` with float32-built models: the process's copy of the
    policy is float64 too, so its rows are the in-trainer oracle's, bitwise."""
    _, oracle = fit(tmp_path / "oracle", 3, 1, runner=InlineRunner(), precision="64-true")
    _, run = fit(tmp_path / "async", 3, 1, runner=ProcessRunner(), precision="64-true")
    assert {v.dtype for v in params(run).values() if v.is_floating_point()} == {torch.float64}
    assert_same(params(oracle), params(run))


def test_lag_counts_published_versions_through_critic_warmup(tmp_path):
    rows = Provenance()
    fit(tmp_path / "w", 5, 1, runner=ProcessRunner(), callbacks=(rows,), warmup=2)
    # iterations 0 and 1 train only the critic: no new version until iteration 2's actor phase
    assert {t: pairs for t, pairs in rows.rows.items()} == {
        0: {(0, 0)},
        1: {(1, 0)},
        2: {(2, 0)},
        3: {(3, 0)},
        4: {(4, 1)},
    }


def test_two_runs_with_random_delays_are_bitwise_equal(tmp_path):
    runs = [
        fit(
            tmp_path / f"run{i}",
            4,
            2,
            runner=ProcessRunner(),
            task=SlowCopyTask(max_delay_s=0.08),
            callbacks=(Jitter(0.02),),
        )[1]
        for i in range(2)
    ]
    assert_same(params(runs[0]), params(runs[1]))


class KillGenerator(PPOCallback):
    """Kills the background rollout process once, at the end of iteration ``at``."""

    def __init__(self, at: int) -> None:
        self.at, self.pids = at, []

    def on_iteration_end(self, ctx, result):
        if ctx.iteration == self.at and not self.pids:
            runner = ctx.trainer.lightning_module.runner
            self.pids.append(runner.process.pid)
            os.kill(runner.process.pid, signal.SIGKILL)


def test_a_dead_generator_is_replaced_and_the_run_is_unchanged(tmp_path):
    _, straight = fit(tmp_path / "straight", 4, 1, runner=ProcessRunner())
    kill = KillGenerator(at=1)
    runner = ProcessRunner(max_restarts=1)
    _, replaced = fit(tmp_path / "killed", 4, 1, runner=runner, callbacks=(kill,))
    assert runner.restarts == 1 and not pid_alive(kill.pids[0])
    assert_same(params(straight), params(replaced))


@pytest.mark.parametrize("staleness", [0, 1, 2, 3])
def test_latencies_and_a_dead_generator_keep_the_lag_exact(tmp_path, staleness):
    # random reward latencies, random training latencies, and the generator killed once:
    # every row still comes from the version published s iterations back, nothing hangs,
    # and the run equals the synchronous oracle bit for bit. Killed at the end of index 1, a
    # job is always submitted after the kill (index 2's publish admits index 3 + s <= 6 of
    # 0..6), so the replacement is always exercised.
    rows, oracle_rows = Provenance(), Provenance()
    runner = ProcessRunner(max_restarts=1, timeout_s=60.0)
    callbacks = (rows, Jitter(0.02), KillGenerator(at=1))
    _, run = fit(tmp_path / "a", 7, staleness, runner, SlowCopyTask(0.05), callbacks)
    _, oracle = fit(tmp_path / "o", 7, staleness, InlineRunner(), callbacks=(oracle_rows,))
    assert runner.restarts == 1
    for t in range(7):
        assert rows.rows[t] == {(t, max(0, t - staleness))}
    assert rows.rows == oracle_rows.rows
    assert_same(params(oracle), params(run))


def test_a_dead_generator_without_restarts_fails_naming_the_iteration(tmp_path):
    dead = r"iteration [34], phase rollout: .*exited with code -9"
    with pytest.raises(IterationError, match=dead):
        fit(
            tmp_path / "k",
            4,
            1,
            runner=ProcessRunner(max_restarts=0),
            callbacks=(KillGenerator(1),),
        )


def test_a_wait_past_its_bound_fails_with_the_named_error(tmp_path):
    runner = ProcessRunner(timeout_s=0.3)
    task = SlowCopyTask(min_delay_s=3.0, max_delay_s=3.0)  # every rollout outlasts the bound
    with pytest.raises(IterationError, match=r"iteration 1, phase rollout: waited 0.3 s for"):
        fit(tmp_path / "t", 3, 1, runner=runner, task=task)
    assert runner.process is None  # the run's teardown stopped it


def test_a_reward_failure_in_the_generator_names_the_iteration_and_cause(tmp_path):
    task = SlowCopyTask(max_delay_s=0.0, fail_on="*")
    with pytest.raises(
        IterationError, match=r"iteration 1, phase rollout: the generator failed: .*server down"
    ):
        fit(tmp_path / "r", 3, 1, runner=ProcessRunner(), task=task)


def test_stale_rows_need_a_recomputed_old_policy_and_a_correction():
    from lppo.algorithms import OffPolicyCorrection
    from lppo.rollout import RolloutSettings
    from lppo.rollout.pipeline import stale_correction
    from lppo.validation import SettingError

    stale = RolloutSettings(max_staleness=2)
    with pytest.raises(SettingError, match=r"old_logprobs='rollout' with .*max_staleness=2"):
        stale_correction(stale, "rollout", OffPolicyCorrection())
    with pytest.raises(SettingError, match=r"mode=none with .*biased.*allow_uncorrected_stale"):
        stale_correction(stale, "recompute", OffPolicyCorrection("none"))
    opted_in = RolloutSettings(max_staleness=2, allow_uncorrected_staleness=True)
    assert stale_correction(opted_in, "recompute", OffPolicyCorrection("none")).mode == "none"
    assert stale_correction(stale, "recompute", OffPolicyCorrection()).mode == "truncate"
    synchronous = RolloutSettings()
    assert stale_correction(synchronous, "rollout", OffPolicyCorrection()).mode == "none"
    with pytest.raises(ValueError, match=r"model.rollout.max_staleness=-1"):
        RolloutSettings(max_staleness=-1)


def test_generator_failures_are_skipped_by_the_failure_policy_with_nothing_leaked(tmp_path):
    task = SlowCopyTask(max_delay_s=0.0, fail_on="*")
    trainer, system = fit(
        tmp_path / "f", 3, 1, runner=ProcessRunner(), task=task, max_failed_iterations=3
    )
    assert system.run_log.failed == 3  # every iteration's generator failed, none hung
    assert len(trainer.datamodule.store) == 0
    assert list(system.rollouts.pending) == [3, 4]  # admitted for a resume
