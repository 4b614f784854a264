"""Engine/trainer log-probability mismatch: diagnostics and truncated importance sampling.

The rollout engine samples token ``y_t`` from its own distribution ``μ`` (the *behaviour*
policy: vLLM's kernels, another precision, another process) and stores ``log μ(y_t)`` as
``gen_logprobs``; the trainer recomputes ``log π_old(y_t)`` on the same weights in the score
phase. The two differ by numerics, so the PPO ratio ``π/π_old`` is taken against a policy that
did not sample the data. Truncated importance sampling (TIS, as in verl's rollout correction
and NeMo-RL's importance-sampling correction) reweights each token's policy loss by

``w_t = min(exp(log π_old − log μ), C)``   (``truncate``), or
``w_t = exp(log π_old − log μ) · 1[F ≤ w_t ≤ C]``   (``mask``: tokens outside the bounds are
zeroed),

detached (a constant per token, like the advantage). Every function here is pure; the caller
aggregates with the step's global normalizer, so exactness under any chunking is kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from lppo.algorithms.losses import LOG_RATIO_CLAMP
from lppo.parallel import SINGLE, ProcessGroup

OffPolicyMode = Literal["none", "truncate", "mask"]

_KEY = "model.actor.init_args.off_policy"


@dataclass(frozen=True)
class OffPolicyCorrection:
    """Off-policy correction of the actor loss, and the bounds the mismatch metrics report.

    Attributes:
        mode: ``none`` (default: plain PPO), ``truncate`` (weight ``min(w, cap)``) or
            ``mask`` (weight ``w`` inside ``[floor, cap]``, 0 outside).
        cap: upper bound ``C >= 1`` of the importance weight.
        floor: lower bound ``F`` in ``(0, 1]`` (``mask`` mode and the outside-bounds metric);
            ``null``: ``1 / cap``.
    """

    mode: OffPolicyMode = "none"
    cap: float = 2.0
    floor: float | None = None

    def __post_init__(self) -> None:
        """Raise ``ValueError`` naming the key, the value and the fix for a bad setting."""
        if self.mode not in ("none", "truncate", "mask"):
            raise ValueError(f"{_KEY}.mode={self.mode!r}; use 'none', 'truncate' or 'mask'.")
        if not (isinstance(self.cap, int | float) and math.isfinite(self.cap) and self.cap >= 1):
            raise ValueError(
                f"{_KEY}.cap={self.cap!r} must be a finite number >= 1 (a weight of 1, the "
                "on-policy case, must pass unchanged); verl and NeMo-RL use 2."
            )
        if self.floor is not None and not (
            isinstance(self.floor, int | float) and 0 < self.floor <= 1
        ):
            raise ValueError(
                f"{_KEY}.floor={self.floor!r} must lie in (0, 1], or be null for 1 / cap."
            )

    @property
    def enabled(self) -> bool:
        """Whether the actor loss is reweighted."""
        return self.mode != "none"

    @property
    def lower(self) -> float:
        """The effective floor ``F``."""
        return self.floor if self.floor is not None else 1.0 / self.cap


@dataclass
class ImportanceWeights:
    """Per-token importance weights of one chunk (detached).

    Attributes:
        weight: ``float[B, T]`` the factor each token's policy loss is multiplied by.
        outside: ``bool[B, T]`` where ``exp(old − behaviour)`` lies outside ``[floor, cap]``.
    """

    weight: torch.Tensor
    outside: torch.Tensor


def importance_weights(
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    correction: OffPolicyCorrection,
) -> ImportanceWeights:
    """Truncated (or masked) importance weights ``π_old / μ`` per token.

    ``w = exp(clamp(old − behaviour, ±20))``; ``truncate``: ``min(w, C)``; ``mask``:
    ``w · 1[F ≤ w ≤ C]``; ``none``: 1. With ``behaviour == old`` every weight is exactly 1,
    so the corrected loss equals plain PPO bit for bit.

    Args:
        old_logprobs: ``float[B, T]`` trainer log-probabilities (π_old).
        behaviour_logprobs: ``float[B, T]`` the engine's sampling log-probabilities (μ).
        correction: mode and bounds.

    Returns:
        :class:`ImportanceWeights`, both tensors without gradient.
    """
    with torch.no_grad():
        log_w = torch.clamp(old_logprobs - behaviour_logprobs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        w = torch.exp(log_w)
        outside = (w > correction.cap) | (w < correction.lower)
        if correction.mode == "truncate":
            w = torch.clamp(w, max=correction.cap)
        elif correction.mode == "mask":
            w = torch.where(outside, torch.zeros_like(w), w)
        else:
            w = torch.ones_like(w)
    return ImportanceWeights(weight=w, outside=outside)


@dataclass
class Mismatch:
    """Engine-vs-trainer mismatch over sampled tokens, accumulated chunk by chunk (float64).

    ``d = log π_old − log μ`` per sampled token. ``KL(μ‖π_old)`` is estimated from the
    engine's own samples with the non-negative, unbiased ``k3 = (e^d − 1) − d``.

    Attributes:
        tokens: sampled tokens seen.
        kl_sum: ``Σ k3``.
        max_abs_log_ratio: ``max |d|``.
        outside: tokens whose ``e^d`` lies outside the correction bounds ``[floor, cap]``.
    """

    tokens: int = 0
    kl_sum: float = 0.0
    max_abs_log_ratio: float = 0.0
    outside: int = 0

    def add(
        self,
        old_logprobs: torch.Tensor,
        behaviour_logprobs: torch.Tensor,
        mask: torch.Tensor,
        correction: OffPolicyCorrection,
    ) -> None:
        """Fold the sampled tokens (``mask``) of one chunk in; all tensors ``[B, T]``."""
        d = (old_logprobs.detach().double() - behaviour_logprobs.detach().double())[mask]
        if d.numel() == 0:
            return
        d = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        w = torch.exp(d)
        self.tokens += int(d.numel())
        self.kl_sum += float(((w - 1.0) - d).sum())
        self.max_abs_log_ratio = max(self.max_abs_log_ratio, float(d.abs().max()))
        self.outside += int(((w > correction.cap) | (w < correction.lower)).sum())

    def all_reduce(self, group: ProcessGroup = SINGLE) -> None:
        """Sum the counts and sums, take the max of the maxima, over ``group``'s ranks."""
        if group.size == 1:
            return
        sums = torch.tensor([self.tokens, self.kl_sum, self.outside], dtype=torch.float64)
        tokens, kl_sum, outside = group.all_reduce(sums, "sum").tolist()
        top = group.all_reduce(torch.tensor([self.max_abs_log_ratio], dtype=torch.float64), "max")
        self.tokens, self.kl_sum, self.outside = round(tokens), kl_sum, round(outside)
        self.max_abs_log_ratio = float(top[0])

    def metrics(self) -> dict[str, float]:
        """``mismatch_kl``, ``mismatch_max_abs_log_ratio``, ``mismatch_outside_fraction``."""
        n = max(self.tokens, 1)
        return {
            "mismatch_kl": self.kl_sum / n,
            "mismatch_max_abs_log_ratio": self.max_abs_log_ratio,
            "mismatch_outside_fraction": self.outside / n,
        }
