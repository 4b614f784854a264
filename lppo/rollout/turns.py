"""Token-level continuation: what an engine offers the multi-turn loop.

A multi-turn trajectory is continued from its exact token ids (never re-tokenized text), one
turn at a time, and each request samples from its own seed: a trajectory is the same whatever
other requests share the engine's batch, so multi-turn rows do not depend on the engine's
batch size or on how many data-parallel ranks generate them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class TurnRequest:
    """Continue one trajectory by one turn.

    Attributes:
        context: the trajectory's token ids so far (prompt, earlier turns, observations).
        seed: the seed of this turn's sampling (the same seed gives the same turn).
        max_new_tokens: most tokens of the turn (the end-of-turn token included).
    """

    context: tuple[int, ...]
    seed: int
    max_new_tokens: int


@dataclass(frozen=True)
class TurnSample:
    """One generated turn.

    Attributes:
        token_ids: the turn's tokens, cut after the first end-of-turn (EOS) token (kept).
        logprobs: log-probability of each token under the distribution it was sampled from
            (after temperature / top-k / top-p), one per token.
        ended: the turn ended with the EOS token (``False``: cut at ``max_new_tokens``).
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    ended: bool


@runtime_checkable
class TurnEngine(Protocol):
    """A :class:`~lppo.rollout.RolloutEngine` that continues token contexts turn by turn.

    :class:`~lppo.rollout.HFGenerateEngine` and :class:`~lppo.rollout.VLLMEngine` are;
    :class:`~lppo.rollout.MultiTurnEngine` drives one.
    """

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a prompt, as the engine encodes it for a single-turn run."""
        ...

    def continue_turns(
        self, requests: Sequence[TurnRequest], greedy: bool = False
    ) -> list[TurnSample]:
        """One turn for each request, in order; each sampled from its own seed.

        Args:
            requests: the trajectories to continue.
            greedy: take the argmax (the seeds then do not matter); log-probabilities are
                then those of the unscaled distribution.
        """
        ...
