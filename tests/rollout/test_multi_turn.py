"""``MultiTurnEngine`` on the Hugging Face engine: trajectories, masks, rewards, seeds, limits."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from lppo.envs import HiddenDigitEnvironment, HiddenDigitTask
from lppo.envs.base import Observation, Turn
from lppo.modules.models import HFCausalLM
from lppo.modules.tokenizer import build_char_tokenizer
from lppo.reports import EpisodeReport
from lppo.rollout import (
    HFGenerateEngine,
    MultiTurnEngine,
    RayWorkersEngine,
    RolloutSettings,
    score,
    to_rollout,
)
from lppo.tasks.base import Prompt
from lppo.types import TURN_REWARDS
from lppo.validation import SettingError

TASK = HiddenDigitTask()
TOK = build_char_tokenizer(TASK.vocabulary())
PROMPTS = TASK.sample_prompts(12, random.Random(0))


@pytest.fixture(scope="module")
def model():
    return HFCausalLM(dtype="float64", seed=3).build(
        len(TOK), TOK.pad_token_id, TOK.bos_token_id, TOK.eos_token_id
    )


def engine(model, batch_size=None, max_turns=3, max_tokens=24, max_calls=2, **sampling):
    sampling = {"max_new_tokens": 4, **sampling}
    out = MultiTurnEngine(
        HFGenerateEngine(batch_size=batch_size),
        HiddenDigitEnvironment(call_reward=0.25, max_calls=max_calls),
        max_turns=max_turns,
        max_tokens=max_tokens,
    )
    out.setup(model, TOK, RolloutSettings(**sampling))
    return out


def spans(mask: torch.Tensor) -> list[tuple[int, int]]:
    """The ``[start, end)`` runs of ``True`` in ``mask``."""
    runs, start = [], None
    for t, m in enumerate([*mask.tolist(), False]):
        if m and start is None:
            start = t
        elif not m and start is not None:
            runs.append((start, t))
            start = None
    return runs


def test_rows_hold_the_whole_trajectory_and_mask_only_the_policy_turns(model):
    mt = engine(model)
    out = mt.generate(PROMPTS, samples_per_prompt=2, seed=7)
    assert len(out) == 24 and out.turn_rewards is not None
    calls = 0
    for r in range(len(out)):
        ids, mask, lp = out.input_ids[r], out.response_mask[r], out.gen_logprobs[r]
        turns = spans(mask)
        digit = PROMPTS[int(out.prompt_index[r])].answer
        p = int(out.prompt_lengths[r])
        assert not mask[:p].any() and turns[0][0] == p
        assert torch.all(lp[~mask] == 0) and torch.all(lp[mask] < 0)
        # between two policy turns: exactly the observation "<digit>>" (never trained on)
        for (_, end), (start, _) in itertools.pairwise(turns):
            assert TOK.decode(ids[end:start].tolist()) == digit + ">"
            calls += 1
        # the turn reward sits on the last token of each call turn
        rewards = out.turn_rewards[r]
        want = torch.zeros_like(rewards)
        for _, end in turns[:-1]:
            want[end - 1] = 0.25
        assert torch.equal(rewards, want)
        assert out.completions[r] == TOK.decode(
            ids[turns[-1][0] : turns[-1][1]].tolist(), skip_special_tokens=True
        )
    assert calls > 0 and out.episodes is not None
    report = out.episodes
    assert report.episodes == 24 and report.tool_calls == calls
    assert report.turns == sum(len(spans(m)) for m in out.response_mask)
    assert report.policy_tokens == sum(int(m.sum()) for m in out.response_mask)


def test_the_reward_is_the_episode_return_and_rows_carry_turn_rewards(model):
    out = engine(model).generate(PROMPTS, samples_per_prompt=2, seed=7)
    rewards = score(TASK, PROMPTS, out)
    final = TASK.rewards([PROMPTS[int(i)] for i in out.prompt_index], out.completions)
    turn_sums = [float(t.sum()) for t in out.turn_rewards]
    want = torch.tensor(final, dtype=torch.float64) + torch.tensor(turn_sums, dtype=torch.float64)
    torch.testing.assert_close(rewards, want)  # rewards are float64 in every run
    rollout = to_rollout(out, rewards, provenance=(0, 0))
    assert rollout.extras[TURN_REWARDS] == out.turn_rewards
    assert rollout.episodes == out.episodes


@pytest.mark.parametrize("batch_size", [1, 5])
def test_trajectories_do_not_depend_on_the_engine_batch_size(model, batch_size):
    want = engine(model).generate(PROMPTS, samples_per_prompt=2, seed=11)
    got = engine(model, batch_size=batch_size).generate(PROMPTS, samples_per_prompt=2, seed=11)
    for a, b in zip(want.input_ids, got.input_ids, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(want.gen_logprobs, got.gen_logprobs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    assert want.episodes == got.episodes


def test_a_block_is_the_same_alone_or_with_other_prompts(model):
    """What makes 2 ranks equal to 1: a block's rows depend on its own prompts and seed only."""
    mt = engine(model)
    alone = mt.generate(PROMPTS[:3], samples_per_prompt=2, seed=5)
    other = mt.generate(PROMPTS[3:], samples_per_prompt=2, seed=6)  # another block, same call
    again = mt.generate(PROMPTS[:3], samples_per_prompt=2, seed=5)
    assert [x.tolist() for x in alone.input_ids] == [x.tolist() for x in again.input_ids]
    assert [x.tolist() for x in alone.input_ids] != [x.tolist() for x in other.input_ids[:6]]


