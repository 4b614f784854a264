"""Arithmetic asked in words, for a chat model (``"What is 3 + 4? ..."`` -> ``"7"``).

``lppo.tasks.ArithmeticTask``'s terse ``"3+4="`` prompts make SmolLM2-135M-Instruct talk about
"the number 3" instead of answering; a question in words gets answers like ``"3 + 4 = 7"`` or
``"The answer is 7."``. The verifier therefore reads the *last integer* of the completion and
scores it with ``ArithmeticTask``'s exact-match / partial-digit reward.
"""

from __future__ import annotations

import re

from lppo.tasks import ArithmeticTask, Prompt
from lppo.tasks.arithmetic import Split

INTEGER = re.compile(r"-?\d+")

#: How each operator is read out in a question (the template's ``{word}``).
WORDS = {"+": "plus", "-": "minus", "*": "times"}


def last_integer(text: str) -> str | None:
    """The last integer written in ``text`` (``"3 + 4 = 7."`` -> ``"7"``), or ``None``."""
    found = INTEGER.findall(text.replace(",", ""))
    return found[-1] if found else None


class ChatArithmeticTask(ArithmeticTask):
    """``ArithmeticTask`` with a natural-language prompt and a last-number verifier.

    Reward: :meth:`ArithmeticTask.reward` of the last integer in the completion (1.0 for the
    right sum, partial credit for right digits, 0.0 when the completion holds no integer).

    Args:
        template: the question, a format string over ``a``, ``b``, ``op`` (``+``, ``-``,
            ``*``) and ``word`` (``plus``, ``minus``, ``times``).
        min_value: smallest operand.
        max_value: largest operand.
        operators: a non-empty subset of ``"+-*"``.
        partial_weight: the largest score a wrong number can earn, in ``[0, 1)``.
        split: ``"all"``, or one side (``"train"`` / ``"heldout"``) of the fixed partition of
            problems (see :class:`~lppo.tasks.ArithmeticTask`).
        heldout_fraction: the share of problems on the held-out side, in ``(0, 1)``.
        problems: a fixed list of problems (``"47-18"``) to draw from instead of random
            operands (see :class:`~lppo.tasks.ArithmeticTask`).
        answer_ends: where the answer ends: only the completion's text before the first
            occurrence is read (``"\\n"`` for a base model prompted with worked lines, which
            goes on to write the next line's question); ``None`` reads all of it.
    """

    name = "chat_arithmetic"

    def __init__(
        self,
        template: str = "What is {a} {op} {b}? Answer with just the number.",
        min_value: int = 0,
        max_value: int = 9,
        operators: str = "+",
        partial_weight: float = 0.0,
        split: Split = "all",
        heldout_fraction: float = 0.1,
        problems: list[str] | None = None,
        answer_ends: str | None = None,
    ) -> None:
        super().__init__(
            min_value, max_value, operators, partial_weight, split, heldout_fraction, problems
        )
        template.format(a=0, op="+", b=0, word="plus")  # fail at construction on a bad template
        if answer_ends == "":
            raise ValueError("answer_ends must be a non-empty string or None, got ''")
        self.template = template
        self.answer_ends = answer_ends

    def make_prompt(self, a: int, op: str, b: int) -> Prompt:
        """The question for ``a op b`` and its answer (see :meth:`ArithmeticTask.make_prompt`)."""
        prompt = super().make_prompt(a, op, b)
        prompt.text = self.template.format(a=a, op=op, b=b, word=WORDS[op])
        return prompt

    def reward(self, prompt: Prompt, completion: str) -> float:
        """Score the last integer of the answer (0.0 when it holds none)."""
        if self.answer_ends is not None:
            completion = completion.split(self.answer_ends, 1)[0]
        number = last_integer(completion)
        return 0.0 if number is None else super().reward(prompt, number)

    def vocabulary(self) -> str:
        """Every character of the questions and answers (for a character tokenizer)."""
        words = "".join(WORDS[op] for op in self.operators)
        return "".join(sorted(set(self.template + words + super().vocabulary())))

    def max_prompt_length(self) -> int:
        """Longest question, in characters."""
        big = max(self.max_value, self.min_value)
        return max(
            len(self.template.format(a=big, op=op, b=big, word=WORDS[op])) for op in self.operators
        )
