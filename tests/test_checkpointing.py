"""Honest resume: atomic checkpoint writes, one clear error for a bad file, settings checked."""

from __future__ import annotations

import os
import re

import pytest
import torch
from test_resume import fit

from lppo.checkpointing import TMP_MARK, AtomicCheckpointIO, CheckpointError

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
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_stale_temporaries_beside_the_target_are_removed_on_the_next_run(tmp_path):
    fit(tmp_path / "run", 1)
    folder = tmp_path / "run" / "checkpoints"
    stale = folder / f"last.ckpt{TMP_MARK}99999"
    stale.write_bytes(b"half a checkpoint")  # what SIGKILL mid-write leaves behind
    fit(tmp_path / "run", 2, ckpt_path="last")
    assert not stale.exists()
    assert all(TMP_MARK not in name for name in os.listdir(folder))