def test_the_engine_log_probs_are_the_policy_s_on_every_policy_token(model):
    out = engine(model, temperature=0.7).generate(PROMPTS, samples_per_prompt=2, seed=3)
    for ids, mask, lp in zip(out.input_ids, out.response_mask, out.gen_logprobs, strict=True):
        with torch.no_grad():
            logits = model(input_ids=ids[None]).logits[0, :-1] / 0.7
        want = torch.log_softmax(logits, -1).gather(1, ids[1:, None])[:, 0]
        torch.testing.assert_close(lp[1:][mask[1:]].double(), want[mask[1:]], rtol=0, atol=1e-6)


def test_turn_and_token_limits_stop_episodes_and_are_counted(model):
    # every turn may call: with one turn, each calling episode is cut by max_turns
    one = engine(model, max_turns=1).generate(PROMPTS, samples_per_prompt=2, seed=7)
    callers = sum(1 for m in one.response_mask for _ in spans(m)[:1])
    assert one.episodes.turns == callers == 24
    assert one.episodes.truncated_by_turns == one.episodes.tool_calls > 0
    assert one.truncated.sum() >= one.episodes.truncated_by_turns
    # a row of at most 6 tokens: the prompt (3) and one turn leave no room for an observation
    short = engine(model, max_tokens=6).generate(PROMPTS, samples_per_prompt=2, seed=7)
    assert max(len(x) for x in short.input_ids) <= 6
    assert short.episodes.truncated_by_tokens == short.episodes.tool_calls > 0
    assert short.episodes.observation_tokens == 0


def test_greedy_episodes_are_deterministic(model):
    mt = engine(model)
    a = mt.generate(PROMPTS, samples_per_prompt=1, seed=1, greedy=True)
    b = mt.generate(PROMPTS, samples_per_prompt=1, seed=2, greedy=True)
    assert [x.tolist() for x in a.input_ids] == [x.tolist() for x in b.input_ids]


