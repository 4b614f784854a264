"""``data.share_prompts``: rows answering one prompt compute it once, with the same results.

Every shared result is compared with the per-row forward on the same weights, in float64:
log-probs, entropy, values and every gradient (materialized and vocabulary-sliced heads,
``trim_prompt``, temperature, SDPA and eager attention, GPT-2 and Llama), whole streamed
steps under three chunk budgets, and a ``configs/grpo.yaml`` fit in 64-true.

Hugging Face's ``LlamaRMSNorm`` computes in float32 whatever the model's dtype. With shared
prompts a prompt's gradient is summed over its rows *before* that norm's backward (per row:
after), so stock Llama agrees to float32 round-off only; with the norm in float64
(:func:`f64_norms`) it agrees to float64 round-off like GPT-2, whose LayerNorm keeps the dtype.
Two data-parallel ranks: ``tests/modules/test_data_parallel.py``.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from _builders import filled_store, shared_prompt_rows, tiny_backbone, tiny_lm
from test_parity import CapturingActor, CapturingCritic, assert_grads_close, rel_close, streamed
from test_vocab import actor, assert_rel, grads, grpo_fit, llama
from torch import nn
from transformers.models.llama import modeling_llama

from lppo.algorithms import ClippedPPO
from lppo.iteration.chunks import read_chunk
from lppo.iteration.data_settings import DataSettings
from lppo.iteration.planner import ChunkPlanner
from lppo.modules import CriticModule
from lppo.modules.shared import (
    AUTO_MIN_PROMPT_CHARS,
    decide,
    float32_inside,
    pack_shared,
    resolve_share_prompts,
    unshareable,
)
from lppo.types import ADVANTAGES, OLD_LOGPROBS, RETURNS, VALUES, Chunk
from lppo.validation import SettingError

GRPO = Path(__file__).resolve().parents[2] / "configs" / "grpo.yaml"
ACTOR_READS = [OLD_LOGPROBS, ADVANTAGES]


def _f64_rms_norm(self: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))


@pytest.fixture
def f64_norms(monkeypatch):
    """Llama's RMSNorm in the model's dtype (Hugging Face's casts to float32)."""
    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", _f64_rms_norm)


def grouped_chunk(seed: int = 3) -> Chunk:
    """Three prompts answered 3, 2 and 1 times, rows shuffled, one multi-turn-like row."""
    store = filled_store(shared_prompt_rows([3, 2, 1], seed=seed))
    order = [4, 0, 5, 2, 1, 3]
    return read_chunk(store, order, [])


def compare(plain, shared, c: Chunk) -> None:
    """Log-probs and entropy where the loss reads them, and the gradients of a mix."""
    lp, ent = plain.token_logprobs(c, with_entropy=True)
    lq, eq = shared.token_logprobs(c, with_entropy=True)
    mask = c.response_mask
    assert_rel(lq[mask], lp[mask])
    assert_rel(eq[mask], ent[mask])
    weights = torch.linspace(-1.0, 2.0, int(mask.sum()), dtype=lp.dtype)
    ((lp[mask] * weights).sum() + (ent[mask] * weights.flip(0)).sum()).backward()
    ((lq[mask] * weights).sum() + (eq[mask] * weights.flip(0)).sum()).backward()
    want, got = grads(plain), grads(shared)
    assert got.keys() == want.keys() and want
    for name in want:
        assert_rel(got[name], want[name])


def pair(model: nn.Module, vocab_chunk: int, temperature: float = 1.0, **kw):
    plain = actor(model, vocab_chunk, temperature, **kw)
    shared = actor(model, vocab_chunk, temperature, **kw)
    shared.share_prompts = True
    return plain, shared


# ----------------------------------------------------------------------------- the pack
def test_the_pack_keeps_each_prompt_once_and_every_token_in_its_place():
    c = grouped_chunk()
    pack = pack_shared(c.input_ids, c.attention_mask, c.response_mask)
    assert pack is not None
    rows = [int(n) for n in c.attention_mask.sum(dim=1)]
    first = c.response_mask.int().argmax(dim=1)
    assert pack.starts.tolist() == first.tolist()
    prompts = {tuple(c.input_ids[b, : first[b]].tolist()) for b in range(len(rows))}
    assert pack.prompts.shape[0] == len(prompts) == 3
    assert int(pack.prompt_mask.sum()) == sum(len(p) for p in prompts)  # each prompt once
    assert pack.prompts.numel() + pack.rests.numel() <= c.input_ids.numel()
    tokens = torch.cat([pack.prompts.reshape(-1), pack.rests.reshape(-1)])
    for b, n in enumerate(rows):  # every chunk token read back from its place
        assert torch.equal(tokens[pack.index[b, :n]], c.input_ids[b, :n])
        prompt = pack.prompts[pack.group[b], : first[b]]
        assert torch.equal(prompt, c.input_ids[b, : first[b]])  # its group's prompt


def test_rows_without_a_common_prompt_run_as_they_are():
    c = grouped_chunk()
    single = [0, 3]  # two rows of different prompts
    ids, att, resp = (x[single] for x in (c.input_ids, c.attention_mask, c.response_mask))
    assert pack_shared(ids, att, resp) is None


# ----------------------------------------------------------------------------- the actor
@pytest.mark.parametrize("vocab_chunk", [0, 7])
@pytest.mark.parametrize("trim", [False, True])
def test_shared_llama_equals_per_row(f64_norms, vocab_chunk, trim):
    compare(*pair(llama(seed=1), vocab_chunk, 0.7, trim_prompt=trim), grouped_chunk())


@pytest.mark.parametrize("vocab_chunk", [0, 5])
def test_shared_gpt2_equals_per_row(vocab_chunk):
    compare(*pair(tiny_lm(seed=2), vocab_chunk, 1.3), grouped_chunk(seed=5))


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_stock_llama_agrees_to_float32_round_off(attention):
    """HF's float32 RMSNorm (and eager attention's float32 softmax): the gradients of a shared
    prompt, summed before them, round there."""
    model = llama(seed=1)
    model.config._attn_implementation = attention
    plain, shared = pair(model, 0, trim_prompt=False)
    c = grouped_chunk()
    lp, _ = plain.token_logprobs(c)
    lq, _ = shared.token_logprobs(c)
    lp[c.response_mask].sum().backward()
    lq[c.response_mask].sum().backward()
    assert torch.equal(lq[c.response_mask], lp[c.response_mask])  # the forward is per position
    for name, want in grads(plain).items():
        got = grads(shared)[name]
        assert (got - want).abs().max() <= 1e-5 * max(want.abs().max().item(), 1e-30), name


def test_score_shares_too():
    plain, shared = pair(tiny_lm(seed=2), 0)
    c = grouped_chunk()
    assert_rel(shared.score(c), plain.score(c))


# ----------------------------------------------------------------------------- the critic
@pytest.mark.parametrize("trim", [False, True])
def test_shared_critic_values_and_gradients_equal_per_row(f64_norms, trim):
    body = llama(seed=3).model
    critics = []
    for share in (False, True):
        critic = CriticModule(copy.deepcopy(body), trim_prompt=trim)
        critic.configure_model()
        critic.share_prompts = share
        critics.append(critic)
    c = grouped_chunk()
    (plain, shared), mask = critics, c.response_mask
    v, w = plain.values(c), shared.values(c)
    assert_rel(w[mask], v[mask])
    weights = torch.linspace(-1.0, 2.0, int(mask.sum()), dtype=v.dtype)
    (v[mask] * weights).sum().backward()
    (w[mask] * weights).sum().backward()
    for name, want in grads(plain).items():
        assert_rel(grads(shared)[name], want)


# ----------------------------------------------------------------------------- whole steps
@pytest.mark.parametrize("budget", [14, 30, 200])
def test_a_streamed_step_is_the_same_under_any_chunk_budget(budget):
    """Sample-order chunks, shared, against length-sorted chunks per row (3 prompts × 4)."""
    store = filled_store(shared_prompt_rows([4, 4, 4], seed=budget))
    results = []
    for share in (False, True):
        settings = DataSettings(budget, seed=1)
        epoch = ChunkPlanner(settings, sample_order=share).plan(store.meta(), minibatches=2)
        actor_ = CapturingActor(
            tiny_lm(seed=0), objective=ClippedPPO(), entropy_coef=0.01, max_grad_norm=None
        )
        actor_.configure_model()
        actor_.share_prompts = share
        critic = CapturingCritic(tiny_backbone(seed=0), value_clip=0.2, max_grad_norm=None)
        critic.share_prompts = share
        results.append(
            (
                streamed(actor_, store, epoch.steps, ACTOR_READS),
                streamed(critic, store, epoch.steps, [VALUES, RETURNS]),
            )
        )
    for want, got in zip(*results, strict=True):
        for (ws, wg), (gs, gg) in zip(want, got, strict=True):
            assert gs.stepped and ws.stepped
            assert rel_close(gs.grad_norm, ws.grad_norm)
            assert_grads_close(gg, wg)
            for key, value in ws.metrics.items():
                assert rel_close(gs.metrics[key], value), key


def test_sample_order_keeps_a_prompts_rows_together_within_the_budget():
    store = filled_store(shared_prompt_rows([4, 4, 4], seed=1))
    meta = store.meta()
    settings = DataSettings(40, shuffle=False)
    [step] = ChunkPlanner(settings, sample_order=True).plan(meta).steps
    flat = [i for chunk in step.chunks for i in chunk]
    assert flat == sorted(flat)
    for chunk in step.chunks:
        assert len(chunk) * max(meta.lengths[i] for i in chunk) <= 40
    [plain] = ChunkPlanner(settings).plan(meta).steps
    assert sorted(i for c in plain.chunks for i in c) == flat


def test_a_grpo_fit_in_64_true_trains_the_same_weights_shared_or_not(f64_norms, tmp_path: Path):
    def fit(name: str, setting: str) -> dict[str, torch.Tensor]:
        cli = grpo_fit(tmp_path / name, f"--data.share_prompts={setting}")
        assert cli.model.actor.share_prompts is (setting == "true")
        assert cli.datamodule.planner.sample_order is (setting == "true")
        return {n: p.detach().clone() for n, p in cli.model.actor.named_parameters()}

    plain, shared = fit("plain", "false"), fit("shared", "true")
    for name, want in plain.items():
        assert want.dtype == torch.float64
        assert (shared[name] - want).abs().max() <= 1e-9 * max(want.abs().max().item(), 1e-30)
    assert any(not torch.equal(shared[n], w) for n, w in plain.items())  # not the same path


# ----------------------------------------------------------------------------- settings
@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_a_bad_setting_names_the_key(bad):
    with pytest.raises(SettingError, match=r"data\.share_prompts"):
        DataSettings(share_prompts=bad)


def test_true_where_a_model_cannot_share_is_refused_and_auto_turns_off():
    reasons = {"model.actor": None, "model.critic": "it needs a llama/... model"}
    with pytest.raises(SettingError, match=r"data\.share_prompts=true: model\.critic"):
        resolve_share_prompts(True, reasons)
    assert resolve_share_prompts("auto", reasons) is False
    assert resolve_share_prompts("auto", {"model.actor": None}) is True


def test_auto_stays_off_where_a_float64_run_would_round_at_float32():
    model = llama()  # float64, Hugging Face's LlamaRMSNorm
    assert "LlamaRMSNorm computes in float32" in float32_inside(model)
    assert float32_inside(model.float()) is None  # float32: the run's own round-off
    assert float32_inside(tiny_lm()) is None  # GPT-2's LayerNorm keeps float64
    inexact = {"model.actor": float32_inside(llama())}
    assert resolve_share_prompts("auto", {"model.actor": None}, inexact) is False
    assert resolve_share_prompts(True, {"model.actor": None}, inexact) is True


def test_auto_shares_only_where_prompts_are_long_enough_to_pay():
    model = actor(llama().float(), 0)
    assert decide("auto", [model], prompt_chars=AUTO_MIN_PROMPT_CHARS) is True
    assert model.share_prompts is True
    assert decide("auto", [model], prompt_chars=AUTO_MIN_PROMPT_CHARS - 1) is False
    assert model.share_prompts is False
    assert decide("auto", [model], prompt_chars=10_000, samples_per_prompt=1) is False
    assert decide(True, [model], prompt_chars=5) is True  # asked for: shared


def test_models_that_cannot_share_are_named():
    gemma = llama()
    gemma.config.model_type = "gemma3_text"
    assert "gemma3_text" in unshareable(gemma)
    eager = llama()
    assert unshareable(eager) is None
    eager.config._attn_implementation = "flash_attention_2"
    assert "flash_attention_2" in unshareable(eager)

    class Custom(type(actor(llama(), 0))):
        def logits(self, chunk, start=0):
            return super().logits(chunk, start)

    custom = Custom(llama())
    custom.configure_model()
    assert "overrides logits" in custom.unshareable()
