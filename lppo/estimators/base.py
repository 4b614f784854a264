"""The ``AdvantageEstimator`` protocol and what the controller hands it.

An estimator turns the scored rows of an iteration (rewards, old values, old and reference
log-probabilities) into the ``advantages`` the actor trains on and the ``returns`` the critic
regresses to, writing both back into the replay store. It streams chunks like every other
phase and never sees a merged batch; any statistic it needs over the whole iteration (the
whitening moments, a group baseline) is accumulated over chunks and reduced over
``inputs.group``, so the result is the same for any chunking and any number of ranks.

To add one: write a class with an ``estimate`` method in its own file and select it with
``model.estimator.class_path`` (export it from :mod:`lppo.estimators` to make it short).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from lppo.algorithms import kl_penalty, token_rewards, whiten
from lppo.algorithms.kl import KLKind
from lppo.iteration.chunks import iter_chunks, unpad
from lppo.parallel import ProcessGroup
from lppo.replay.base import ReplayStore
from lppo.stats import Moments
from lppo.types import (
    ADVANTAGES,
    OLD_LOGPROBS,
    REF_LOGPROBS,
    REWARD,
    TURN_REWARDS,
    Chunk,
    StepPlan,
)


@dataclass(frozen=True)
class EstimatorInputs:
    """The iteration's scored rows, as an estimator reads and writes them.

    Attributes:
        store: the replay store holding the rows.
        step: every valid row of the iteration that this rank handles, in chunks.
        group: the ranks the rows are split over (statistics are reduced over it; a
            single-rank group when every rank holds every row).
        kl_coef: β of the KL penalty folded into the per-token reward (0: none).
        kl_kind: estimator of that KL (``k1``, ``k2``, ``k3``).
        turn_rewards: the rows are multi-turn trajectories with a ``turn_rewards`` column
            (:class:`~lppo.rollout.MultiTurnEngine`): each turn's own reward sits on the
            turn's last token, and ``reward`` is the episode's return (those plus the final
            answer's score).
    """

    store: ReplayStore
    step: StepPlan
    group: ProcessGroup
    kl_coef: float = 0.0
    kl_kind: KLKind = "k1"
    turn_rewards: bool = False

    def chunks(self, names: Sequence[str]) -> Iterator[Chunk]:
        """The non-padding chunks of :attr:`step` with columns ``names``, read when reached."""
        return (c for c in iter_chunks(self.store, self.step, names) if not c.is_padding)

    def write(self, chunk: Chunk, columns: Mapping[str, torch.Tensor]) -> None:
        """Write token-level ``[B, T]`` tensors of ``chunk``'s rows back into the store."""
        self.store.write(chunk.row_ids, {k: unpad(chunk, v) for k, v in columns.items()})

    @property
    def reward_columns(self) -> list[str]:
        """Columns :meth:`token_rewards` reads."""
        kl = [OLD_LOGPROBS, REF_LOGPROBS] if self.kl_coef > 0 else []
        return [REWARD, *kl, *([TURN_REWARDS] if self.turn_rewards else [])]

    def token_rewards(self, chunk: Chunk, kl_moments: Moments) -> torch.Tensor:
        """Per-token rewards ``r·[t = last] − β·KL_t`` of ``chunk``; folds KL into ``kl_moments``.

        Multi-turn rows (:attr:`turn_rewards`) get each turn's reward ``u_t`` on its turn's
        last token and the rest of the return on the last token:
        ``r_t = (R − Σ u)·[t = last] + u_t − β·KL_t``, so the rewards still sum to the
        return ``R`` (what critic-free estimators use).

        The chunk must hold :attr:`reward_columns`.
        """
        assert chunk.reward is not None
        kl = None
        if self.kl_coef > 0:
            assert chunk.old_logprobs is not None and chunk.ref_logprobs is not None
            kl = kl_penalty(chunk.old_logprobs, chunk.ref_logprobs, self.kl_kind)
            kl_moments.update(kl, chunk.response_mask)
        if not self.turn_rewards:
            return token_rewards(chunk.reward, chunk.response_mask, kl, self.kl_coef)
        turns = chunk.extras[TURN_REWARDS].to(chunk.reward.dtype)
        final = chunk.reward - turns.sum(dim=-1)
        return token_rewards(final, chunk.response_mask, kl, self.kl_coef) + turns

    def whiten_advantages(self, moments: Moments) -> None:
        """Second streamed pass: whiten the stored advantages with ``moments`` merged over ranks."""
        moments.all_reduce(self.group)
        for chunk in self.chunks([ADVANTAGES]):
            assert chunk.advantages is not None
            white = whiten(chunk.advantages, chunk.response_mask, moments)
            self.write(chunk, {ADVANTAGES: white})


@dataclass
class TargetMoments:
    """What a :class:`ValueTargets` estimator accumulates over an iteration's chunks.

    Attributes:
        advantages: moments of the raw advantages over valid tokens (for whitening).
        kl: moments of the per-token KL of the penalty over valid tokens.
    """

    advantages: Moments = field(default_factory=Moments)
    kl: Moments = field(default_factory=Moments)


@runtime_checkable
class AdvantageEstimator(Protocol):
    """Computes advantages (and, with a critic, returns) of every valid row of an iteration.

    Attributes:
        uses_critic: ``True``: the estimator reads the critic's ``values`` and writes the
            ``returns`` it trains on; ``False``: it needs no critic (``model.critic: null``).
    """

    uses_critic: bool

    def reads(self) -> list[str]:
        """The columns :meth:`estimate` reads besides :attr:`EstimatorInputs.reward_columns`.

        ``values`` for an estimator that uses a critic, ``prompt_index`` for a group baseline.
        The run plan checks that something in the run writes each one.
        """
        ...

    def writes(self) -> list[str]:
        """The columns :meth:`estimate` writes: ``advantages``, and ``returns`` with a critic."""
        ...

    def estimate(self, inputs: EstimatorInputs) -> dict[str, float]:
        """Write ``advantages`` (and ``returns`` when it uses a critic) into the store.

        Args:
            inputs: the rows (with ``reward``, ``prompt_index``, ``old_logprobs``, ``values``
                when there is a critic and ``ref_logprobs`` when ``kl_coef > 0``) and the group
                to reduce over.

        Returns:
            Iteration metrics reported under ``rollout/`` (e.g. ``kl_mean``).
        """
        ...


@runtime_checkable
class ValueTargets(AdvantageEstimator, Protocol):
    """An estimator whose targets of a row depend only on that row's values and rewards.

    Such an estimator can take the old values from the critic's first training epoch
    (``model.ppo.old_values: critic``): per chunk, :meth:`chunk_targets` turns the values the
    critic just computed into advantages and returns; after the epoch :meth:`finish_targets`
    applies what spans rows (whitening). :meth:`estimate` is the same two calls over stored
    values.
    """

    def chunk_targets(
        self, inputs: EstimatorInputs, chunk: Chunk, values: torch.Tensor, acc: TargetMoments
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw ``(advantages, returns)``, ``float[B, T]``, of ``chunk``'s rows from ``values``.

        Args:
            inputs: the iteration's rows (for the reward columns and the KL settings).
            chunk: rows holding :attr:`EstimatorInputs.reward_columns`.
            values: ``float[B, T]`` old values of those rows (0 off-response).
            acc: moments to accumulate for :meth:`finish_targets`.
        """
        ...

    def finish_targets(self, inputs: EstimatorInputs, acc: TargetMoments) -> dict[str, float]:
        """Finish the stored advantages of every chunk (e.g. whiten); return metrics."""
        ...
