"""A user's own verifier and a recording dataset task, addressable by class_path in tests."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from lppo.tasks import DatasetTask, Prompt
from lppo.tasks.verifiers import Verifier


class LengthVerifier(Verifier):
    """1.0 if the completion has the answer's length (after stripping), else ``partial``."""

    def __init__(self, partial: float = 0.0) -> None:
        self.partial = partial
        self.batch_calls = 0

    def __call__(self, completion: str, answer: str) -> float:
        return 1.0 if len(completion.strip()) == len(answer) else self.partial

    def batch(self, completions: Sequence[str], answers: Sequence[str]) -> list[float]:
        self.batch_calls += 1
        return super().batch(completions, answers)


class RecordingDatasetTask(DatasetTask):
    """A DatasetTask that remembers the prompt texts of every ``sample_prompts`` call."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sampled: list[list[str]] = []

    def sample_prompts(self, n: int, generator: random.Random) -> list[Prompt]:
        prompts = super().sample_prompts(n, generator)
        self.sampled.append([p.text for p in prompts])
        return prompts
