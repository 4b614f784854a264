"""Token-level rewards and generalized advantage estimation (GAE).

All functions work on right-padded ``[B, T]`` tensors aligned with ``input_ids`` (see
:mod:`lppo.types`). Positions where ``mask`` is ``False`` (prompt, padding, environment-masked
tokens) are skipped by the recursions and hold 0 in every output.
"""

from __future__ import annotations

import torch


def last_valid_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last ``True`` of each row of ``mask`` (``bool[B, T]``); -1 for empty rows.

    Returns:
        ``int64[B]``.
    """
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask, positions, torch.full_like(positions, -1)).max(dim=-1).values


def token_rewards(
    reward: torch.Tensor,
    mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """Per-token rewards: the sequence score on the last valid token, minus a KL penalty.

    ``r[b, t] = score[b] * [t == last_valid(b)] - kl_coef * kl[b, t] * mask[b, t]``.

    Args:
        reward: ``float[B]`` sequence-level scores.
        mask: ``bool[B, T]`` valid (trained) tokens.
        kl: ``float[B, T]`` per-token KL estimate (see :func:`lppo.algorithms.kl_penalty`),
            or ``None`` for no penalty.
        kl_coef: β, the penalty's weight.

    Returns:
        ``float[B, T]`` in the dtype of ``reward`` (0 off-mask).
    """
    dtype = reward.dtype if reward.is_floating_point() else torch.float32
    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    if kl is not None and kl_coef != 0.0:
        out = out - kl_coef * kl.to(dtype) * mask.to(dtype)
    last = last_valid_index(mask)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    out[rows, last[rows]] += reward.to(dtype)[rows]
    return out


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> torch.Tensor:
    """Generalized advantage estimation over the valid tokens of each row.

    Walking valid tokens backwards (``t'`` is the next valid token after ``t``; the episode
    ends after the last one, so its next value is 0)::

        δ_t = r_t + γ · V_{t'} − V_t
        A_t = δ_t + γ · λ · A_{t'}

    Args:
        rewards: ``float[B, T]`` per-token rewards.
        values: ``float[B, T]`` critic values ``V_t``.
        mask: ``bool[B, T]`` valid tokens; others are skipped and get 0.
        gamma: discount γ.
        lam: GAE λ.

    Returns:
        ``float[B, T]`` advantages ``A_t`` (0 off-mask).
    """
    dtype = torch.promote_types(rewards.dtype, values.dtype)
    rewards, values = rewards.to(dtype), values.to(dtype)
    batch, length = mask.shape
    next_value = torch.zeros(batch, dtype=dtype, device=rewards.device)
    running = torch.zeros(batch, dtype=dtype, device=rewards.device)
    out = torch.zeros((batch, length), dtype=dtype, device=rewards.device)
    for t in range(length - 1, -1, -1):
        valid = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        step = delta + gamma * lam * running
        running = torch.where(valid, step, running)
        next_value = torch.where(valid, values[:, t], next_value)
        out[:, t] = torch.where(valid, step, torch.zeros_like(step))
    return out


def advantages_and_returns(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
    lam_returns: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages for the actor and value targets for the critic.

    ``advantages = GAE(γ, λ)``; ``returns = GAE(γ, λ_returns) + V`` on valid tokens, where
    ``λ_returns`` defaults to ``λ`` (one GAE pass then serves both).

    Args:
        rewards: ``float[B, T]``.
        values: ``float[B, T]``.
        mask: ``bool[B, T]``.
        gamma: discount γ.
        lam: λ of the actor's advantages.
        lam_returns: λ of the critic's targets (``None``: same as ``lam``).

    Returns:
        ``(advantages, returns)``, both ``float[B, T]`` and 0 off-mask.
    """
    adv = gae(rewards, values, mask, gamma, lam)
    if lam_returns is None or lam_returns == lam:
        ret_adv = adv
    else:
        ret_adv = gae(rewards, values, mask, gamma, lam_returns)
    returns = torch.where(mask, ret_adv + values.to(ret_adv.dtype), torch.zeros_like(ret_adv))
    return adv, returns
