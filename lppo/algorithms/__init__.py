"""PPO estimators and losses: small pure functions with their formulas in the docstrings."""

from lppo.algorithms.advantages import advantages_and_returns, gae, last_valid_index, token_rewards
from lppo.algorithms.distill import distill_advantages
from lppo.algorithms.kl import KLKind, kl_loss, kl_penalty
from lppo.algorithms.losses import (
    LOSS_AGGREGATIONS,
    LossAggregation,
    PolicyTerms,
    ValueTerms,
    entropy_from_logprobs,
    policy_loss,
    token_weights,
    value_loss,
)
from lppo.algorithms.objectives import CISPO, GSPO, ClippedPPO, PolicyObjective
from lppo.algorithms.off_policy import (
    ImportanceWeights,
    OffPolicyCorrection,
    OffPolicyMode,
    importance_weights,
)
from lppo.algorithms.whitening import Moments, whiten

__all__ = [
    "CISPO",
    "GSPO",
    "LOSS_AGGREGATIONS",
    "ClippedPPO",
    "ImportanceWeights",
    "KLKind",
    "LossAggregation",
    "Moments",
    "OffPolicyCorrection",
    "OffPolicyMode",
    "PolicyObjective",
    "PolicyTerms",
    "ValueTerms",
    "advantages_and_returns",
    "distill_advantages",
    "entropy_from_logprobs",
    "gae",
    "importance_weights",
    "kl_loss",
    "kl_penalty",
    "last_valid_index",
    "policy_loss",
    "token_rewards",
    "token_weights",
    "value_loss",
    "whiten",
]
