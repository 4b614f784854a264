"""Built-in lppo callbacks, one per file; importable as ``lppo.callbacks``.

:func:`lifecycle` gives the three callbacks every iteration needs; :class:`~lppo.PPOTrainer`
installs them (with the monitoring ones) unless callbacks of those types are given.
"""

from collections.abc import Sequence

from lightning.pytorch.callbacks import Callback
from lppo.callbacks.abort_cleanup import AbortCleanup
from lppo.callbacks.evaluation import Evaluation
from lppo.callbacks.hf_export import HFExport
from lppo.callbacks.iteration_checkpoint import IterationCheckpoint
from lppo.callbacks.metrics_logger import PPOMetricsLogger
from lppo.callbacks.optimizer_step import OptimizerStep
from lppo.callbacks.progress import PPOProgress
from lppo.callbacks.reward_plot import RewardCurve
from lppo.callbacks.rollout_samples import RolloutSamples
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
    "RolloutSamples",
    "RowRetention",
    "RunSummary",
    "defaults",
    "lifecycle",
]


def lifecycle(given: Sequence[Callback] = ()) -> list[Callback]:
    """New lifecycle callbacks: the optimizer step, row retention and abort cleanup.

    Every iteration needs them: without them a step is never finished or rows are never
    released, and the controller fails the iteration saying so. A plain-Python
    :class:`~lppo.iteration.controller.PPOController` takes them as
    ``callbacks=[*mine, *lifecycle(mine)]``.

    Args:
        given: callbacks already chosen; a built-in of a type one of them has (a subclass
            counts) is left out.
    """
    return _missing([OptimizerStep(), RowRetention(), AbortCleanup()], given)


def defaults(given: Sequence[Callback] = (), checkpoints: bool = True) -> list[Callback]:
    """New built-in callbacks of a :class:`~lppo.PPOTrainer` run, in hook order.

    Monitoring (metrics, reward curve, rollout samples, progress, summary), the per-iteration
    checkpoint, then :func:`lifecycle` (last, so every other callback sees a step before it is
    taken and the rows before they are released). The one place lppo's built-in callbacks are
    chosen.

    Args:
        given: callbacks already chosen; a built-in of a type one of them has is left out.
        checkpoints: include the per-iteration checkpoint.
    """
    monitoring: list[Callback] = [
        PPOMetricsLogger(),  # first: the others read the iteration's step on the run log
        RewardCurve(),
        RolloutSamples(),
        PPOProgress(),
        RunSummary(),
    ]
    if checkpoints:
        monitoring.append(IterationCheckpoint())
    return [*_missing(monitoring, given), *lifecycle(given)]


def _missing(builtins: list[Callback], given: Sequence[Callback]) -> list[Callback]:
    return [cb for cb in builtins if not any(isinstance(c, type(cb)) for c in given)]
