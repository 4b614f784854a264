"""Policy objectives: the per-token actor loss, chosen by ``model.actor.init_args.objective``.

An objective turns the current and old log-probabilities and the advantages of a chunk into
per-token loss terms (:class:`~lppo.algorithms.losses.PolicyTerms`). It never aggregates:
the actor weights each token with the step's global normalizer
(:func:`~lppo.algorithms.losses.token_weights`), so every objective is exact under any
chunking and data-parallel size. A sequence-level objective (GSPO) only needs the rows'
own tokens, and a chunk always holds whole rows.

To add one: a class with ``__call__(logprobs, old_logprobs, advantages, mask) ->
PolicyTerms`` in this module or your own, selected by ``class_path``.

========== ============================================= ==========================
objective  per-token loss ``ℓ_t``                        clips
========== ============================================= ==========================
ClippedPPO ``max(−A·r, −A·clip(r, 1−ε_l, 1+ε_h))``       tokens (PPO, DAPO)
GSPO       the same with ``r`` → the sequence ratio ``s`` sequences (GSPO paper)
CISPO      ``−sg(clip(r, 1−ε_l, 1+ε_h))·A·log π``       IS weights (MiniMax-M1)
========== ============================================= ==========================
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from lppo.algorithms.losses import LOG_RATIO_CLAMP, PolicyTerms, policy_loss
from lppo.validation import check_number

_KEY = "model.actor.init_args.objective.init_args"


@runtime_checkable
class PolicyObjective(Protocol):
    """Per-token policy loss terms of a chunk of whole rows."""

    def __call__(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
    ) -> PolicyTerms:
        """Loss terms ``float[B, T]`` (entries off ``mask`` are ignored by the caller).

        Args:
            logprobs: ``float[B, T]`` log π_θ of the sampled tokens (with grad).
            old_logprobs: ``float[B, T]`` log π_old.
            advantages: ``float[B, T]``.
            mask: ``bool[B, T]`` the tokens that count (the policy's response tokens).
        """
        ...


class ClippedPPO:
    """PPO's clipped surrogate per token, with clip-higher and dual clip (the default).

    ``ℓ_t = max(−A_t·r_t, −A_t·clip(r_t, 1 − ε_low, 1 + ε_high))``, ``r_t = π_θ/π_old``;
    with dual clip ``c``, ``ℓ_t = min(ℓ_t, −c·A_t)`` where ``A_t < 0``
    (:func:`~lppo.algorithms.losses.policy_loss`). ``clip_high > clip_low`` is DAPO's
    clip-higher.

    Args:
        clip_low: ε_low of the ratio clip.
        clip_high: ε_high of the ratio clip.
        dual_clip: dual-clip constant ``c > 1`` for negative advantages, or ``None``.
    """

    def __init__(
        self, clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None
    ) -> None:
        check_number(
            f"{_KEY}.clip_low",
            clip_low,
            low=0,
            high=1,
            high_open=True,
            fix="The ratio is clipped to [1 - clip_low, 1 + clip_high]; typical: 0.2.",
        )
        check_number(f"{_KEY}.clip_high", clip_high, low=0, fix="Typical: 0.2 to 0.28.")
        check_number(
            f"{_KEY}.dual_clip",
            dual_clip,
            low=1,
            low_open=True,
            optional=True,
            fix="Dual clip bounds negative-advantage ratios; typical: 3.",
        )
        self.clip_low = clip_low
        self.clip_high = clip_high
        self.dual_clip = dual_clip

    def __call__(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
    ) -> PolicyTerms:
        """See :class:`PolicyObjective`."""
        return policy_loss(
            logprobs, old_logprobs, advantages, self.clip_low, self.clip_high, self.dual_clip
        )


def sequence_log_ratio(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor, clamp: bool = True
) -> torch.Tensor:
    """GSPO's length-normalized sequence log-ratio, ``float[B, 1]``.

    ``log s_i = (1/|y_i|) Σ_t m_t (log π_θ − log π_old)``, clamped to ±:data:`LOG_RATIO_CLAMP`
    unless ``clamp=False`` (``|y_i|`` the row's masked tokens; 0 for a row without one).
    """
    m = mask.to(logprobs.dtype)
    total = ((logprobs - old_logprobs) * m).sum(dim=-1, keepdim=True)
    mean = total / m.sum(dim=-1, keepdim=True).clamp_min(1.0)
    return torch.clamp(mean, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) if clamp else mean


class GSPO:
    """Group Sequence Policy Optimization (Zheng et al. 2025): the ratio of whole sequences.

    With the sequence ratio ``s_i = exp(log s_i)`` (:func:`sequence_log_ratio`), every token
    takes the token form of the paper (GSPO-token):
    ``s_{i,t} = sg(s_i) · π_θ(y_t) / sg(π_θ(y_t))`` (the value ``s_i``, the gradient
    ``s_i·∇log π_θ(y_t)``), and
    ``ℓ_t = max(−A_t·s_{i,t}, −A_t·clip(s_{i,t}, 1 − ε_low, 1 + ε_high))``.
    With one advantage per sequence (GRPO, RLOO, REINFORCE++) and
    ``loss_aggregation: seq_mean_token_mean`` this is exactly the paper's sequence objective
    ``−(1/G) Σ_i min(s_i·A_i, clip(s_i)·A_i)``; with token advantages (GAE) each token keeps
    its own. Whether a token is clipped depends on its sequence's ratio and its advantage's
    sign (on the sequence alone with one advantage per sequence); the actor reports the
    fraction of rows with a clipped token (``seq_clip_fraction``). The paper's ranges are tiny
    because ``s_i`` is a geometric mean of token ratios: ``3e-4`` / ``4e-4``.

    The token log-ratio ``log s_{i,t}`` (value and gradient path) is clamped to
    ±:data:`LOG_RATIO_CLAMP`: where the cap bounds the value, the gradient is 0 (as verl's
    clamp of the same quantity), so no token of a sequence that moved that far pushes further.

    Args:
        clip_low: ε_low of the sequence-ratio clip.
        clip_high: ε_high of the sequence-ratio clip.
    """

    def __init__(self, clip_low: float = 3e-4, clip_high: float = 4e-4) -> None:
        check_number(
            f"{_KEY}.clip_low", clip_low, low=0, high=1, high_open=True, fix="GSPO uses 3e-4."
        )
        check_number(f"{_KEY}.clip_high", clip_high, low=0, fix="GSPO's paper uses 4e-4.")
        self.clip_low = clip_low
        self.clip_high = clip_high

    def __call__(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
    ) -> PolicyTerms:
        """See :class:`PolicyObjective`."""
        log_s = sequence_log_ratio(logprobs, old_logprobs, mask, clamp=False).detach()
        token_log_ratio = torch.clamp(
            log_s + logprobs - logprobs.detach(), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP
        )
        ratio = torch.exp(token_log_ratio)  # value s_i, gradient s_i·∇log π_θ (0 at the cap)
        unclipped = -advantages * ratio
        bounded = torch.clamp(ratio, 1.0 - self.clip_low, 1.0 + self.clip_high)
        clipped_obj = -advantages * bounded
        loss = torch.maximum(unclipped, clipped_obj)
        clipped = clipped_obj > unclipped
        token_lr = torch.clamp(logprobs - old_logprobs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        approx_kl = (torch.exp(token_lr) - 1.0) - token_lr
        return PolicyTerms(
            loss=loss,
            clipped=clipped,
            approx_kl=approx_kl.detach(),
            ratio=ratio,
            sequence_level=True,
        )


class CISPO:
    """Clipped IS-weight Policy Optimization (MiniMax-M1, 2025): REINFORCE with a capped weight.

    ``ℓ_t = −sg(clip(r_t, 1 − ε_low, 1 + ε_high)) · A_t · log π_θ(y_t)``, ``r_t = π_θ/π_old``.
    Unlike PPO no token's gradient is ever dropped: the importance weight is bounded instead
    (``clipped`` marks tokens whose weight was). The paper sets no lower bound
    (``clip_low: 1``, weights down to 0) and tunes only ``clip_high``.

    Args:
        clip_low: ε_low of the weight (1: no lower bound).
        clip_high: ε_high of the weight.
    """

    def __init__(self, clip_low: float = 1.0, clip_high: float = 0.28) -> None:
        check_number(
            f"{_KEY}.clip_low",
            clip_low,
            low=0,
            high=1,
            fix="1 puts no lower bound on the weight (the paper's choice).",
        )
        check_number(
            f"{_KEY}.clip_high",
            clip_high,
            low=0,
            low_open=True,
            fix="The weight is capped at 1 + clip_high; typical: 0.28.",
        )
        self.clip_low = clip_low
        self.clip_high = clip_high

    def __call__(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
    ) -> PolicyTerms:
        """See :class:`PolicyObjective`."""
        log_ratio = torch.clamp(logprobs - old_logprobs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        ratio = torch.exp(log_ratio)
        low, high = 1.0 - self.clip_low, 1.0 + self.clip_high
        weight = torch.clamp(ratio, low, high).detach()
        loss = -weight * advantages * logprobs
        clipped = (ratio < low) | (ratio > high)
        approx_kl = (ratio - 1.0) - log_ratio
        return PolicyTerms(loss=loss, clipped=clipped, approx_kl=approx_kl.detach(), ratio=ratio)
