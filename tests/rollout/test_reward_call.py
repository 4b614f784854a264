"""call_reward: a reward is stopped at its limit, named when it raises, and cannot hold signals.

The last tests drive a real ``lppo fit`` whose reward hangs or exits.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lppo.config import PPOConfig
from lppo.rollout.reward_call import RewardRaised, RewardTimeout, call_reward
from lppo.run import interrupts
from lppo.run.interrupts import RunInterrupted
from lppo.validation import SettingError

ROOT = Path(__file__).resolve().parents[2]


def sleep_long() -> float:
    time.sleep(600)
    return 1.0


def busy_long() -> float:
    end = time.monotonic() + 600
    while time.monotonic() < end:
        pass
    return 1.0


def in_thread(fn: Callable[[], object]) -> object:
    """What ``fn`` returns or raises, run in a thread other than the main one."""
    out: list[object] = []

    def target() -> None:
        try:
            out.append(fn())
        except BaseException as error:
            out.append(error)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(120)
    assert not thread.is_alive()
    return out[0]


def test_the_reward_s_value_comes_back_and_the_process_is_as_before() -> None:
    handlers = {s: signal.getsignal(s) for s in (signal.SIGALRM, signal.SIGINT, signal.SIGTERM)}
    assert call_reward(lambda: [1.0, 0.5], 30.0) == [1.0, 0.5]
    assert call_reward(lambda: 2.0, None) == 2.0
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert {s: signal.getsignal(s) for s in handlers} == handlers


def test_a_sleeping_reward_is_stopped_at_its_limit_in_the_main_thread() -> None:
    with pytest.raises(RewardTimeout, match=r"reward_timeout_s=0\.2 s and was stopped"):
        call_reward(sleep_long, 0.2)
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_a_busy_reward_is_stopped_at_its_limit_in_another_thread() -> None:
    error = in_thread(lambda: call_reward(busy_long, 0.2))
    assert isinstance(error, RewardTimeout), error
    assert in_thread(lambda: call_reward(lambda: 3.0, 30.0)) == 3.0


@pytest.mark.parametrize("main", [True, False], ids=["main-thread", "other-thread"])
@pytest.mark.parametrize(
    "raised", [SystemExit(0), KeyboardInterrupt("by the code"), GeneratorExit(), KeyError("k")]
)
def test_everything_the_reward_raises_is_named(main: bool, raised: BaseException) -> None:
    def reward() -> float:
        raise raised

    call = lambda: call_reward(reward, 30.0)  # noqa: E731
    if main:
        with pytest.raises(RewardRaised) as caught:
            call()
        error = caught.value
    else:
        error = in_thread(call)
    assert isinstance(error, RewardRaised) and error.error is raised


@pytest.fixture
def run_handlers() -> Iterator[None]:
    """lppo's SIGTERM / SIGINT handlers, as the fit loop installs them for a run."""
    previous = {s: signal.getsignal(s) for s in interrupts.SIGNALS}
    interrupts.install()
    yield
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def signal_soon(signum: int) -> None:
    threading.Timer(0.2, os.kill, (os.getpid(), signum)).start()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_ends_a_sleeping_reward_and_is_no_reward_failure(run_handlers, signum) -> None:
    signal_soon(signum)
    with pytest.raises(RunInterrupted) as caught:
        call_reward(sleep_long, 60.0)
    assert caught.value.code == 128 + signum  # the process's exit status
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_a_reward_that_swallows_the_interruption_is_still_interrupted(run_handlers) -> None:
    def stubborn() -> float:
        try:
            time.sleep(600)
        except BaseException:
            pass
        return 1.0

    signal_soon(signal.SIGTERM)
    with pytest.raises(RunInterrupted):
        call_reward(stubborn, 60.0)


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), float("nan"), "5", True])
def test_the_limit_is_validated(value: object) -> None:
    with pytest.raises(SettingError, match=r"model\.ppo\.reward_timeout_s=.*null: no limit"):
        PPOConfig(reward_timeout_s=value)  # type: ignore[arg-type]


# ------------------------------------------------------------------- a real lppo fit
def lppo_fit(root: Path, mode: str, *extra: str) -> subprocess.Popen[str]:
    task = {
        "class_path": "_user_rewards.MisbehavingRewardTask",
        "init_args": {"mode": mode, "marker": str(root / "reached")},
    }
    args = ["--config", str(ROOT / "configs" / "tiny.yaml"), "--trainer.max_epochs", "2"]
    args += ["--model.rollout.prompts_per_iteration", "4", "--model.rollout.samples_per_prompt"]
    args += ["2", "--trainer.default_root_dir", str(root), "--model.task", json.dumps(task)]
    tests = str(ROOT / "tests")
    env = {**os.environ, "PYTHONPATH": f"{tests}{os.pathsep}{ROOT}", "HF_HUB_OFFLINE": "1"}
    code = "from lppo.run.cli import main; main()"
    return subprocess.Popen(
        [sys.executable, "-c", code, "fit", *args, *extra],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # a SIGINT ignored by the shell that started pytest would be ignored in the run too
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    try:
        output, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        pytest.fail(f"lppo fit did not end:\n{output[-3000:]}")
    return proc.returncode, output


def wait_for(marker: Path, proc: subprocess.Popen[str]) -> None:
    for _ in range(2400):
        if marker.exists() or proc.poll() is not None:
            break
        time.sleep(0.1)
    assert marker.exists(), finish(proc)[1][-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_a_run_whose_reward_hangs(tmp_path: Path, signum: int) -> None:
    # Skipping failed iterations must not turn the signal into a skipped iteration.
    proc = lppo_fit(tmp_path, "hang", "--model.ppo.max_failed_iterations", "5")
    wait_for(tmp_path / "reached", proc)
    proc.send_signal(signum)
    rc, output = finish(proc)
    assert rc == 128 + signum, output[-3000:]
    assert "skipped" not in output and "failed iterations" not in output


@pytest.mark.slow
def test_a_hanging_reward_fails_the_run_at_its_limit(tmp_path: Path) -> None:
    proc = lppo_fit(tmp_path, "hang", "--model.ppo.reward_timeout_s", "1")
    rc, output = finish(proc)
    assert rc != 0
    assert (
        "MisbehavingRewardTask.rewards did not return within model.ppo.reward_timeout_s=1.0 s"
        in output
    ), output[-3000:]


@pytest.mark.slow
def test_a_reward_raising_system_exit_fails_the_run_by_name(tmp_path: Path) -> None:
    rc, output = finish(lppo_fit(tmp_path, "exit"))
    assert rc != 0, output[-3000:]
    assert "iteration 1, phase rollout: MisbehavingRewardTask.rewards raised SystemExit: 0" in (
        output
    ), output[-3000:]
    assert not (tmp_path / "checkpoints" / "last.ckpt").exists()
