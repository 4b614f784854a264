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
from lppo.validation import check_number


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
        turn_rewards: multi-turn samples only: ``float32[L_i]`` per sample, each turn's own
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


@dataclass(frozen=True)
class RolloutSettings:
    """How each iteration's samples are generated: the one source of sampling settings.

    The engine samples with them and the actor scores with the same temperature (set from
    here at setup), so sampling and training can never silently disagree.

    Attributes:
        prompts_per_iteration: prompts drawn from the task per iteration.
        samples_per_prompt: responses sampled per prompt.
        max_new_tokens: longest response (EOS included).
        temperature: sampling temperature (the actor scores with the same one).
        top_p: nucleus-sampling mass; 1 disables it.
        top_k: keep the ``top_k`` most likely tokens; 0 disables it.
        prompts_per_block: prompts generated together, from one seed, by one ``generate``
            call: the unit of rollout work that data-parallel ranks split (whole blocks,
            contiguous, so every prompt's samples stay on one rank). Block ``b`` of iteration
            ``i`` samples from a seed derived from ``(model.seed, i, b)``, so with a fixed value
            the samples do not depend on how many ranks generate them. ``null``: one block per
            data-parallel rank (one block in a single process); set it to compare runs across
            rank counts.
        min_new_tokens: the end-of-sequence token is suppressed (probability 0) before this
            many response tokens; the sampling distribution then differs from the policy's
            for those tokens, so ``gen_logprobs`` are no longer the trainer's.
        ignore_eos: keep sampling after an end-of-sequence token: every response has exactly
            ``max_new_tokens`` tokens (EOS tokens stay in it as ordinary tokens) and none is
            truncated; the distribution is unchanged (benchmarks, fixed-length workloads).
        max_staleness: the fixed lag ``s`` of asynchronous rollouts. Iteration ``t`` trains on
            samples drawn from exactly the policy published after iteration ``t - s - 1``'s
            actor phase (the initial policy for the first ones), generated while iterations
            ``t - s .. t - 1`` train. ``0``: the synchronous run. With ``s > 0`` the actor's
            off-policy correction (``model.actor.init_args.off_policy``, ``auto``: truncated
            importance sampling) reweights the stale rows.
        allow_uncorrected_staleness: with ``max_staleness > 0`` and the off-policy correction
            off (``off_policy.mode: none``), train on stale rows as if they were on-policy.
            That biases the gradient (the PPO ratio is then taken against a policy that did
            not sample the rows); an explicit opt-in.
        dynamic_sampling_rounds: DAPO's dynamic sampling (:mod:`lppo.rollout.dynamic_sampling`).
            ``0``: off. ``N > 0``: prompt groups whose samples all got the same reward are
            dropped, and each block refills itself from up to ``N`` extra blocks of fresh
            prompts until it holds as many informative groups as prompts (then the iteration
            trains on what there is). The refills' prompts are drawn when the iteration is
            admitted, so a task with a position (a dataset) advances by
            ``(N + 1) × prompts_per_iteration`` prompts per iteration. Refills are whole
            blocks: a small ``prompts_per_block`` wastes fewer samples. An iteration left with
            fewer valid rows than ``*_minibatches`` takes one step per row; one left with none
            trains nothing (logged, not failed).
    """

    prompts_per_iteration: int = 32
    samples_per_prompt: int = 4
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    prompts_per_block: int | None = None
    min_new_tokens: int = 0
    ignore_eos: bool = False
    max_staleness: int = 0
    allow_uncorrected_staleness: bool = False
    dynamic_sampling_rounds: int = 0

    def __post_init__(self) -> None:
        """Raise ``ValueError`` naming the key, the value and the fix for a bad setting."""
        for key in ("prompts_per_iteration", "samples_per_prompt", "max_new_tokens"):
            check_number(f"model.rollout.{key}", getattr(self, key), integer=True, low=1)
        check_number(
            "model.rollout.temperature",
            self.temperature,
            low=0,
            low_open=True,
            fix="1.0 samples from the policy itself.",
        )
        check_number(
            "model.rollout.top_p",
            self.top_p,
            low=0,
            high=1,
            low_open=True,
            fix="1.0 disables nucleus sampling.",
        )
        check_number("model.rollout.top_k", self.top_k, integer=True, low=0, fix="0 disables it.")
        check_number(
            "model.rollout.prompts_per_block",
            self.prompts_per_block,
            integer=True,
            low=1,
            optional=True,
            fix="null: one block per rank.",
        )
        check_number(
            "model.rollout.min_new_tokens",
            self.min_new_tokens,
            integer=True,
            low=0,
            high=self.max_new_tokens,
            fix="It must lie in [0, model.rollout.max_new_tokens].",
        )
        check_number(
            "model.rollout.max_staleness",
            self.max_staleness,
            integer=True,
            low=0,
            fix="0 is the synchronous run; 1 overlaps generation with one training iteration.",
        )
        check_number(
            "model.rollout.dynamic_sampling_rounds",
            self.dynamic_sampling_rounds,
            integer=True,
            low=0,
            fix="0 turns dynamic sampling off; DAPO allows a few extra generation rounds.",
        )
        if self.dynamic_sampling_rounds and self.samples_per_prompt < 2:
            raise ValueError(
                f"model.rollout.dynamic_sampling_rounds={self.dynamic_sampling_rounds} with "
                f"model.rollout.samples_per_prompt={self.samples_per_prompt}: a group of one "
                "sample always has a single reward, so every group would be dropped; sample at "
                "least 2 per prompt, or set dynamic_sampling_rounds: 0."
            )

    @property
    def rows_per_iteration(self) -> int:
        """Rows each iteration puts into the replay store."""
        return self.prompts_per_iteration * self.samples_per_prompt


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
    reward = torch.as_tensor(rewards, dtype=torch.float32).reshape(-1)
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
