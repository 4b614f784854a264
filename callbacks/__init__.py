"""Built-in lppo callbacks, one per file; importable as ``lppo.callbacks``."""

from lppo.callbacks.abort_cleanup import AbortCleanup
from lppo.callbacks.optimizer_step import OptimizerStep
from lppo.callbacks.row_retention import RowRetention

__all__ = ["AbortCleanup", "OptimizerStep", "RowRetention"]
