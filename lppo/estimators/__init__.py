"""Advantage estimators: the algorithm seam, chosen by ``class_path`` (``model.estimator``)."""

from lppo.estimators.base import AdvantageEstimator, EstimatorInputs, TargetMoments, ValueTargets
from lppo.estimators.distill import Distill
from lppo.estimators.gae import GAE
from lppo.estimators.outcome import GRPO, RLOO
from lppo.estimators.reinforce_pp import ReinforcePP

__all__ = [
    "GAE",
    "GRPO",
    "RLOO",
    "AdvantageEstimator",
    "Distill",
    "EstimatorInputs",
    "ReinforcePP",
    "TargetMoments",
    "ValueTargets",
]
