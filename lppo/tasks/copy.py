"""String-transform task small enough for a tiny random model to learn within a few PPO steps.

A prompt is a short random string followed by ``=`` (e.g. ``"cab="``) and the answer is a simple
deterministic transform of that string (by default its first character, ``"c"``). The reward is
dense: position-wise character accuracy plus a length term, so random sampling already earns a
non-zero score and improvement shows early.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from lppo.tasks.base import Prompt, Task
from lppo.validation import check_number

#: Characters the task draws its strings from, in order (``alphabet_size`` takes a prefix).
FULL_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"

#: The separator between the input string and the answer.
SEPARATOR = "="

TRANSFORMS: dict[str, Callable[[str], str]] = {
    "first": lambda s: s[0],
    "last": lambda s: s[-1],
    "copy": lambda s: s,
    "reverse": lambda s: s[::-1],
    "repeat_first": lambda s: s[0] * 2,
    "sort": lambda s: "".join(sorted(s)),
}


def position_accuracy(target: str, completion: str) -> float:
    """Fraction of ``target``'s characters that ``completion`` matches at the same position.

    Args:
        target: the reference answer (non-empty).
        completion: the generated answer.

    Returns:
        A value in ``[0, 1]``.
    """
    hits = sum(1 for t, c in zip(target, completion, strict=False) if t == c)
    return hits / len(target)


class CopyTask(Task):
    """Answer a fixed transform of a short random string (``"cab="`` -> ``"c"`` by default).

    Reward: ``(1 - length_weight) * acc + length_weight * len_score`` where ``acc`` is the
    fraction of answer characters matched position-wise and ``len_score`` is
    ``max(0, 1 - |len(completion) - len(answer)| / length_tolerance)``. Only the exact answer
    scores 1.0.

    Args:
        min_length: shortest input string.
        max_length: longest input string.
        alphabet_size: number of distinct characters strings are drawn from (a prefix of
            ``abc...z0...9``, at most 36).
        transform: one of ``first``, ``last``, ``copy``, ``reverse``, ``repeat_first``, ``sort``.
        length_weight: weight of the length term of the reward, in ``[0, 1]``.
        length_tolerance: number of missing or extra characters at which the length term
            reaches 0.
    """

    name = "copy"

    def __init__(
        self,
        min_length: int = 2,
        max_length: int = 4,
        alphabet_size: int = 8,
        transform: str = "first",
        length_weight: float = 0.3,
        length_tolerance: int = 4,
    ) -> None:
        key = "model.task.init_args"
        check_number(f"{key}.min_length", min_length, integer=True, low=1)
        check_number(
            f"{key}.max_length",
            max_length,
            integer=True,
            low=min_length,
            fix=f"It must be at least {key}.min_length.",
        )
        check_number(f"{key}.length_tolerance", length_tolerance, integer=True, low=1)
        check_number(
            f"{key}.alphabet_size", alphabet_size, integer=True, low=1, high=len(FULL_ALPHABET)
        )
        check_number(f"{key}.length_weight", length_weight, low=0, high=1)
        if transform not in TRANSFORMS:
            raise ValueError(f"unknown transform {transform!r}; known: {sorted(TRANSFORMS)}")
        self.min_length = min_length
        self.max_length = max_length
        self.alphabet = FULL_ALPHABET[:alphabet_size]
        self.transform = transform
        self.length_weight = length_weight
        self.length_tolerance = length_tolerance

    def make_prompt(self, source: str) -> Prompt:
        """Build the prompt for a given input string.

        Args:
            source: the input string (characters from the task's alphabet).

        Returns:
            The prompt ``source + "="`` with its reference answer.
        """
        answer = TRANSFORMS[self.transform](source)
        return Prompt(
            text=source + SEPARATOR,
            answer=answer,
            metadata={"source": source, "transform": self.transform},
        )

    def sample_prompts(self, n: int, generator: random.Random) -> list[Prompt]:
        """Draw ``n`` random strings and their answers (see :meth:`Task.sample_prompts`)."""
        prompts = []
        for _ in range(n):
            length = generator.randint(self.min_length, self.max_length)
            source = "".join(generator.choice(self.alphabet) for _ in range(length))
            prompts.append(self.make_prompt(source))
        return prompts

    def reward(self, prompt: Prompt, completion: str) -> float:
        """Dense score of ``completion`` (see the class docstring)."""
        target = prompt.answer
        if completion == target:
            return 1.0
        acc = position_accuracy(target, completion)
        len_score = max(0.0, 1.0 - abs(len(completion) - len(target)) / self.length_tolerance)
        score = (1.0 - self.length_weight) * acc + self.length_weight * len_score
        # Only the exact answer reaches 1.0 (can happen here only with length_weight == 0).
        return min(score, 1.0 - 1e-6)

    def vocabulary(self) -> str:
        """Alphabet plus the separator."""
        return self.alphabet + SEPARATOR

    def max_prompt_length(self) -> int:
        """Longest prompt, the input string plus the separator, in characters."""
        return self.max_length + len(SEPARATOR)

    def max_answer_length(self) -> int:
        """Longest possible reference answer, in characters."""
        return len(TRANSFORMS[self.transform]("a" * self.max_length))
