"""Advantage estimators: the algorithm seam, chosen by ``class_path`` (``model.estimator``)."""

from lppo.estimators.base import AdvantageEstimator, EstimatorInputs
from lppo.estimators.gae import GAE

__all__ = ["GAE", "AdvantageEstimator", "EstimatorInputs"]
