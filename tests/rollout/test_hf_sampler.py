"""The Hugging Face engine draws tokens with the Gumbel-max trick (lppo.rollout.hf.sampler)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import TopKLogitsWarper, TopPLogitsWarper

from lppo.modules.models import HFCausalLM
from lppo.modules.tokenizer import build_char_tokenizer
from lppo.rollout import HFGenerateEngine, RolloutSettings
from lppo.rollout.hf.sampler import GumbelSampler, gumbel_obstacles
from lppo.tasks import CopyTask

TASK = CopyTask(min_length=1, max_length=8)
TOK = build_char_tokenizer(TASK.vocabulary())


def _frequencies(sampler: GumbelSampler, logits: torch.Tensor, draws: int) -> torch.Tensor:
    rows = logits.expand(draws, -1).clone()
    tokens = sampler(torch.zeros((draws, 1), dtype=torch.long), rows).argmax(dim=-1)
    return torch.bincount(tokens, minlength=logits.shape[-1]).double() / draws


@pytest.mark.parametrize(
    ("settings", "warper"),
    [
        ({"temperature": 1.0}, None),
        ({"temperature": 0.6}, None),
        ({"temperature": 1.3, "top_k": 3}, TopKLogitsWarper(top_k=3)),
        ({"temperature": 1.0, "top_p": 0.8}, TopPLogitsWarper(top_p=0.8)),
    ],
)
def test_draws_follow_the_warped_softmax(settings, warper) -> None:
    """200,000 seeded draws: each token's frequency within 0.006 of its probability (>5σ)."""
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    sampler = GumbelSampler(RolloutSettings(**settings))
    freq = _frequencies(sampler, logits, 200_000)
    scaled = logits / settings["temperature"]
    expected = scaled if warper is None else warper(None, scaled)
    probs = torch.softmax(expected.double(), dim=-1)[0]
    assert (freq - probs).abs().max() < 0.006, (freq, probs)
    assert freq[probs == 0].sum() == 0  # a token the warper removed is never drawn
    # it records each draw (generate's argmax) and its log-prob under the warped distribution
    drawn = sampler.tokens[0]
    assert torch.equal(torch.bincount(drawn, minlength=6).double() / 200_000, freq)
    want = torch.log_softmax(expected, dim=-1)[0][drawn]
    assert torch.equal(sampler.logprobs[0], want)


def test_the_engine_samples_with_it_reproducibly_and_reports_its_scores(monkeypatch) -> None:
    """Its log-probs are the warped distribution's at the drawn tokens; it keeps no
    ``[rows, vocabulary]`` scores (``output_scores`` off)."""
    model = HFCausalLM(seed=0).build(len(TOK), TOK.pad_token_id, TOK.bos_token_id, TOK.eos_token_id)
    prompts = TASK.sample_prompts(6, random.Random(0))
    engine = HFGenerateEngine()
    engine.setup(model, TOK, RolloutSettings(max_new_tokens=5, temperature=0.8, top_k=4))
    assert engine.gumbel
    calls = []
    generate = model.generate

    def spy(*args, **kwargs):
        calls.append(kwargs["generation_config"].do_sample)
        assert not kwargs["generation_config"].output_scores
        return generate(*args, **kwargs)

    monkeypatch.setattr(model, "generate", spy)
    out = engine.generate(prompts, samples_per_prompt=2, seed=1)
    again = engine.generate(prompts, samples_per_prompt=2, seed=1)
    assert calls == [False, False]  # generate's greedy argmax over the noised scores
    for a, b in zip(out.input_ids, again.input_ids, strict=True):
        assert torch.equal(a, b)
    # gen_logprobs are those of the warped distribution: top-4 at temperature 0.8
    model.eval()
    for ids, mask, logprobs in zip(out.input_ids, out.response_mask, out.gen_logprobs, strict=True):
        with torch.no_grad():
            logits = model(ids[None]).logits[0, :-1].float() / 0.8
        warped = torch.log_softmax(TopKLogitsWarper(top_k=4)(None, logits), dim=-1)
        picked = warped.gather(-1, ids[1:, None])[:, 0]
        torch.testing.assert_close(logprobs[1:][mask[1:]], picked[mask[1:]], atol=2e-5, rtol=0)


def test_a_model_asking_for_another_warper_keeps_generates_sampling(caplog) -> None:
    model = HFCausalLM(seed=0).build(len(TOK), TOK.pad_token_id, TOK.bos_token_id, TOK.eos_token_id)
    model.generation_config.min_p = 0.1
    model.generation_config.typical_p = 0.9
    assert gumbel_obstacles(model.generation_config) == ["min_p=0.1", "typical_p=0.9"]
    engine = HFGenerateEngine()
    with caplog.at_level("INFO"):
        engine.setup(model, TOK, RolloutSettings(max_new_tokens=3))
    assert not engine.gumbel
    assert "torch.multinomial: the model's generation config sets min_p=0.1" in caplog.text
    assert engine.generation_config().do_sample
    out = engine.generate(TASK.sample_prompts(3, random.Random(0)), seed=0)
    assert len(out.completions) == 3
    plain = HFCausalLM(seed=0).build(len(TOK), TOK.pad_token_id, TOK.bos_token_id, TOK.eos_token_id)
    assert gumbel_obstacles(plain.generation_config) == []


def test_a_processor_after_the_sampler_is_caught_not_misreported() -> None:
    """``picked`` checks generate's tokens against the draws up to each row's first EOS."""
    sampler = GumbelSampler(RolloutSettings())
    torch.manual_seed(0)
    for _ in range(3):
        sampler(torch.zeros((2, 1), dtype=torch.long), torch.randn(2, 5))
    drawn = torch.stack(sampler.tokens, dim=1)
    torch.testing.assert_close(sampler.picked(drawn, None), torch.stack(sampler.logprobs, 1))
    eos = int(drawn[0, 0])
    after = drawn.clone()
    after[0, 1:] = (eos + 1) % 5  # padding after row 0's EOS: allowed
    sampler.picked(after, eos)
    changed = drawn.clone()
    changed[1, 0] = (int(drawn[1, 0]) + 1) % 5  # before any EOS (id 99 never occurs)
    with pytest.raises(RuntimeError, match="a logits processor ran after it"):
        sampler.picked(changed, 99)
    with pytest.raises(RuntimeError, match="a logits processor ran after it"):
        sampler.picked(after, None)  # without a stop token nothing may differ
