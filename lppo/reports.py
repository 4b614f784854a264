"""What the rollout side did, counted per rank and summed over ranks for the rollout metrics.

Each report is a dataclass of counts: ``merged`` adds two, ``counts`` lists them (all-reduced
as one tensor) and ``metrics`` turns the sums into the ``rollout/`` statistics.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Self, TypeVar


class Counts:
    """A dataclass of counts that add up field by field (over parts, over ranks)."""

    def merged(self, other: Self | None) -> Self:
        """The sum of both reports (``other`` ``None``: this one)."""
        if other is None:
            return self
        return type(self)(*(a + b for a, b in zip(self.counts(), other.counts(), strict=True)))

    def counts(self) -> tuple[float, ...]:
        """Every field, in order (all-reduced as one tensor)."""
        return tuple(getattr(self, f.name) for f in fields(self))  # type: ignore[arg-type]


_Report = TypeVar("_Report", bound=Counts)


def merge_reports(reports: Sequence[_Report | None]) -> _Report | None:
    """The sum of the reports that are not ``None`` (``None`` when all are)."""
    return functools.reduce(lambda a, b: b if a is None else a.merged(b), reports, None)


@dataclass
class SamplingReport(Counts):
    """What dynamic sampling (``model.rollout.dynamic_sampling_rounds``) did on one rank.

    Attributes:
        uniform_groups: prompt groups dropped because their finite rewards hold fewer than two
            different values (exact equality, in the rewards' float64).
        surplus_groups: informative groups a refill generated beyond its block's quota (unused).
        short_groups: groups still missing after every refill round (the iteration trains on
            fewer).
        refills: refill ``generate`` calls (one per block and extra round).
        nonfinite_groups: groups holding a NaN or infinite reward (those rows become invalid
            when put; the group is judged on its finite rewards), kept or dropped.
        first_reward_sum: sum of the finite task rewards of the first round's samples (the
            prompts a run without dynamic sampling draws), kept or dropped.
        first_samples: how many rewards that sum holds.
        short_samples: the samples the short groups would have held (``short_groups ×
            samples_per_prompt``): what an iteration left with no group loses.
    """

    uniform_groups: int = 0
    surplus_groups: int = 0
    short_groups: int = 0
    refills: int = 0
    nonfinite_groups: int = 0
    first_reward_sum: float = 0.0
    first_samples: int = 0
    short_samples: int = 0

    def metrics(self) -> dict[str, float]:
        """The counts, and ``sampled_reward_mean``.

        ``sampled_reward_mean`` is the mean task reward of the first round, before any group
        was dropped: comparable with a run without dynamic sampling, unlike ``reward_mean``
        (over the kept rows).
        """
        mean = self.first_reward_sum / self.first_samples if self.first_samples else math.nan
        return {
            "uniform_groups": float(self.uniform_groups),
            "surplus_groups": float(self.surplus_groups),
            "short_groups": float(self.short_groups),
            "refills": float(self.refills),
            "nonfinite_groups": float(self.nonfinite_groups),
            "short_samples": float(self.short_samples),
            "sampled_reward_mean": mean,
        }


@dataclass
class EpisodeReport(Counts):
    """What the multi-turn rollouts (:class:`~lppo.rollout.MultiTurnEngine`) did on one rank.

    Attributes:
        episodes: episodes run (one per sample generated, kept or not).
        turns: policy turns over every episode.
        tool_calls: tool calls the turns made.
        tool_errors: calls that failed (missing tool, malformed call, bad arguments, a tool
            that raised or timed out).
        tool_timeouts: calls stopped at the tool timeout.
        policy_tokens: tokens the policy generated (trained on).
        observation_tokens: tokens the environment appended (never trained on).
        truncated_by_turns: episodes still running after ``max_turns`` turns.
        truncated_by_tokens: episodes stopped by the trajectory token limit.
    """

    episodes: int = 0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    policy_tokens: int = 0
    observation_tokens: int = 0
    truncated_by_turns: int = 0
    truncated_by_tokens: int = 0

    def metrics(self) -> dict[str, float]:
        """Per-episode means and fractions (NaN without episodes).

        ``turns_per_episode``, ``tool_calls_per_episode``, ``tool_errors_per_episode``,
        ``tool_successes_per_episode`` (well-formed calls that returned a result),
        ``tool_timeouts_per_episode``, ``policy_tokens_per_row``,
        ``observation_tokens_per_row``, ``observation_token_fraction`` (of the trajectory's
        response-side tokens), ``truncated_by_turns`` and ``truncated_by_tokens`` (fractions
        of the episodes).
        """
        n = self.episodes or math.nan
        tokens = (self.policy_tokens + self.observation_tokens) or math.nan
        return {
            "turns_per_episode": self.turns / n,
            "tool_calls_per_episode": self.tool_calls / n,
            "tool_errors_per_episode": self.tool_errors / n,
            "tool_successes_per_episode": (self.tool_calls - self.tool_errors) / n,
            "tool_timeouts_per_episode": self.tool_timeouts / n,
            "policy_tokens_per_row": self.policy_tokens / n,
            "observation_tokens_per_row": self.observation_tokens / n,
            "observation_token_fraction": self.observation_tokens / tokens,
            "truncated_by_turns": self.truncated_by_turns / n,
            "truncated_by_tokens": self.truncated_by_tokens / n,
        }
