import random
import time

import pytest
import torch
from transformers import TemperatureLogitsWarper, TopPLogitsWarper

from lppo.modules.models import HFCausalLM
from lppo.modules.tokenizer import build_char_tokenizer
from lppo.rollout import (
    TRUNCATED,
    GenerationOutput,
    HFGenerateEngine,
    RolloutEngine,
    RolloutSettings,
    score,
    to_rollout,
)
from lppo.tasks import CopyTask

TASK = CopyTask()
TOK = build_char_tokenizer(TASK.vocabulary())


def _model(arch: str = "llama", seed: int = 0):
    return HFCausalLM(architecture=arch, seed=seed).build(
        len(TOK), TOK.pad_token_id, TOK.bos_token_id, TOK.eos_token_id
    )


def _engine(model, batch_size=None, **sampling) -> HFGenerateEngine:
    """An engine set up on ``model`` with ``RolloutSettings(**sampling)``."""
    engine = HFGenerateEngine(batch_size=batch_size)
    engine.setup(model, TOK, RolloutSettings(**sampling))
    return engine


@pytest.fixture(scope="module")
def llama():
    return _model("llama")


def _prompts(n: int, seed: int = 0):
    return TASK.sample_prompts(n, random.Random(seed))


def _teacher_forced(model, ids: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0):
    """Reference logprobs per the lppo.types convention, with the same processors."""
    with torch.no_grad():
        logits = model(ids[None]).logits[0, :-1].float()
    scores = TemperatureLogitsWarper(temperature)(None, logits) if temperature != 1.0 else logits
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    ref = torch.zeros(len(ids))
    ref[1:] = torch.log_softmax(scores, -1).gather(1, ids[1:, None]).squeeze(1)
    return ref


def _check_structure(out: GenerationOutput, n_prompts: int, k: int, max_new: int):
    assert len(out) == n_prompts * k == len(out.completions)
    assert out.prompt_index.tolist() == [i for i in range(n_prompts) for _ in range(k)]
    for r in range(len(out)):
        ids, mask, lp = out.input_ids[r], out.response_mask[r], out.gen_logprobs[r]
        p = int(out.prompt_lengths[r])
        assert ids.dtype == torch.int64 and mask.dtype == torch.bool and lp.dtype == torch.float32
        assert ids.shape == mask.shape == lp.shape
        assert not mask[:p].any() and mask[p:].all() and not mask[0]
        assert torch.all(lp[:p] == 0) and torch.all(lp[p:] <= 0)
        n = len(ids) - p
        assert 1 <= n <= max_new
        eos = (ids[p:] == TOK.eos_token_id).nonzero().flatten().tolist()
        if out.truncated[r]:
            assert eos == [] and n == max_new
        else:
            assert eos == [n - 1]
        text_ids = ids[p:] if out.truncated[r] else ids[p:-1]
        assert out.completions[r] == TOK.decode(text_ids, skip_special_tokens=True)
        assert ids[0] == TOK.bos_token_id


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_logprobs_match_teacher_forcing(arch):
    model = _model(arch)
    engine = _engine(model, max_new_tokens=12)
    prompts = _prompts(6)
    out = engine.generate(prompts, samples_per_prompt=3, seed=1)
    _check_structure(out, 6, 3, 12)
    assert out.truncated.any() and not out.truncated.all()
    for ids, mask, lp in zip(out.input_ids, out.response_mask, out.gen_logprobs, strict=True):
        ref = torch.where(mask, _teacher_forced(model, ids), torch.zeros(len(ids)))
        torch.testing.assert_close(lp, ref, atol=1e-4, rtol=0)


def test_logprobs_follow_temperature_and_top_p(llama):
    engine = _engine(llama, max_new_tokens=8, temperature=0.7, top_p=0.9)
    out = engine.generate(_prompts(4), samples_per_prompt=2, seed=5)
    _check_structure(out, 4, 2, 8)
    for ids, mask, lp in zip(out.input_ids, out.response_mask, out.gen_logprobs, strict=True):
        ref = _teacher_forced(llama, ids, temperature=0.7, top_p=0.9)
        ref = torch.where(mask, ref, torch.zeros_like(ref))
        torch.testing.assert_close(lp, ref, atol=1e-4, rtol=0)


