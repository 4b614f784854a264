"""lppo's setup errors print as one short block; ``--debug`` / ``LPPO_DEBUG=1`` add the traceback.

Every check runs ``python -m lppo.run.cli fit`` in a fresh process and reads its stderr.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from _cli import ROOT, TINY, lppo_cli


def fit(root: Path, *extra: str) -> list[str]:
    return ["fit", "--config", str(TINY), "--trainer.default_root_dir", str(root), *extra]


def error_block(stderr: str) -> list[str]:
    """The lines from lppo's ``lppo: error:`` on (Lightning's start-up lines come before)."""
    lines = stderr.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("lppo: error:")]
    assert starts, stderr[-3000:]
    return lines[starts[0] :]


def test_bad_setting_prints_a_short_block_naming_the_key(tmp_path: Path) -> None:
    proc = lppo_cli(*fit(tmp_path / "run", "--model.ppo.critic_epochs", "0"))
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    block = error_block(proc.stderr)
    assert block[0].startswith("lppo: error: SettingError: model.ppo.critic_epochs=0 ")
    assert "where: model.ppo.critic_epochs" in block[1]
    assert len(block) <= 4
    assert "--debug" in block[-1] and "LPPO_DEBUG=1" in block[-1]


@pytest.mark.parametrize(
    ("flag", "env"), [(["--debug"], {}), ([], {"LPPO_DEBUG": "1"})], ids=["flag", "env"]
)
def test_debug_switch_shows_the_traceback(
    tmp_path: Path, flag: list[str], env: dict[str, str]
) -> None:
    proc = lppo_cli(*fit(tmp_path / "run", "--model.ppo.critic_epochs", "0"), *flag, env=env)
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr
    assert "SettingError: model.ppo.critic_epochs=0" in proc.stderr


def test_missing_checkpoint_names_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.ckpt"
    proc = lppo_cli(*fit(tmp_path / "run", "--ckpt_path", str(missing)))
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    block = error_block(proc.stderr)
    assert block[0].startswith("lppo: error: CheckpointError:") and str(missing) in block[0]
    assert len(block) <= 3


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_missing_extra_names_the_install(tmp_path: Path) -> None:
    vllm = ROOT / "configs" / "vllm.yaml"
    args = ["fit", "--config", str(vllm), "--trainer.default_root_dir", str(tmp_path / "run")]
    proc = lppo_cli(*args)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    block = error_block(proc.stderr)
    assert "vLLM" in block[0] and "[vllm]" in block[0]
    assert len(block) <= 3
