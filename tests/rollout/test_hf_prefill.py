"""HFGenerateEngine's ``prefill_tokens`` (length-sorted prefill pieces) and ``cache`` knobs."""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from _builders import sliding_window_model

from lppo.modules.models import HFCausalLM
from lppo.modules.tokenizer import build_char_tokenizer
from lppo.rollout import HFGenerateEngine, RolloutSettings
from lppo.rollout.hf.prefill import AUTO_PREFILL_TOKENS, prefill_pieces, shared_prefill_pieces
from lppo.tasks import CopyTask

TASK = CopyTask(min_length=1, max_length=12)
TOK = build_char_tokenizer(TASK.vocabulary())
PROMPTS = TASK.sample_prompts(10, random.Random(4))


def _model(dtype: str = "float64") -> transformers.PreTrainedModel:
    spec = HFCausalLM(dtype=dtype, seed=1)
    return spec.build(len(TOK), TOK.pad_token_id, TOK.bos_token_id, TOK.eos_token_id)


def _generate(model, greedy: bool = False, ignore_eos: bool = False, **knobs):
    engine = HFGenerateEngine(batch_size=8, **knobs)
    sampling = RolloutSettings(max_new_tokens=7, temperature=2.0, ignore_eos=ignore_eos)
    engine.setup(model, TOK, sampling)
    return engine.generate(PROMPTS, samples_per_prompt=2, seed=5, greedy=greedy)


def test_pieces_cover_every_row_once_within_the_budget() -> None:
    lengths = [random.Random(s).randint(1, 40) for s in range(50)]
    for budget in (1, 7, 40, 100, 10_000):
        pieces = prefill_pieces(lengths, budget)
        assert sorted(r for p in pieces for r in p) == list(range(50))
        for piece in pieces:
            width = max(lengths[r] for r in piece)
            assert len(piece) == 1 or len(piece) * width <= budget
        flat = [lengths[r] for p in pieces for r in p]
        assert flat == sorted(flat)  # shortest first, so each piece is narrow
    assert prefill_pieces(lengths, None) == [sorted(range(50), key=lambda r: lengths[r])]
    assert prefill_pieces([], 8) == []


@pytest.mark.parametrize(
    "knobs",
    [
        {"prefill_tokens": 12},
        {"cache": "static"},
        {"prefill_tokens": 12, "cache": "static"},
        {"prefill_tokens": 1},
        {},  # auto: a static cache and prefill pieces for this full-attention model
    ],
)
@pytest.mark.parametrize("ignore_eos", [False, True])
def test_samples_equal_the_one_pass_prefill(knobs, ignore_eos) -> None:
    """Same tokens, texts and log-probs (float64: round-off never flips a sample)."""
    model = _model()
    base = _generate(model, ignore_eos=ignore_eos, prefill_tokens=None, cache="dynamic")
    out = _generate(model, ignore_eos=ignore_eos, **knobs)
    assert len({len(ids) for ids in base.input_ids}) > 3  # the prompts' lengths vary
    for a, b in zip(out.input_ids, base.input_ids, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(out.gen_logprobs, base.gen_logprobs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)
    assert out.completions == base.completions
    assert torch.equal(out.truncated, base.truncated)
    for a, b in zip(out.response_mask, base.response_mask, strict=True):
        assert torch.equal(a, b)


def test_greedy_float32_equals_the_one_pass_prefill() -> None:
    model = _model("float32")
    base = _generate(model, greedy=True, prefill_tokens=None, cache="dynamic")
    out = _generate(model, greedy=True, prefill_tokens=16, cache="static")
    for a, b in zip(out.input_ids, base.input_ids, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(out.gen_logprobs, base.gen_logprobs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_the_prefill_runs_in_narrow_pieces() -> None:
    """The knob is not vacuous: the prefill forwards are narrower than the padded batch."""
    model = _model()
    widths: list[tuple[int, int]] = []
    hook = model.register_forward_pre_hook(
        lambda _m, _a, kw: widths.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    try:
        _generate(model, prefill_tokens=12)
    finally:
        hook.remove()
    prefill = [w for w in widths if w[1] > 1]  # decode steps feed one column
    assert len(prefill) > 2
    assert all(rows * width <= 12 or rows == 1 for rows, width in prefill)
    longest = max(len(TOK(p.text)["input_ids"]) for p in PROMPTS) + 1  # + BOS
    assert min(width for _, width in prefill) < longest - 1


def test_each_distinct_prompt_is_prefilled_once() -> None:
    """samples_per_prompt=2: the prefill forwards hold each prompt once, the cache every row."""
    model = _model()
    rows: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda _m, _a, kw: (
            rows.append(kw["input_ids"].shape[0]) if kw["input_ids"].shape[1] > 1 else None
        ),
        with_kwargs=True,
    )
    try:
        _generate(model, prefill_tokens=10_000)
    finally:
        hook.remove()
    distinct = len({p.text for p in PROMPTS})
    assert rows and sum(rows) == distinct  # batch_size 8 of 20 rows: 3 generate calls
    pieces, sources = shared_prefill_pieces([[1, 2], [3], [1, 2], [3], [4, 5]], None)
    assert pieces == [[1, 0, 4]] and sources == [0, 1, 0, 1, 4]


def test_sliding_window_models_are_refused_with_the_fix(caplog: pytest.LogCaptureFixture) -> None:
    model = sliding_window_model(len(TOK))
    for knobs in ({"prefill_tokens": 64}, {"cache": "static"}):
        engine = HFGenerateEngine(**knobs)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"prefill_tokens.*SlidingWindow.*prefill_tokens: nu"):
            engine.setup(model, TOK, RolloutSettings(max_new_tokens=3))
    engine = HFGenerateEngine()  # auto: a dynamic cache and a one-pass prefill here
    with caplog.at_level("INFO"):
        engine.setup(model, TOK, RolloutSettings(max_new_tokens=3))
    assert (engine.cache_kind, engine.prefill_budget) == ("dynamic", None)
    assert "cache=auto: dynamic (a DynamicSlidingWindowLayer layer)" in caplog.text
    assert "prefill_tokens=auto: one pass (a DynamicSlidingWindowLayer layer)" in caplog.text


def test_auto_is_a_static_cache_and_prefill_pieces_for_full_attention() -> None:
    engine = HFGenerateEngine()
    assert (engine.cache, engine.prefill_tokens) == ("auto", "auto")
    engine.setup(_model(), TOK, RolloutSettings(max_new_tokens=3))
    assert (engine.cache_kind, engine.prefill_budget) == ("static", AUTO_PREFILL_TOKENS)
    explicit = HFGenerateEngine(prefill_tokens=None)
    explicit.setup(_model(), TOK, RolloutSettings(max_new_tokens=3))
    assert explicit.prefill_budget is None


def test_knobs_are_validated() -> None:
    with pytest.raises(ValueError, match=r"model\.engine\.init_args\.prefill_tokens=0"):
        HFGenerateEngine(prefill_tokens=0)
    with pytest.raises(ValueError, match=r"model\.engine\.init_args\.cache='paged'"):
        HFGenerateEngine(cache="paged")  # type: ignore[arg-type]