def same(x: GenerationOutput, y: GenerationOutput) -> bool:
    return len(x) == len(y) and all(
        torch.equal(u, v) for u, v in zip(x.input_ids, y.input_ids, strict=True)
    )


def test_seeding(llama):
    prompts = _prompts(5)
    rng = torch.get_rng_state()
    a, b = _engine(llama), _engine(llama)
    a1, a2 = a.generate(prompts, 2, seed=3), a.generate(prompts, 2, seed=4)
    b1 = b.generate(prompts, 2, seed=3)
    assert torch.equal(rng, torch.get_rng_state())
    assert same(a1, b1)
    assert not same(a1, a2)
    assert same(a.generate(prompts, 2, seed=9), b.generate(prompts, 2, seed=9))


def test_left_padding_does_not_change_greedy_outputs(llama):
    engine = _engine(llama, max_new_tokens=6)
    prompts = [TASK.make_prompt("a"), TASK.make_prompt("abcdefgh"), TASK.make_prompt("hg")]
    batched = engine.generate(prompts, greedy=True)
    for i, p in enumerate(prompts):
        alone = engine.generate([p], greedy=True)
        assert torch.equal(alone.input_ids[0], batched.input_ids[i])
        torch.testing.assert_close(
            alone.gen_logprobs[0], batched.gen_logprobs[i], atol=1e-5, rtol=0
        )
    micro = _engine(llama, batch_size=2, max_new_tokens=6).generate(prompts, greedy=True)
    assert same(micro, batched)


def test_restores_training_mode_and_syncs_weights(llama):
    other = _model(seed=1)
    engine = _engine(_model(), max_new_tokens=4)
    assert isinstance(engine, RolloutEngine)
    engine.model.train()
    engine.generate(_prompts(2))
    assert engine.model.training
    engine.sync_from(other, version=3)
    assert engine.weights_version == 3
    assert all(
        torch.equal(u, v)
        for u, v in zip(engine.model.parameters(), other.parameters(), strict=True)
    )
    engine.sync_from(engine.model, version=4)  # shared model: only the version moves
    assert engine.weights_version == 4


def test_to_rollout_and_score(llama):
    prompts = _prompts(4)
    out = _engine(llama, max_new_tokens=5).generate(prompts, samples_per_prompt=2)
    rewards = score(TASK, prompts, out)
    assert rewards.shape == (8,) and rewards.dtype == torch.float64
    assert ((rewards >= 0) & (rewards <= 1)).all()
    rollout = to_rollout(out, rewards)
    assert len(rollout) == 8
    assert torch.equal(rollout.prompt_index, out.prompt_index)
    assert [bool(t) for t in rollout.extras[TRUNCATED]] == out.truncated.tolist()
    cols = rollout.columns()
    assert len(cols["input_ids"]) == len(cols["reward"]) == 8
    assert TRUNCATED not in to_rollout(out, rewards, include_truncated=False).extras
    with pytest.raises(ValueError):
        to_rollout(out, rewards[:3])


def test_generation_speed(llama):
    engine = _engine(llama, max_new_tokens=16)
    prompts = _prompts(64)
    engine.generate(prompts[:2])  # warm-up
    start = time.perf_counter()
    out = engine.generate(prompts)
    elapsed = time.perf_counter() - start
    tokens = sum(int(m.sum()) for m in out.response_mask)
    print(f"\nHFGenerateEngine: 64 prompts x <=16 new tokens: {elapsed:.3f}s ({tokens} tokens)")


def test_float64_generation_with_left_padding():
    """Fully masked left-padding rows must not turn a float64 model's logits into NaN."""
    model = HFCausalLM(dtype="float64", seed=2).build(
        len(TOK), TOK.pad_token_id, TOK.bos_token_id, TOK.eos_token_id
    )
    prompts = [TASK.make_prompt("a"), TASK.make_prompt("abcdefgh"), TASK.make_prompt("hg")]
    out = _engine(model, max_new_tokens=6).generate(prompts, samples_per_prompt=2, seed=0)
    _check_structure(out, 3, 2, 6)
    for ids, mask, lp in zip(out.input_ids, out.response_mask, out.gen_logprobs, strict=True):
        assert torch.isfinite(lp).all()
        ref = torch.where(mask, _teacher_forced(model, ids).float(), torch.zeros(len(ids)))
        torch.testing.assert_close(lp, ref, atol=1e-5, rtol=0)
