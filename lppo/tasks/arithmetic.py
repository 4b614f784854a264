"""Small integer arithmetic (``"12+7="`` -> ``"19"``) with partial credit for correct digits."""

from __future__ import annotations

import hashlib
import random
import re
from typing import Literal

from lppo.tasks.base import Prompt, Task
from lppo.validation import check_number

OPERATORS = "+-*"

#: Which problems a task draws: every one, or one side of the fixed train / held-out partition.
Split = Literal["all", "train", "heldout"]

#: Draws a split may reject in a row before the task gives up (a held-out side this small
#: means the operand range is too narrow for ``heldout_fraction``).
MAX_REJECTIONS = 10_000

#: One problem of a fixed list: ``"47-18"``, ``"3 * 12"``.
PROBLEM = re.compile(r"^\s*(\d+)\s*([-+*])\s*(\d+)\s*$")


def apply(a: int, op: str, b: int) -> int:
    """``a op b`` for ``op`` in :data:`OPERATORS`."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    return a * b


def heldout_score(a: int, op: str, b: int) -> float:
    """A fixed pseudo-random number in ``[0, 1)`` for the problem ``a op b``.

    The problem is held out when its score is below ``heldout_fraction``: a property of the
    problem itself (a SHA-256 of ``"a op b"``), so the train and held-out sides are disjoint
    whatever seeds, samplers or processes draw them.
    """
    digest = hashlib.sha256(f"{a}{op}{b}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def right_aligned_matches(target: str, completion: str) -> int:
    """Count characters equal at the same place value (strings aligned on their last char).

    Args:
        target: reference answer.
        completion: generated answer.

    Returns:
        Number of matching positions.
    """
    return sum(1 for t, c in zip(reversed(target), reversed(completion), strict=False) if t == c)


class ArithmeticTask(Task):
    """Add, subtract or multiply two random integers: prompt ``"a+b="``, answer ``str(a + b)``.

    Reward: 1.0 for the exact answer; otherwise
    ``partial_weight * matches / max(len(answer), len(completion))`` where ``matches`` counts
    characters equal at the same place value (strings aligned on the right, so ``"18"`` earns
    credit for the tens digit of ``"19"``).

    Args:
        min_value: smallest operand.
        max_value: largest operand.
        operators: the operators to draw from, a non-empty subset of ``"+-*"``. Subtraction
            may produce negative answers (with a leading ``-``).
        partial_weight: the largest score a wrong answer can earn, in ``[0, 1)``.
        split: ``"all"`` draws every problem; ``"train"`` and ``"heldout"`` draw only one side
            of a fixed partition of the problems (:func:`heldout_score`), so a training task and
            an evaluation task never share a problem.
        heldout_fraction: the share of problems on the held-out side, in ``(0, 1)``.
        problems: a fixed list of problems (``"47-18"``) to draw from, uniformly, instead of
            random operands; each must lie in the operand range, use the task's operators and
            belong to its split. ``None``: random operands.
    """

    name = "arithmetic"

    def __init__(
        self,
        min_value: int = 0,
        max_value: int = 20,
        operators: str = "+",
        partial_weight: float = 0.5,
        split: Split = "all",
        heldout_fraction: float = 0.1,
        problems: list[str] | None = None,
    ) -> None:
        key = "model.task.init_args"
        check_number(f"{key}.min_value", min_value, integer=True, low=0)
        check_number(
            f"{key}.max_value",
            max_value,
            integer=True,
            low=min_value,
            fix=f"It must be at least {key}.min_value.",
        )
        check_number(f"{key}.partial_weight", partial_weight, low=0, high=1, high_open=True)
        if not operators or any(op not in OPERATORS for op in operators):
            raise ValueError(
                f"{key}.operators={operators!r} must be a non-empty subset of {OPERATORS!r}"
            )
        if split not in ("all", "train", "heldout"):
            raise ValueError(f"{key}.split={split!r} is not one of 'all', 'train', 'heldout'.")
        check_number(
            f"{key}.heldout_fraction",
            heldout_fraction,
            low=0,
            high=1,
            low_open=True,
            high_open=True,
        )
        self.split = split
        self.heldout_fraction = heldout_fraction
        self.min_value = min_value
        self.max_value = max_value
        self.operators = "".join(sorted(set(operators), key=OPERATORS.index))
        self.partial_weight = partial_weight
        self.problems = None if problems is None else self.parse_problems(problems, key)

    def parse_problems(self, problems: list[str], key: str) -> list[tuple[int, str, int]]:
        """``[(a, op, b), ...]`` of ``problems``, each checked against the task's settings.

        Raises:
            ValueError: an empty list, or a problem that does not parse, lies outside the
                operand range, uses another operator or belongs to the other split.
        """
        if not problems:
            raise ValueError(f"{key}.problems is empty; give problems like '47-18', or null.")
        parsed = []
        for text in problems:
            match = PROBLEM.match(str(text))
            if match is None:
                raise ValueError(f"{key}.problems: {text!r} is not a problem like '47-18'.")
            a, op, b = int(match[1]), match[2], int(match[3])
            inside = all(self.min_value <= v <= self.max_value for v in (a, b))
            if not inside or op not in self.operators or not self.in_split(a, op, b):
                raise ValueError(
                    f"{key}.problems: {text!r} is outside the task (operands "
                    f"{self.min_value}..{self.max_value}, operators {self.operators!r}, split "
                    f"{self.split!r}); drop it or widen the task."
                )
            parsed.append((a, op, b))
        return parsed

    def make_prompt(self, a: int, op: str, b: int) -> Prompt:
        """Build the prompt ``f"{a}{op}{b}="`` and its answer.

        Args:
            a: left operand.
            op: one of :data:`OPERATORS`.
            b: right operand.

        Returns:
            The prompt.
        """
        result = apply(a, op, b)
        return Prompt(text=f"{a}{op}{b}=", answer=str(result), metadata={"a": a, "b": b, "op": op})

    def sample_prompts(self, n: int, generator: random.Random) -> list[Prompt]:
        """Draw ``n`` random problems of the task's split (see :meth:`Task.sample_prompts`).

        Raises:
            ValueError: the split holds (almost) no problem of the operand range.
        """
        if self.problems is not None:
            return [self.make_prompt(*generator.choice(self.problems)) for _ in range(n)]
        prompts = []
        for _ in range(n):
            for _ in range(MAX_REJECTIONS):
                a = generator.randint(self.min_value, self.max_value)
                b = generator.randint(self.min_value, self.max_value)
                op = generator.choice(self.operators)
                if self.in_split(a, op, b):
                    break
            else:
                raise ValueError(
                    f"ArithmeticTask.split={self.split!r}: no problem of that side in "
                    f"{MAX_REJECTIONS} draws; widen min_value..max_value or change "
                    "heldout_fraction."
                )
            prompts.append(self.make_prompt(a, op, b))
        return prompts

    def in_split(self, a: int, op: str, b: int) -> bool:
        """Whether the problem ``a op b`` belongs to the task's :attr:`split`."""
        if self.split == "all":
            return True
        heldout = heldout_score(a, op, b) < self.heldout_fraction
        return heldout == (self.split == "heldout")

    def reward(self, prompt: Prompt, completion: str) -> float:
        """Exact-match score with partial digit credit (see the class docstring)."""
        target = prompt.answer
        if completion == target:
            return 1.0
        if not completion:
            return 0.0
        matches = right_aligned_matches(target, completion)
        return self.partial_weight * matches / max(len(target), len(completion))

    def vocabulary(self) -> str:
        """Digits, the operators and ``=`` (``-`` also signs negative results)."""
        return "0123456789" + self.operators + "="

    def max_prompt_length(self) -> int:
        """Longest prompt, ``"<a><op><b>="``, in characters."""
        width = max(len(str(self.min_value)), len(str(self.max_value)))
        return 2 * width + 2

    def max_answer_length(self) -> int:
        """Longest possible reference answer, in characters."""
        ends = (self.min_value, self.max_value)
        results = [apply(a, op, b) for op in self.operators for a in ends for b in ends]
        return max(len(str(r)) for r in results)
