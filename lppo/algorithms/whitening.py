"""Advantage whitening with statistics over every valid token of the iteration."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Moments:
    """Running float64 sums of a masked quantity, mergeable across chunks and ranks.

    Attributes:
        count: number of valid entries seen.
        total: sum of the valid entries.
        total_sq: sum of their squares.
    """

    count: float = 0.0
    total: float = 0.0
    total_sq: float = 0.0

    def update(self, x: torch.Tensor, mask: torch.Tensor) -> None:
        """Fold the entries of ``x`` where ``mask`` is ``True`` into the sums."""
        v = x.detach()[mask].to(torch.float64)
        self.count += float(v.numel())
        self.total += float(v.sum())
        self.total_sq += float(v.square().sum())

    def all_reduce(self) -> None:
        """Sum the moments across the default process group (no-op without one)."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        flat = torch.tensor([self.count, self.total, self.total_sq], dtype=torch.float64)
        if dist.get_backend() == "nccl":
            flat = flat.cuda()
        dist.all_reduce(flat)
        flat = flat.cpu()
        self.count, self.total, self.total_sq = (float(v) for v in flat)

    @property
    def mean(self) -> float:
        """Mean of the valid entries."""
        if self.count == 0:
            raise ValueError("no valid entries: cannot compute a mean")
        return self.total / self.count

    @property
    def var(self) -> float:
        """Population variance of the valid entries."""
        mean = self.mean
        return max(self.total_sq / self.count - mean * mean, 0.0)


def whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    moments: Moments,
    shift_mean: bool = True,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Whiten ``x`` with global moments: ``(x − μ) / sqrt(σ² + eps)`` on valid entries.

    Args:
        x: ``float[B, T]``.
        mask: ``bool[B, T]``; entries off the mask come back 0.
        moments: statistics over all valid tokens of the iteration (not of this chunk).
        shift_mean: subtract μ (``False`` only rescales).
        eps: variance floor.

    Returns:
        ``float[B, T]`` in ``x``'s dtype.
    """
    scale = (moments.var + eps) ** -0.5
    y = (x - moments.mean) * scale if shift_mean else x * scale
    return torch.where(mask, y, torch.zeros_like(y))
