"""SIGKILL a real ``lppo fit`` at several points; the resumed run ends bitwise equal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lppo.run.checkpointing import TMP_MARK

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ITERATIONS = 3
ARGS = [
    "--config", str(ROOT / "configs" / "tiny.yaml"),
    "--model.rollout.prompts_per_iteration", "4",
    "--model.rollout.samples_per_prompt", "2",
    "--trainer.max_epochs", str(ITERATIONS),
]  # fmt: skip


def lppo_fit(root: Path, *extra: str) -> list[str]:
    code = "from lppo.run.cli import main; main()"
    args = ["--trainer.default_root_dir", str(root), *extra]
    return [sys.executable, "-c", code, "fit", *ARGS, *args]


def env() -> dict[str, str]:
    tests = str(Path(__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": tests, "HF_HUB_OFFLINE": "1"}


def final_state(root: Path) -> dict[str, torch.Tensor]:
    ckpt = torch.load(root / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["epoch"] == ITERATIONS - 1
    return ckpt["state_dict"]


@pytest.mark.parametrize("point", ["rollout:1", "critic:1", "actor:2", "checkpoint:1"])
def test_sigkill_then_resume_is_bitwise_equal(tmp_path, straight_tiny_fit, point):
    straight = straight_tiny_fit  # tests/conftest.py: the uninterrupted run of ARGS
    marker = tmp_path / "reached"
    pause = ["--trainer.callbacks+=_fault_points.PauseAt"]
    pause += [f"--trainer.callbacks.point={point}", f"--trainer.callbacks.marker={marker}"]
    proc = subprocess.Popen(
        lppo_fit(tmp_path, *pause), env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 600
    while not marker.exists():
        if proc.poll() is not None:
            pytest.fail(f"lppo fit ended before {point}: {proc.stderr.read().decode()[-2000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"{point} not reached in time")
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    resumed = subprocess.run(
        lppo_fit(tmp_path, "--ckpt_path", "last"), env=env(), capture_output=True, timeout=900
    )
    assert resumed.returncode == 0, resumed.stderr.decode()[-2000:]
    state = final_state(tmp_path)
    assert state.keys() == straight.keys()
    for key, value in straight.items():
        assert torch.equal(state[key], value), key
    assert not any(TMP_MARK in p.name for p in (tmp_path / "checkpoints").iterdir())