def test_settings_that_do_not_apply_to_turns_are_refused(model):
    with pytest.raises(SettingError, match="min_new_tokens"):
        engine(model, min_new_tokens=1)
    with pytest.raises(SettingError, match="ignore_eos"):
        engine(model, ignore_eos=True)
    inner = MultiTurnEngine(RayWorkersEngine(), HiddenDigitEnvironment())
    with pytest.raises(SettingError, match="RayWorkersEngine with engine: MultiTurnEngine"):
        inner.setup(model, TOK, RolloutSettings())
    with pytest.raises(SettingError, match="max_turns"):
        MultiTurnEngine(HFGenerateEngine(), HiddenDigitEnvironment(), max_turns=0)


def test_a_prompt_longer_than_the_row_limit_is_refused(model):
    """The first episode's backstop (a prompt longer than the task's longest): the short block's
    SettingError naming the key and the value that fits, not a bare ValueError."""
    mt = engine(model, max_tokens=3)
    with pytest.raises(SettingError, match=r"max_tokens=3: .* 7 tokens .* at least 11"):
        mt.generate([Prompt("d:d:d:", "1")], samples_per_prompt=1, seed=0)


def test_an_opening_that_leaves_no_room_for_a_turn_is_refused_at_setup():
    """``check_setup`` (the run plan's) measures the opening of the task's longest prompt as the
    episodes will: the inner engine's encoding (BOS + prompt) or the environment's own text."""
    task = HiddenDigitTask(prompt="d:" * 8)  # 16 characters, 17 tokens with BOS
    sampling = RolloutSettings(max_new_tokens=4)
    refused = r"max_tokens=17: the prompt 'd:d:d:d:d:d:d:d:' \(16 characters\) opens its episode "
    refused += r"with 17 tokens \(as the engine encodes prompts\).* at least 21"
    for max_tokens, ok in ((17, False), (18, True)):
        mt = MultiTurnEngine(HFGenerateEngine(), HiddenDigitEnvironment(), max_tokens=max_tokens)
        for checked in (mt, RayWorkersEngine(engine=mt)):  # the workers' engine checks too
            check = checked.capabilities().check_setup
            assert check is not None
            if ok:
                check(TOK, task, sampling)
            else:
                with pytest.raises(SettingError, match=refused):
                    check(TOK, task, sampling)
    scripted = MultiTurnEngine(HFGenerateEngine(), _Scripted(turns=1), max_tokens=2)  # "d:"
    with pytest.raises(SettingError, match=r"2 tokens \(the environment's opening"):
        scripted.check_setup(TOK, task, sampling)
    with pytest.raises(SettingError, match="min_new_tokens"):
        scripted.check_setup(TOK, task, RolloutSettings(min_new_tokens=1))


class _Scripted:
    """An environment that answers every turn with ``"1>"`` and ends after ``turns`` turns."""

    def __init__(self, turns: int) -> None:
        self.turns = turns

    def setup(self, tokenizer) -> None:
        pass

    def start(self, prompt, seed):
        env = self

        class Episode:
            n = 0

            def opening(self) -> str | None:
                return "d:"

            def step(self, turn: Turn) -> Observation:
                self.n += 1
                return Observation("1>", reward=1.0, done=self.n == env.turns)

        return Episode()

    def close(self) -> None:
        pass


def test_an_opening_text_replaces_the_engine_s_prompt_encoding(model):
    mt = MultiTurnEngine(HFGenerateEngine(), _Scripted(turns=3), max_turns=3, max_tokens=40)
    mt.setup(model, TOK, RolloutSettings(max_new_tokens=2))
    out = mt.generate(PROMPTS[:2], samples_per_prompt=1, seed=0)
    for ids, rewards in zip(out.input_ids, out.turn_rewards, strict=True):
        assert TOK.decode(ids[:2].tolist()) == "d:"  # no BOS: the opening is encoded verbatim
        assert float(rewards.sum()) == 3.0
    assert out.episodes == EpisodeReport(
        episodes=2,
        turns=6,
        policy_tokens=out.episodes.policy_tokens,
        observation_tokens=8,
    )
