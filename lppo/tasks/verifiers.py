"""Reward functions for prompt datasets: compare a completion with a reference answer.

A verifier is chosen in YAML by ``class_path`` (``model.task.init_args.verifier``), so each one
is a class; a user's own verifier subclasses :class:`Verifier` and is named the same way::

    verifier:
      class_path: lppo.tasks.verifiers.NumericAnswer
      init_args: {tolerance: 0.001}
"""

from __future__ import annotations

import abc
import math
import re
from collections.abc import Sequence

from lppo.init_args import RecordsInitArgs
from lppo.validation import check_number

__all__ = ["ExactMatch", "NumericAnswer", "Verifier", "extract_number"]

#: A decimal number: optional sign (only where it cannot be a binary minus, as in ``4-3``),
#: digits with optional thousands separators (``1,234``), optional fraction (``.5``, ``2.50``).
NUMBER = re.compile(r"(?:(?<![\w).])-)?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)")


class Verifier(RecordsInitArgs, abc.ABC):
    """Scores one completion against its reference answer.

    Subclasses implement :meth:`__call__`; override :meth:`batch` to score many at once (a
    reward model, a sandbox) and :meth:`validate_answer` to reject unusable reference answers
    when the dataset is loaded rather than mid-run. A verifier's init arguments are recorded
    in checkpoints (:class:`~lppo.init_args.RecordsInitArgs`): a resumed run must score alike.
    """

    @abc.abstractmethod
    def __call__(self, completion: str, answer: str) -> float:
        """Score ``completion`` against ``answer``.

        Args:
            completion: the decoded completion, without the end-of-sequence token.
            answer: the reference answer from the dataset.

        Returns:
            A score in ``[0, 1]``; exactly ``1.0`` when ``completion == answer``.
        """

    def batch(self, completions: Sequence[str], answers: Sequence[str]) -> list[float]:
        """Score ``completions[i]`` against ``answers[i]`` (the default calls :meth:`__call__`).

        Args:
            completions: decoded completions.
            answers: one reference answer per completion.

        Returns:
            One score per completion.

        Raises:
            ValueError: if the two sequences differ in length.
        """
        if len(completions) != len(answers):
            raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
        return [float(self(c, a)) for c, a in zip(completions, answers, strict=True)]

    def validate_answer(self, answer: str) -> None:
        """Raise ``ValueError`` if ``answer`` cannot be scored against (default: accept all).

        Args:
            answer: a reference answer from the dataset.
        """


class ExactMatch(Verifier):
    """1.0 if the completion equals the answer after normalization, else 0.0.

    Args:
        strip: ignore leading and trailing whitespace.
        ignore_case: compare case-insensitively.
        collapse_whitespace: treat every run of whitespace as one space.
    """

    def __init__(
        self, strip: bool = True, ignore_case: bool = False, collapse_whitespace: bool = False
    ) -> None:
        self.strip = strip
        self.ignore_case = ignore_case
        self.collapse_whitespace = collapse_whitespace

    def normalize(self, text: str) -> str:
        """Apply the configured normalizations to ``text``."""
        if self.collapse_whitespace:
            text = " ".join(text.split()) if self.strip else re.sub(r"\s+", " ", text)
        elif self.strip:
            text = text.strip()
        return text.casefold() if self.ignore_case else text

    def __call__(self, completion: str, answer: str) -> float:
        """1.0 on a normalized match, else 0.0."""
        return 1.0 if self.normalize(completion) == self.normalize(answer) else 0.0


def extract_number(
    text: str, marker: str | None = "####", last_number: bool = True
) -> float | None:
    """The number a text answers with.

    Args:
        text: a completion or a reference answer.
        marker: if it occurs in ``text``, the first number after its last occurrence is the
            answer (GSM8K writes ``... #### 42``); ``None`` disables the marker.
        last_number: without a marker, use the last number in the text.

    Returns:
        The number (thousands separators removed), or ``None`` if there is none.
    """
    if marker and marker in text:
        match = NUMBER.search(text.rsplit(marker, 1)[1])
        return float(match.group().replace(",", "")) if match else None
    if not last_number:
        return None
    numbers = NUMBER.findall(text)
    return float(numbers[-1].replace(",", "")) if numbers else None


class NumericAnswer(Verifier):
    """1.0 if the completion's number equals the answer's number within tolerance, else 0.0.

    Both numbers are extracted the same way (:func:`extract_number`): after ``marker`` when it
    is present (GSM8K's ``#### 42``), otherwise the last number in the text, so a reference
    answer that holds a whole worked solution works too.

    Args:
        tolerance: absolute tolerance of the comparison.
        relative_tolerance: relative tolerance (``math.isclose``'s ``rel_tol``).
        marker: the string after which the final answer follows; ``""`` disables it. (A
            string, not ``str | None``: jsonargparse read the default ``"####"`` of an optional
            string as a YAML comment, i.e. ``null``.)
        last_number: without the marker, take the last number in the text (``false``: a
            completion without the marker scores 0).
    """

    def __init__(
        self,
        tolerance: float = 1e-6,
        relative_tolerance: float = 0.0,
        marker: str = "####",
        last_number: bool = True,
    ) -> None:
        key = "model.task.init_args.verifier.init_args"
        check_number(f"{key}.tolerance", tolerance, low=0, fix="0 demands equal numbers.")
        check_number(f"{key}.relative_tolerance", relative_tolerance, low=0)
        self.tolerance = tolerance
        self.relative_tolerance = relative_tolerance
        self.marker = marker
        self.last_number = last_number

    def _number(self, text: str, last_number: bool) -> float | None:
        return extract_number(text, self.marker, last_number)

    def __call__(self, completion: str, answer: str) -> float:
        """1.0 on a numeric match, else 0.0 (also when the completion holds no number)."""
        target = self._number(answer, last_number=True)
        if target is None:
            raise ValueError(f"NumericAnswer: reference answer {answer!r} holds no number")
        value = self._number(completion, self.last_number)
        if value is None:
            return 0.0
        close = math.isclose(value, target, rel_tol=self.relative_tolerance, abs_tol=self.tolerance)
        return 1.0 if close else 0.0

    def validate_answer(self, answer: str) -> None:
        """Reject a reference answer that holds no number."""
        if self._number(answer, last_number=True) is None:
            where = f"after the marker {self.marker!r} or " if self.marker else ""
            raise ValueError(f"reference answer {answer!r} holds no number ({where}anywhere)")
