"""A run directory belongs to one run: the rule, ``last`` / ``auto``, the lock, temporaries."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_sigkill import env, lppo_fit

from lppo.run.checkpointing import TMP_MARK, CheckpointError
from lppo.run.digests import remove_stale_temporaries
from lppo.run.directory import RunDirectory, RunDirectoryError


def fake_run(root: Path, *names: str) -> RunDirectory:
    (root / "checkpoints").mkdir(parents=True)
    for name in names:
        (root / "checkpoints" / name).write_bytes(b"x")
    (root / "version_0").mkdir()
    (root / "summary.json").write_text("{}")
    return RunDirectory(str(root), str(root / "checkpoints"))


def test_a_fresh_run_into_a_directory_holding_checkpoints_is_refused(tmp_path):
    directory = fake_run(tmp_path, "last.ckpt", "iteration-0002.ckpt")
    with pytest.raises(RunDirectoryError, match=r"already holds a run .*--ckpt_path last"):
        directory.resolve(None, overwrite=False)
    named = str(tmp_path.parent / "elsewhere.ckpt")  # a named file is what the user resumes
    assert directory.resolve(named, overwrite=False) == named
    assert directory.resolve(None, overwrite=True) is None
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "version_0").exists()
    assert not (tmp_path / "summary.json").exists()


def test_last_needs_a_checkpoint_and_auto_resumes_when_there_is_one(tmp_path):
    directory = RunDirectory(str(tmp_path), str(tmp_path / "checkpoints"))
    with pytest.raises(CheckpointError, match=r"no last.ckpt in .*checkpoints.*--ckpt_path auto"):
        directory.resolve("last", overwrite=False)
    assert directory.resolve("auto", overwrite=False) is None
    fake_run(tmp_path, "last.ckpt")
    last = str(tmp_path.resolve() / "checkpoints" / "last.ckpt")
    assert directory.resolve("auto", overwrite=False) == last
    assert directory.resolve("last", overwrite=False) == last


def test_the_lock_refuses_a_second_process_naming_the_first(tmp_path):
    code = (
        "import sys, time; from lppo.run.directory import RunDirectory; "
        "d = RunDirectory(sys.argv[1], None); d.lock(); print('locked', flush=True); "
        "time.sleep(600)"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, env=env_here()
    )
    try:
        assert holder.stdout.readline().strip() == b"locked"
        with pytest.raises(RunDirectoryError, match=rf"in use by pid {holder.pid} on "):
            RunDirectory(str(tmp_path), None).lock()
    finally:
        holder.kill()
        holder.wait()
    directory = RunDirectory(str(tmp_path), None)
    directory.lock()  # the kernel dropped the killed holder's lock
    directory.unlock()


def test_the_lock_survives_the_deletion_of_its_file(tmp_path):
    """The directory itself is locked: a deleted ``.lppo.lock`` opens nothing."""
    holder = RunDirectory(str(tmp_path), None)
    holder.lock()
    try:
        (tmp_path / ".lppo.lock").unlink()
        with pytest.raises(RunDirectoryError, match=r"in use by another process \(its .lppo"):
            RunDirectory(str(tmp_path), None).lock()
    finally:
        holder.unlock()
    directory = RunDirectory(str(tmp_path), None)
    directory.lock()  # released: free again
    directory.unlock()


def env_here() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}


def test_only_temporaries_of_a_gone_writer_are_removed(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], text=True,
                          capture_output=True).stdout.strip()  # fmt: skip
    live = tmp_path / f"last.ckpt{TMP_MARK}{os.getpid()}"
    stale = tmp_path / f"last.ckpt{TMP_MARK}{gone}"
    live.write_bytes(b"x")
    stale.write_bytes(b"x")
    assert remove_stale_temporaries(str(tmp_path)) == [str(stale)]
    assert live.exists() and not stale.exists()


def fit(root: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(lppo_fit(root, *extra), env=env(), capture_output=True, timeout=900)


@contextlib.contextmanager
def paused_fit(root: Path, point: str) -> Iterator[subprocess.Popen]:
    """``lppo fit`` into ``root``, paused at ``point`` (``_fault_points.PauseAt``), then killed."""
    marker = root.parent / f"{root.name}.reached"
    pause = ["--trainer.callbacks+=_fault_points.PauseAt", f"--trainer.callbacks.point={point}",
             f"--trainer.callbacks.marker={marker}"]  # fmt: skip
    first = subprocess.Popen(lppo_fit(root, *pause), env=env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        while not marker.exists():
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        yield first
    finally:
        os.kill(first.pid, signal.SIGKILL)
        first.wait()


def summary(root: Path) -> dict:
    return json.loads((root / "summary.json").read_text())


@pytest.mark.slow
def test_a_kill_inside_the_first_last_ckpt_write_resumes_from_the_iteration_checkpoint(tmp_path):
    """The write is atomic, so such a kill leaves iteration-0000.ckpt, no last.ckpt, and a
    temporary: ``last`` and ``auto`` resume from the iteration checkpoint (a fresh run is
    still refused)."""
    directory = fake_run(tmp_path, "iteration-0000.ckpt", f"last.ckpt{TMP_MARK}999999")
    first = str(tmp_path.resolve() / "checkpoints" / "iteration-0000.ckpt")
    assert directory.resolve("last", overwrite=False) == first
    assert directory.resolve("auto", overwrite=False) == first
    with pytest.raises(RunDirectoryError, match=r"already holds a run .*--ckpt_path last"):
        directory.resolve(None, overwrite=False)


@pytest.mark.slow
def test_a_run_stranded_by_a_kill_in_its_first_last_ckpt_write_resumes(tmp_path):
    assert fit(tmp_path, "--trainer.max_epochs", "1").returncode == 0
    (tmp_path / "checkpoints" / "last.ckpt").rename(
        tmp_path / "checkpoints" / f"last.ckpt{TMP_MARK}999999"  # its writer is gone
    )
    resumed = fit(tmp_path, "--trainer.max_epochs", "2", "--ckpt_path", "auto")
    assert resumed.returncode == 0, resumed.stderr.decode()[-2000:]
    assert "no last.ckpt in" in resumed.stdout.decode()
    assert summary(tmp_path)["resumed_from"]["iteration"] == 1
    assert summary(tmp_path)["iterations"] == 2
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if TMP_MARK in p.name]


def test_a_rerun_is_refused_and_last_resumes_the_run_that_owns_the_directory(tmp_path):
    assert fit(tmp_path, "--trainer.max_epochs", "2").returncode == 0
    again = fit(tmp_path, "--trainer.max_epochs", "2")
    assert again.returncode != 0 and "already holds a run" in again.stderr.decode()
    # A new run over the old one: 1 iteration, another seed.
    over = fit(tmp_path, "--trainer.max_epochs", "1", "--model.seed", "1", "--trainer.overwrite",
               "true")  # fmt: skip
    assert over.returncode == 0, over.stderr.decode()[-2000:]
    deleted = re.search(r"--trainer.overwrite true: deleting in (\S+): (.*)", over.stdout.decode())
    assert deleted and deleted.group(1) == str(tmp_path), over.stdout.decode()[-2000:]
    assert re.fullmatch(
        r"checkpoints/ \(\d+ files\), version_0/ \(\d+ files\), summary.json, reward_curve.png",
        deleted.group(2),
    ), deleted.group(2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "iteration-0000.ckpt", "iteration-0000.ckpt.sha256", "last.ckpt",
        "last.ckpt.sha256"]  # fmt: skip
    resumed = fit(tmp_path, "--trainer.max_epochs", "2", "--model.seed", "1", "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr.decode()[-2000:]
    assert summary(tmp_path)["resumed_from"]["iteration"] == 1  # the second run's checkpoint
    assert summary(tmp_path)["iterations"] == 2
    assert "is not empty" not in resumed.stderr.decode()  # Lightning's warning, moot here
    finished = fit(
        tmp_path, "--trainer.max_epochs", "2", "--model.seed", "1", "--ckpt_path", "last"
    )
    assert finished.returncode == 0, finished.stderr.decode()[-2000:]
    said = "already holds all 2 iterations of this run (trainer.max_epochs=2): nothing to train"
    assert said in finished.stdout.decode() + finished.stderr.decode()


@pytest.mark.slow
def test_ckpt_path_last_without_a_checkpoint_fails_and_auto_starts_then_resumes(tmp_path):
    missing = fit(tmp_path, "--ckpt_path", "last")
    assert missing.returncode != 0
    assert f"no last.ckpt in '{tmp_path.resolve() / 'checkpoints'}'" in missing.stderr.decode()
    assert not (tmp_path / "checkpoints").exists()
    first = fit(tmp_path, "--trainer.max_epochs", "1", "--ckpt_path", "auto")
    assert first.returncode == 0, first.stderr.decode()[-2000:]
    assert summary(tmp_path)["resumed_from"] is None
    second = fit(tmp_path, "--trainer.max_epochs", "2", "--ckpt_path", "auto")
    assert second.returncode == 0, second.stderr.decode()[-2000:]
    assert summary(tmp_path)["resumed_from"]["iteration"] == 1


@pytest.mark.slow
def test_a_second_fit_into_a_directory_in_use_is_refused_and_keeps_its_checkpoint_write(tmp_path):
    """The first run is paused while it writes iteration 1's checkpoint temporary file."""
    with paused_fit(tmp_path, "write:1") as first:
        temporaries = [p for p in (tmp_path / "checkpoints").iterdir() if TMP_MARK in p.name]
        assert temporaries
        second = fit(tmp_path, "--ckpt_path", "last")
        assert second.returncode != 0
        assert f"is in use by pid {first.pid}" in second.stderr.decode()
        assert all(p.exists() for p in temporaries)
        last = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
        assert last["epoch"] == 0


@pytest.mark.slow
def test_a_second_fit_is_refused_after_the_lock_file_of_a_running_one_was_deleted(tmp_path):
    with paused_fit(tmp_path, "critic:1") as first:
        (tmp_path / ".lppo.lock").unlink()
        for ckpt_path in ("auto", "last"):
            second = fit(tmp_path, "--ckpt_path", ckpt_path)
            assert second.returncode == 1, second.stderr.decode()[-2000:]
            assert "is in use by another process (its .lppo.lock was deleted)" in (
                second.stderr.decode()
            )
        assert first.poll() is None  # untouched
