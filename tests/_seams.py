"""Engines, estimators and tasks plugged into lppo's seams by tests (addressable by class_path)."""

from __future__ import annotations

import copy
from typing import Any

import torch

from lppo.estimators import GAE, EstimatorInputs
from lppo.rollout import GenerationOutput, HFGenerateEngine, RolloutSettings
from lppo.tasks import CopyTask, Prompt


class CopyingEngine(HFGenerateEngine):
    """An engine holding its OWN copy of the policy (as a remote or vLLM engine does)."""

    def __init__(self, batch_size: int | None = None) -> None:
        super().__init__(batch_size=batch_size)
        self.generate_calls = 0
        self.syncs: list[int] = []

    def setup(self, policy: torch.nn.Module, tokenizer: Any, sampling: RolloutSettings) -> None:
        super().setup(copy.deepcopy(policy), tokenizer, sampling)

    def sync_from(self, policy: torch.nn.Module, version: int) -> None:
        super().sync_from(policy, version)
        self.syncs.append(version)

    def generate(
        self,
        prompts: list[Prompt],
        samples_per_prompt: int = 1,
        seed: int = 0,
        greedy: bool = False,
    ) -> GenerationOutput:
        self.generate_calls += 1
        return super().generate(prompts, samples_per_prompt, seed=seed, greedy=greedy)


class ForgetfulEngine(CopyingEngine):
    """Claims to sync but keeps its stale copy and version: lppo must refuse it."""

    def sync_from(self, policy: torch.nn.Module, version: int) -> None:
        self.syncs.append(version)


class CountingGAE(GAE):
    """GAE that counts its calls and reports them as a rollout metric."""

    def __init__(self, gamma: float = 1.0, lam: float = 0.95) -> None:
        super().__init__(gamma=gamma, lam=lam)
        self.calls = 0

    def estimate(self, inputs: EstimatorInputs) -> dict[str, float]:
        self.calls += 1
        return {**super().estimate(inputs), "estimator_calls": float(self.calls)}


class BatchOnlyTask(CopyTask):
    """A task that can only score whole batches (like a reward model or a sandbox)."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[int] = []

    def reward(self, prompt: Prompt, completion: str) -> float:
        raise AssertionError("per-sample reward called; rewards must go through one batch call")

    def rewards(self, prompts: list[Prompt], completions: list[str]) -> list[float]:
        self.batches.append(len(completions))
        return [float(c == p.answer) for p, c in zip(prompts, completions, strict=True)]
