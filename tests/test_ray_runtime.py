"""How lppo runs Ray: nothing of a local Ray it started outlives an lppo process killed hard."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.distributed
def test_sigkill_of_a_fit_with_ray_and_transfer_queue_leaves_no_process(tmp_path):
    """``kill -9`` of a real ``lppo fit`` (Ray rollout workers + TransferQueue) in its critic
    phase: every process of its Ray (agents, workers, storage) is gone after a short wait."""
    temp_dir = tempfile.mkdtemp(prefix="lppo-", dir="/tmp")  # Ray's socket paths are short
    marker = tmp_path / "reached"
    args = ["--config", str(ROOT / "configs" / "ray_workers.yaml")]
    args += [
        "--model.rollout.prompts_per_iteration",
        "4",
        "--model.rollout.samples_per_prompt",
        "2",
    ]
    args += ["--trainer.ray.temp_dir", temp_dir, "--trainer.default_root_dir", str(tmp_path)]
    args += ["--trainer.callbacks+=_fault_points.PauseAt", "--trainer.callbacks.point=critic:0"]
    args += [f"--trainer.callbacks.marker={marker}"]
    code = "from lppo.cli import main; main()"
    path = os.pathsep.join([str(ROOT / "tests"), str(ROOT)])
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "fit", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 600
        while not marker.exists():
            if proc.poll() is not None:
                pytest.fail(f"lppo fit ended early: {proc.stderr.read().decode()[-3000:]}")
            assert time.monotonic() < deadline, "the critic phase was not reached in time"
            time.sleep(0.2)
        # This fit's processes only (never a global pgrep: other Rays may run on the machine).
        started = psutil.Process(proc.pid).children(recursive=True)
        names = {p.name() for p in started}
        assert {"raylet", "ray::DashboardAgent", "ray::SimpleStorageUnit"} <= names, names
        assert "ray::RolloutWorker" in names, names
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    _, alive = psutil.wait_procs(started, timeout=30)
    left = [(p.pid, p.name()) for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    for p in alive:  # what the fix should have stopped: not left running for the next tests
        p.kill()
    assert left == []
