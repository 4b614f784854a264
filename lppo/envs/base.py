"""The ``Environment`` seam: what answers the policy between the turns of a trajectory.

``model.task`` stays the source of prompts and scores the episode's final answer; an
environment, chosen by ``class_path`` under the multi-turn engine
(:class:`~lppo.rollout.MultiTurnEngine`), starts one :class:`Episode` per sample and, after
every policy turn, returns the :class:`Observation` the policy reads next. Episodes are
independent objects (many run at once) and deterministic given their seed.

An observation's ``text`` is appended to the trajectory verbatim, so it carries its own chat
template markers (the end of the tool turn and the start of the next assistant turn); it is
tokenized without the tokenizer's own special tokens and gets no loss, KL, entropy or
advantage weight (``response_mask`` is false on it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from lppo.tasks.base import Prompt


@dataclass(frozen=True)
class Turn:
    """One turn the policy generated.

    Attributes:
        text: the turn decoded without special tokens (the end-of-turn token removed).
        token_ids: the turn's token ids, end-of-turn token included when generated.
        ended: the turn ended with the end-of-turn (EOS) token; ``False`` when it was cut by
            the per-turn or the trajectory token limit.
    """

    text: str
    token_ids: tuple[int, ...]
    ended: bool


@dataclass(frozen=True)
class Observation:
    """What the environment answers to a turn.

    Attributes:
        text: appended to the trajectory verbatim before the policy's next turn (template
            markers included); ignored when ``done``.
        reward: the turn's own reward, placed on the turn's last token (0: none).
        done: the episode is over; the turn was the final answer, which the task scores.
        tool_calls: tool calls the turn made.
        tool_errors: calls that failed (missing tool, malformed call, bad arguments, a tool
            that raised or timed out).
        tool_timeouts: calls stopped at the tool timeout (also counted in ``tool_errors``).
    """

    text: str = ""
    reward: float = 0.0
    done: bool = False
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0


@runtime_checkable
class Episode(Protocol):
    """One sample's conversation with the environment."""

    def opening(self) -> str | None:
        """The text the policy is first conditioned on, already templated.

        ``None``: the engine encodes the prompt as a single-turn run does (its
        ``chat_template`` and ``prepend_bos`` settings).
        """
        ...

    def step(self, turn: Turn) -> Observation:
        """Answer the policy's ``turn``."""
        ...


@runtime_checkable
class Environment(Protocol):
    """Starts episodes; chosen by ``model.engine.init_args.environment.class_path``.

    Lifecycle: :meth:`setup` once with the policy's tokenizer (in every process that rolls
    out: the trainer, a rollout process, each Ray worker, so the environment must pickle
    before setup), :meth:`start` per sample, :meth:`close` at the end.
    """

    def setup(self, tokenizer: Any) -> None:
        """Bind the policy's tokenizer (chat templates, end-of-turn token)."""
        ...

    def start(self, prompt: Prompt, seed: int) -> Episode:
        """A new episode answering ``prompt``; ``seed`` fixes whatever it draws at random."""
        ...

    def close(self) -> None:
        """Release what the environment started (tool processes); idempotent."""
        ...
