"""``GAE``: generalized advantage estimation with the KL penalty in the reward (the default)."""

from __future__ import annotations

import torch

from lppo.algorithms import advantages_and_returns, kl_penalty, token_rewards, whiten
from lppo.estimators.base import EstimatorInputs
from lppo.stats import Moments
from lppo.types import ADVANTAGES, OLD_LOGPROBS, REF_LOGPROBS, RETURNS, REWARD, VALUES


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
        for key, value in (("gamma", gamma), ("lam", lam), ("lam_returns", lam_returns)):
            if value is not None and not 0.0 <= value <= 1.0:
                raise ValueError(
                    f"model.estimator.init_args.{key}={value} must lie in [0, 1]"
                    + (" or be null." if key == "lam_returns" else ".")
                )
        self.gamma = gamma
        self.lam = lam
        self.lam_returns = lam_returns
        self.whiten = whiten

    @torch.no_grad()
    def estimate(self, inputs: EstimatorInputs) -> dict[str, float]:
        """Write advantages and returns; report the mean KL of the penalty (0 without one)."""
        use_kl = inputs.kl_coef > 0
        names = [REWARD, VALUES, OLD_LOGPROBS] + ([REF_LOGPROBS] if use_kl else [])
        moments, kl_moments = Moments(), Moments()
        for chunk in inputs.chunks(names):
            mask = chunk.response_mask
            assert chunk.reward is not None and chunk.values is not None
            kl = None
            if use_kl:
                assert chunk.old_logprobs is not None and chunk.ref_logprobs is not None
                kl = kl_penalty(chunk.old_logprobs, chunk.ref_logprobs, inputs.kl_kind)
                kl_moments.update(kl, mask)
            rewards = token_rewards(chunk.reward, mask, kl, inputs.kl_coef)
            adv, ret = advantages_and_returns(
                rewards, chunk.values, mask, self.gamma, self.lam, self.lam_returns
            )
            moments.update(adv, mask)
            inputs.write(chunk, {ADVANTAGES: adv, RETURNS: ret})
        if self.whiten:
            moments.all_reduce(inputs.group)
            for chunk in inputs.chunks([ADVANTAGES]):
                assert chunk.advantages is not None
                white = whiten(chunk.advantages, chunk.response_mask, moments)
                inputs.write(chunk, {ADVANTAGES: white})
        kl_moments.all_reduce(inputs.group)
        return {"kl_mean": kl_moments.mean if kl_moments.count else 0.0}
