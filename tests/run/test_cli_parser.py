"""``lppo --help`` / ``lppo fit --help`` are lppo's; parse errors come first; Trainer knobs refused.

Every check runs ``python -m lppo.run.cli`` in a fresh process and reads what a person sees.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from _cli import TINY, lppo_cli

from lppo.config import PPOConfig
from lppo.run.system import RolloutSettings

#: The size of ``lppo fit --help`` before lppo had its own help (Lightning's, 811 lines).
LIGHTNING_HELP_LINES = 811


def options(help_text: str) -> dict[str, str]:
    """``--option`` -> its help text (the option's line and its indented continuation)."""
    found: dict[str, str] = {}
    current = None
    for line in help_text.splitlines():
        match = re.match(r"  (--[\w.]+)", line)
        if match:
            current = match.group(1)
            # drop the metavar (``KL_KIND``, ``{true,false}``): the description follows it
            found[current] = re.sub(r"^ (\{\S*\}|[A-Z_]+)", "", line[len(match.group(0)) :])
        elif current and line.startswith("    "):
            found[current] += " " + line.strip()
        else:
            current = None
    return {k: " ".join(v.split()) for k, v in found.items()}


def test_top_level_help_says_what_lppo_is() -> None:
    proc = lppo_cli("--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = " ".join(proc.stdout.split())
    assert "streamed PPO post-training for language models" in text
    assert "Lightning Trainer command line tool" not in text
    assert "{fit}" in text
    for absent in ("validate", "test", "predict"):
        assert not re.search(rf"\b{absent}\b", text), absent
    assert "--debug" in text and "LPPO_DEBUG=1" in text


def test_validate_is_not_a_subcommand() -> None:
    proc = lppo_cli("validate", "--config", str(TINY))
    assert proc.returncode == 2
    assert proc.stderr.startswith("lppo: error:"), proc.stderr[:2000]
    assert "Traceback" not in proc.stderr


def test_fit_help_is_short_lppo_first_and_every_lppo_key_described() -> None:
    proc = lppo_cli("fit", "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    lines = out.splitlines()
    assert len(lines) < LIGHTNING_HELP_LINES
    flags = [line.split()[0] for line in lines if line.startswith("  --")]
    lightning = [f for f in flags if f.startswith("--trainer.") and "--trainer.ray" not in f]
    assert len(lightning) < 0.4 * len(flags)  # mostly lppo's own keys, no longer Lightning's
    assert len(out.splitlines()[0]) < 100  # a one-line usage, not a 90-line list
    assert out.index("--model.ppo.kl_coef") < out.index("--trainer.max_epochs")
    assert out.index("--data.max_tokens_per_chunk") < out.index("--trainer.max_epochs")
    described = options(out)
    keys = [f"--model.ppo.{f.name}" for f in dataclasses.fields(PPOConfig)]
    keys += [f"--model.rollout.{f.name}" for f in dataclasses.fields(RolloutSettings)]
    keys += [k for k in described if k.startswith(("--data.", "--trainer.ray."))]
    keys = [k for k in keys if not k.endswith(".help")]
    keys += ["--ckpt_path"]
    bare = [k for k in keys if not re.match(r"[^\s(].*\(.*default: ", described.get(k, ""))]
    assert not bare, f"without a description or default in `lppo fit --help`: {bare}"
    refused = ("gradient_clip_val", "accumulate_grad_batches", "limit_val_batches")
    for hidden in (*refused, "fast_dev_run", "log_every_n_steps", "sync_batchnorm"):
        assert f"--trainer.{hidden}" not in out


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        pytest.param(
            ["--model.ppo.kl_coeff", "0.1"],
            "lppo: error: unrecognized arguments: --model.ppo.kl_coeff",
            id="unknown-key",
        ),
        pytest.param([], "lppo: error:", id="no-arguments"),
    ],
)
def test_parse_error_comes_first_and_suggests_a_config(args: list[str], expected: str) -> None:
    config = ["--config", str(TINY)] if args else []
    proc = lppo_cli("fit", *config, *args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith(expected), proc.stderr[:3000]
    assert len(lines) <= 5, proc.stderr[:3000]
    assert "lppo fit --config configs/tiny.yaml" in proc.stderr
    if args:
        assert "did you mean model.ppo.kl_coef?" in proc.stderr


@pytest.mark.parametrize(
    ("option", "value", "replacement"),
    [
        ("gradient_clip_val", "1.0", "model.actor.init_args.max_grad_norm"),
        ("accumulate_grad_batches", "2", "model.ppo.actor_minibatches"),
    ],
)
def test_inapplicable_trainer_option_is_refused_at_parse_time(
    tmp_path: Path, option: str, value: str, replacement: str
) -> None:
    root = tmp_path / "run"
    args = ["--config", str(TINY), "--trainer.default_root_dir", str(root)]
    proc = lppo_cli("fit", *args, f"--trainer.{option}", value)
    assert proc.returncode == 2, proc.stderr[-3000:]
    first = proc.stderr.strip().splitlines()[-3]  # the error, then usage and tip
    assert first.startswith(f"lppo: error: trainer.{option}={value}"), proc.stderr[-3000:]
    assert replacement in first
    assert "Traceback" not in proc.stderr
    assert not root.exists()  # refused before any model or run directory


def test_inapplicable_trainer_option_in_a_config_file_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "mine.yaml"
    config.write_text("trainer:\n  accumulate_grad_batches: 4\n")
    root = tmp_path / "run"
    args = ["--config", str(TINY), "--config", str(config), "--trainer.default_root_dir", str(root)]
    proc = lppo_cli("fit", *args)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "lppo: error: trainer.accumulate_grad_batches=4 does not apply" in proc.stderr
    assert "model.ppo.actor_minibatches" in proc.stderr
    assert not root.exists()


def test_yaml_syntax_error_names_the_file_and_line(tmp_path: Path) -> None:
    config = tmp_path / "mine.yaml"
    config.write_text("model:\n  ppo:\n    kl_coef: [0.1\n  rollout: {}\n")
    proc = lppo_cli("fit", "--config", str(TINY), "--config", str(config))
    assert proc.returncode == 2
    assert proc.stderr.startswith("lppo: error: Problems parsing config"), proc.stderr[:3000]
    assert f'in "{config}", line 3' in proc.stderr
