"""One owner of the run's lifetimes: reverse-order close, exactly once; runners that close alike."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lppo.iteration.data import ReplayDataModule
from lppo.replay.memory import MemoryReplayStore
from lppo.rollout import ProcessRunner, RolloutProcessError, RolloutSettings, ThreadRunner
from lppo.rollout.base import PromptBlock
from lppo.rollout.jobs import RolloutJob
from lppo.runtime.lifetimes import ResourceCloseError, RunResources
from lppo.validation import SettingError

# --------------------------------------------------------------------------- RunResources


def recorder(log: list[str], name: str, error: BaseException | None = None) -> Any:
    def close() -> None:
        log.append(name)
        if error is not None:
            raise error

    return close


def test_resources_close_in_reverse_start_order() -> None:
    log: list[str] = []
    resources = RunResources()
    for name in ("ray", "store", "engine", "runner", "tools"):
        resources.enter(name, recorder(log, name))
    resources.close()
    assert log == ["tools", "runner", "engine", "store", "ray"]
    assert resources.closed == log
    assert resources.entered == ["ray", "store", "engine", "runner", "tools"]


def test_each_resource_is_closed_exactly_once_and_close_is_idempotent() -> None:
    log: list[str] = []
    resources = RunResources()
    resources.enter("a", recorder(log, "a"))
    # a close that closes the whole run again (a teardown reached twice) does nothing more
    resources.enter("b", lambda: (log.append("b"), resources.close()))
    resources.close()
    resources.close()
    assert log == ["b", "a"] and resources.is_closed


def test_a_failing_close_does_not_stop_the_later_ones() -> None:
    log: list[str] = []
    resources = RunResources()
    resources.enter("store", recorder(log, "store"))
    resources.enter("engine", recorder(log, "engine", ValueError("worker gone")))
    resources.enter("runner", recorder(log, "runner", OSError("pipe closed")))
    with pytest.raises(ResourceCloseError) as caught:
        resources.close()
    assert log == ["runner", "engine", "store"]
    assert [name for name, _ in caught.value.failures] == ["runner", "engine"]
    assert "runner: OSError: pipe closed" in str(caught.value)
    assert "engine: ValueError: worker gone" in str(caught.value)
    resources.close()  # nothing raised twice, nothing closed twice
    assert log == ["runner", "engine", "store"]


def test_an_exit_raised_by_a_close_survives_as_itself_after_all_closed() -> None:
    log: list[str] = []
    resources = RunResources()
    resources.enter("a", recorder(log, "a"))
    resources.enter("b", recorder(log, "b", SystemExit(143)))
    resources.enter("c", recorder(log, "c", ValueError("c")))
    with pytest.raises(SystemExit) as caught:
        resources.close()
    assert caught.value.code == 143 and log == ["c", "b", "a"]


def test_leaving_on_an_error_logs_close_failures_and_keeps_the_error(caplog) -> None:
    log: list[str] = []
    with caplog.at_level(logging.WARNING, logger="lppo.runtime.lifetimes"):
        with pytest.raises(KeyError, match="the run's own"):
            with RunResources() as resources:
                resources.enter("a", recorder(log, "a"))
                resources.enter("b", recorder(log, "b", ValueError("b")))
                raise KeyError("the run's own")
    assert log == ["b", "a"]
    assert "closing b failed" in caplog.text


def test_objects_with_close_are_entered_as_they_are() -> None:
    class Service:
        closes = 0

        def close(self) -> None:
            self.closes += 1

    resources = RunResources()
    service = resources.enter("service", Service())
    resources.close()
    assert isinstance(service, Service) and service.closes == 1


def test_what_cannot_be_closed_or_is_entered_twice_or_late_is_refused() -> None:
    resources = RunResources()
    with pytest.raises(TypeError, match=r"'x' is a int, which has no close\(\)"):
        resources.enter("x", 3)
    resources.enter("x", lambda: None)
    with pytest.raises(ValueError, match="'x' was entered already"):
        resources.enter("x", lambda: None)
    resources.close()
    with pytest.raises(RuntimeError, match="'y' entered after the run's resources were closed"):
        resources.enter("y", lambda: None)


def test_the_store_outlives_the_runner_that_puts_into_it() -> None:
    # the design review's bug: a runner still putting rows while it closes, after the store
    class Store:
        def __init__(self) -> None:
            self.open = True
            self.rows: list[int] = []

        def put(self, row: int) -> None:
            assert self.open, "put into a closed store"
            self.rows.append(row)

        def close(self) -> None:
            self.open = False

    store = Store()
    resources = RunResources()
    resources.enter("store", store)
    resources.enter("runner", lambda: store.put(7))  # its last job lands at close
    resources.close()
    assert store.rows == [7] and not store.open


class CountingStore(MemoryReplayStore):
    closes = 0

    def close(self) -> None:
        self.closes += 1


def test_the_data_module_closes_its_store_once_until_handed_over() -> None:
    data = ReplayDataModule(store=CountingStore())
    data.teardown("fit")
    data.teardown("fit")  # Lightning's teardown and a second path: one close
    assert data.store.closes == 1
    data.configure()  # a new fit connects again
    close = data.hand_over_close()
    data.on_exception(RuntimeError("x"))
    data.teardown("fit")
    assert data.store.closes == 1  # Lightning's hooks leave it to the run's resources
    resources = RunResources()
    resources.enter("store", close)
    resources.close()
    close()
    assert data.store.closes == 2


# --------------------------------------------------------------------------- runners


class StallingEngine:
    """Marks each generation it starts (a file named by the seed), then stalls ``stall_s``.

    Module-level, so the background process unpickles it by name. Its close ends a stall at
    once, as closing Ray rollout workers fails the generation they run.
    """

    def __init__(self, directory: str, stall_s: float) -> None:
        self.directory = directory
        self.stall_s = stall_s
        self._closed: threading.Event | None = None  # made at setup: a copy cannot carry one

    def setup(self, policy: torch.nn.Module, tokenizer: Any, sampling: Any) -> None:
        self._closed = threading.Event()

    def sync_from(self, policy: torch.nn.Module, version: int) -> None:
        pass

    def generate(self, prompts: Any, samples_per_prompt: int = 1, seed: int = 0, greedy=False):
        Path(self.directory, f"started-{seed}").touch()
        assert self._closed is not None
        if self._closed.wait(self.stall_s):
            raise RuntimeError("the engine was closed under the job")
        Path(self.directory, f"finished-{seed}").touch()
        raise RuntimeError("stalled; its rows do not matter here")

    def close(self) -> None:
        if self._closed is not None:
            self._closed.set()


def source() -> Any:
    policy = torch.nn.Linear(2, 2)
    actor = SimpleNamespace(policy=lambda: policy)
    return SimpleNamespace(actor=actor, tokenizer=None, settings=RolloutSettings(), task=None)


def job(iteration: int) -> RolloutJob:
    weights = {k: v.clone() for k, v in torch.nn.Linear(2, 2).state_dict().items()}
    return RolloutJob(iteration, 0, [PromptBlock(0, [], seed=iteration)], weights)


def generator(runner: Any) -> Any:
    return runner.thread if isinstance(runner, ThreadRunner) else runner.process


def wait_for(path: Path, bound_s: float = 180.0) -> None:
    deadline = time.monotonic() + bound_s  # a spawned process imports torch first
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.05)


RUNNERS = [ThreadRunner, pytest.param(ProcessRunner, marks=pytest.mark.slow)]
# the trainer's threads plus the process's may exceed a small machine's cores: beside the point
crowded = pytest.mark.filterwarnings("ignore:the trainer's .* torch threads:RuntimeWarning")


@crowded
@pytest.mark.parametrize("kind", RUNNERS)
def test_a_hung_job_is_given_up_after_close_timeout_and_queued_jobs_never_start(
    tmp_path, kind
) -> None:
    runner = kind(close_timeout_s=0.5)
    runner.start(source(), StallingEngine(str(tmp_path), stall_s=120.0))
    runner.submit(job(0))
    runner.submit(job(1))
    wait_for(tmp_path / "started-0")
    running = generator(runner)
    clock = time.monotonic()
    runner.close()
    took = time.monotonic() - clock
    assert 0.5 <= took < 10.0  # the bound, then a kill: not the 120 s stall
    running.join(10.0)
    assert not running.is_alive()
    assert not (tmp_path / "finished-0").exists()
    assert not (tmp_path / "started-1").exists()  # queued, dropped: never generated
    with pytest.raises(RolloutProcessError, match="iteration 3's job was submitted to a"):
        runner.submit(job(2))
    runner.close()  # idempotent


@crowded
@pytest.mark.parametrize("kind", RUNNERS)
def test_close_waits_for_the_running_job_within_the_bound(tmp_path, kind) -> None:
    runner = kind(close_timeout_s=60.0)
    runner.start(source(), StallingEngine(str(tmp_path), stall_s=1.0))
    runner.submit(job(0))
    runner.submit(job(1))
    wait_for(tmp_path / "started-0")
    running = generator(runner)
    clock = time.monotonic()
    runner.close()
    assert time.monotonic() - clock < 30.0
    assert (tmp_path / "finished-0").exists()  # the running job ended on its own
    assert not (tmp_path / "started-1").exists()
    running.join(10.0)
    assert not running.is_alive()
    if isinstance(runner, ProcessRunner):
        assert running.exitcode == 0  # it stopped by itself: not killed


@pytest.mark.parametrize("kind", [ThreadRunner, ProcessRunner])
def test_close_timeout_is_checked_at_construction(kind) -> None:
    key = r"model\.runner\.init_args\.close_timeout_s=-1 is out of range; it must be a finite"
    with pytest.raises(SettingError, match=rf"{key}.*0 kills it at once"):
        kind(close_timeout_s=-1)
    kind().close()  # never started: nothing to close
    assert kind.resume_safe == ("close_timeout_s",)
