"""Per-token KL estimators between the policy and the reference policy."""

from __future__ import annotations

from typing import Literal

import torch

from lppo.algorithms.losses import LOG_RATIO_CLAMP

KLKind = Literal["k1", "k2", "k3"]


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLKind) -> torch.Tensor:
    """Estimate ``KL(π ‖ π_ref)`` per sampled token (Schulman's estimators).

    With ``d = clamp(log π(a) − log π_ref(a), ±20)``
    (:data:`~lppo.algorithms.losses.LOG_RATIO_CLAMP`):

    * ``k1 = d`` (unbiased, can be negative),
    * ``k2 = d² / 2``,
    * ``k3 = exp(−d) − 1 + d`` (unbiased, non-negative).

    The one clamp policy of lppo's KL, in the reward (``model.ppo.kl_coef``) and in the loss
    (:func:`kl_loss`): ``d`` is bounded, the estimators' values are not. So every value is
    finite in float32 (k3 at most ``e^20 − 21 ≈ 4.9e8``) and each estimator is exact
    wherever ``|d| ≤ 20``; beyond, the value is the bound's and the gradient through ``d``
    is 0 (a token that far from π_ref is not pulled further by this term).

    Args:
        logprobs: ``float[B, T]`` log-probabilities of the sampled tokens under π.
        ref_logprobs: ``float[B, T]`` the same under π_ref.
        kind: which estimator.

    Returns:
        ``float[B, T]``.
    """
    diff = torch.clamp(logprobs - ref_logprobs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff.square()
    if kind == "k3":
        return torch.expm1(-diff) + diff
    raise ValueError(f"kl kind must be one of 'k1', 'k2', 'k3'; got {kind!r}")


def kl_loss(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLKind) -> torch.Tensor:
    """Per-token KL penalty as a loss term (GRPO's ``β·KL`` in the loss), with its gradient.

    The value is :func:`kl_penalty` (its clamp policy: ``d = clamp(log π_θ − log π_ref, ±20)``,
    gradient 0 beyond), and autograd through it gives each estimator's own gradient on the
    sampled tokens where ``|d| < 20``:

    * ``k1 = d``: ``∇ = ∇log π_θ``, zero in expectation on-policy (the score function): as
      a loss term it adds variance, not a pull towards π_ref;
    * ``k2 = d²/2``: ``∇ = d·∇log π_θ``, whose expectation on-policy is the gradient of
      KL(π_θ ‖ π_ref) (the "unbiased gradient" choice);
    * ``k3 = exp(−d) − 1 + d``: ``∇ = (1 − π_ref/π_θ)·∇log π_θ``, whose expectation
      on-policy is the gradient of the *forward* KL(π_ref ‖ π_θ); GRPO's choice (low-variance,
      non-negative value).

    The tokens are sampled from π_old, not π_θ, and no importance weight is applied (as GRPO,
    verl and TRL do).

    Args:
        logprobs: ``float[B, T]`` log π_θ of the sampled tokens (with grad).
        ref_logprobs: ``float[B, T]`` log π_ref of the same tokens.
        kind: which estimator.

    Returns:
        ``float[B, T]``.
    """
    return kl_penalty(logprobs, ref_logprobs, kind)
