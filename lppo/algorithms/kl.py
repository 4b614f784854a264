"""Per-token KL estimators between the policy and the reference policy."""

from __future__ import annotations

from typing import Literal

import torch

KLKind = Literal["k1", "k2", "k3"]


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLKind) -> torch.Tensor:
    """Estimate ``KL(π ‖ π_ref)`` per sampled token (Schulman's estimators).

    With ``d = log π(a) − log π_ref(a)``:

    * ``k1 = d`` (unbiased, can be negative),
    * ``k2 = d² / 2``,
    * ``k3 = exp(−d) − 1 + d`` (unbiased, non-negative).

    Args:
        logprobs: ``float[B, T]`` log-probabilities of the sampled tokens under π.
        ref_logprobs: ``float[B, T]`` the same under π_ref.
        kind: which estimator.

    Returns:
        ``float[B, T]``.
    """
    diff = logprobs - ref_logprobs
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff.square()
    if kind == "k3":
        return torch.expm1(-diff) + diff
    raise ValueError(f"kl kind must be one of 'k1', 'k2', 'k3'; got {kind!r}")
