"""Rollout engines: sample responses from the policy and pack them into ``Rollout`` rows."""

from __future__ import annotations

from lppo.rollout.base import TRUNCATED, GenerationOutput, RolloutEngine, score, to_rollout
from lppo.rollout.hf import HFGenerateEngine

__all__ = [
    "TRUNCATED",
    "GenerationOutput",
    "HFGenerateEngine",
    "RolloutEngine",
    "score",
    "to_rollout",
]
