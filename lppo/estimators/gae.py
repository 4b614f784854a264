"""``GAE``: generalized advantage estimation with the KL penalty in the reward (the default)."""

from __future__ import annotations

import torch

from lppo.algorithms import advantages_and_returns
from lppo.estimators.base import EstimatorInputs, TargetMoments
from lppo.init_args import RecordsInitArgs
from lppo.types import ADVANTAGES, RETURNS, VALUES, Chunk
from lppo.validation import check_number


class GAE(RecordsInitArgs):
    """Token-level GAE over each row, then whitening over every valid token of the iteration.

    Per chunk: ``r_t = score·[t = last] − β·KL_t`` (:func:`~lppo.algorithms.token_rewards`),
    ``A = GAE(γ, λ)``, ``R = GAE(γ, λ_returns) + V``
    (:func:`~lppo.algorithms.advantages_and_returns`). Whitening uses the moments of ``A``
    over all valid tokens of all chunks and ranks, merged stably, in a second streamed pass.

    It is a :class:`~lppo.estimators.ValueTargets` estimator: with ``model.ppo.old_values:
    critic`` the critic's first epoch hands it each chunk's values (:meth:`chunk_targets`)
    instead of a score pass writing them first.

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

    def reads(self) -> list[str]:
        """The old values (besides the reward columns)."""
        return [VALUES] if self.uses_critic else []

    def writes(self) -> list[str]:
        """The advantages and the critic's returns."""
        return [ADVANTAGES, RETURNS] if self.uses_critic else [ADVANTAGES]

    @torch.no_grad()
    def estimate(self, inputs: EstimatorInputs) -> dict[str, float]:
        """Write advantages and returns; report the mean KL of the penalty (0 without one)."""
        acc = TargetMoments()
        for chunk in inputs.chunks([*inputs.reward_columns, *self.reads()]):
            assert chunk.values is not None
            adv, ret = self.chunk_targets(inputs, chunk, chunk.values, acc)
            inputs.write(chunk, {ADVANTAGES: adv, RETURNS: ret})
        return self.finish_targets(inputs, acc)

    @torch.no_grad()
    def chunk_targets(
        self, inputs: EstimatorInputs, chunk: Chunk, values: torch.Tensor, acc: TargetMoments
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw advantages and returns ``float[B, T]`` of one chunk's rows from their ``values``.

        ``chunk`` holds :attr:`EstimatorInputs.reward_columns`; ``acc`` gathers the
        whitening and KL moments that :meth:`finish_targets` reduces.
        """
        rewards = inputs.token_rewards(chunk, acc.kl)
        adv, ret = advantages_and_returns(
            rewards, values, chunk.response_mask, self.gamma, self.lam, self.lam_returns
        )
        acc.advantages.update(adv, chunk.response_mask)
        return adv, ret

    def finish_targets(self, inputs: EstimatorInputs, acc: TargetMoments) -> dict[str, float]:
        """Whiten the stored advantages (when ``whiten``); return the mean KL (0 without one)."""
        if self.whiten:
            inputs.whiten_advantages(acc.advantages)
        acc.kl.all_reduce(inputs.group)
        return {"kl_mean": acc.kl.mean if acc.kl.count else 0.0}
