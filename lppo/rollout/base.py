"""The ``RolloutEngine`` protocol, its output container, and helpers to build a ``Rollout``.

Token-level fields follow the alignment convention of :mod:`lppo.types`: position ``t`` is
aligned with ``input_ids[t]`` and ``gen_logprobs[t] = log p(input_ids[t] | input_ids[:t])``
under the sampling distribution; prompt positions hold ``False`` / 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from lppo.replay.base import ReplayStore
from lppo.replay.rollout_rows import RowRules, StoredRollout
from lppo.reports import merge_reports
from lppo.rollout.settings import RolloutSettings
from lppo.tasks.base import Prompt, Task
from lppo.types import (
    FOR_ITERATION,
    OLD_LOGPROBS,
    POLICY_VERSION,
    TRUNCATED,
    TURN_REWARDS,
    EpisodeReport,
    Rollout,
)


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
        policy_logprobs: ``float32[L_i]`` per sample, from an engine asked for them: each
            response token's log-probability under π itself (the model's logits at the
            sampling temperature, before top-p / top-k or any other processing: what the
            actor scores as π_old); 0 on the prompt. ``None`` otherwise.
        completions: decoded response text per sample, without EOS or other special tokens.
        truncated: ``bool[n]``; ``True`` when a sample hit ``max_new_tokens`` without EOS.
        prompt_index: ``int64[n]``; index (into the ``prompts`` argument) each sample answers.
        prompt_lengths: ``int64[n]``; number of prompt tokens of each sample.
        dropped: samples the engine lost for good (a worker that kept failing); they are
            missing here and count against ``data.drop_budget``.
        turn_rewards: multi-turn samples only: ``float64[L_i]`` per sample, each turn's own
            reward on the turn's last token (0 elsewhere); ``None`` for single-turn samples.
        episodes: multi-turn samples only: what the episodes did (every episode the call
            ran, also those a later selection drops).
    """

    input_ids: list[torch.Tensor]
    response_mask: list[torch.Tensor]
    gen_logprobs: list[torch.Tensor]
    completions: list[str]
    truncated: torch.Tensor
    prompt_index: torch.Tensor
    prompt_lengths: torch.Tensor
    dropped: int = 0
    policy_logprobs: list[torch.Tensor] | None = None
    turn_rewards: list[torch.Tensor] | None = None
    episodes: EpisodeReport | None = None

    def __len__(self) -> int:
        return len(self.input_ids)

    def select(self, rows: Sequence[int]) -> GenerationOutput:
        """The samples ``rows``, in that order (``dropped`` and ``episodes`` kept whole)."""
        index = torch.tensor(list(rows), dtype=torch.long)
        turn_rewards, policy = self.turn_rewards, self.policy_logprobs
        return GenerationOutput(
            input_ids=[self.input_ids[i] for i in rows],
            response_mask=[self.response_mask[i] for i in rows],
            gen_logprobs=[self.gen_logprobs[i] for i in rows],
            completions=[self.completions[i] for i in rows],
            truncated=self.truncated[index],
            prompt_index=self.prompt_index[index],
            prompt_lengths=self.prompt_lengths[index],
            dropped=self.dropped,
            policy_logprobs=None if policy is None else [policy[i] for i in rows],
            turn_rewards=None if turn_rewards is None else [turn_rewards[i] for i in rows],
            episodes=self.episodes,
        )


@runtime_checkable
class RolloutEngine(Protocol):
    """Samples responses from the current policy; chosen by ``model.engine.class_path``.

    Lifecycle: :meth:`setup` once (the policy, its tokenizer and the sampling settings), then
    :meth:`generate` every iteration (and greedily for evaluation). An engine that holds its
    own copy of the weights (another process, vLLM) refreshes it in :meth:`sync_from`, which
    lppo calls after every actor phase and before any generation whose
    :attr:`weights_version` lags the policy's. :meth:`close` when the run ends.

    Optional: an engine whose forward pass is the actor's own (``HFGenerateEngine``) may
    define ``policy_logprob_obstacles(policy) -> list[str]`` (why its log-probs of π would not
    be π_old; empty: they are) and then, once lppo sets its ``return_policy_logprobs`` to
    ``True``, fill ``GenerationOutput.policy_logprobs`` (``model.ppo.old_logprobs: engine``).

    Attributes:
        weights_version: the policy ``weights_version`` the engine samples from (set by
            :meth:`sync_from`); lppo refuses to generate when it lags the policy's.
    """

    weights_version: int

    def setup(self, policy: torch.nn.Module, tokenizer: Any, sampling: RolloutSettings) -> None:
        """Bind the engine to ``policy`` (a causal LM), ``tokenizer`` and ``sampling``."""
        ...

    def generate(
        self, prompts: list[Prompt], samples_per_prompt: int, seed: int, greedy: bool = False
    ) -> GenerationOutput:
        """Sample ``samples_per_prompt`` responses to each prompt, reproducibly from ``seed``.

        Args:
            prompts: the prompts to answer.
            samples_per_prompt: responses per prompt.
            seed: seed of this call (the same seed gives the same samples).
            greedy: take the argmax instead of sampling (evaluation; the seed then does not
                matter); ``gen_logprobs`` are then those of the unscaled distribution.

        Returns:
            ``len(prompts) * samples_per_prompt`` samples, grouped by prompt.
        """
        ...

    def sync_from(self, policy: torch.nn.Module, version: int) -> None:
        """Sample from ``policy``'s current weights from now on; set ``weights_version``."""
        ...

    def close(self) -> None:
        """Release what the engine started (processes, servers, files); idempotent.

        lppo calls it when the run ends (``PPOSystem.teardown``); an engine that started
        nothing does nothing.
        """
        ...


