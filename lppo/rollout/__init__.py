"""Rollout engines: sample responses from the policy and pack them into ``Rollout`` rows."""

from lppo.rollout.base import (
    TRUNCATED,
    GenerationOutput,
    RewardError,
    RolloutEngine,
    RolloutSettings,
    score,
    to_rollout,
)
from lppo.rollout.hf import HFGenerateEngine
from lppo.rollout.ray_workers import RayWorkersEngine, RolloutWorkerError
from lppo.rollout.source import RolloutSource, StaleWeightsError, derive_seed
from lppo.rollout.vllm import VLLMEngine

__all__ = [
    "TRUNCATED",
    "GenerationOutput",
    "HFGenerateEngine",
    "RayWorkersEngine",
    "RewardError",
    "RolloutEngine",
    "RolloutSettings",
    "RolloutSource",
    "RolloutWorkerError",
    "StaleWeightsError",
    "VLLMEngine",
    "derive_seed",
    "score",
    "to_rollout",
]
