"""The engine/trainer log-probability mismatch, accumulated chunk by chunk and over ranks.

A mergeable statistic like those of :mod:`lppo.stats` (kept apart because it reads the
off-policy correction's bounds from :mod:`lppo.algorithms`, which itself builds on
:mod:`lppo.stats`). The score phase folds every chunk in and reduces over the data-parallel
ranks once; the metrics are then exact under any chunking and rank count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lppo.algorithms.losses import LOG_RATIO_CLAMP
from lppo.algorithms.off_policy import OffPolicyCorrection
from lppo.parallel import SINGLE, ProcessGroup


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
