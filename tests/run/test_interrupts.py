"""SIGTERM / SIGINT to a real ``lppo fit``: exit 143 / 130, summary and curve marked
interrupted, the last checkpoint kept, and ``--ckpt_path last`` resumes bitwise; the same
for every engine and store (Hugging Face in-process, TransferQueue, Ray rollout workers,
vLLM)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from _builders import stored
from test_controller import make_controller, make_rollout
from test_faults import SETTINGS, same, snapshot
from test_sigkill import ITERATIONS, ROOT, env, final_state, lppo_fit

from lppo.iteration.hooks import PPOCallback
from lppo.replay import MemoryReplayStore
from lppo.run import interrupts
from lppo.run.checkpointing import TMP_MARK
from lppo.run.interrupts import RunInterrupted


class SignalSelf(PPOCallback):
    """Sends ``SIGTERM`` to this process at the actor's second chunk."""

    def __init__(self) -> None:
        self.chunks = 0

    def on_chunk_end(self, ctx, result) -> None:
        if ctx.phase == "actor":
            self.chunks += 1
            if self.chunks == 2:
                os.kill(os.getpid(), signal.SIGTERM)


def test_a_signal_mid_iteration_leaves_no_open_step_and_no_row():
    """In process: lppo's handler raises RunInterrupted where the signal lands; the
    controller aborts the open step, releases the rows and (transactional) restores both
    models, then lets the interruption through (not an IterationError the failure policy could
    skip)."""
    store = MemoryReplayStore()
    ctl = make_controller(store=store, callbacks=[SignalSelf()], **SETTINGS)
    start = snapshot(ctl)
    previous = {s: signal.getsignal(s) for s in interrupts.SIGNALS}
    interrupts.install()
    try:
        with pytest.raises(RunInterrupted) as caught:
            ctl.run_iteration(stored(ctl, make_rollout(6, 0)), iteration=0)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    assert caught.value.code == 143
    assert len(store) == 0
    assert not any(m.step_open for m in ctl.trainable_modules())
    assert same(snapshot(ctl), start)


def pause_then_signal(
    cmd: list[str], marker: Path, sig: int, cwd: Path | None = None, **extra_env: str
) -> subprocess.CompletedProcess:
    """Run ``cmd`` until it writes ``marker``, send ``sig`` to it, wait for its end."""
    proc = subprocess.Popen(
        cmd, env={**env(), **extra_env}, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 600
    while not marker.exists():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"lppo fit ended before the pause: {err.decode()[-2000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("pause not reached in time")
        time.sleep(0.2)
    os.kill(proc.pid, sig)
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def pause_args(point: str, marker: Path, seconds: float | None = None) -> list[str]:
    args = [
        "--trainer.callbacks+=_fault_points.PauseAt",
        f"--trainer.callbacks.point={point}",
        f"--trainer.callbacks.marker={marker}",
    ]
    return args + ([] if seconds is None else [f"--trainer.callbacks.seconds={seconds}"])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sig", "point", "ran"),
    [
        (signal.SIGTERM, "critic:1", 1),  # iteration 1 (0-based) aborted
        (signal.SIGINT, "actor:1", 1),
        # At the boundary (iteration 1 counted, its checkpoint not yet written): the signal
        # waits for the write, so last.ckpt holds the iteration the summary counts.
        (signal.SIGTERM, "published:1", 2),
        (signal.SIGTERM, "write:1", 2),  # inside torch.save of iteration 1's checkpoint
    ],
)
def test_a_signal_stops_the_run_resumably(tmp_path, straight_tiny_fit, sig, point, ran):
    marker = tmp_path / "reached"
    boundary = ran == 2  # paused inside the boundary: a bounded pause, the run goes on
    cmd = lppo_fit(tmp_path, *pause_args(point, marker, 2.0 if boundary else None))
    run = pause_then_signal(cmd, marker, sig)
    assert run.returncode == 128 + sig, run.stderr.decode()[-2000:]
    assert "Traceback" not in run.stderr.decode()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    assert summary["reason"] == f"interrupted by {signal.Signals(sig).name}"
    assert summary["iterations"] == ran
    assert "lppo run summary (interrupted)" in run.stdout.decode()
    assert (tmp_path / "reward_curve.png").stat().st_size > 0
    kept = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert kept["epoch"] == ran - 1  # every iteration the summary counts (ran) is in it
    assert not any(TMP_MARK in p.name for p in (tmp_path / "checkpoints").iterdir())

    resumed = subprocess.run(
        lppo_fit(tmp_path, "--ckpt_path", "last"), env=env(), capture_output=True, timeout=900
    )
    assert resumed.returncode == 0, resumed.stderr.decode()[-2000:]
    state = final_state(tmp_path)
    assert state.keys() == straight_tiny_fit.keys()  # tests/conftest.py: the uninterrupted run
    for key, value in straight_tiny_fit.items():
        assert torch.equal(state[key], value), key
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "completed"
    last = str((tmp_path / "checkpoints" / "last.ckpt").resolve())
    assert summary["resumed_from"] == {"path": last, "iteration": ran}
    assert f"resumed from {last} after iteration {ran}" in resumed.stdout.decode()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("where", ["critic", "ray.get"])
def test_sigterm_is_the_same_with_transfer_queue_and_ray_workers(tmp_path, where):
    """configs/ray_workers.yaml: Ray rollout workers putting rows into TransferQueue. Ray
    makes SIGTERM exit its driver at once (``sys.exit(15)``), and a signal that lands while
    the trainer waits for the workers in ``ray.get`` (iteration 1's reward pauses in the
    workers) comes out of it as ``SystemExit(1)``; lppo keeps its own handling."""
    marker = tmp_path / "reached"
    if where == "critic":
        pause = pause_args("critic:1", marker)
    else:
        task = "--model.task.init_args"
        pause = ["--model.task.class_path", "_fault_points.PausingCopyTask",
                 f"{task}.marker={marker}", f"{task}.pause_at=2"]  # fmt: skip
    cmd = lppo_fit(tmp_path, *pause)
    cmd[cmd.index("--config") + 1] = str(ROOT / "configs" / "ray_workers.yaml")
    run = pause_then_signal(cmd, marker, signal.SIGTERM)
    assert run.returncode == 143, run.stderr.decode()[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["status"], summary["iterations"]) == ("interrupted", 1)
    assert summary["reason"] == "interrupted by SIGTERM"
    resume = cmd[: cmd.index(pause[0])]
    if where != "critic":  # the same task, without the pause (resume-safe)
        resume += ["--model.task.class_path", "_fault_points.PausingCopyTask"]
    resumed = subprocess.run(
        [*resume, "--ckpt_path", "last"], env=env(), capture_output=True, timeout=900
    )
    assert resumed.returncode == 0, resumed.stderr.decode()[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["status"], summary["iterations"]) == ("completed", ITERATIONS)


@pytest.mark.slow
@pytest.mark.vllm
def test_sigterm_is_the_same_with_the_vllm_engine(tmp_path):
    """configs/vllm.yaml: the vLLM engine in the trainer process (run by .ci/vllm)."""
    marker = tmp_path / "reached"
    cmd = lppo_fit(tmp_path, *pause_args("critic:1", marker))
    cmd[cmd.index("--config") + 1] = str(ROOT / "configs" / "vllm.yaml")
    vllm_env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    run = pause_then_signal(cmd, marker, signal.SIGTERM, cwd=ROOT, **vllm_env)
    assert run.returncode == 143, run.stderr.decode()[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["status"], summary["iterations"]) == ("interrupted", 1)
