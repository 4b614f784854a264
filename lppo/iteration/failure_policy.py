"""The failure policy: stop at a failed iteration, or skip it within a budget (one knob)."""

from __future__ import annotations

import warnings

from lppo.errors import IterationError
from lppo.run.log import RunLog
from lppo.types import IterationResult, RolloutStats, iteration_label


class FailurePolicy:
    """Applies ``model.ppo.max_failed_iterations`` to iterations that raised ``IterationError``.

    By the time an :class:`~lppo.errors.IterationError` arrives here its iteration has
    been cleaned up (open steps aborted, rows released, and with ``model.ppo.transactional``
    the committed steps rolled back), so skipping it is safe.

    Args:
        budget: failed iterations the run may skip (``0``: the first one stops the run).
        run_log: the run log, which keeps the count (saved with it).
    """

    def __init__(self, budget: int, run_log: RunLog) -> None:
        self.budget = budget
        self.run_log = run_log

    @property
    def failed(self) -> int:
        """Failed iterations of the run so far."""
        return self.run_log.failed

    def absorb(
        self, iteration: int, error: IterationError
    ) -> tuple[IterationResult, IterationError | None]:
        """Count ``error``; the failed iteration's result, and the error that stops the run.

        Returns:
            ``(result, fatal)``: ``result.failed`` holds the error; ``fatal`` is ``None`` when
            the iteration is skipped (warned about), else the error to raise (``error``
            itself when the budget is 0).
        """
        self.run_log.failed += 1
        result = IterationResult(iteration, rollout=RolloutStats(), steps=[], failed=str(error))
        if self.budget == 0:
            return result, error
        if self.failed > self.budget:
            fatal = IterationError(
                f"{error} ({self.failed} failed iterations exceed "
                f"model.ppo.max_failed_iterations={self.budget})"
            )
            fatal.__cause__, fatal.__suppress_context__ = error, True
            return result, fatal
        warnings.warn(
            f"{iteration_label(iteration)} skipped ({self.failed} of "
            f"model.ppo.max_failed_iterations={self.budget}): {error}",
            RuntimeWarning,
            stacklevel=2,
        )
        return result, None
