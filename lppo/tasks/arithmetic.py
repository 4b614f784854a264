"""Small integer arithmetic (``"12+7="`` -> ``"19"``) with partial credit for correct digits."""

from __future__ import annotations

import random

from lppo.tasks.base import Prompt, Task
from lppo.validation import check_number

OPERATORS = "+-"


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
    """Add (or subtract) two random integers: prompt ``"a+b="``, answer ``str(a + b)``.

    Reward: 1.0 for the exact answer; otherwise
    ``partial_weight * matches / max(len(answer), len(completion))`` where ``matches`` counts
    characters equal at the same place value (strings aligned on the right, so ``"18"`` earns
    credit for the tens digit of ``"19"``).

    Args:
        min_value: smallest operand.
        max_value: largest operand.
        operators: the operators to draw from, a non-empty subset of ``"+-"``. Subtraction may
            produce negative answers (with a leading ``-``).
        partial_weight: the largest score a wrong answer can earn, in ``[0, 1)``.
    """

    name = "arithmetic"

    def __init__(
        self,
        min_value: int = 0,
        max_value: int = 20,
        operators: str = "+",
        partial_weight: float = 0.5,
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
            raise ValueError(f"operators must be a non-empty subset of {OPERATORS!r}")
        self.min_value = min_value
        self.max_value = max_value
        self.operators = "".join(sorted(set(operators), key=OPERATORS.index))
        self.partial_weight = partial_weight

    def make_prompt(self, a: int, op: str, b: int) -> Prompt:
        """Build the prompt ``f"{a}{op}{b}="`` and its answer.

        Args:
            a: left operand.
            op: ``"+"`` or ``"-"``.
            b: right operand.

        Returns:
            The prompt.
        """
        result = a + b if op == "+" else a - b
        return Prompt(text=f"{a}{op}{b}=", answer=str(result), metadata={"a": a, "b": b, "op": op})

    def sample_prompts(self, n: int, generator: random.Random) -> list[Prompt]:
        """Draw ``n`` random problems (see :meth:`Task.sample_prompts`)."""
        prompts = []
        for _ in range(n):
            a = generator.randint(self.min_value, self.max_value)
            b = generator.randint(self.min_value, self.max_value)
            op = generator.choice(self.operators)
            prompts.append(self.make_prompt(a, op, b))
        return prompts

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
        hi = self.max_value + self.max_value if "+" in self.operators else self.max_value
        lo = self.min_value - self.max_value if "-" in self.operators else 0
        return max(len(str(hi)), len(str(lo)))
