"""lppo's setup errors print as one short block; ``--debug`` / ``LPPO_DEBUG=1`` add the traceback.

Every check runs ``python -m lppo.run.cli fit`` in a fresh process and reads its stderr.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml
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


@pytest.mark.parametrize(
    ("config", "key", "value", "fix"),
    [
        pytest.param(
            TINY,
            "model.estimator",
            "lppo.estimators.GRPo",
            "did you mean lppo.estimators.GRPO? lppo's AdvantageEstimator classes: "
            "lppo.estimators.Distill, lppo.estimators.GAE, lppo.estimators.GRPO, "
            "lppo.estimators.RLOO, lppo.estimators.ReinforcePP",
            id="unknown-estimator",
        ),
        pytest.param(
            TINY,
            "model.actor.init_args.objective",
            "lppo.algorithms.DAPO",
            "lppo's PolicyObjective classes: lppo.algorithms.CISPO, lppo.algorithms.ClippedPPO, "
            "lppo.algorithms.GSPO",
            id="missing-objective",
        ),
        pytest.param(
            ROOT / "configs" / "dataset.yaml",
            "model.task.init_args.verifier",
            "mymod.MyVerifier",
            "an own module must be importable: run from its folder or set "
            "PYTHONPATH=<its folder>; lppo's Verifier classes: lppo.tasks.verifiers.ExactMatch",
            id="own-module-not-importable",
        ),
    ],
)
def test_class_path_mistake_prints_a_short_block_with_the_valid_classes(
    tmp_path: Path, config: Path, key: str, value: str, fix: str
) -> None:
    args = ["fit", "--config", str(config), "--trainer.default_root_dir", str(tmp_path / "run")]
    proc = lppo_cli(*args, f"--{key}", value)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    block = error_block(proc.stderr)
    assert block[0].startswith(f"lppo: error: {key}={value}: "), block
    assert block[1] == f"  where: {key}"
    assert block[2].startswith(f"  fix:   {fix}"), block
    assert len(block) == 4 and "--debug" in block[-1]
    assert "Union" not in proc.stderr and "NoneType" not in proc.stderr


def _refused_before_any_iteration(proc, run: Path, key: str) -> str:
    """The short block naming ``key`` (no traceback), and no iteration begun."""
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    block = error_block(proc.stderr)
    assert block[0].startswith(f"lppo: error: SettingError: {key}=")
    assert f"where: {key}" in block[1] and len(block) <= 3
    assert not list(run.rglob("*.ckpt"))
    assert json.loads((run / "summary.json").read_text())["iterations"] == 0
    return block[0]


@pytest.mark.parametrize("staleness", ["0", "1"])
def test_a_multi_turn_prompt_longer_than_max_tokens_is_refused_at_setup(
    tmp_path: Path, staleness: str
) -> None:
    """It failed inside iteration 1 with a 75-line traceback (from the rollout process at
    staleness 1); the run plan measures the task's longest prompt before anything starts."""
    run = tmp_path / "run"
    proc = lppo_cli(
        "fit", "--config", str(ROOT / "configs" / "multiturn.yaml"),
        "--trainer.default_root_dir", str(run),
        "--model.task.init_args.prompt", "d" * 20 + ":",
        "--model.rollout.max_staleness", staleness,
    )  # fmt: skip
    line = _refused_before_any_iteration(proc, run, "model.engine.init_args.max_tokens")
    assert "22 tokens" in line and "at least 25" in line


def test_a_tool_environment_the_character_tokenizer_cannot_express_is_refused_at_setup(
    tmp_path: Path,
) -> None:
    """configs/tiny.yaml's character tokenizer with ToolEnvironment: the Hermes system prompt
    and every call would be <unk> (accepted before; the first call then failed mid-run)."""
    engine = {
        "class_path": "lppo.rollout.MultiTurnEngine",
        "init_args": {
            "engine": {"class_path": "lppo.rollout.HFGenerateEngine"},
            "environment": {
                "class_path": "lppo.envs.ToolEnvironment",
                "init_args": {
                    "tools": ["examples.smollm2.calculator.calculator"],
                    "template": "hermes",
                    "assistant_prefix": '<tool_call>\n{"name": "calculator"',
                },
            },
            "max_tokens": 2048,
        },
    }
    extra = tmp_path / "tools.yaml"
    extra.write_text(yaml.safe_dump({"model": {"engine": engine}}))
    run = tmp_path / "run"
    proc = lppo_cli(*fit(run, "--config", str(extra), "--data.max_tokens_per_chunk", "4096"))
    key = "model.engine.init_args.environment.init_args.template"
    line = _refused_before_any_iteration(proc, run, key)
    assert "cannot express a tool call" in line and "(to <unk>)" in line


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (  # the character tokenizer has no chat template
            ["--model.engine", "lppo.rollout.HFGenerateEngine",
             "--model.engine.init_args.chat_template", "true"],
            "SettingError: model.engine.init_args.chat_template=true but the tokenizer has no",
        ),
        (  # dynamic sampling drops every group of one sample
            ["--model.rollout.dynamic_sampling_rounds", "2",
             "--model.rollout.samples_per_prompt", "1"],
            "SettingError: model.rollout.dynamic_sampling_rounds=2 with",
        ),
    ],
)  # fmt: skip
def test_engine_and_sampling_mistakes_stop_at_setup(tmp_path, extra, message):
    proc = lppo_cli(*fit(tmp_path / "run", *extra))
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert message in error_block(proc.stderr)[0]
    assert not (tmp_path / "run" / "checkpoints").exists()
