"""The ``RolloutEngine`` protocol, its output container, and helpers to build a ``Rollout``.

Token-level fields follow the alignment convention of :mod:`lppo.types`: position ``t`` is
aligned with ``input_ids[t]`` and ``gen_logprobs[t] = log p(input_ids[t] | input_ids[:t])``
under the sampling distribution; prompt positions hold ``False`` / 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from lppo.tasks.base import Prompt, Task
from lppo.types import Rollout

#: Name of the row-level extra column :func:`to_rollout` adds for truncated samples.
TRUNCATED = "truncated"


@dataclass
class GenerationOutput:
    """Samples of one ``generate`` call, packed (one variable-length tensor per sample).

    Samples of the same prompt are contiguous: sample ``j`` of prompt ``i`` is row
    ``i * samples_per_prompt + j``.

    Attributes:
        input_ids: ``int64[L_i]`` per sample: the prompt's ids followed by the response ids,
            cut after the first end-of-sequence token (which is kept).
        response_mask: ``bool[L_i]`` per sample; ``True`` on response tokens (EOS included).
        gen_logprobs: ``float32[L_i]`` per sample; log-probability of each response token under
            the distribution it was sampled from (after temperature / top-p); 0 on the prompt.
        completions: decoded response text per sample, without EOS or other special tokens.
        truncated: ``bool[n]``; ``True`` when a sample hit ``max_new_tokens`` without EOS.
        prompt_index: ``int64[n]``; index (into the ``prompts`` argument) each sample answers.
        prompt_lengths: ``int64[n]``; number of prompt tokens of each sample.
    """

    input_ids: list[torch.Tensor]
    response_mask: list[torch.Tensor]
    gen_logprobs: list[torch.Tensor]
    completions: list[str]
    truncated: torch.Tensor
    prompt_index: torch.Tensor
    prompt_lengths: torch.Tensor

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def response_lengths(self) -> torch.Tensor:
        """``int64[n]``: number of response tokens of each sample (EOS included)."""
        return torch.tensor([int(m.sum()) for m in self.response_mask], dtype=torch.int64)


@runtime_checkable
class RolloutEngine(Protocol):
    """Something that samples responses from the current policy."""

    def generate(self, prompts: list[Prompt], samples_per_prompt: int = 1) -> GenerationOutput:
        """Sample ``samples_per_prompt`` responses to each prompt.

        Args:
            prompts: the prompts to answer.
            samples_per_prompt: responses per prompt.

        Returns:
            ``len(prompts) * samples_per_prompt`` samples, grouped by prompt.
        """
        ...

    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load new policy weights (parameter name -> tensor)."""
        ...

    def sync_from(self, model: torch.nn.Module) -> None:
        """Make the engine sample from ``model``'s current weights."""
        ...


def score(task: Task, prompts: Sequence[Prompt], output: GenerationOutput) -> torch.Tensor:
    """Reward every sample of ``output`` with ``task``.

    Args:
        task: the task whose reward is used.
        prompts: the prompts passed to ``generate`` (indexed by ``output.prompt_index``).
        output: the generated samples.

    Returns:
        ``float32[n]`` rewards in ``[0, 1]``.
    """
    rewards = [
        task.reward(prompts[int(i)], text)
        for i, text in zip(output.prompt_index.tolist(), output.completions, strict=True)
    ]
    return torch.tensor(rewards, dtype=torch.float32)


def to_rollout(
    output: GenerationOutput,
    rewards: torch.Tensor | Sequence[float],
    include_truncated: bool = True,
) -> Rollout:
    """Pack generated samples and their rewards into a :class:`lppo.types.Rollout`.

    Args:
        output: the generated samples.
        rewards: one sequence-level score per sample.
        include_truncated: add a row-level ``"truncated"`` extra (0-dim bool tensor per row).

    Returns:
        The rollout (tensors are shared with ``output``, not copied).

    Raises:
        ValueError: if the number of rewards differs from the number of samples.
    """
    reward = torch.as_tensor(rewards, dtype=torch.float32).reshape(-1)
    if reward.numel() != len(output):
        raise ValueError(f"{reward.numel()} rewards for {len(output)} samples")
    extras: dict[str, list[torch.Tensor]] = {}
    if include_truncated:
        extras[TRUNCATED] = list(output.truncated.to(torch.bool).unbind(0))
    return Rollout(
        input_ids=list(output.input_ids),
        response_mask=list(output.response_mask),
        gen_logprobs=list(output.gen_logprobs),
        reward=reward,
        prompt_index=output.prompt_index.to(torch.int64),
        extras=extras,
    )
