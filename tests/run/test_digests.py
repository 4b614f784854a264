"""Checkpoint digests: written beside every checkpoint, verified by every load, kept consistent
through a kill at any point of the write."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lppo.run.checkpointing import (
    TMP_MARK,
    AtomicCheckpointIO,
    CheckpointError,
    check_checkpoint,
    load_checkpoint,
)
from lppo.run.cli import run
from lppo.run.digests import (
    HashingWriter,
    digest_path,
    remove_stale_temporaries,
    write_digest,
)
from lppo.run.export import export_from_checkpoint

pytestmark = [
    # In-process `lppo fit` runs pass `args` while pytest's own argv is in sys.argv.
    pytest.mark.filterwarnings("ignore:LightningCLI's args parameter:UserWarning"),
    # A resume writes into the folder it resumes (a copy of a run, for some).
    pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty"),
    pytest.mark.filterwarnings("ignore:The dirpath has changed"),
]


def checkpoint(value: float) -> dict:
    return {"state_dict": {"w": torch.full((64,), value)}, "epoch": int(value)}


def weight(path: Path) -> float:
    return float(load_checkpoint(str(path))["state_dict"]["w"][0])


def sha256sum_check(path: Path) -> subprocess.CompletedProcess[str]:
    """The real ``sha256sum -c`` on the digest file of ``path``, run from its folder."""
    digest = Path(digest_path(str(path))).name
    return subprocess.run(
        ["sha256sum", "-c", digest], cwd=path.parent, capture_output=True, text=True
    )


@pytest.fixture(scope="module")
def gone_pid() -> int:
    """The pid of a process that has ended (a writer killed before the test looks)."""
    code = "import os; print(os.getpid())"
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True).stdout)


# ------------------------------------------------------------------------ the digest file
def test_the_digest_is_written_while_saving_and_sha256sum_agrees(tmp_path):
    target = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint(checkpoint(1.0), target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "last.ckpt.sha256"]
    line = (tmp_path / "last.ckpt.sha256").read_text()
    assert line == f"{hashlib.sha256(target.read_bytes()).hexdigest()}  last.ckpt\n"
    done = sha256sum_check(target)
    assert done.returncode == 0 and done.stdout == "last.ckpt: OK\n", done.stderr
    assert weight(target) == 1.0


def test_the_hashing_writer_hashes_what_torch_save_writes(tmp_path):
    path = tmp_path / "f"
    with path.open("wb") as f:
        writer = HashingWriter(f)
        torch.save({"a": torch.randn(300, 70), "b": [1, "x"], "c": torch.arange(5)}, writer)
    assert writer.hexdigest() == hashlib.sha256(path.read_bytes()).hexdigest()


def test_write_digest_is_sha256sum(tmp_path):
    path = tmp_path / "crafted.ckpt"
    torch.save(checkpoint(2.0), path)
    write_digest(path)
    assert sha256sum_check(path).returncode == 0
    assert weight(path) == 2.0


def test_remove_checkpoint_removes_its_digest_too(tmp_path):
    io, target = AtomicCheckpointIO(), tmp_path / "iteration-0000.ckpt"
    io.save_checkpoint(checkpoint(1.0), target)
    io.remove_checkpoint(target)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ refused before loading
def flip_middle(path: Path) -> None:
    """Overwrite bytes in the middle of ``path`` in place (what a stray writer does)."""
    with path.open("r+b") as f:
        f.seek(path.stat().st_size // 2)
        data = f.read(8)
        f.seek(-len(data), os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in data))


def test_a_changed_file_is_refused_naming_it_both_digests_and_the_fix(tmp_path):
    target = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint(checkpoint(1.0), target)
    recorded = (tmp_path / "last.ckpt.sha256").read_text().split()[0]
    flip_middle(target)
    actual = hashlib.sha256(target.read_bytes()).hexdigest()
    with pytest.raises(CheckpointError) as info:
        check_checkpoint(str(target))
    message = str(info.value)
    assert f"checkpoint {str(target)!r} changed after lppo wrote it" in message
    assert actual[:16] in message and recorded[:16] in message
    assert "Restore the file, or resume from another checkpoint" in message
    assert "iteration-NNNN.ckpt" in message


def test_a_missing_digest_is_refused_and_the_fix_in_the_message_works(tmp_path):
    target = tmp_path / "last.ckpt"
    torch.save(checkpoint(3.0), target)  # e.g. written by an lppo from before digests
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(str(target))
    message = str(info.value)
    assert f"checkpoint {str(target)!r} has no digest file" in message
    assert repr(str(target) + ".sha256") in message
    assert "`sha256sum last.ckpt > last.ckpt.sha256`" in message
    subprocess.run("sha256sum last.ckpt > last.ckpt.sha256", shell=True, cwd=tmp_path, check=True)
    assert weight(target) == 3.0


# ----------------------------------------------------------- a kill at any point of a write
def crashed_write(folder: Path, pid: int, state: str) -> Path:
    """``folder/last.ckpt`` (weight 1) and its digest, then a rewrite (weight 2) killed at
    ``state``, as that kill leaves the folder; the killed writer's pid is ``pid``.

    ``writing``: in ``torch.save`` (a partial checkpoint temporary); ``digesting``: the
    checkpoint temporary written, the digest temporary being written; ``renaming``: both
    temporaries written, neither renamed; ``between``: the checkpoint renamed, its digest not.
    """
    target = folder / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint(checkpoint(1.0), target)
    elsewhere = folder / "new"
    io.save_checkpoint(checkpoint(2.0), elsewhere / "last.ckpt")  # the rewrite's two files
    new, new_digest = elsewhere / "last.ckpt", elsewhere / "last.ckpt.sha256"
    tmp = folder / f"last.ckpt{TMP_MARK}{pid}"
    digest_tmp = folder / f"last.ckpt.sha256{TMP_MARK}{pid}"
    if state == "writing":
        tmp.write_bytes(new.read_bytes()[:100])
    if state == "digesting":
        tmp.write_bytes(new.read_bytes())
        digest_tmp.write_text(new_digest.read_text()[:20])
    if state == "renaming":
        tmp.write_bytes(new.read_bytes())
        digest_tmp.write_text(new_digest.read_text())
    if state == "between":
        os.replace(new, target)
        digest_tmp.write_text(new_digest.read_text())
    shutil.rmtree(elsewhere)
    return target


#: Each kill state: the weight of the checkpoint it leaves, and how many temporaries.
STATES = {"writing": (1.0, 1), "digesting": (1.0, 2), "renaming": (1.0, 2), "between": (2.0, 1)}


@pytest.mark.parametrize(("state", "kept", "temporaries"), [(k, *v) for k, v in STATES.items()])
def test_after_the_cleanup_a_killed_write_leaves_a_checkpoint_that_matches_its_digest(
    tmp_path, gone_pid, state, kept, temporaries
):
    target = crashed_write(tmp_path, gone_pid, state)
    assert len(remove_stale_temporaries(str(tmp_path))) == temporaries
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "last.ckpt.sha256"]
    assert sha256sum_check(target).returncode == 0
    assert weight(target) == kept


def test_a_load_before_the_cleanup_rolls_the_digest_forward_too(tmp_path, gone_pid):
    """A ``--ckpt_path`` file is checked at parse time, an export has no cleanup: the same."""
    target = crashed_write(tmp_path, gone_pid, "between")
    assert weight(target) == 2.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "last.ckpt.sha256"]


def test_a_first_write_killed_between_the_renames_gets_its_digest(tmp_path, gone_pid):
    target = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint(checkpoint(2.0), target)
    os.replace(tmp_path / "last.ckpt.sha256", tmp_path / f"last.ckpt.sha256{TMP_MARK}{gone_pid}")
    assert remove_stale_temporaries(str(tmp_path))
    assert sha256sum_check(target).returncode == 0


def test_a_live_writers_digest_temporary_is_left_alone(tmp_path):
    target = crashed_write(tmp_path, os.getpid(), "between")
    assert remove_stale_temporaries(str(tmp_path)) == []
    assert (tmp_path / f"last.ckpt.sha256{TMP_MARK}{os.getpid()}").exists()
    with pytest.raises(CheckpointError, match="changed after lppo wrote it"):
        load_checkpoint(str(target))  # its writer may still rename it: not ours to settle


def test_an_exception_between_the_renames_still_renames_the_digest(tmp_path, monkeypatch):
    target = tmp_path / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint(checkpoint(1.0), target)
    replace = os.replace
    calls = []

    def interrupted(src, dst):
        calls.append(dst)
        if len(calls) == 2:  # the digest's rename: a signal's KeyboardInterrupt arrives
            raise KeyboardInterrupt
        replace(src, dst)

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint(checkpoint(2.0), target)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "last.ckpt.sha256"]
    assert weight(target) == 2.0


# ------------------------------------------------------------------- a real run's last.ckpt
ROOT = Path(__file__).resolve().parents[2]


def fit_args(root: Path, *extra: str) -> list[str]:
    """``lppo fit`` of the shrunk tiny config into ``root``."""
    args = ["fit", "--config", str(ROOT / "configs" / "tiny.yaml"), "--trainer.max_epochs", "2"]
    args += ["--model.rollout.prompts_per_iteration", "4", "--model.rollout.samples_per_prompt"]
    return [*args, "2", "--trainer.default_root_dir", str(root), *extra]


@pytest.fixture(scope="module")
def two_iterations(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run directory of two iterations (its first iteration checkpoint deleted since)."""
    root = tmp_path_factory.mktemp("digests") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        run(fit_args(root, "--trainer.max_epochs", "1"))
        run(fit_args(root, "--ckpt_path", "last"))
    return root


