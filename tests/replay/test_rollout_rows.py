"""``put_rollout``: rows go in by ``PUT_ROWS`` at a time, and a failed put leaves none behind."""

from __future__ import annotations

import math

import pytest
import torch
from _builders import random_rows

from lppo.replay import MemoryReplayStore
from lppo.replay import rollout_rows as rr
from lppo.types import GEN_LOGPROBS, INPUT_IDS, RESPONSE_MASK, REWARD, Rollout


def _rollout(n: int) -> Rollout:
    cols = random_rows(n, seed=3)
    reward = torch.stack(cols[REWARD]).float()
    reward[2] = float("nan")  # one bad reward, in the first slice
    reward[n - 1] = float("inf")  # and one in the last
    return Rollout(
        input_ids=cols[INPUT_IDS],
        response_mask=cols[RESPONSE_MASK],
        gen_logprobs=[torch.full((len(t),), -0.5) for t in cols[INPUT_IDS]],
        reward=reward,
        prompt_index=torch.arange(n),
    )


class FailingPut(MemoryReplayStore):
    """Fails its ``fail_at``-th put (counting from 1)."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at, self.puts = fail_at, 0

    def put(self, ids, columns) -> None:
        self.puts += 1
        if self.puts == self.fail_at:
            raise OSError("disk full")
        super().put(ids, columns)


def test_sliced_puts_equal_one_put(monkeypatch: pytest.MonkeyPatch) -> None:
    rollout = _rollout(11)
    stores = []
    for rows in (4, 10**6):
        monkeypatch.setattr(rr, "PUT_ROWS", rows)
        store = MemoryReplayStore()
        got = rr.put_rollout(store, store.allocate(11), rollout, rr.RowRules())
        assert got.bad_rewards == 2 and len(got) == 11
        stores.append((store, got))
    (a, ga), (b, gb) = stores
    names = [INPUT_IDS, RESPONSE_MASK, GEN_LOGPROBS, REWARD, "prompt_index"]
    got_a, got_b = a.read(ga.row_ids, names), b.read(gb.row_ids, names)
    for name in names:
        for x, y in zip(got_a[name], got_b[name], strict=True):
            assert torch.equal(x, y)
    masks = got_a[RESPONSE_MASK]
    assert not masks[2].any() and not masks[10].any()  # bad rewards marked in both slices


def test_a_put_failing_part_way_leaves_no_row(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rr, "PUT_ROWS", 4)
    store = FailingPut(fail_at=3)
    ids = store.allocate(11)
    with pytest.raises(OSError, match="disk full"):
        rr.put_rollout(store, ids, _rollout(11), rr.RowRules())
    assert store.puts == 3  # two slices were in before the third failed
    assert len(store) == 0 and store.nbytes() == 0


def test_overlong_punishment_shapes_good_rewards_in_the_store() -> None:
    """The stored reward is the task's plus DAPO's penalty of the row's response length; a bad
    reward stays a zeroed, invalid row; the reported rewards are the task's own."""
    rollout = _rollout(9)
    longest = max(int(m.sum()) for m in rollout.response_mask)
    rules = rr.RowRules(overlong_buffer=4, overlong_penalty=0.5, max_new_tokens=longest)
    store = MemoryReplayStore()
    got = rr.put_rollout(store, store.allocate(9), rollout, rules)
    stored = store.read(got.row_ids, [REWARD])[REWARD]
    penalized = 0
    pairs = zip(rollout.response_mask, rollout.reward, strict=True)
    for i, (mask, task_reward) in enumerate(pairs):
        if not torch.isfinite(task_reward):
            assert float(stored[i]) == 0.0
            continue
        length = int(mask.sum())
        penalty = -0.5 * max(length - (longest - 4), 0) / 4
        penalized += penalty < 0
        assert float(stored[i]) == pytest.approx(float(task_reward) + penalty, abs=1e-6)
    assert penalized > 0
    # the reported rewards are the task's own, a rejected one NaN (no statistic averages it)
    task = torch.where(torch.isfinite(rollout.reward), rollout.reward, math.nan)
    assert torch.allclose(got.reward, task, rtol=0, atol=0, equal_nan=True)


def test_a_reward_beyond_max_abs_reward_is_in_no_statistic() -> None:
    """It invalidates its row, and the rollout's reward mean and range leave it out."""
    from lppo.iteration.score_phase import rollout_stats
    from lppo.parallel import SINGLE

    rollout = _rollout(4)
    rollout.reward = torch.tensor([0.25, 3.28e29, 0.75, -math.inf], dtype=torch.float64)
    store = MemoryReplayStore()
    got = rr.put_rollout(store, store.allocate(4), rollout, rr.RowRules(max_abs_reward=10.0))
    stats, _ = rollout_stats(got, SINGLE)
    assert (got.bad_rewards, stats.reward_mean, stats.bad_rewards) == (2, 0.5, 2.0)
    assert (stats.extra["reward_min"], stats.extra["reward_max"]) == (0.25, 0.75)
