"""SIGTERM and SIGINT during a run: abort the iteration, keep the last checkpoint, exit 143 / 130.

One behaviour for every engine and store. :func:`install` (called by the fit loop when the
run starts, after Ray and TransferQueue have installed their own handlers) makes both signals
raise :class:`RunInterrupted` in the main thread, wherever the run is: in a rollout, a reward,
a TransferQueue wait or a chunk's backward. The exception travels the run's ordinary failure
path: the iteration is aborted (no optimizer step open, rows released, by the abort-cleanup
callback), the summary and the reward curve are written marked ``interrupted``, services lppo
started are stopped, and the process exits with ``128 + signal`` (143 for SIGTERM, 130 for
SIGINT), the code a scheduler reads as "killed by a signal". The last iteration-boundary
checkpoint is kept (none is written mid-iteration), so ``--ckpt_path last`` resumes bitwise. A
library that turns the exception into its own (``ray.get`` raises ``SystemExit(1)``) changes
nothing: the fit loop raises the signal's exception in its place
(:func:`replace_if_interrupted`).

A signal that arrives at an iteration's boundary, from the moment the iteration is counted
(``on_iteration_end``) until its checkpoint is written (:func:`hold` ... :func:`release`), is
held until the write is done: ``last.ckpt`` then holds every iteration the summary counts,
and the run still exits 143 / 130 ``interrupted``, never inside ``torch.save``.

A second signal during that cleanup exits at once with the same code. Lightning restores
the handlers that were in place before ``fit`` when it tears down.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

__all__ = [
    "SIGNALS",
    "RunInterrupted",
    "hold",
    "install",
    "raise_if_interrupted",
    "release",
    "replace_if_interrupted",
]

#: The signals a run turns into :class:`RunInterrupted`.
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class RunInterrupted(SystemExit):
    """The run was stopped by a signal; its exit code is ``128 + signum``.

    A ``SystemExit``, so that a process ending on it exits with that code without a traceback,
    and ``except Exception`` in user code (a reward function) does not swallow it.

    Attributes:
        signum: the signal received.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum

    @property
    def signal_name(self) -> str:
        """``"SIGTERM"`` or ``"SIGINT"``."""
        return signal.Signals(self.signum).name

    def __str__(self) -> str:
        return f"interrupted by {self.signal_name}"


class _State:
    received: RunInterrupted | None = None
    holding = False


def _raise(signum: int, frame: FrameType | None) -> None:
    for sig in SIGNALS:
        signal.signal(sig, _exit_now)
    _State.received = RunInterrupted(signum)
    if not _State.holding:  # else raised by release(), once the boundary's work is done
        raise _State.received


def hold() -> None:
    """From now until :func:`release`, a first signal is recorded, not raised.

    Called when an iteration is counted (before its ``on_iteration_end``); the fit loop
    releases once the iteration's checkpoint is written.
    """
    _State.holding = True


def release() -> None:
    """End :func:`hold`; raise the :class:`RunInterrupted` of a signal held meanwhile."""
    was, _State.holding = _State.holding, False
    if was and _State.received is not None:
        raise _State.received


def raise_if_interrupted() -> None:
    """Raise the :class:`RunInterrupted` of a signal already received.

    User code that caught it and went on (a reward with ``except BaseException``) cannot
    swallow it.
    """
    # Only while the run's shutdown is on (its handlers still those the signal left), and
    # not while a held signal waits for the boundary's checkpoint (release() raises it).
    held = _State.holding
    if _State.received is not None and signal.getsignal(signal.SIGTERM) is _exit_now and not held:
        raise _State.received


def replace_if_interrupted(error: BaseException) -> None:
    """Raise the received signal's :class:`RunInterrupted` in place of ``error``.

    A library may turn the exception the signal handler raised inside it into its own:
    ``ray.get`` ends a wait that a handler interrupted with ``SystemExit(1)`` (and a
    ``KeyboardInterrupt``), which would exit 1 ``failed``. Whatever ends the run after a signal
    arrived, the run stops interrupted (``error`` is kept as the cause). Does nothing while a
    held signal waits for :func:`release`, or when no signal arrived.
    """
    received = _State.received
    if received is None or _State.holding or error is received:
        return
    raise RunInterrupted(received.signum) from error


def _exit_now(signum: int, frame: FrameType | None) -> None:
    # A second signal while the first one's cleanup runs: the user insists, exit at once.
    os._exit(128 + signum)


def install() -> bool:
    """Make SIGTERM and SIGINT raise :class:`RunInterrupted`; ``False`` off the main thread.

    Python delivers signals to the main thread only; a run started from another thread keeps
    the handlers it found.
    """
    if threading.current_thread() is not threading.main_thread():
        return False
    _State.received, _State.holding = None, False
    for sig in SIGNALS:
        signal.signal(sig, _raise)
    return True
