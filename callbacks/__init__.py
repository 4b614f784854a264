"""Built-in lppo callbacks, one per file; importable as ``lppo.callbacks``."""

from lppo.callbacks.abort_cleanup import AbortCleanup
from lppo.callbacks.evaluation import Evaluation
from lppo.callbacks.hf_export import HFExport
from lppo.callbacks.iteration_checkpoint import IterationCheckpoint
from lppo.callbacks.metrics_logger import PPOMetricsLogger
from lppo.callbacks.optimizer_step import OptimizerStep
from lppo.callbacks.progress import PPOProgress
from lppo.callbacks.reward_plot import RewardCurve
from lppo.callbacks.row_retention import RowRetention
from lppo.callbacks.run_summary import RunSummary

__all__ = [
    "AbortCleanup",
    "Evaluation",
    "HFExport",
    "IterationCheckpoint",
    "OptimizerStep",
    "PPOMetricsLogger",
    "PPOProgress",
    "RewardCurve",
    "RowRetention",
    "RunSummary",
]
