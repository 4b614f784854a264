"""The body of one Ray rollout worker actor (:class:`~lppo.rollout.RayWorkersEngine` runs N)."""

from __future__ import annotations

import os
from typing import Any

import torch

from lppo.replay.base import ReplayStore
from lppo.replay.rollout_rows import RowRules, StoredRollout, put_rollout
from lppo.rollout.base import GenerationOutput, RolloutEngine, to_rollout
from lppo.rollout.reward_call import score
from lppo.runtime.ray_runtime import ray_module
from lppo.tasks.base import Prompt, Task

__all__ = ["RolloutWorker", "RolloutWorkerError"]


class RolloutWorkerError(RuntimeError):
    """A rollout worker did not answer in time, or failed in a way a retry cannot fix."""


class RolloutWorker:
    """The body of one rollout worker actor: an engine over its own copy of the policy.

    Args:
        engine: the engine (pickled into the worker; set up here on the worker's policy).
        policy: the causal LM (a copy, loaded with the trainer's weights by :meth:`load`).
        tokenizer: the policy's tokenizer.
        sampling: the sampling settings.
    """

    def __init__(
        self, engine: RolloutEngine, policy: torch.nn.Module, tokenizer: Any, sampling: Any
    ) -> None:
        torch.set_num_threads(1)  # workers share the machine's cores with the trainer
        self.engine = engine
        self.engine.setup(policy, tokenizer, sampling)
        self.policy = policy

    def load(self, state: dict[str, torch.Tensor], version: int) -> int:
        """Load the trainer's weights ``state`` as ``version``; return the version now held."""
        self.policy.load_state_dict(state)
        self.engine.sync_from(self.policy, version)
        return self.engine.weights_version

    def generate(
        self, prompts: list[Prompt], samples_per_prompt: int, seed: int, greedy: bool = False
    ) -> tuple[GenerationOutput, int]:
        """The engine's samples and the weights version they were sampled from."""
        output = self.engine.generate(prompts, samples_per_prompt, seed, greedy=greedy)
        return output, self.engine.weights_version

    def generate_into(
        self,
        store: ReplayStore,
        ids: tuple[int, ...],
        prompts: list[Prompt],
        samples_per_prompt: int,
        seed: int,
        start: int,
        task: Task,
        rules: RowRules,
        version: int,
        provenance: tuple[int, int],
    ) -> StoredRollout:
        """Sample, reward and put the samples as rows ``ids`` of ``store``, from this process.

        ``start`` is the ``prompt_index`` of ``prompts[0]``; ``version`` the weights version
        the trainer expects (checked before anything is sampled or put); ``provenance`` the
        rows' ``(iteration, policy version)``.
        """
        if self.engine.weights_version != version:
            raise RolloutWorkerError(
                f"worker holds weights version {self.engine.weights_version}, not {version}."
            )
        output = self.engine.generate(prompts, samples_per_prompt, seed)
        rewards = score(task, prompts, output)
        output.prompt_index = output.prompt_index + start
        try:
            rollout = to_rollout(output, rewards, provenance=provenance)
            return put_rollout(store, ids, rollout, rules)
        finally:
            store.close()  # a pickled copy: detaches this process, the rows stay

    def where(self) -> tuple[int, str]:
        """The worker's process id and the id of the Ray node it runs on."""
        return os.getpid(), ray_module().get_runtime_context().get_node_id()
