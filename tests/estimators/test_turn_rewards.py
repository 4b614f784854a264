"""Per-turn rewards of multi-turn rows: on their turn's last token, summing to the return."""

from __future__ import annotations

import random

import pytest
import torch
from _builders import filled_store

from lppo.estimators import GAE, GRPO, EstimatorInputs, ReinforcePP
from lppo.iteration.chunks import read_chunk
from lppo.iteration.data_settings import DataSettings
from lppo.iteration.planner import ChunkPlanner
from lppo.parallel import SINGLE
from lppo.stats import Moments
from lppo.types import (
    ADVANTAGES,
    INPUT_IDS,
    OLD_LOGPROBS,
    RESPONSE_MASK,
    REWARD,
    TURN_REWARDS,
    VALUES,
)


def multi_turn_rows(n: int, seed: int) -> dict[str, list[torch.Tensor]]:
    """Rows of 1–3 policy turns separated by observations, a turn reward on each call turn."""
    rng = random.Random(seed)
    cols = {k: [] for k in (INPUT_IDS, RESPONSE_MASK, REWARD, TURN_REWARDS, OLD_LOGPROBS, VALUES)}
    for i in range(n):
        mask, turns = [False] * rng.randint(2, 4), []
        for turn in range(rng.randint(1, 3)):
            if turn:
                mask += [False] * rng.randint(1, 3)  # the observation
            mask += [True] * rng.randint(1, 4)
            turns.append(len(mask) - 1)
        rewards = torch.zeros(len(mask), dtype=torch.float64)
        for end in turns[:-1]:
            rewards[end] = rng.uniform(-0.5, 0.5)
        cols[INPUT_IDS].append(torch.randint(0, 9, (len(mask),)))
        cols[RESPONSE_MASK].append(torch.tensor(mask))
        cols[TURN_REWARDS].append(rewards)
        final = float(i % 2)
        cols[REWARD].append(torch.tensor(final + float(rewards.sum()), dtype=torch.float64))
        cols[OLD_LOGPROBS].append(-torch.rand(len(mask), dtype=torch.float64))
        cols[VALUES].append(torch.rand(len(mask), dtype=torch.float64))
    return cols


def inputs(store, budget: int) -> EstimatorInputs:
    planner = ChunkPlanner(DataSettings(budget, seed=0, drop_budget=len(store)))
    [step] = planner.plan(store.meta()).steps
    return EstimatorInputs(store, step, SINGLE, turn_rewards=True)


def test_each_turn_reward_sits_on_its_turn_and_the_rest_on_the_last_token():
    cols = multi_turn_rows(6, seed=0)
    store = filled_store(cols)
    chunk = read_chunk(store, list(range(6)), [REWARD, TURN_REWARDS])
    rewards = inputs(store, 200).token_rewards(chunk, Moments())
    for r in range(6):
        mask = cols[RESPONSE_MASK][r]
        got = rewards[r, : len(mask)]
        last = int(mask.nonzero().max())
        want = cols[TURN_REWARDS][r].clone()
        want[last] += float(cols[REWARD][r]) - float(want.sum())
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        torch.testing.assert_close(got.sum(), cols[REWARD][r], rtol=0, atol=1e-12)


@pytest.mark.parametrize("estimator", [GAE, ReinforcePP, GRPO])
def test_advantages_of_multi_turn_rows_do_not_depend_on_the_chunking(estimator):
    cols = multi_turn_rows(12, seed=1)
    cols["prompt_index"] = [torch.tensor(i // 3) for i in range(12)]
    want = None
    for budget in (22, 30, 45, 400):
        store = filled_store(cols)
        estimator().estimate(inputs(store, budget))
        got = store.read(list(range(12)), [ADVANTAGES])[ADVANTAGES]
        if want is None:
            want = got
        for a, b in zip(want, got, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_gae_sees_the_turn_rewards():
    """Moving a turn's reward onto the last token (same return) changes GAE's advantages."""
    cols = multi_turn_rows(8, seed=2)
    store = filled_store(cols)
    GAE().estimate(inputs(store, 400))
    with_turns = store.read(list(range(8)), [ADVANTAGES])[ADVANTAGES]
    store = filled_store(cols)
    GAE().estimate(EstimatorInputs(store, inputs(store, 400).step, SINGLE))
    without = store.read(list(range(8)), [ADVANTAGES])[ADVANTAGES]
    assert any(not torch.allclose(a, b) for a, b in zip(with_turns, without, strict=True))
