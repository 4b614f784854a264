"""A multi-turn fit whose tool code attacks the run ends bitwise like the run without attacks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import time
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


def environ() -> dict[str, str]:
    """This process's environment; tests/envs and tests/ (the fault points) importable."""
    paths = [str(Path(__file__).parent), str(Path(__file__).parents[1])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "HF_HUB_OFFLINE": "1"}


def command(path: Path) -> list[str]:
    """``lppo fit --config path``."""
    cli = [sys.executable, "-c", "from lppo.run.cli import main; main()", "fit"]
    return [*cli, "--config", str(path)]


def fit(path: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*command(path), *extra], env=environ(), capture_output=True, text=True, timeout=600,
        check=False,
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


@pytest.mark.slow
def test_unjailed_tampering_is_caught_by_the_checkpoint_digest(tmp_path):
    """Without the jail the same code overwrites ``last.ckpt`` during iteration 1's rollout;
    the trainer is killed before it writes the next one, and the resume refuses the file."""
    attacked = tmp_path / "attacked"
    environment = {
        "class_path": "_attack_env.AttackEnvironment",
        "init_args": {
            "run_dir": str(attacked), "marker": "0", "probes": "tamper",
            "jail": {"class_path": "lppo.envs.Unjailed"},
        },
    }  # fmt: skip
    path, _ = config(tmp_path, "attacked", environment)
    marker = tmp_path / "reached"
    pause = ["--trainer.callbacks+=_fault_points.PauseAt", "--trainer.callbacks.point=rollout:1"]
    proc = subprocess.Popen(
        [*command(path), *pause, f"--trainer.callbacks.marker={marker}"],
        env=environ(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 600
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.kill()
    stderr = proc.communicate()[1]
    assert marker.exists(), stderr[-2000:]
    assert "WITHOUT a jail" in stderr and "TAMPERED" in stderr  # the code did overwrite it
    resumed = fit(path, "--ckpt_path", "last")
    assert resumed.returncode != 0
    assert "changed after lppo wrote it" in resumed.stderr and "last.ckpt" in resumed.stderr
    assert "Traceback" not in resumed.stderr


@pytest.mark.slow
def test_a_fit_where_the_jail_cannot_start_stops_at_setup(tmp_path):
    """In a user namespace whose limit is 0 (a host without user namespaces, as far as bwrap
    can tell), ``lppo fit`` stops before the first iteration with the cause and the fix."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1)")
    environment = {
        "class_path": "_attack_env.AttackEnvironment",
        "init_args": {"run_dir": str(tmp_path / "run"), "marker": "0", "probes": "escape"},
    }
    path, run_dir = config(tmp_path, "run", environment)
    no_userns = 'echo 0 > /proc/sys/user/max_user_namespaces && exec "$@"'
    done = subprocess.run(
        ["unshare", "--user", "--map-root-user", "sh", "-c", no_userns, "sh", *command(path)],
        env=environ(), capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    if "unshare failed" in done.stderr:
        pytest.skip(f"this machine cannot nest user namespaces: {done.stderr[-200:]}")
    assert done.returncode != 0
    error = "lppo: error: JailError: the tool jail cannot run here"
    assert error in done.stderr, done.stderr[-2000:]
    assert "user namespaces" in done.stderr and "lppo.envs.Unjailed" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (run_dir / "checkpoints").exists()  # no iteration ran
