"""On-policy distillation: a teacher's per-token log-probabilities as the advantage."""

from __future__ import annotations

import torch

from lppo.algorithms.kl import kl_penalty


def distill_advantages(
    logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
) -> torch.Tensor:
    """Per-token advantages ``A_t = −coef · (log π(a_t) − log π_T(a_t)) · mask_t``.

    ``log π(a_t) − log π_T(a_t)`` is the one-sample estimate (``k1``) of the per-token reverse
    KL ``KL(π ‖ π_T)`` at the state before ``a_t``, for tokens sampled from π: a token the
    teacher finds likelier than the student gets a positive advantage. Each token's advantage
    is its own (no sum over later tokens: discount 0), as in on-policy distillation (Agarwal
    et al. 2024, GKD; Thinking Machines 2025). The log-ratio is clamped as every KL of lppo is
    (:func:`~lppo.algorithms.kl_penalty`, ``±20``).

    Args:
        logprobs: ``float[B, T]`` π_old's log-probabilities of the sampled tokens.
        teacher_logprobs: ``float[B, T]`` the teacher's, of the same tokens.
        mask: ``bool[B, T]`` valid (trained) tokens.
        coef: the weight of the term.

    Returns:
        ``float[B, T]`` in the dtype of ``logprobs`` (0 off-mask).
    """
    reverse_kl = kl_penalty(logprobs, teacher_logprobs, "k1")
    return torch.where(mask, -coef * reverse_kl, torch.zeros_like(reverse_kl))
