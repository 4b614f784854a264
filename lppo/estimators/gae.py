"""``GAE``: generalized advantage estimation with the KL penalty in the reward (the default)."""

from __future__ import annotations

import torch

from lppo.algorithms import advantages_and_returns
from lppo.estimators.base import EstimatorInputs
from lppo.stats import Moments
from lppo.types import ADVANTAGES, RETURNS, VALUES
from lppo.validation import check_number


class GAE:
    """Token-level GAE over each row, then whitening over every valid token of the iteration.

    Per chunk: ``r_t = score·[t = last] − β·KL_t`` (:func:`~lppo.algorithms.token_rewards`),
    ``A = GAE(γ, λ)``, ``R = GAE(γ, λ_returns) + V``
    (:func:`~lppo.algorithms.advantages_and_returns`). Whitening uses the moments of ``A``
    over all valid tokens of all chunks and ranks, merged stably, in a second streamed pass.

    Args:
        gamma: discount γ.
        lam: GAE λ of the actor's advantages.
        lam_returns: GAE λ of the critic's targets (``null``: same as ``lam``).
        whiten: whiten advantages with the iteration's mean and standard deviation.
    """

    uses_critic = True

    def __init__(
        self,
        gamma: float = 1.0,
        lam: float = 0.95,
        lam_returns: float | None = None,
        whiten: bool = True,
    ) -> None:
        key = "model.estimator.init_args"
        check_number(f"{key}.gamma", gamma, low=0, high=1, fix="Typical: 1.0 for LM rewards.")
        check_number(f"{key}.lam", lam, low=0, high=1, fix="Typical: 0.95.")
        check_number(
            f"{key}.lam_returns",
            lam_returns,
            low=0,
            high=1,
            optional=True,
            fix="null uses lam for the returns too.",
        )
        self.gamma = gamma
        self.lam = lam
        self.lam_returns = lam_returns
        self.whiten = whiten

    @torch.no_grad()
    def estimate(self, inputs: EstimatorInputs) -> dict[str, float]:
        """Write advantages and returns; report the mean KL of the penalty (0 without one)."""
        moments, kl_moments = Moments(), Moments()
        for chunk in inputs.chunks([*inputs.reward_columns, VALUES]):
            assert chunk.values is not None
            rewards = inputs.token_rewards(chunk, kl_moments)
            adv, ret = advantages_and_returns(
                rewards, chunk.values, chunk.response_mask, self.gamma, self.lam, self.lam_returns
            )
            moments.update(adv, chunk.response_mask)
            inputs.write(chunk, {ADVANTAGES: adv, RETURNS: ret})
        if self.whiten:
            inputs.whiten_advantages(moments)
        kl_moments.all_reduce(inputs.group)
        return {"kl_mean": kl_moments.mean if kl_moments.count else 0.0}
