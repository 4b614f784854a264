"""A benchmark environment with a fixed number of turns and fixed-length observations.

Every episode lasts exactly ``turns`` policy turns, whatever the policy says: after each of
the first ``turns - 1`` turns the environment answers with ``observation_length`` characters
drawn (from the episode's seed) from the task's vocabulary, and the turn after that ends the
episode. So a benchmark controls the number of turns and the observation tokens per row (one
token per character with lppo's char tokenizer); only the policy turns' lengths vary (a random
model stops at EOS at random).
"""

from __future__ import annotations

import random
from typing import Any

from lppo.envs.base import Episode, Observation, Turn
from lppo.tasks.base import Prompt


class _FixedEpisode:
    """One episode: ``turns`` turns, the same observation text after each but the last."""

    def __init__(self, turns: int, observation: str) -> None:
        self.turns_left = turns
        self.observation = observation

    def opening(self) -> str | None:
        return None  # the engine encodes the prompt as in a single-turn run

    def step(self, turn: Turn) -> Observation:
        self.turns_left -= 1
        if self.turns_left <= 0:
            return Observation(done=True)
        return Observation(text=self.observation, tool_calls=1)


class FixedTurnsEnvironment:
    """Episodes of exactly ``turns`` policy turns with ``observation_length``-token answers.

    Args:
        vocabulary: the characters observations are drawn from (the task's vocabulary).
        turns: policy turns per episode (mutable between ``generate`` calls: each episode
            reads it when it starts).
        observation_length: characters (= tokens) per observation.
    """

    def __init__(self, vocabulary: str, turns: int = 1, observation_length: int = 8) -> None:
        if not vocabulary or turns < 1 or observation_length < 1:
            raise ValueError("need a vocabulary, turns >= 1 and observation_length >= 1")
        self.alphabet = sorted(set(vocabulary))
        self.turns = turns
        self.observation_length = observation_length

    def setup(self, tokenizer: Any) -> None:
        """Nothing to bind: observations are plain characters of the vocabulary."""

    def start(self, prompt: Prompt, seed: int) -> Episode:
        """An episode whose observation text is drawn from ``seed``."""
        rng = random.Random(seed)
        text = "".join(rng.choice(self.alphabet) for _ in range(self.observation_length))
        return _FixedEpisode(self.turns, text)

    def close(self) -> None:
        """Nothing was started."""
