"""A multi-turn fit whose tool code attacks the run ends bitwise like the run without attacks."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
import yaml
from test_python_tool import host_processes

ROOT = Path(__file__).resolve().parents[2]
ITERATIONS = 3


def config(tmp_path: Path, name: str, environment: dict | None) -> tuple[Path, Path]:
    """configs/multiturn.yaml, small, into ``tmp_path/name`` (its environment replaced)."""
    settings = yaml.safe_load((ROOT / "configs" / "multiturn.yaml").read_text())
    run_dir = tmp_path / name
    settings["trainer"].update(max_epochs=ITERATIONS, default_root_dir=str(run_dir))
    settings["model"]["rollout"].update(prompts_per_iteration=8, samples_per_prompt=2)
    if environment is not None:
        settings["model"]["engine"]["init_args"]["environment"] = environment
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(settings))
    return path, run_dir


def fit(path: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-c", "from lppo.run.cli import main; main()", "fit"]
    return subprocess.run(
        [*cmd, "--config", str(path), *extra], env=env, capture_output=True, text=True,
        timeout=600, check=False,
    )  # fmt: skip


def final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["epoch"] == ITERATIONS - 1
    return checkpoint["state_dict"]


@pytest.mark.slow
def test_a_fit_under_attack_ends_like_the_run_without_it(tmp_path):
    path, plain = config(tmp_path, "plain", None)
    done = fit(path)
    assert done.returncode == 0, done.stderr[-2000:]
    marker = f"{50 + os.getpid() % 1000 / 1000:.3f}"
    attacked = tmp_path / "attacked"
    environment = {
        "class_path": "_attack_env.AttackEnvironment",
        "init_args": {"run_dir": str(attacked), "marker": marker},
    }
    path, run_dir = config(tmp_path, "attacked", environment)
    # Two iterations, then a resume: the code goes after a checkpoint that exists.
    first = fit(path, "--trainer.max_epochs", str(ITERATIONS - 1))
    assert first.returncode == 0, first.stderr[-2000:]
    resumed = fit(path, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    for run in (first, resumed):
        assert "attack output:" in run.stderr  # the code ran, and every probe failed:
        assert "signal 19 [Errno 3] No such process" in run.stderr
        assert "environ [Errno 2] No such file or directory" in run.stderr
        for word in ("TAMPERED", "SECRET", "PLANTED", "ESCAPED"):
            assert word not in run.stderr
    expected, state = final_state(plain), final_state(run_dir)
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(state[key], value), key
    assert not host_processes(marker)
    assert not (run_dir / "escaped.txt").exists()
    purelib = Path(sysconfig.get_paths()["purelib"])
    assert (
        not (purelib / "sitecustomize.py").exists()
        or "planted" not in (purelib / "sitecustomize.py").read_text()
    )
