"""Honest resume: atomic checkpoint writes, one clear error for a bad file, settings checked."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_resume import fit

from lppo.run.checkpointing import TMP_MARK, AtomicCheckpointIO, CheckpointError
from lppo.run.digests import write_digest
from lppo.run.export import export_from_checkpoint
from lppo.run.trainer import PPOTrainer
from lppo.validation import SettingError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt") / "run"
    fit(root, 1)
    return root


def last(root):
    return root / "checkpoints" / "last.ckpt"


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (b"", "is empty (0 bytes)"),
        (b"not a checkpoint at all", "is corrupt or not a torch file"),
        (None, "does not exist"),
        ("truncated", "is corrupt or not a torch file"),
        ("foreign", "was not written by lppo"),
    ],
)
def test_a_bad_checkpoint_file_gives_one_clear_message(tmp_path, run_dir, content, fragment):
    bad = tmp_path / "bad.ckpt"
    if content == "truncated":
        data = last(run_dir).read_bytes()
        bad.write_bytes(data[: len(data) // 2])
    elif content == "foreign":
        torch.save({"state_dict": {}, "epoch": 3}, bad)
    elif content is not None:
        bad.write_bytes(content)
    if content:  # a digest that matches: the check after it is the one under test
        write_digest(bad)
    with pytest.raises(CheckpointError, match=re.escape(fragment)) as info:
        fit(tmp_path / "resume", 2, ckpt_path=str(bad))
    assert str(bad) in str(info.value)


def test_resume_refuses_changed_settings_and_lists_them(tmp_path, run_dir):
    with pytest.raises(CheckpointError) as info:
        fit(tmp_path / "r", 2, ckpt_path=str(last(run_dir)), actor_epochs=3, hidden=48)
    message = str(info.value)
    assert "model.ppo.actor_epochs: 1 -> 3" in message
    assert "model.actor.init_args.model.init_args.hidden_size: 32 -> 48" in message


def test_resume_applies_a_new_learning_rate_to_the_restored_optimizer(tmp_path, run_dir):
    _, system = fit(tmp_path / "r", 2, ckpt_path=str(last(run_dir)), lr=1e-3)
    assert system.actor.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)
    assert system.actor.optimizer.state_dict()["state"][0]["step"] > 1  # restored, not fresh


def test_an_interrupted_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    target = tmp_path / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}}, target)

    def crash(obj, f):
        f.write(b"partial")
        raise KeyboardInterrupt  # killed mid-write

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"state_dict": {"w": torch.zeros(3)}}, target)
    monkeypatch.undo()
    assert torch.equal(torch.load(target)["state_dict"]["w"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "last.ckpt.sha256"]


def test_stale_temporaries_beside_the_target_are_removed_on_the_next_run(tmp_path):
    fit(tmp_path / "run", 1)
    folder = tmp_path / "run" / "checkpoints"
    stale = folder / f"last.ckpt{TMP_MARK}99999"
    stale.write_bytes(b"half a checkpoint")  # what SIGKILL mid-write leaves behind
    fit(tmp_path / "run", 2, ckpt_path="last")
    assert not stale.exists()
    assert all(TMP_MARK not in name for name in os.listdir(folder))


# ------------------------------------------------------------- checkpoints that carry code
ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"
#: Makes torch unpickle everything wherever a load does not ask for weights-only explicitly.
UNSAFE_DEFAULT = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"
NOT_WEIGHTS = "holds non-weights content"


class Payload:
    """Unpickling it creates ``marker``: it stands for any code a pickled object can run."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def with_payload(run_dir: Path, folder: Path) -> tuple[Path, Path]:
    """``folder/checkpoints/last.ckpt``: the run's real checkpoint with a payload inside."""
    checkpoint = torch.load(last(run_dir), map_location="cpu", weights_only=True)
    marker = folder / "payload-ran"
    checkpoint["lppo_task"]["note"] = Payload(marker)
    path = folder / "checkpoints" / "last.ckpt"
    path.parent.mkdir(parents=True)
    torch.save(checkpoint, path)
    write_digest(path)  # as if written with its digest: the weights-only load must refuse it
    return path, marker


@pytest.mark.parametrize("ckpt_path", ["last", "file"])
def test_a_payload_checkpoint_never_runs_through_fit(tmp_path, run_dir, monkeypatch, ckpt_path):
    path, marker = with_payload(run_dir, tmp_path)
    monkeypatch.setenv(UNSAFE_DEFAULT, "1")
    with pytest.raises(CheckpointError, match=NOT_WEIGHTS) as info:
        fit(tmp_path, 2, ckpt_path="last" if ckpt_path == "last" else str(path))
    assert str(path) in str(info.value) and "exec" in str(info.value)
    assert not marker.exists()


@pytest.mark.parametrize("ckpt_path", ["last", "file"])
def test_a_payload_checkpoint_never_runs_through_lppo_fit(tmp_path, run_dir, ckpt_path):
    path, marker = with_payload(run_dir, tmp_path)
    args = ["fit", "--config", str(TINY), "--trainer.default_root_dir", str(tmp_path)]
    args += ["--ckpt_path", "last" if ckpt_path == "last" else str(path)]
    proc = subprocess.run(
        [sys.executable, "-m", "lppo.run.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, UNSAFE_DEFAULT: "1", "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode != 0
    assert f"CheckpointError: checkpoint {str(path)!r} {NOT_WEIGHTS}" in proc.stderr
    assert not marker.exists()


def test_a_payload_checkpoint_never_runs_through_export(tmp_path, run_dir, monkeypatch):
    path, marker = with_payload(run_dir, tmp_path)
    monkeypatch.setenv(UNSAFE_DEFAULT, "1")
    with pytest.raises(CheckpointError, match=NOT_WEIGHTS):
        export_from_checkpoint(path, tmp_path / "export")
    assert not marker.exists()
    proc = subprocess.run(
        [sys.executable, "-m", "lppo.run.export", str(path), str(tmp_path / "export")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, UNSAFE_DEFAULT: "1", "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 2 and f"{str(path)!r} {NOT_WEIGHTS}" in proc.stderr
    assert not marker.exists() and not (tmp_path / "export").exists()


def test_a_fit_that_asks_to_unpickle_everything_is_refused(tmp_path, run_dir):
    trainer = PPOTrainer(default_root_dir=str(tmp_path), accelerator="cpu")
    with pytest.raises(SettingError, match=r"weights_only=False"):
        trainer.fit(None, ckpt_path=str(last(run_dir)), weights_only=False)
