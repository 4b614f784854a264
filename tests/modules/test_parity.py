"""The central invariant: streamed chunks == one merged batch, to float64 round-off."""

from __future__ import annotations

import copy

import pytest
import torch
from _builders import filled_store, random_rows, tiny_backbone, tiny_lm
from hypothesis import given
from hypothesis import strategies as st

from lppo.algorithms import ClippedPPO, policy_loss, value_loss
from lppo.iteration.chunks import iter_chunks, read_chunk
from lppo.iteration.data_settings import DataSettings
from lppo.iteration.planner import ChunkPlanner
from lppo.modules import ActorModule, CriticModule, shifted_logprobs
from lppo.types import ADVANTAGES, OLD_LOGPROBS, RETURNS, VALUES

RTOL = 1e-10


class GradCapture:
    """Mixin recording the complete gradients handed to the optimizer."""

    def on_before_step(self, grad_norm: float) -> None:
        self.captured = {
            n: p.grad.detach().clone() for n, p in self.named_parameters() if p.grad is not None
        }


class CapturingActor(GradCapture, ActorModule):
    pass


class CapturingCritic(GradCapture, CriticModule):
    pass


def rel_close(a: float, b: float, tol: float = RTOL) -> bool:
    return abs(a - b) <= tol * max(abs(a), abs(b), 1e-300) or a == b


def assert_grads_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        g, w = got[name], want[name]
        scale = w.abs().max().item()
        err = (g - w).abs().max().item()
        assert err <= RTOL * max(scale, 1e-30), f"{name}: max err {err:.3e} vs scale {scale:.3e}"


def streamed(module, store, plan_steps, names):
    results = []
    for step in plan_steps:
        module.begin(step)
        for chunk in iter_chunks(store, step, names):
            module.train_chunk(chunk)
        results.append((module.finish(), module.captured))
    return results


def merged_actor_reference(actor: ActorModule, store, rows):
    """Independent reference: one padded batch of all valid rows, plain masked means."""
    chunk = read_chunk(store, rows, [OLD_LOGPROBS, ADVANTAGES])
    model = copy.deepcopy(actor.model)
    out = model(input_ids=chunk.input_ids, attention_mask=chunk.attention_mask.long())
    logits = out.logits / actor.temperature
    lp, logp = shifted_logprobs(logits, chunk.input_ids)
    terms = policy_loss(
        lp,
        chunk.old_logprobs,
        chunk.advantages,
        actor.objective.clip_low,
        actor.objective.clip_high,
        actor.objective.dual_clip,
    )
    entropy = torch.nn.functional.pad(-(logp.exp() * logp).sum(-1), (1, 0))
    m = chunk.response_mask
    loss = (terms.loss - actor.entropy_coef * entropy)[m].mean()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    norm = torch.sqrt(sum(g.square().sum() for g in grads.values())).item()
    diag = {
        "loss": loss.item(),
        "policy_loss": terms.loss[m].mean().item(),
        "clip_fraction": terms.clipped[m].double().mean().item(),
        "approx_kl": terms.approx_kl[m].mean().item(),
        "entropy": entropy[m].mean().item(),
        "ratio_min": terms.ratio[m].min().item(),
        "ratio_max": terms.ratio[m].max().item(),
    }
    return diag, {f"model.{n}": g for n, g in grads.items()}, norm


