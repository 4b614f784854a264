"""``cache: static`` decodes over the filled part of the cache only (rollout.hf_attention)."""

from __future__ import annotations

import random

import pytest
import torch

import lppo.rollout.hf.attention as hf_attention
from lppo.modules.models import HFCausalLM
from lppo.modules.tokenizer import build_char_tokenizer
from lppo.rollout import HFGenerateEngine, RolloutSettings
from lppo.tasks import CopyTask

TASK = CopyTask(min_length=1, max_length=12)
TOK = build_char_tokenizer(TASK.vocabulary())
PROMPTS = TASK.sample_prompts(6, random.Random(2))
NEW_TOKENS = 9


def _generate(model, cache: str, ignore_eos: bool = True):
    engine = HFGenerateEngine(cache=cache)  # type: ignore[arg-type]
    settings = RolloutSettings(max_new_tokens=NEW_TOKENS, temperature=1.5, ignore_eos=ignore_eos)
    engine.setup(model, TOK, settings)
    return engine.generate(PROMPTS, samples_per_prompt=2, seed=3)


def _model(dtype: str = "float64"):
    spec = HFCausalLM(dtype=dtype, seed=3)
    return spec.build(len(TOK), TOK.pad_token_id, TOK.bos_token_id, TOK.eos_token_id)


@pytest.mark.parametrize("ignore_eos", [True, False])
def test_static_decode_reads_only_the_filled_part_and_samples_alike(monkeypatch, ignore_eos):
    """Each decode step's keys end at the newest column; samples equal the full read's."""
    model = _model()
    assert model.config._attn_implementation == "sdpa"
    full = _generate(model, "dynamic", ignore_eos)
    key_lengths: list[tuple[int, int]] = []
    inner = hf_attention.sdpa_attention_forward

    def spy(module, query, key, value, mask, **kwargs):
        if module.layer_idx == 0:
            key_lengths.append((query.shape[-2], key.shape[-2]))
        return inner(module, query, key, value, mask, **kwargs)

    monkeypatch.setattr(hf_attention, "sdpa_attention_forward", spy)
    cut = _generate(model, "static", ignore_eos)
    decode = [k for q, k in key_lengths if q == 1]
    rows = zip(cut.input_ids, cut.response_mask, strict=True)
    width = max(len(ids) - int(mask.sum()) for ids, mask in rows)
    # one step per new token (the first feeds the last prompt column), each one column longer
    assert decode == list(range(width, width + NEW_TOKENS))
    assert model.config._attn_implementation == "sdpa"  # switched back after generate
    for a, b in zip(cut.input_ids, full.input_ids, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(cut.gen_logprobs, full.gen_logprobs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    assert cut.completions == full.completions


def test_other_attention_implementations_read_the_whole_cache() -> None:
    model = _model("float32")
    model.set_attn_implementation("eager")
    assert not hf_attention.reads_filled_part(model)
    with hf_attention.filled_part_decode(model):
        assert model.config._attn_implementation == "eager"
    sdpa = _model("float32")
    with hf_attention.filled_part_decode(sdpa):
        assert sdpa.config._attn_implementation == hf_attention.IMPLEMENTATION
    assert sdpa.config._attn_implementation == "sdpa"
