"""Per-token PPO loss terms. Aggregation (and its exact global normalization) is the caller's.

Every function returns ``[B, T]`` tensors; entries off the mask are meaningless and must be
masked out by the caller (see :func:`token_weights`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from lppo.types import Normalizers

LossAggregation = Literal[
    "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"
]
#: Every aggregation mode, in the order the docs list them.
LOSS_AGGREGATIONS: tuple[str, ...] = (
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
)

#: Bound of the policy log-ratio before ``exp`` (as verl and OpenRLHF clamp it): ``e^20`` is
#: finite, so a token whose probability moved far still gives a finite loss, and a zero
#: advantage a zero (not NaN) loss and gradient.
LOG_RATIO_CLAMP = 20.0


@dataclass
class PolicyTerms:
    """Per-token terms of the clipped policy objective.

    Attributes:
        loss: ``float[B, T]`` the loss to minimize.
        clipped: ``bool[B, T]`` where the clipped branch was taken.
        approx_kl: ``float[B, T]`` ``(r − 1) − log r``, a non-negative estimate of KL(π_old‖π).
        ratio: ``float[B, T]`` ``r = π / π_old`` (a sequence-level objective: its row's ratio).
        sequence_level: the objective clips whole sequences (the actor then also reports the
            fraction of rows with a clipped token).
    """

    loss: torch.Tensor
    clipped: torch.Tensor
    approx_kl: torch.Tensor
    ratio: torch.Tensor
    sequence_level: bool = False


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> PolicyTerms:
    """Clipped surrogate with asymmetric clip range and optional dual clip.

    ``r = exp(clamp(logπ − logπ_old, −20, 20))`` (:data:`LOG_RATIO_CLAMP`; the gradient is 0
    where the clamp is active, where the clipped objective is flat anyway);
    ``L = max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high))``; with dual clip ``c > 1``, for
    ``A < 0`` the loss is further capped: ``L = min(L, −c·A)``.

    Args:
        logprobs: ``float[B, T]`` under the current policy (with grad).
        old_logprobs: ``float[B, T]`` under π_old.
        advantages: ``float[B, T]``.
        clip_low: ε_low.
        clip_high: ε_high.
        dual_clip: ``c`` (> 1) or ``None``.

    Returns:
        :class:`PolicyTerms`.
    """
    log_ratio = torch.clamp(logprobs - old_logprobs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped_obj = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped_obj)
    clipped = clipped_obj > unclipped
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1; got {dual_clip}")
        cap = -advantages * dual_clip
        capped = (advantages < 0) & (loss > cap)
        loss = torch.where(capped, cap, loss)
        clipped = clipped | capped
    approx_kl = (ratio - 1.0) - log_ratio
    return PolicyTerms(loss=loss, clipped=clipped, approx_kl=approx_kl.detach(), ratio=ratio)


@dataclass
class ValueTerms:
    """Per-token terms of the clipped value loss.

    Attributes:
        loss: ``float[B, T]``.
        clipped: ``bool[B, T]`` where the clipped prediction gave the larger error.
    """

    loss: torch.Tensor
    clipped: torch.Tensor


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    clip: float | None = 0.2,
) -> ValueTerms:
    """Clipped value loss ``½·max((V − R)², (V_clip − R)²)``.

    ``V_clip = V_old + clip(V − V_old, −ε, ε)``; with ``clip=None`` the loss is ``½(V − R)²``.

    Args:
        values: ``float[B, T]`` current predictions (with grad).
        old_values: ``float[B, T]`` predictions at scoring time.
        returns: ``float[B, T]`` targets.
        clip: ε or ``None``.

    Returns:
        :class:`ValueTerms`.
    """
    err = (values - returns).square()
    if clip is None:
        return ValueTerms(loss=0.5 * err, clipped=torch.zeros_like(err, dtype=torch.bool))
    delta = values - old_values
    v_clip = old_values + torch.clamp(delta, -clip, clip)
    err_clip = (v_clip - returns).square()
    # Only where the clamp is active can the clipped branch differ: elsewhere V_clip equals V up
    # to rounding, which must neither flip the clip flag nor change the loss.
    clipped = (delta.abs() > clip) & (err_clip > err)
    return ValueTerms(loss=0.5 * torch.where(clipped, err_clip, err), clipped=clipped)


def entropy_from_logprobs(logp: torch.Tensor) -> torch.Tensor:
    """Entropy ``−Σ_v p_v log p_v`` from normalized log-probabilities ``float[..., V]``.

    ``0 · log 0 = 0``: entries at −inf never turn the entropy (or its gradient) NaN.
    """
    probs = logp.exp()
    return -(probs * logp.clamp_min(torch.finfo(logp.dtype).min)).sum(dim=-1)


def token_weights(
    mask: torch.Tensor,
    normalizers: Normalizers,
    mode: LossAggregation,
    constant: int | None = None,
) -> torch.Tensor:
    """Weights ``w`` such that ``Σ w·ℓ`` over a chunk is its exact share of the step's loss.

    With ``m`` the mask, ``N_tok`` / ``N_rows`` the step's global valid tokens / rows and
    ``n_i`` row ``i``'s valid tokens:

    * ``token_mean``: ``w = m / N_tok`` (every token of the step weighs the same; DAPO);
    * ``seq_mean_token_mean``: ``w = m / (n_i · N_rows)`` (each row's token mean, then the
      mean over rows; GRPO's paper);
    * ``seq_mean_token_sum``: ``w = m / N_rows`` (each row's token sum, then the mean over
      rows: longer rows weigh more);
    * ``seq_mean_token_sum_norm``: ``w = m / (L · N_rows)`` with the constant ``L`` (Dr. GRPO:
      the maximum response length), free of any length bias.

    Summing ``Σ w·ℓ`` over every chunk of every rank equals the merged batch's loss exactly,
    since every denominator is a property of the step (or a constant), never of the chunk.

    Args:
        mask: ``bool[B, T]`` valid tokens.
        normalizers: the step's global denominators.
        mode: aggregation mode.
        constant: ``L`` of ``seq_mean_token_sum_norm``.

    Returns:
        ``float64[B, T]``.
    """
    m = mask.to(torch.float64)
    rows = max(normalizers.valid_rows, 1)
    if mode == "token_mean":
        return m / max(normalizers.valid_tokens, 1)
    if mode == "seq_mean_token_mean":
        per_row = m.sum(dim=-1, keepdim=True).clamp_min(1.0)
        return m / per_row / rows
    if mode == "seq_mean_token_sum":
        return m / rows
    if mode == "seq_mean_token_sum_norm":
        if constant is None or constant < 1:
            raise ValueError(
                f"seq_mean_token_sum_norm needs a constant normalizer >= 1; got {constant!r}"
            )
        return m / (float(constant) * rows)
    raise ValueError(f"loss aggregation must be one of {LOSS_AGGREGATIONS}; got {mode!r}")
