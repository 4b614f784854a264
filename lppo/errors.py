"""Errors that cross module boundaries (raised by one layer, handled by another)."""

from __future__ import annotations

__all__ = ["IterationError"]


class IterationError(RuntimeError):
    """An iteration failed; the message says where (iteration, phase, epoch, chunk).

    Raised by the rollout source and the controller once the iteration is cleaned up (open
    steps aborted, rows released); :class:`~lppo.failure_policy.FailurePolicy` decides whether
    the run skips it or stops.
    """
