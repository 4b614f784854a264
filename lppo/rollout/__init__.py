"""Rollout engines: sample responses from the policy and pack them into ``Rollout`` rows."""

from lppo.rollout.base import (
    TRUNCATED,
    GenerationOutput,
    PromptBlock,
    RolloutEngine,
    RolloutSettings,
    RowJob,
    StoreWritingEngine,
    to_rollout,
)
from lppo.rollout.evaluation import EvalSamples
from lppo.rollout.hf.engine import HFGenerateEngine
from lppo.rollout.multi_turn import MultiTurnEngine
from lppo.rollout.process_runner import ProcessRunner
from lppo.rollout.ray_workers.engine import RayWorkersEngine, RolloutWorkerError
from lppo.rollout.reward_call import RewardError, score
from lppo.rollout.runners import InlineRunner, RolloutProcessError, RolloutRunner, ThreadRunner
from lppo.rollout.source import RolloutSource, StaleWeightsError, derive_seed
from lppo.rollout.turns import TurnEngine, TurnRequest, TurnSample
from lppo.rollout.vllm.engine import VLLMEngine

__all__ = [
    "TRUNCATED",
    "EvalSamples",
    "GenerationOutput",
    "HFGenerateEngine",
    "InlineRunner",
    "MultiTurnEngine",
    "ProcessRunner",
    "PromptBlock",
    "RayWorkersEngine",
    "RewardError",
    "RolloutEngine",
    "RolloutProcessError",
    "RolloutRunner",
    "RolloutSettings",
    "RolloutSource",
    "RolloutWorkerError",
    "RowJob",
    "StaleWeightsError",
    "StoreWritingEngine",
    "ThreadRunner",
    "TurnEngine",
    "TurnRequest",
    "TurnSample",
    "VLLMEngine",
    "derive_seed",
    "score",
    "to_rollout",
]
