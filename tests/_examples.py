"""The real-model examples (examples/smollm2, examples/gemma3) as the tests load and shorten them.

``convert`` is ``examples/smollm2/convert.py`` (both families) and ``smollm2_task`` the task
module every recipe's ``class_path`` names; both are imported from their files, without the
folder on ``sys.path``.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "smollm2"
#: The second family's recipe (Gemma 3 270M), relative to EXAMPLE, on the same task module.
GEMMA_RECIPE = "../gemma3/grpo.yaml"


def _load(name: str, file: str) -> ModuleType:
    """Import ``examples/smollm2/<file>`` as ``name`` (once)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLE / file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


convert = _load("smollm2_convert", "convert.py")
# The name the configs' class_path (smollm2_task.ChatArithmeticTask) imports.
smollm2_task = _load("smollm2_task", "smollm2_task.py")


def missing(*modules: tuple[str, str]) -> list[str]:
    """``"dist (import mod)"`` for each ``(mod, dist)`` not installed, and the loader's."""
    needed = (*modules, ("gguf", "gguf"), ("accelerate", "accelerate"))
    return [f"{d} (import {m})" for m, d in needed if importlib.util.find_spec(m) is None]


def recipe(
    name: str, converted: Path, run_dir: Path, iterations: int = 2, held_out: int = 12
) -> dict:
    """``examples/smollm2/<name>``'s short form: ``iterations`` of 8 samples, ``held_out``
    problems evaluated after each, the model read from ``converted``, no checkpoint
    (1.6-3.2 GB), the export kept."""
    config = yaml.safe_load((EXAMPLE / name).read_text())
    trainer, model = config["trainer"], config["model"]
    trainer.update(max_epochs=iterations, default_root_dir=str(run_dir))
    callbacks = {c["class_path"].rsplit(".", 1)[-1]: c for c in trainer["callbacks"]}
    callbacks["Evaluation"]["init_args"].update(num_prompts=held_out, every_n_iterations=1)
    if "IterationCheckpoint" in callbacks:
        callbacks["IterationCheckpoint"]["init_args"]["every_n_iterations"] = 1000
    model["tokenizer_path"] = str(converted)
    model["actor"]["init_args"]["model"]["init_args"]["pretrained_path"] = str(converted)
    if model["critic"] is not None:
        model["critic"]["init_args"]["backbone"]["init_args"]["pretrained_path"] = str(converted)
    model["rollout"].update(prompts_per_iteration=2, samples_per_prompt=4)
    return config


def check_short_form(
    name: str, converted: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fit ``name``'s short form (2 iterations) and check its evaluations and its export."""
    from transformers import AutoModelForCausalLM

    from lppo.run.cli import run

    monkeypatch.syspath_prepend(str(EXAMPLE))  # class_path: smollm2_task.ChatArithmeticTask
    run_dir = tmp_path / "run"
    config = tmp_path / Path(name).name
    config.write_text(yaml.safe_dump(recipe(name, converted, run_dir)))
    threads = torch.get_num_threads()
    try:
        cli = run(["fit", "--config", str(config)])
    finally:
        torch.set_num_threads(threads)
    assert cli.trainer.current_epoch == 2
    history = cli.model.run_log.evaluations["eval"]
    assert [h["iteration"] for h in history] == [0, 1, 2]  # before, and after each iteration
    for entry in history:
        assert entry["pass@1_ci95_low"] <= entry["pass@1"] <= entry["pass@1_ci95_high"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["evaluation"]["eval"]["iteration"] == 2
    policy = AutoModelForCausalLM.from_pretrained(run_dir / "hf" / "policy")
    exported = policy.state_dict()
    trained = cli.model.actor.model.state_dict()
    assert all(torch.equal(exported[k], trained[k]) for k in trained if k in exported)
    start = AutoModelForCausalLM.from_pretrained(converted).state_dict()
    assert any(not torch.equal(start[k], exported[k]) for k in start), "no weight moved"
