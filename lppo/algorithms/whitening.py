"""Advantage whitening with statistics over every valid token of the iteration."""

from __future__ import annotations

import torch

from lppo.stats import Moments

__all__ = ["Moments", "whiten"]


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
        moments: statistics over all valid tokens of the iteration (not of this chunk),
            merged stably across chunks and ranks (:class:`~lppo.stats.Moments`).
        shift_mean: subtract μ (``False`` only rescales).
        eps: variance floor.

    Returns:
        ``float[B, T]`` in ``x``'s dtype.
    """
    scale = (moments.var + eps) ** -0.5
    y = (x - moments.mean) * scale if shift_mean else x * scale
    return torch.where(mask, y, torch.zeros_like(y))
