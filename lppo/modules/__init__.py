"""Trainable roles (actor, critic) with the begin / train_chunk / finish / abort lifecycle."""

from lppo.modules.actor import ActorModule, shifted_logprobs
from lppo.modules.critic import CriticModule
from lppo.modules.lifecycle import ChunkResult, NonFiniteParameters, PPOModule, StepStateError
from lppo.modules.reward_model import RewardModel
from lppo.modules.teacher import Teacher

__all__ = [
    "ActorModule",
    "ChunkResult",
    "CriticModule",
    "NonFiniteParameters",
    "PPOModule",
    "RewardModel",
    "StepStateError",
    "Teacher",
    "shifted_logprobs",
]
