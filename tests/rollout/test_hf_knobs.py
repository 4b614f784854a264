"""HFGenerateEngine's length knobs: ``rollout.ignore_eos`` and ``rollout.min_new_tokens``."""

from __future__ import annotations

import random

import pytest
import torch

from lppo.modules.models import HFCausalLM
from lppo.modules.tokenizer import build_char_tokenizer
from lppo.rollout import HFGenerateEngine, RolloutSettings
from lppo.tasks import CopyTask

TASK = CopyTask()
TOK = build_char_tokenizer(TASK.vocabulary())
PROMPTS = TASK.sample_prompts(16, random.Random(0))


def generate(**sampling):
    model = HFCausalLM(seed=0).build(len(TOK), TOK.pad_token_id, TOK.bos_token_id, TOK.eos_token_id)
    engine = HFGenerateEngine()
    # A high temperature makes EOS (1 of ~20 tokens) likely at every step.
    engine.setup(model, TOK, RolloutSettings(temperature=50.0, **sampling))
    return engine.generate(PROMPTS, samples_per_prompt=2, seed=3)


def response(out, r):
    return out.input_ids[r][out.response_mask[r]]


def test_without_ignore_eos_responses_stop_at_eos() -> None:
    out = generate(max_new_tokens=16)
    lengths = [int(m.sum()) for m in out.response_mask]
    assert min(lengths) < 16  # the knob below is not vacuous
    for r in range(len(out)):
        eos = (response(out, r) == TOK.eos_token_id).nonzero().flatten().tolist()
        assert eos in ([], [lengths[r] - 1])


def test_ignore_eos_gives_exactly_max_new_tokens() -> None:
    # 96 tokens: long enough that every row samples EOS, so generate would stop at the last
    # row's EOS (and pad the rows after theirs) if EOS still ended a row.
    out = generate(max_new_tokens=96, ignore_eos=True)
    assert all(int(m.sum()) == 96 for m in out.response_mask)
    assert not out.truncated.any()
    inner = [(response(out, r)[:-1] == TOK.eos_token_id).any() for r in range(len(out))]
    assert any(inner)  # EOS tokens were sampled and kept as ordinary tokens
    for r in range(len(out)):  # after its first EOS a row samples on; it is not padded
        eos = (response(out, r) == TOK.eos_token_id).nonzero().flatten().tolist()
        tail = response(out, r)[eos[0] + 1 :] if eos else torch.tensor([])
        if len(tail) >= 4:
            assert not (tail == TOK.pad_token_id).all()
    assert all(lp[m].lt(0).all() for lp, m in zip(out.gen_logprobs, out.response_mask, strict=True))


def test_min_new_tokens_suppresses_early_eos() -> None:
    out = generate(max_new_tokens=16, min_new_tokens=10)
    for r in range(len(out)):
        assert not (response(out, r)[:10] == TOK.eos_token_id).any()
        assert int(out.response_mask[r].sum()) >= 10


def test_min_new_tokens_is_validated() -> None:
    with pytest.raises(ValueError, match=r"model\.rollout\.min_new_tokens=9"):
        RolloutSettings(max_new_tokens=8, min_new_tokens=9)
    with pytest.raises(ValueError, match=r"model\.rollout\.min_new_tokens=-1"):
        RolloutSettings(min_new_tokens=-1)


def test_length_sorted_batches_come_back_in_prompt_order() -> None:
    model = HFCausalLM(seed=0).build(len(TOK), TOK.pad_token_id, TOK.bos_token_id, TOK.eos_token_id)
    prompts = CopyTask(min_length=1, max_length=6).sample_prompts(12, random.Random(1))
    widths: list[list[int]] = []
    outputs = []
    for sort in (False, True):
        engine = HFGenerateEngine(batch_size=4, sort_by_length=sort)
        engine.setup(model, TOK, RolloutSettings(max_new_tokens=3))
        batch = engine._generate_batch
        seen: list[int] = []

        def record(rows, config, device, sampler, batch=batch, seen=seen):
            seen.append(max(len(r) for r in rows))
            return batch(rows, config, device, sampler)

        engine._generate_batch = record  # type: ignore[method-assign]
        outputs.append(engine.generate(prompts, samples_per_prompt=2, seed=0))
        widths.append(seen)
    assert widths[1] == sorted(widths[1]) and sum(widths[1]) < sum(widths[0])
    plain, ordered = outputs
    assert torch.equal(plain.prompt_index, ordered.prompt_index)
    assert torch.equal(plain.prompt_lengths, ordered.prompt_lengths)
    for r, p in enumerate(plain.prompt_lengths.tolist()):
        assert torch.equal(ordered.input_ids[r][:p], plain.input_ids[r][:p])
        assert not ordered.response_mask[r][:p].any() and ordered.response_mask[r][p:].all()
