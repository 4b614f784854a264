"""``ReinforcePP``: REINFORCE++ (Hu 2025): discounted token returns, normalized over the batch."""

from __future__ import annotations

import torch

from lppo.algorithms import gae
from lppo.estimators.base import EstimatorInputs
from lppo.init_args import RecordsInitArgs
from lppo.stats import Moments
from lppo.types import ADVANTAGES
from lppo.validation import check_number


class ReinforcePP(RecordsInitArgs):
    """Critic-free token advantages: ``A_t = whiten(Σ_{t' ≥ t} γ^{k(t, t')} r_{t'})``.

    The sum runs over the row's valid tokens ``t' ≥ t``, and ``k(t, t')`` counts the valid
    tokens after ``t`` up to ``t'``: masked positions (a multi-turn row's observations) are
    skipped, not discounted; in a single-turn row it is ``t' − t``.

    ``r_t = r·[t = last] − β·KL_t`` (:func:`~lppo.algorithms.token_rewards`, KL in the reward),
    the discounted return walks valid tokens (GAE with ``V = 0`` and ``λ = 1`` is exactly that
    sum), and the returns are whitened with the mean and standard deviation over every valid
    token of the iteration (all chunks, all ranks), in a second streamed pass.

    Args:
        gamma: discount γ.
        whiten: normalize the returns over the batch (the "++": global normalization).
    """

    uses_critic = False

    def __init__(self, gamma: float = 1.0, whiten: bool = True) -> None:
        check_number("model.estimator.init_args.gamma", gamma, low=0, high=1)
        self.gamma = gamma
        self.whiten = whiten

    def reads(self) -> list[str]:
        """Nothing besides the reward columns."""
        return []

    def writes(self) -> list[str]:
        """The advantages (the whitened returns)."""
        return [ADVANTAGES]

    @torch.no_grad()
    def estimate(self, inputs: EstimatorInputs) -> dict[str, float]:
        """Write the (whitened) discounted returns as advantages; report the mean KL."""
        moments, kl_moments = Moments(), Moments()
        for chunk in inputs.chunks(inputs.reward_columns):
            rewards = inputs.token_rewards(chunk, kl_moments)
            returns = gae(rewards, torch.zeros_like(rewards), chunk.response_mask, self.gamma, 1.0)
            moments.update(returns, chunk.response_mask)
            inputs.write(chunk, {ADVANTAGES: returns})
        if self.whiten:
            inputs.whiten_advantages(moments)
        kl_moments.all_reduce(inputs.group)
        return {"kl_mean": kl_moments.mean if kl_moments.count else 0.0}
