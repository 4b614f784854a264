"""``HFGenerateEngine(chat_template=True)``: prompts wrapped as one user turn, BOS never doubled."""

from __future__ import annotations

import random

import pytest
import torch

from lppo.modules.models import HFCausalLM
from lppo.modules.tokenizer import build_char_tokenizer
from lppo.rollout import HFGenerateEngine, RolloutSettings
from lppo.tasks import CopyTask

TASK = CopyTask()
# Characters of the templates below, on top of the task's (unknown ones would encode to <unk>).
VOCAB = TASK.vocabulary() + "userastni:|"
WITH_BOS = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
WITHOUT_BOS = (
    "{% for m in messages %}|{{ m['role'] }}:{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}|assistant:{% endif %}"
)


def _tokenizer(template: str | None):
    tok = build_char_tokenizer(VOCAB)
    tok.chat_template = template
    return tok


def _engine(tok, **kwargs) -> HFGenerateEngine:
    model = HFCausalLM(seed=0).build(len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    engine = HFGenerateEngine(**kwargs)
    engine.setup(model, tok, RolloutSettings(max_new_tokens=4))
    return engine


def _chars(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def test_a_template_that_writes_bos_gets_exactly_one() -> None:
    tok = _tokenizer(WITH_BOS)
    # The tokenizer itself adds BOS too (add_special_tokens=True): the engine must not.
    assert tok("ab=")["input_ids"][0] == tok.bos_token_id
    engine = _engine(tok, chat_template=True)
    assert engine.prompt_text("ab=") == "<bos>user:ab=<eos>assistant:"
    ids = engine.encode_prompt("ab=")
    expected = [
        tok.bos_token_id,
        *_chars(tok, "user:ab="),
        tok.eos_token_id,
        *_chars(tok, "assistant:"),
    ]
    assert ids == expected
    assert ids.count(tok.bos_token_id) == 1
    assert tok.unk_token_id not in ids


@pytest.mark.parametrize("prepend_bos", [True, False])
def test_a_template_without_bos_gets_it_from_prepend_bos(prepend_bos: bool) -> None:
    tok = _tokenizer(WITHOUT_BOS)
    engine = _engine(tok, chat_template=True, prepend_bos=prepend_bos)
    body = _chars(tok, "|user:ab=|assistant:")
    assert engine.encode_prompt("ab=") == ([tok.bos_token_id] if prepend_bos else []) + body


def test_without_chat_template_prompts_are_encoded_as_before() -> None:
    tok = _tokenizer(WITH_BOS)
    engine = _engine(tok)
    assert engine.chat_template is False
    assert engine.prompt_text("ab=") == "ab="
    assert engine.encode_prompt("ab=") == list(tok("ab=")["input_ids"])


def test_chat_template_needs_a_tokenizer_with_one() -> None:
    with pytest.raises(ValueError, match="chat_template=true but the tokenizer has no chat"):
        _engine(_tokenizer(None), chat_template=True)


def test_generate_conditions_on_the_templated_prompt() -> None:
    tok = _tokenizer(WITH_BOS)
    engine = _engine(tok, chat_template=True)
    prompts = TASK.sample_prompts(3, random.Random(0))
    out = engine.generate(prompts, samples_per_prompt=2, seed=0)
    for r in range(len(out)):
        prompt_ids = engine.encode_prompt(prompts[int(out.prompt_index[r])].text)
        p = int(out.prompt_lengths[r])
        assert p == len(prompt_ids)
        assert out.input_ids[r][:p].tolist() == prompt_ids
        assert not out.response_mask[r][:p].any() and out.response_mask[r][p:].all()
        assert torch.all(out.gen_logprobs[r][p:] <= 0)
    # Same seed, same samples: templating is deterministic.
    again = engine.generate(prompts, samples_per_prompt=2, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(out.input_ids, again.input_ids, strict=True))
