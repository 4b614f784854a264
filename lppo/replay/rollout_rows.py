"""A rollout's samples as replay rows: invalid rows marked, put, summarized for the statistics.

The one owner of turning a rewarded :class:`~lppo.types.Rollout` into rows of a
:class:`~lppo.replay.ReplayStore`. The trainer calls :func:`put_rollout` for the samples it
holds (``PPOController``'s collect phase); rollout workers that write into a shared store call
the same function in their own processes (:class:`~lppo.rollout.StoreWritingEngine`), so both
paths mark, put and summarize rows identically. What comes back (:class:`StoredRollout`) holds
row ids and per-row scalars only, never token tensors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lppo.replay.base import ReplayStore
from lppo.reports import merge_reports
from lppo.types import (
    RESPONSE_MASK,
    REWARD,
    TRUNCATED,
    EpisodeReport,
    Rollout,
    SamplingReport,
)

__all__ = ["PUT_ROWS", "RowRules", "StoredRollout", "concat_stored", "mark_invalid", "put_rollout"]

PUT_ROWS = 1024
"""Rows per ``store.put``: the per-row column views of a put exist for this many rows at once,
so putting 16k short rows does not hold tens of thousands of small tensors at the peak."""


@dataclass(frozen=True)
class RowRules:
    """What happens to rows when they are put (``PPOConfig.row_rules()`` gives the rules).

    Attributes:
        max_abs_reward: rewards with a larger magnitude (like non-finite ones) make their row
            invalid (``None``: only non-finite rewards do).
        mask_truncated: rows cut at ``max_new_tokens`` become invalid (overlong filtering).
        overlong_buffer: DAPO's soft overlong punishment: the last ``overlong_buffer``
            tokens before ``max_new_tokens`` cost reward linearly (0: off; see
            :func:`overlong_penalty`).
        overlong_penalty: the penalty at ``max_new_tokens`` (DAPO: 1).
        max_new_tokens: ``L_max`` of the punishment (``model.rollout.max_new_tokens``).
    """

    max_abs_reward: float | None = None
    mask_truncated: bool = False
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    max_new_tokens: int = 0


def overlong_penalty(length: int, rules: RowRules) -> float:
    """DAPO's soft overlong punishment of a response of ``length`` tokens (added to its reward).

    With ``L_max`` = ``rules.max_new_tokens``, ``B`` = ``rules.overlong_buffer`` and ``c`` =
    ``rules.overlong_penalty``: ``0`` for ``length ≤ L_max − B``, else
    ``c · (L_max − B − length) / B`` (down to ``−c`` at ``L_max``; a response never exceeds
    it). ``B = 0``: always 0.
    """
    buffer = rules.overlong_buffer
    if buffer <= 0:
        return 0.0
    excess = length - (rules.max_new_tokens - buffer)
    return -rules.overlong_penalty * max(excess, 0) / buffer


@dataclass
class StoredRollout:
    """Rows of a rollout that are in the store, with what the rollout statistics need.

    Attributes:
        row_ids: the rows' ids, in sample order.
        reward: ``float64[n]``; each row's reward as the task gave it, a rejected one
            (non-finite or beyond ``max_abs_reward``) as NaN: no statistic averages it.
        response_tokens: ``float32[n]``; each row's response tokens as generated (before
            masking).
        bad_rewards: rows whose reward was non-finite or out of bounds.
        dropped: samples lost before reaching the store (they count against the drop budget).
        sampling: what dynamic sampling did (``None``: off).
        episodes: what multi-turn rollouts did (``None``: single-turn rows).
        worker_restarts: rollout workers replaced since the previous rollout (``None``: an
            engine without workers).
        columns: the columns the rows were put with (their row schema; what a row carries
            when it moves to another rank's store, :mod:`lppo.iteration.balance`).
    """

    row_ids: tuple[int, ...]
    reward: torch.Tensor
    response_tokens: torch.Tensor
    bad_rewards: int = 0
    dropped: int = 0
    sampling: SamplingReport | None = None
    episodes: EpisodeReport | None = None
    worker_restarts: int | None = None
    columns: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.row_ids)


def mark_invalid(columns: dict[str, list[torch.Tensor]], rules: RowRules) -> int:
    """Make rows with a bad reward or (by ``rules``) a truncated response invalid, in place.

    A bad reward (non-finite, or ``|r| > rules.max_abs_reward``) becomes 0 and its row's
    ``response_mask`` all ``False``; with ``rules.mask_truncated`` a truncated row's mask is
    zeroed too. A good reward gets the :func:`overlong_penalty` of its response length (the
    bound applies to the task's reward, before the penalty). The ``"truncated"`` column is
    removed (it only serves this marking). Only list entries are replaced: the tensors the
    lists held are not modified.

    Returns:
        The number of bad rewards.
    """
    masks, rewards = columns[RESPONSE_MASK], columns[REWARD]
    truncated = columns.pop(TRUNCATED, None)
    bound = rules.max_abs_reward
    bad_rewards = 0
    for i, reward in enumerate(rewards):
        value = float(reward)
        bad_reward = not math.isfinite(value) or (bound is not None and abs(value) > bound)
        bad_rewards += bad_reward
        overlong = rules.mask_truncated and truncated is not None and bool(truncated[i])
        if bad_reward or overlong:
            masks[i] = torch.zeros_like(masks[i])
        if bad_reward:
            rewards[i] = torch.zeros_like(reward)
        elif rules.overlong_buffer > 0:
            penalty = overlong_penalty(int(masks[i].sum()), rules)
            rewards[i] = reward + torch.tensor(penalty, dtype=reward.dtype)
    return bad_rewards


def put_rollout(
    store: ReplayStore, ids: Sequence[int], rollout: Rollout, rules: RowRules
) -> StoredRollout:
    """Put ``rollout``'s rows into ``store`` as rows ``ids``, invalid rows marked.

    The rows go in :data:`PUT_ROWS` at a time; if any put fails, every id is discarded.

    Args:
        store: the replay store.
        ids: one id per sample (from ``store.allocate``), in sample order.
        rollout: the rewarded samples.
        rules: which rows become invalid.

    Returns:
        The rows' ids with their rewards and response lengths as generated.

    Raises:
        ValueError: ``len(ids)`` differs from the number of samples (nothing is put).
    """
    if len(ids) != len(rollout):
        raise ValueError(f"put_rollout: {len(ids)} row ids for {len(rollout)} samples")
    bad_rewards = 0
    names: tuple[str, ...] = ()
    try:
        for start in range(0, len(ids), PUT_ROWS):
            rows = slice(start, start + PUT_ROWS)
            columns = rollout.columns(rows)
            bad_rewards += mark_invalid(columns, rules)
            store.put(ids[rows], columns)
            names = tuple(columns)
    except BaseException:
        store.discard(ids)  # a put that fails part-way leaves none of the rollout behind
        raise
    lengths = torch.tensor([float(m.sum()) for m in rollout.response_mask])
    reward = rollout.reward
    bound = math.inf if rules.max_abs_reward is None else rules.max_abs_reward
    accepted = torch.isfinite(reward) & (reward.abs() <= bound)
    return StoredRollout(
        tuple(ids),
        torch.where(accepted, reward, torch.full_like(reward, math.nan)),
        lengths,
        bad_rewards,
        rollout.dropped,
        rollout.sampling,
        rollout.episodes,
        rollout.worker_restarts,
        names,
    )


def concat_stored(parts: Sequence[StoredRollout], dropped: int = 0) -> StoredRollout:
    """Several parts' rows, in order, as one; ``dropped`` samples lost besides theirs."""
    return StoredRollout(
        row_ids=tuple(i for p in parts for i in p.row_ids),
        reward=torch.cat([p.reward for p in parts]) if parts else torch.zeros(0),
        response_tokens=(
            torch.cat([p.response_tokens for p in parts]) if parts else torch.zeros(0)
        ),
        bad_rewards=sum(p.bad_rewards for p in parts),
        dropped=dropped + sum(p.dropped for p in parts),
        sampling=merge_reports([p.sampling for p in parts]),
        episodes=merge_reports([p.episodes for p in parts]),
        worker_restarts=_sum_known([p.worker_restarts for p in parts]),
        columns=next((p.columns for p in parts if p.columns), ()),
    )


def _sum_known(counts: Sequence[int | None]) -> int | None:
    """The sum of the counts that are not ``None`` (``None`` when all are)."""
    known = [c for c in counts if c is not None]
    return sum(known) if known else None
