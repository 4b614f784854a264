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

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

import torch

from lppo.algorithms.losses import LOG_RATIO_CLAMP

OffPolicyMode = Literal["auto", "none", "truncate", "mask"]

_KEY = "model.actor.init_args.off_policy"


@dataclass(frozen=True)
class OffPolicyCorrection:
    """Off-policy correction of the actor loss, and the bounds the mismatch metrics report.

    Attributes:
        mode: ``auto`` (default: ``truncate`` when ``model.rollout.max_staleness > 0``, else
            ``none``), ``none`` (plain PPO), ``truncate`` (weight ``min(w, cap)``) or ``mask``
            (weight ``w`` inside ``[floor, cap]``, 0 outside).
        cap: upper bound ``C >= 1`` of the importance weight.
        floor: lower bound ``F`` in ``(0, 1]`` (``mask`` mode and the outside-bounds metric);
            ``null``: ``1 / cap``.
    """

    mode: OffPolicyMode = "auto"
    cap: float = 2.0
    floor: float | None = None

    def __post_init__(self) -> None:
        """Raise ``ValueError`` naming the key, the value and the fix for a bad setting."""
        if self.mode not in ("auto", "none", "truncate", "mask"):
            raise ValueError(
                f"{_KEY}.mode={self.mode!r}; use 'auto', 'none', 'truncate' or 'mask'."
            )
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
        """Whether the actor loss is reweighted (``auto`` unresolved: no)."""
        return self.mode in ("truncate", "mask")

    def resolved(self, stale: bool) -> OffPolicyCorrection:
        """``auto`` made concrete: ``truncate`` for stale rows, ``none`` for on-policy ones."""
        if self.mode != "auto":
            return self
        return dataclasses.replace(self, mode="truncate" if stale else "none")

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
