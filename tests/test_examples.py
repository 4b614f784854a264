"""Runs ``examples/`` exactly as ``examples/README.md`` documents it."""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import torch

from lppo.modules.tokenizer import build_char_tokenizer

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "examples" / "README.md"


def documented_command() -> tuple[dict[str, str], list[str]]:
    """The ``VAR=value lppo fit ...`` line of the README's bash block: (env, argv)."""
    block = re.search(r"```bash\n(.*?)\n```", README.read_text(), re.S)
    assert block is not None, "examples/README.md has no ```bash block"
    words = shlex.split(block.group(1).strip())
    env = {}
    while "=" in words[0]:
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    return env, words


def test_readme_documents_the_command() -> None:
    env, argv = documented_command()
    assert env == {"PYTHONPATH": "examples"}
    assert argv == ["lppo", "fit", "--config", "examples/custom.yaml"]


def test_custom_example_runs_with_its_subclasses(tmp_path: Path) -> None:
    env_vars, argv = documented_command()
    # The console script of this environment (the README's `lppo`), from the repository root.
    argv[0] = str(Path(sys.executable).with_name("lppo"))
    env = dict(os.environ)
    for key, value in env_vars.items():
        env[key] = os.pathsep.join(p for p in (value, env.get(key)) if p)
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [*argv, "--trainer.default_root_dir", str(run_dir)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["iterations"] == 3
    assert (run_dir / "reward_curve.png").read_bytes().startswith(b"\x89PNG")
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()

    # TrustRegionActor: its extra diagnostic reaches metrics.csv on every actor step.
    with open(summary["metrics_csv"]) as f:
        rows = list(csv.DictReader(f))
    actor_rows = [r for r in rows if r.get("actor/loss")]
    assert actor_rows
    kls = [float(r["actor/trust_kl"]) for r in actor_rows]
    assert all(k >= 0.0 for k in kls) and max(kls) > 0.0

    # MLPHeadCritic: the checkpoint holds the two-layer value head.
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    head = sorted(k for k in ckpt["state_dict"] if k.startswith("critic.value_head."))
    assert head == [
        "critic.value_head.0.bias",
        "critic.value_head.0.weight",
        "critic.value_head.2.bias",
        "critic.value_head.2.weight",
    ]
    assert ckpt["state_dict"]["critic.value_head.0.weight"].shape == (16, 32)

    # MaxDigitTask: the character tokenizer (hence every embedding) is built from its
    # vocabulary "0123456789=", not from the copy task's.
    vocab = len(build_char_tokenizer("0123456789="))
    embed = [v for k, v in ckpt["state_dict"].items() if k.endswith("embed_tokens.weight")]
    assert len(embed) == 2 and all(e.shape[0] == vocab for e in embed)
    saved = "\n".join(p.read_text() for p in run_dir.rglob("config.yaml"))
    for name in ("TrustRegionActor", "MLPHeadCritic", "MaxDigitTask"):
        assert f"class_path: custom_modules.{name}" in saved
