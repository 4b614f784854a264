"""Off-policy correction in the actor: plain PPO when μ = π_old, exact under any chunking."""

from __future__ import annotations

import copy

import pytest
import torch
from _builders import filled_store, random_rows, tiny_lm
from hypothesis import given, settings
from hypothesis import strategies as st

from lppo.algorithms import ClippedPPO, OffPolicyCorrection, importance_weights, policy_loss
from lppo.iteration.chunks import iter_chunks, read_chunk
from lppo.iteration.data_settings import DataSettings
from lppo.iteration.planner import ChunkPlanner
from lppo.modules import ActorModule, shifted_logprobs
from lppo.types import ADVANTAGES, GEN_LOGPROBS, OLD_LOGPROBS

NAMES = [OLD_LOGPROBS, ADVANTAGES, GEN_LOGPROBS]


class CapturingActor(ActorModule):
    def on_before_step(self, grad_norm: float) -> None:
        self.captured = {
            n: p.grad.detach().clone() for n, p in self.named_parameters() if p.grad is not None
        }


def rows_with_behaviour(n: int, seed: int, noise: float, invalid: int = 0):
    cols = random_rows(n, seed, invalid_rows=invalid)
    g = torch.Generator().manual_seed(seed + 1)
    cols[GEN_LOGPROBS] = [
        torch.where(m, old + noise * torch.randn(len(old), generator=g, dtype=old.dtype), 0.0)
        for old, m in zip(cols[OLD_LOGPROBS], cols["response_mask"], strict=True)
    ]
    return cols


def one_step(actor: ActorModule, store, step):
    actor.begin(step)
    for chunk in iter_chunks(store, step, NAMES):
        actor.train_chunk(chunk)
    return actor.finish(), actor.captured


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_behaviour_equal_to_old_is_plain_ppo_bitwise(mode):
    cols = rows_with_behaviour(6, seed=3, noise=0.0)
    store = filled_store(cols)
    step = ChunkPlanner(DataSettings(20, seed=0)).plan(store.meta(), epoch=0).steps[0]
    plain = CapturingActor(
        tiny_lm(), lr=1e-3, max_grad_norm=None, objective=ClippedPPO(clip_high=0.28)
    )
    corrected = copy.deepcopy(plain)
    corrected.off_policy = OffPolicyCorrection(mode, cap=1.5, floor=0.9)
    want, want_grads = one_step(plain, store, step)
    got, got_grads = one_step(corrected, store, step)
    assert got.grad_norm == want.grad_norm
    for name, grad in want_grads.items():
        assert torch.equal(got_grads[name], grad), name
    for key, value in want.metrics.items():
        assert got.metrics[key] == value, key
    assert got.metrics["is_weight_mean"] == 1.0
    assert got.metrics["is_outside_fraction"] == 0.0


def merged_reference(actor: ActorModule, store, rows):
    """Independent merged batch: one padded forward, weights applied by hand."""
    chunk = read_chunk(store, rows, NAMES)
    model = copy.deepcopy(actor.model)
    out = model(input_ids=chunk.input_ids, attention_mask=chunk.attention_mask.long())
    lp, _ = shifted_logprobs(out.logits / actor.temperature, chunk.input_ids)
    terms = policy_loss(
        lp,
        chunk.old_logprobs,
        chunk.advantages,
        actor.objective.clip_low,
        actor.objective.clip_high,
    )
    iw = importance_weights(chunk.old_logprobs, chunk.gen_logprobs, actor.off_policy)
    m = chunk.response_mask
    loss = (terms.loss * iw.weight)[m].mean()
    loss.backward()
    grads = {f"model.{n}": p.grad.detach().clone() for n, p in model.named_parameters()}
    diag = {
        "loss": loss.item(),
        "is_weight_mean": iw.weight[m].mean().item(),
        "is_outside_fraction": iw.outside[m].double().mean().item(),
    }
    return diag, grads


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 8),
    data_seed=st.integers(0, 10_000),
    budget_slack=st.integers(0, 50),
    plan_seed=st.integers(0, 100),
    mode=st.sampled_from(["truncate", "mask"]),
)
def test_corrected_loss_streamed_equals_merged(n, data_seed, budget_slack, plan_seed, mode):
    cols = rows_with_behaviour(n, data_seed, noise=0.6)
    store = filled_store(cols)
    longest = max(len(t) for t in cols["input_ids"])
    epoch = ChunkPlanner(DataSettings(longest + budget_slack, seed=plan_seed)).plan(
        store.meta(), epoch=0
    )
    actor = CapturingActor(
        tiny_lm(), lr=1e-3, max_grad_norm=None, off_policy=OffPolicyCorrection(mode, cap=1.5)
    )
    want, want_grads = merged_reference(actor, store, epoch.valid_rows)
    stats, grads = one_step(actor, store, epoch.steps[0])
    for key, value in want.items():
        assert stats.metrics[key] == pytest.approx(value, rel=1e-10, abs=1e-14), key
    for name, grad in want_grads.items():
        err = (grads[name] - grad).abs().max().item()
        assert err <= 1e-10 * max(grad.abs().max().item(), 1e-30), name


def test_missing_behaviour_column_fails_clearly():
    cols = rows_with_behaviour(3, seed=0, noise=0.1)
    store = filled_store(cols)
    step = ChunkPlanner(DataSettings(40)).plan(store.meta(), epoch=0).steps[0]
    actor = ActorModule(tiny_lm(), off_policy=OffPolicyCorrection("truncate"))
    actor.begin(step)
    with pytest.raises(ValueError, match="gen_logprobs"):
        for chunk in iter_chunks(store, step, [OLD_LOGPROBS, ADVANTAGES]):
            actor.train_chunk(chunk)
    actor.abort()
