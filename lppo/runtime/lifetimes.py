"""One owner of a run's processes, threads and services: closed in reverse start order, once.

A run starts, in this order, Ray (and its reaper), the replay store (TransferQueue), the
rollout engine (Ray rollout workers, a vLLM engine), the rollout runner (a thread or a
background process) and the tool servers of a multi-turn environment. Each may use the ones
started before it (the runner puts rows into the store; the store lives on Ray), so each
must be closed before them: in the reverse of the start order, from one place, whether the
run succeeded, failed or was interrupted.

:class:`RunResources` is that place: whoever starts a resource enters it right after it
started (:meth:`RunResources.enter`); one teardown calls :meth:`RunResources.close`. A close
that fails does not stop the ones after it: every resource gets its close, then the failures
are raised together (:class:`ResourceCloseError`). Each resource bounds its own close (a
runner by ``close_timeout_s``); this class adds no timeout of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import ExitStack
from types import TracebackType
from typing import Protocol, Self, TypeVar, runtime_checkable

__all__ = ["ResourceCloseError", "RunResources", "SupportsClose"]

_log = logging.getLogger(__name__)


@runtime_checkable
class SupportsClose(Protocol):
    """A resource that stops what it started with ``close()``."""

    def close(self) -> object:
        """Stop what the resource started."""
        ...


R = TypeVar("R", bound="SupportsClose | Callable[[], object]")


class ResourceCloseError(RuntimeError):
    """Closing some resources failed; every other resource was still closed.

    Attributes:
        failures: ``(name, error)`` of each failed close, in closing order.
    """

    def __init__(self, failures: list[tuple[str, BaseException]]) -> None:
        lines = [f"{name}: {type(error).__name__}: {error}" for name, error in failures]
        super().__init__(
            f"{len(failures)} resource(s) of the run failed to close (every other one was "
            "closed):\n  " + "\n  ".join(lines)
        )
        self.failures = failures


class RunResources:
    """The run's started resources, closed in reverse start order exactly once.

    Usable as a context manager: leaving the ``with`` block closes what was entered. When
    the block is left by an exception, close failures are logged instead of raised, so the
    run's own error is the one that propagates.

    Attributes:
        entered: names of the resources entered, in start order.
        closed: names of the resources whose close ran (failed ones included), in closing
            order.
        failures: ``(name, error)`` of each close that raised, in closing order.
    """

    def __init__(self) -> None:
        self._stack = ExitStack()
        self._closing = False
        self.entered: list[str] = []
        self.closed: list[str] = []
        self.failures: list[tuple[str, BaseException]] = []

    @property
    def is_closed(self) -> bool:
        """Whether :meth:`close` has been called (later calls do nothing)."""
        return self._closing

    def enter(self, name: str, resource: R) -> R:
        """Register ``resource``, just started, to be closed before those entered earlier.

        Args:
            name: a name unique within this run, recorded in :attr:`entered` and
                :attr:`closed` and named in close errors (``"runner"``, ``"store"``).
            resource: an object with a ``close()`` method (preferred when it has one), or a
                callable taking no arguments that closes it.

        Returns:
            ``resource`` itself, so a start reads ``x = resources.enter("x", start_x())``.

        Raises:
            ValueError: ``name`` was entered already.
            TypeError: ``resource`` has no ``close()`` and is not callable.
            RuntimeError: :meth:`close` was called already (the resource would never be
                closed, so the caller must close it itself).
        """
        if self._closing:
            raise RuntimeError(
                f"resource {name!r} entered after the run's resources were closed; close it "
                "where it was started, or start it before the run's teardown."
            )
        if name in self.entered:
            raise ValueError(f"resource {name!r} was entered already; give each one its own name.")
        close = _closer(name, resource)
        self._stack.callback(self._close_one, name, close)
        self.entered.append(name)
        return resource

    def close(self, *, raise_errors: bool = True) -> None:
        """Close every entered resource, the last entered first; a second call does nothing.

        Every close runs even when one before it raises. After all have run, a failure is
        raised (or logged, with ``raise_errors=False``): a ``BaseException`` that is not an
        ``Exception`` (``SystemExit``, ``KeyboardInterrupt``) as it is, so an exit code
        survives; otherwise one :class:`ResourceCloseError` naming each failed resource.

        Args:
            raise_errors: ``False`` logs the failures instead (a teardown that already
                propagates the run's own error).

        Raises:
            ResourceCloseError: one or more closes raised an ``Exception``.
        """
        if self._closing:
            return
        self._closing = True
        self._stack.close()  # each callback catches its own failure: every one runs
        if not self.failures:
            return
        for name, error in self.failures:
            _log.warning("closing %s failed", name, exc_info=error)
        if not raise_errors:
            return
        for _, error in self.failures:
            if not isinstance(error, Exception):
                raise error
        raise ResourceCloseError(list(self.failures)) from self.failures[0][1]

    def _close_one(self, name: str, close: Callable[[], object]) -> None:
        self.closed.append(name)
        try:
            close()
        except BaseException as error:  # reported once every other resource is closed
            self.failures.append((name, error))

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close(raise_errors=error is None)


def _closer(name: str, resource: object) -> Callable[[], object]:
    """The callable that closes ``resource`` (its ``close`` method, or itself)."""
    if isinstance(resource, SupportsClose):
        return resource.close
    if callable(resource):
        return resource
    raise TypeError(
        f"resource {name!r} is a {type(resource).__name__}, which has no close() and is not "
        "callable; enter the object that stops it, or a function that does."
    )