@pytest.fixture
def copied(tmp_path: Path, two_iterations: Path) -> Path:
    root = tmp_path.resolve() / "run"
    shutil.copytree(two_iterations, root)
    (root / ".lppo.lock").unlink(missing_ok=True)
    return root


@pytest.mark.slow
def test_a_run_writes_a_digest_beside_every_checkpoint_and_deletes_it_with_it(two_iterations):
    folder = two_iterations / "checkpoints"
    names = ["iteration-0001.ckpt", "iteration-0001.ckpt.sha256", "last.ckpt", "last.ckpt.sha256"]
    assert sorted(p.name for p in folder.iterdir()) == names
    for name in names[::2]:
        assert sha256sum_check(folder / name).returncode == 0


@pytest.mark.slow
def test_a_tampered_last_ckpt_is_refused_by_every_load(copied, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    last = copied / "checkpoints" / "last.ckpt"
    flip_middle(last)
    for ckpt_path in ("last", "auto", str(last)):
        with pytest.raises(CheckpointError, match="changed after lppo wrote it") as info:
            run(fit_args(copied, "--trainer.max_epochs", "3", "--ckpt_path", ckpt_path))
        assert f"checkpoint {str(last)!r}" in str(info.value)
    with pytest.raises(CheckpointError, match="changed after lppo wrote it"):
        export_from_checkpoint(last, copied / "hf")
    assert not (copied / "hf").exists()
    assert load_checkpoint(str(copied / "checkpoints" / "iteration-0001.ckpt"))["epoch"] == 1


@pytest.mark.slow
def test_a_last_ckpt_without_its_digest_is_refused_until_it_is_given_one(copied, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    last = copied / "checkpoints" / "last.ckpt"
    Path(digest_path(str(last))).unlink()
    resume = fit_args(copied, "--trainer.max_epochs", "3", "--ckpt_path", "last")
    with pytest.raises(CheckpointError, match="has no digest file") as info:
        run(resume)
    assert f"checkpoint {str(last)!r}" in str(info.value)
    write_digest(last)  # the user trusts the file
    assert run(resume).trainer.current_epoch == 3