@dataclass(frozen=True)
class PromptBlock:
    """Prompts generated together from one seed (one block of ``model.rollout``).

    Attributes:
        start: index of the block's first prompt among the iteration's prompts (the block's
            samples answer prompts ``start + i``).
        prompts: the block's prompts.
        seed: the block's generation seed.
        refills: the block's reserve for dynamic sampling (``model.rollout.
            dynamic_sampling_rounds``): one block of fresh prompts per extra round, generated
            in order only while this block has fewer informative groups than prompts.
    """

    start: int
    prompts: list[Prompt]
    seed: int
    refills: tuple[PromptBlock, ...] = ()


@dataclass(frozen=True)
class RowJob:
    """What an engine needs to write a rank's rollout rows into a shared store itself.

    Attributes:
        blocks: this rank's blocks, in order (their rows come back in this order).
        samples_per_prompt: responses sampled per prompt.
        task: rewards the samples (``score``: one ``Task.rewards`` call per unit of work, so a
            reward must not depend on which other samples share its call).
        rules: which rows become invalid when put (``model.ppo``).
        provenance: ``(iteration, policy version)`` stored with every row (:func:`to_rollout`).
    """

    blocks: list[PromptBlock]
    samples_per_prompt: int
    task: Task
    rules: RowRules
    provenance: tuple[int, int] = (0, 0)


@runtime_checkable
class StoreWritingEngine(Protocol):
    """A :class:`RolloutEngine` that also writes rows into a shared store from its own processes.

    :class:`~lppo.rollout.RolloutSource` uses it when the replay store is shared
    (``store.shared``); the trainer then receives row ids and per-row scalars, never the
    samples' tensors. Each unit of work must sample what :meth:`RolloutEngine.generate` would
    for it, reward with :func:`score` and put with :func:`~lppo.replay.rollout_rows.put_rollout`
    into ids from ``store.allocate``. A failed call leaves nothing in the store.
    """

    def generate_into(self, store: ReplayStore, job: RowJob) -> StoredRollout:
        """Sample, reward and put ``job``'s rows into ``store``; return them in block order.

        Samples lost for good are counted in ``StoredRollout.dropped``.

        Raises:
            RewardError: the task's reward failed (nothing of the call stays in the store).
        """
        ...


def concat_outputs(outputs: Sequence[GenerationOutput]) -> GenerationOutput:
    """The samples of several ``generate`` calls, in order, as one output."""
    multi_turn = [o.turn_rewards is not None for o in outputs]
    if any(multi_turn) and not all(multi_turn):
        raise ValueError("concat_outputs: multi-turn and single-turn samples mixed")
    turn_rewards = [x for o in outputs for x in o.turn_rewards or []] if all(multi_turn) else None
    with_policy = all(o.policy_logprobs is not None for o in outputs)
    return GenerationOutput(
        input_ids=[x for o in outputs for x in o.input_ids],
        response_mask=[x for o in outputs for x in o.response_mask],
        gen_logprobs=[x for o in outputs for x in o.gen_logprobs],
        completions=[x for o in outputs for x in o.completions],
        truncated=torch.cat([o.truncated for o in outputs]),
        prompt_index=torch.cat([o.prompt_index for o in outputs]),
        prompt_lengths=torch.cat([o.prompt_lengths for o in outputs]),
        dropped=sum(o.dropped for o in outputs),
        policy_logprobs=[x for o in outputs for x in o.policy_logprobs or []]
        if outputs and with_policy
        else None,
        turn_rewards=turn_rewards if outputs else None,
        episodes=merge_reports([o.episodes for o in outputs]),
    )


def to_rollout(
    output: GenerationOutput,
    rewards: torch.Tensor | Sequence[float],
    include_truncated: bool = True,
    provenance: tuple[int, int] | None = None,
) -> Rollout:
    """Pack generated samples and their rewards into a :class:`lppo.types.Rollout`.

    Args:
        output: the generated samples.
        rewards: one sequence-level score per sample.
        include_truncated: add a row-level ``"truncated"`` extra (0-dim bool tensor per row).
        provenance: ``(iteration, policy version)``: add the row-level ``for_iteration`` and
            ``policy_version`` extras (0-dim int64 per row).

    Returns:
        The rollout (tensors are shared with ``output``, not copied).

    Raises:
        ValueError: if the number of rewards differs from the number of samples.
    """
    reward = torch.as_tensor(rewards, dtype=torch.float64).reshape(-1)
    if reward.numel() != len(output):
        raise ValueError(f"{reward.numel()} rewards for {len(output)} samples")
    extras: dict[str, list[torch.Tensor]] = {}
    if include_truncated:
        extras[TRUNCATED] = list(output.truncated.to(torch.bool).unbind(0))
    if output.turn_rewards is not None:
        extras[TURN_REWARDS] = list(output.turn_rewards)
    if output.policy_logprobs is not None:  # model.ppo.old_logprobs: engine
        extras[OLD_LOGPROBS] = list(output.policy_logprobs)
    if provenance is not None:
        for name, value in zip((FOR_ITERATION, POLICY_VERSION), provenance, strict=True):
            extras[name] = [torch.tensor(value, dtype=torch.int64) for _ in range(len(output))]
    return Rollout(
        input_ids=list(output.input_ids),
        response_mask=list(output.response_mask),
        gen_logprobs=list(output.gen_logprobs),
        reward=reward,
        prompt_index=output.prompt_index.to(torch.int64),
        extras=extras,
        dropped=output.dropped,
        episodes=output.episodes,
    )
