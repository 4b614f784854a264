"""The exactness sweep over everything that shapes the actor's step.

Every policy objective × loss aggregation × advantage estimator × KL placement (in the reward,
in the loss with k1 / k2 / k3, both, neither) × off-policy correction: one optimizer step
streamed in random chunks equals the merged batch in float64 — the loss, the gradients, the
grad norm and **every metric the actor logs** (the reference must produce exactly the same
metric names, so a new metric without a reference fails here). The critic's aggregations
likewise. Two gloo ranks against one process: ``test_data_parallel.py``.
"""

from __future__ import annotations

import random

import pytest
import torch
from _builders import tiny_backbone, tiny_lm
from _objective_sweep import (
    KL_LOSS,
    MAX_RESPONSE_TOKENS,
    NAMES,
    OBJECTIVES,
    OFF_POLICY,
    Combo,
    aggregate,
    merged_reference,
    sweep_store,
)
from test_parity import CapturingActor, CapturingCritic, assert_grads_close, rel_close, streamed

from lppo.algorithms import LOSS_AGGREGATIONS, value_loss
from lppo.estimators import GAE, GRPO, RLOO, EstimatorInputs, ReinforcePP
from lppo.iteration.chunks import read_chunk
from lppo.iteration.data_settings import DataSettings
from lppo.iteration.planner import ChunkPlanner
from lppo.parallel import SINGLE
from lppo.types import RETURNS, VALUES

ESTIMATORS = {"gae": GAE, "grpo": GRPO, "rloo": RLOO, "reinforce_pp": ReinforcePP}
KL_IN_REWARD = (0.0, 0.1)


def estimate(store, name: str, kl_coef: float) -> None:
    """Write the estimator's advantages (streamed, one row per chunk) into ``store``."""
    planner = ChunkPlanner(DataSettings(14, seed=0, drop_budget=len(store)))
    [step] = planner.plan(store.meta()).steps
    ESTIMATORS[name]().estimate(EstimatorInputs(store, step, SINGLE, kl_coef, "k3"))


def plan(store, rng: random.Random):
    """One step over every valid row, in chunks of a random token budget."""
    budget = rng.randint(14, 60)
    settings = DataSettings(budget, seed=rng.randint(0, 99), drop_budget=len(store))
    epoch = ChunkPlanner(settings).plan(store.meta(), epoch=0)
    return epoch


@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
def test_streamed_step_equals_the_merged_batch(objective, aggregation, estimator):
    rng = random.Random(f"{objective}/{aggregation}/{estimator}")
    model = tiny_lm()
    for kl_coef in KL_IN_REWARD:
        store = sweep_store(n_prompts=3, seed=rng.randint(0, 10_000))
        estimate(store, estimator, kl_coef)
        for kl_loss in KL_LOSS:
            for off_policy in OFF_POLICY:
                combo = Combo(objective, aggregation, kl_loss, off_policy)
                epoch = plan(store, rng)
                actor = combo.actor(model, cls=CapturingActor)
                want, want_grads, want_norm = merged_reference(
                    actor, combo, store, epoch.valid_rows
                )
                [(stats, grads)] = streamed(actor, store, epoch.steps, NAMES)
                where = (combo, kl_coef, len(epoch.steps[0].chunks))
                assert stats.stepped, where
                assert rel_close(stats.grad_norm, want_norm), (where, stats.grad_norm, want_norm)
                assert_grads_close(grads, want_grads)
                assert stats.metrics.keys() == want.keys(), where
                for key, value in want.items():
                    assert rel_close(stats.metrics[key], value), (where, key)


def test_the_sweep_clips_some_and_not_all():
    """The data reaches both branches of every objective (a sweep of all-clipped steps proves
    little)."""
    model = tiny_lm()
    store = sweep_store(n_prompts=3, seed=5)
    estimate(store, "grpo", 0.0)
    epoch = plan(store, random.Random(0))
    for objective in OBJECTIVES:
        combo = Combo(objective, "token_mean", None, "none")
        actor = combo.actor(model, cls=CapturingActor)
        [(stats, _)] = streamed(actor, store, epoch.steps, NAMES)
        key = "seq_clip_fraction" if objective == "gspo" else "clip_fraction"
        assert 0.0 < stats.metrics[key] < 1.0, (objective, stats.metrics[key])


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
def test_critic_aggregations_are_exact(aggregation):
    rng = random.Random(aggregation)
    store = sweep_store(n_prompts=3, seed=rng.randint(0, 10_000))
    epoch = plan(store, rng)
    critic = CapturingCritic(
        tiny_backbone(), value_clip=0.2, max_grad_norm=None, loss_aggregation=aggregation
    )
    critic.max_response_tokens = MAX_RESPONSE_TOKENS
    chunk = read_chunk(store, epoch.valid_rows, [VALUES, RETURNS])
    reference = CapturingCritic(tiny_backbone(), value_clip=0.2)
    reference.load_state_dict(critic.state_dict())
    v = reference.values(chunk)
    terms = value_loss(v, chunk.values, chunk.returns, clip=0.2)
    loss = aggregate(terms.loss, chunk.response_mask, aggregation)
    loss.backward()
    want_grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters()}
    want_norm = torch.sqrt(sum(g.square().sum() for g in want_grads.values())).item()

    [(stats, grads)] = streamed(critic, store, epoch.steps, [VALUES, RETURNS])
    assert len(epoch.steps[0].chunks) > 1
    assert rel_close(stats.metrics["loss"], loss.item())
    assert rel_close(stats.grad_norm, want_norm)
    assert_grads_close(grads, want_grads)


def test_seq_mean_token_sum_norm_needs_the_response_length():
    store = sweep_store(n_prompts=1, seed=0)
    epoch = plan(store, random.Random(0))
    actor = Combo("ppo", "seq_mean_token_sum_norm", None, "none").actor(tiny_lm())
    actor.max_response_tokens = None
    with pytest.raises(ValueError, match=r"seq_mean_token_sum_norm needs actor.max_response"):
        actor.begin(epoch.steps[0])
