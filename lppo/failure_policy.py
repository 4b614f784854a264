"""The failure policy: stop at a failed iteration, or skip it within a budget (one knob)."""

from __future__ import annotations

import warnings

from lppo.controller import IterationError
from lppo.types import IterationResult, iteration_label


class FailurePolicy:
    """Applies ``model.ppo.max_failed_iterations`` to iterations that raised ``IterationError``.

    By the time an :class:`~lppo.controller.IterationError` arrives here its iteration has
    been cleaned up (open steps aborted, rows released, and with ``model.ppo.transactional``
    the committed steps rolled back), so skipping it is safe.

    Args:
        budget: failed iterations the run may skip (``0``: the first one stops the run).
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.failed = 0

    def absorb(self, iteration: int, error: IterationError) -> IterationResult:
        """Count ``error``; re-raise it past the budget, else warn and report a skipped result.

        Raises:
            IterationError: the budget is spent (``error`` itself when the budget is 0).
        """
        self.failed += 1
        if self.budget == 0:
            raise error
        if self.failed > self.budget:
            raise IterationError(
                f"{error} ({self.failed} failed iterations exceed "
                f"model.ppo.max_failed_iterations={self.budget})"
            ) from error
        warnings.warn(
            f"{iteration_label(iteration)} skipped ({self.failed} of "
            f"model.ppo.max_failed_iterations={self.budget}): {error}",
            RuntimeWarning,
            stacklevel=2,
        )
        return IterationResult(iteration, rollout={}, steps=[], failed=str(error))