@given(
    n=st.integers(1, 9),
    data_seed=st.integers(0, 10_000),
    budget_slack=st.integers(0, 60),
    plan_seed=st.integers(0, 100),
    invalid=st.integers(0, 2),
    clip_high=st.sampled_from([0.2, 0.28]),
    dual_clip=st.sampled_from([None, 3.0]),
    entropy_coef=st.sampled_from([0.0, 0.01]),
)
def test_actor_streamed_equals_merged(
    n, data_seed, budget_slack, plan_seed, invalid, clip_high, dual_clip, entropy_coef
):
    invalid = min(invalid, n - 1)
    cols = random_rows(n, data_seed, invalid_rows=invalid)
    store = filled_store(cols)
    longest = max(len(t) for t in cols["input_ids"])
    planner = ChunkPlanner(
        DataSettings(longest + budget_slack, seed=plan_seed, drop_budget=invalid)
    )
    epoch = planner.plan(store.meta(), epoch=0)
    assert len(epoch.invalid_rows) == invalid

    objective = ClippedPPO(clip_high=clip_high, dual_clip=dual_clip)
    kwargs = dict(objective=objective, entropy_coef=entropy_coef)
    actor = CapturingActor(tiny_lm(), lr=1e-3, max_grad_norm=None, **kwargs)
    want_diag, want_grads, want_norm = merged_actor_reference(actor, store, epoch.valid_rows)

    [(stats, grads)] = streamed(actor, store, epoch.steps, [OLD_LOGPROBS, ADVANTAGES])
    assert stats.stepped
    assert rel_close(stats.grad_norm, want_norm)
    assert_grads_close(grads, want_grads)
    for key, want in want_diag.items():
        assert rel_close(stats.metrics[key], want), (key, stats.metrics[key], want)


def merged_critic_reference(critic: CriticModule, store, rows):
    chunk = read_chunk(store, rows, [VALUES, RETURNS])
    ref = copy.deepcopy(critic)
    v = ref.values(chunk)
    terms = value_loss(v, chunk.values, chunk.returns, clip=critic.value_clip)
    m = chunk.response_mask
    loss = terms.loss[m].mean()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
    norm = torch.sqrt(sum(g.square().sum() for g in grads.values())).item()
    r, vv = chunk.returns[m], v.detach()[m]
    diag = {
        "loss": loss.item(),
        "value_loss": loss.item(),
        "clip_fraction": terms.clipped[m].double().mean().item(),
        "explained_variance": (1 - (r - vv).var(unbiased=False) / r.var(unbiased=False)).item(),
        "value_mean": vv.mean().item(),
        "value_min": vv.min().item(),
        "value_max": vv.max().item(),
        "return_mean": r.mean().item(),
        "return_min": r.min().item(),
        "return_max": r.max().item(),
    }
    return diag, grads, norm


@given(
    n=st.integers(2, 9),
    data_seed=st.integers(0, 10_000),
    budget_slack=st.integers(0, 60),
    plan_seed=st.integers(0, 100),
    value_clip=st.sampled_from([None, 0.2]),
)
def test_critic_streamed_equals_merged(n, data_seed, budget_slack, plan_seed, value_clip):
    cols = random_rows(n, data_seed)
    store = filled_store(cols)
    longest = max(len(t) for t in cols["input_ids"])
    epoch = ChunkPlanner(DataSettings(longest + budget_slack, seed=plan_seed)).plan(store.meta())
    critic = CapturingCritic(tiny_backbone(), value_clip=value_clip, max_grad_norm=None)
    want_diag, want_grads, want_norm = merged_critic_reference(critic, store, epoch.valid_rows)

    [(stats, grads)] = streamed(critic, store, epoch.steps, [VALUES, RETURNS])
    assert rel_close(stats.grad_norm, want_norm)
    assert_grads_close(grads, want_grads)
    for key, want in want_diag.items():
        assert rel_close(
            stats.metrics[key], want, tol=1e-8 if key == "explained_variance" else RTOL
        ), (
            key,
            stats.metrics[key],
            want,
        )


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean"])
def test_any_two_chunkings_agree(mode):
    """Two very different chunkings (one row per chunk vs all in one) give identical steps."""
    cols = random_rows(7, 3)
    store = filled_store(cols)
    longest = max(len(t) for t in cols["input_ids"])
    results = []
    for budget in (longest, 10 * longest):
        epoch = ChunkPlanner(DataSettings(budget, seed=1)).plan(store.meta())
        actor = CapturingActor(tiny_lm(), max_grad_norm=None, loss_aggregation=mode)
        [(stats, grads)] = streamed(actor, store, epoch.steps, [OLD_LOGPROBS, ADVANTAGES])
        results.append((stats, grads, len(epoch.steps[0].chunks)))
    (s1, g1, c1), (s2, g2, c2) = results
    assert c1 == 7 and c2 == 1
    assert rel_close(s1.grad_norm, s2.grad_norm)
    assert_grads_close(g1, g2)
    for key in s1.metrics:
        assert rel_close(s1.metrics[key], s2.metrics[key]), key
