"""Task interface: procedurally generated prompts with a verifiable reward.

A task produces :class:`Prompt` objects (the text fed to the model and the reference answer) and
scores a decoded completion in ``[0, 1]``. Completions are the generated text *without* the
end-of-sequence token; generation stops at that token, so a task's answers never contain it.
"""

from __future__ import annotations

import abc
import random
from dataclasses import dataclass, field
from typing import Any

from lppo.init_args import RecordsInitArgs


@dataclass
class Prompt:
    """One question of a task.

    Attributes:
        text: what the model is conditioned on (e.g. ``"12+7="``).
        answer: the reference completion (e.g. ``"19"``), without any end-of-sequence token.
        metadata: free-form task-specific fields (operands, transform name, ...).
    """

    text: str
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict)


class Task(RecordsInitArgs, abc.ABC):
    """A procedurally generated, verifiable task (nothing is downloaded)."""

    #: Short registry name of the task (see :func:`lppo.tasks.get_task`).
    name: str = "task"

    #: Seconds one :meth:`rewards` call may take before it is stopped and fails the iteration
    #: (``None``: no limit). Not a task setting: the run sets it from
    #: ``model.ppo.reward_timeout_s`` (it travels with the task to rollout processes).
    reward_timeout_s: float | None = None

    @abc.abstractmethod
    def sample_prompts(self, n: int, generator: random.Random) -> list[Prompt]:
        """Draw ``n`` prompts.

        Args:
            n: number of prompts to draw.
            generator: source of randomness; the same generator state gives the same prompts.

        Returns:
            ``n`` prompts.
        """

    @abc.abstractmethod
    def reward(self, prompt: Prompt, completion: str) -> float:
        """Score ``completion`` as an answer to ``prompt``.

        Args:
            prompt: the prompt that was answered.
            completion: the decoded completion, without the end-of-sequence token.

        Returns:
            A score in ``[0, 1]``; exactly ``1.0`` for the reference answer.
        """

    @abc.abstractmethod
    def vocabulary(self) -> str:
        """Return every character prompts and answers of this task can contain.

        Used to build a character-level tokenizer; the order of the characters is irrelevant.
        """

    def max_prompt_length(self) -> int:
        """Longest prompt text the task can produce, in characters.

        The default samples 1024 prompts with a fixed seed; tasks that know the bound override
        it. Used to reject a chunk token budget below the longest possible row at setup.
        """
        return max(len(p.text) for p in self.sample_prompts(1024, random.Random(0)))

    def longest_prompt(self) -> Prompt:
        """A prompt with the longest text the task can produce.

        A multi-turn run renders its episode's opening at setup, to refuse a prompt that leaves
        no room for a turn under the engine's ``max_tokens``. The default samples 1024 prompts
        with a fixed seed (as :meth:`max_prompt_length`) and puts the task back to its state
        (:meth:`state_dict`); tasks that know their longest prompt override it.
        """
        state = self.state_dict()
        try:
            prompts = self.sample_prompts(1024, random.Random(0))
        finally:
            self.load_state_dict(state)
        return max(prompts, key=lambda p: len(p.text))

    def sample_texts(self) -> list[str]:
        """Prompt texts and answers the run's tokenizer is checked against at setup.

        The default samples 256 prompts with a fixed seed and puts the task back to its state
        (:meth:`state_dict`), so the check changes neither the task nor any RNG; tasks holding
        all their prompts override it to return them all.
        """
        state = self.state_dict()
        try:
            prompts = self.sample_prompts(256, random.Random(0))
        finally:
            self.load_state_dict(state)
        return [text for p in prompts for text in (p.text, p.answer)]

    def state_dict(self) -> dict[str, Any]:
        """State to checkpoint at iteration boundaries (e.g. a position in a prompt file).

        The default task is stateless: its prompts depend only on the generator passed to
        :meth:`sample_prompts`. Must hold only what ``torch.load(weights_only=True)`` reads.
        """
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` when a run resumes (stateless tasks accept ``{}``)."""
        if state:
            raise ValueError(f"{type(self).__name__} is stateless but got state {sorted(state)}")

    def rewards(self, prompts: list[Prompt], completions: list[str]) -> list[float]:
        """Score a batch of completions, ``completions[i]`` answering ``prompts[i]``.

        Args:
            prompts: one prompt per completion.
            completions: decoded completions, without the end-of-sequence token.

        Returns:
            One score in ``[0, 1]`` per completion.

        Raises:
            ValueError: if the two lists differ in length.
        """
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        return [self.reward(p, c) for p, c in zip(prompts, completions, strict=True)]
