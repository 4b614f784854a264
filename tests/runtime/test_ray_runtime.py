"""How lppo runs Ray: a local Ray it started never outlives the lppo process, and a dead raylet
ends the run with lppo's error (real ``lppo fit`` processes, killed for real)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.fixture
def temp_dir():
    """Ray's session root for one fit (short: Ray's socket paths are)."""
    path = tempfile.mkdtemp(prefix="lppo-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def paused_fit(tmp_path: Path, temp_dir: str) -> subprocess.Popen:
    """A real ``lppo fit`` of configs/ray_workers.yaml (Ray rollout workers + TransferQueue on
    its own local Ray), paused in iteration 1's critic phase."""
    marker = tmp_path / "reached"
    args = ["--config", str(ROOT / "configs" / "ray_workers.yaml")]
    args += ["--model.rollout.prompts_per_iteration", "4"]
    args += ["--trainer.ray.temp_dir", temp_dir, "--trainer.default_root_dir", str(tmp_path)]
    args += ["--trainer.callbacks+=_fault_points.PauseAt", "--trainer.callbacks.point=critic:0"]
    args += [f"--trainer.callbacks.marker={marker}"]
    code = "from lppo.run.cli import main; main()"
    path = os.pathsep.join([str(ROOT / "tests"), str(ROOT)])
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "fit", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 600
    while not marker.exists():
        if proc.poll() is not None:
            pytest.fail(f"lppo fit ended early: {proc.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the critic phase was not reached in time")
        time.sleep(0.2)
    return proc


def descendants(proc: subprocess.Popen) -> list[psutil.Process]:
    """``proc``'s processes (never a global pgrep: other Rays may run on this machine)."""
    found = psutil.Process(proc.pid).children(recursive=True)
    names = {p.name() for p in found}
    assert {"raylet", "ray::DashboardAgent", "ray::SimpleStorageUnit"} <= names, names
    assert "ray::RolloutWorker" in names, names
    return found


def left_running(started: list[psutil.Process], timeout: float) -> list[tuple[int, str]]:
    """Which of ``started`` still run after ``timeout`` s (those are then killed here)."""
    _, alive = psutil.wait_procs(started, timeout=timeout)
    left = [(p.pid, p.name()) for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    for p in alive:  # a fault's leftovers must not hold ports for the next tests
        p.kill()
    return left


def test_sigkill_of_a_fit_with_ray_and_transfer_queue_leaves_no_process(tmp_path, temp_dir):
    """``kill -9`` of the fit: every process of its Ray (GCS, raylet, agents, workers,
    TransferQueue's storage) is gone after a short wait."""
    proc = paused_fit(tmp_path, temp_dir)
    try:
        started = descendants(proc)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert left_running(started, timeout=30) == []


def test_a_killed_raylet_ends_the_fit_with_lppos_error(tmp_path, temp_dir):
    """Ray ends the fit from its C++ core when the raylet dies; lppo's error says so first."""
    proc = paused_fit(tmp_path, temp_dir)
    try:
        started = descendants(proc)
        raylet = next(p for p in started if p.name() == "raylet")
        raylet.kill()
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode != 0
    assert "lppo: RayError: the raylet" in stderr, stderr[-3000:]
    assert "OOM killer" in stderr and "raylet.out" in stderr
    assert left_running(started, timeout=30) == []
