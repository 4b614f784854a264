"""Environments for multi-turn rollouts: what answers the policy between its turns."""

from lppo.envs.base import Environment, Episode, Observation, Turn
from lppo.envs.hidden_digit import HiddenDigitEnvironment, HiddenDigitTask

__all__ = [
    "Environment",
    "Episode",
    "HiddenDigitEnvironment",
    "HiddenDigitTask",
    "Observation",
    "Turn",
]
