"""Critic-free estimators from sequence outcomes: GRPO (group-normalized) and RLOO.

Both score each row once, ``s_i = r_i − β·Σ_t KL_t`` (the sequence reward minus the KL penalty
summed over its valid tokens, the same KL-in-reward shaping as :class:`~lppo.estimators.GAE`),
then compare it with the other samples of the same prompt. Group statistics are accumulated
per prompt from every chunk and merged over ``inputs.group`` (Chan et al.), so they are the
same whatever the chunking and the number of ranks. Every valid token of row ``i`` gets the
row's advantage ``A_i``. Rows without a valid token never reach an estimator.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from lppo.algorithms import kl_penalty
from lppo.estimators.base import EstimatorInputs
from lppo.init_args import RecordsInitArgs
from lppo.stats import Moments
from lppo.types import ADVANTAGES, OLD_LOGPROBS, PROMPT_INDEX, REF_LOGPROBS, REWARD
from lppo.validation import check_number


def sequence_scores(inputs: EstimatorInputs) -> dict[int, tuple[int, float]]:
    """``row id -> (prompt index, s_i)`` for every row of ``inputs.step``, streamed by chunk.

    ``s_i = r_i − β·Σ_t KL_t`` over the row's valid tokens (``β = inputs.kl_coef``), in float64.
    """
    use_kl = inputs.kl_coef > 0
    names = [REWARD, PROMPT_INDEX] + ([OLD_LOGPROBS, REF_LOGPROBS] if use_kl else [])
    scores: dict[int, tuple[int, float]] = {}
    for chunk in inputs.chunks(names):
        assert chunk.reward is not None
        s = chunk.reward.to(torch.float64)
        if use_kl:
            assert chunk.old_logprobs is not None and chunk.ref_logprobs is not None
            kl = kl_penalty(chunk.old_logprobs, chunk.ref_logprobs, inputs.kl_kind)
            s = s - inputs.kl_coef * (kl.to(torch.float64) * chunk.response_mask).sum(-1)
        groups = chunk.extras[PROMPT_INDEX].tolist()
        for row, g, v in zip(chunk.row_ids, groups, s.tolist(), strict=True):
            scores[row] = (int(g), float(v))
    return scores


def group_moments(
    scores: dict[int, tuple[int, float]], inputs: EstimatorInputs
) -> dict[int, Moments]:
    """Per-prompt moments of the scores, merged over every rank of ``inputs.group``."""
    local: dict[int, Moments] = {}
    for g, v in scores.values():
        local.setdefault(g, Moments()).update(torch.tensor([v], dtype=torch.float64))
    if inputs.group.size == 1:
        return local
    merged: dict[int, Moments] = {}
    for part in inputs.group.all_gather_object(
        {g: (m.count, m.mu, m.m2) for g, m in local.items()}
    ):
        for g, (count, mu, m2) in sorted(part.items()):
            merged.setdefault(g, Moments()).merge(Moments(count, mu, m2))
    return merged


def write_row_advantages(inputs: EstimatorInputs, advantages: dict[int, float]) -> None:
    """Write ``A_i`` on every valid token of each row (0 elsewhere)."""
    for chunk in inputs.chunks([REWARD]):
        assert chunk.reward is not None  # its dtype is the advantages' (float64 in parity runs)
        per_row = torch.tensor([advantages[r] for r in chunk.row_ids], dtype=chunk.reward.dtype)
        adv = per_row[:, None] * chunk.response_mask
        inputs.write(chunk, {ADVANTAGES: adv})


def _summary(values: Iterable[float]) -> dict[str, float]:
    vals = list(values)
    return {"advantage_abs_mean": math.fsum(abs(v) for v in vals) / max(len(vals), 1)}


class _Outcome(RecordsInitArgs):
    """What GRPO and RLOO read and write: one score per row, compared within its prompt."""

    uses_critic = False

    def reads(self) -> list[str]:
        """The prompt each row answers (besides the reward columns)."""
        return [PROMPT_INDEX]

    def writes(self) -> list[str]:
        """The advantages."""
        return [ADVANTAGES]


class GRPO(_Outcome):
    """Group-relative advantages: ``A_i = (s_i − mean_g) / (std_g + eps)`` (DeepSeekMath).

    ``mean_g`` and the population ``std_g`` (divided by G) are over the valid samples of row
    ``i``'s prompt. TRL and verl divide by G − 1 (the sample std), so these advantages are
    √(G / (G − 1)) × theirs (1.069 at G = 8): a constant factor that AdamW cancels, but SGD
    or a gradient clip that binds on one side only does not. With ``scale_by_std=false`` the
    division is dropped (Dr. GRPO). A group whose samples all scored the same gets advantage 0
    everywhere.

    Args:
        scale_by_std: divide by the group's standard deviation.
        eps: added to the standard deviation.
    """

    def __init__(self, scale_by_std: bool = True, eps: float = 1e-6) -> None:
        check_number(
            "model.estimator.init_args.eps", eps, low=0, low_open=True, fix="Typical: 1e-6."
        )
        self.scale_by_std = scale_by_std
        self.eps = eps

    @torch.no_grad()
    def estimate(self, inputs: EstimatorInputs) -> dict[str, float]:
        """Write group-normalized advantages; report their mean absolute value."""
        scores = sequence_scores(inputs)
        groups = group_moments(scores, inputs)
        adv = {}
        for row, (g, v) in scores.items():
            m = groups[g]
            centered = v - m.mean
            adv[row] = centered / (math.sqrt(m.var) + self.eps) if self.scale_by_std else centered
        write_row_advantages(inputs, adv)
        return _summary(adv.values())


class RLOO(_Outcome):
    """REINFORCE leave-one-out: ``A_i = s_i − mean_{j ≠ i, j ∈ g} s_j`` (Ahmadian et al. 2024).

    Equivalently ``A_i = k/(k − 1) · (s_i − mean_g)`` for a group of ``k`` valid samples; a
    prompt needs at least two valid samples (``model.rollout.samples_per_prompt >= 2``).
    """

    @torch.no_grad()
    def estimate(self, inputs: EstimatorInputs) -> dict[str, float]:
        """Write leave-one-out advantages; report their mean absolute value.

        Raises:
            ValueError: a prompt has a single valid sample (no baseline to leave it out of).
        """
        scores = sequence_scores(inputs)
        groups = group_moments(scores, inputs)
        adv = {}
        for row, (g, v) in scores.items():
            k = groups[g].count
            if k < 2:
                raise ValueError(
                    f"RLOO: prompt {g} has {int(k)} valid sample; leave-one-out needs >= 2 "
                    "per prompt: raise model.rollout.samples_per_prompt (or data.drop_budget "
                    "lost the others)."
                )
            adv[row] = k / (k - 1) * (v - groups[g].mean)
        write_row_advantages(inputs, adv)
        return _summary(adv.values())
