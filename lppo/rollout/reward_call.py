"""One call into a task's reward code: bounded in time, its exceptions named, signals honoured.

:func:`call_reward` is the only way lppo calls user reward code (``Task.rewards``, through
:func:`~lppo.rollout.base.score`). What the user's code raises, ``SystemExit`` and
``KeyboardInterrupt`` included, comes back as :class:`RewardRaised`, so the caller turns it
into a named failure of the iteration instead of ending the run. What a *signal* raises is
not the reward's failure: during a run SIGINT and SIGTERM raise
:class:`~lppo.interrupts.RunInterrupted` wherever the main thread is, inside a sleeping or
looping reward too, and it propagates unchanged.

The time limit (``model.ppo.reward_timeout_s``) is enforced with ``SIGALRM`` in the main
thread and, in another thread, by raising the timeout into that thread; either lands between
two Python bytecodes of the reward (a blocking C call, e.g. a sleep, is interrupted in the main
thread only; elsewhere the timeout lands when it returns).
"""

from __future__ import annotations

import ctypes
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import TypeVar

from lppo.interrupts import RunInterrupted, raise_if_interrupted

__all__ = ["RewardRaised", "RewardTimeout", "call_reward"]

T = TypeVar("T")


class RewardTimeout(Exception):
    """The reward call did not return within its limit (it was stopped)."""


class RewardRaised(Exception):
    """The reward code raised ``error`` (any ``BaseException`` not caused by a signal).

    Attributes:
        error: what the reward code raised.
    """

    def __init__(self, error: BaseException) -> None:
        super().__init__(f"{type(error).__name__}: {error}")
        self.error = error


class _Expired(BaseException):
    """Raised into the reward's frame when its time is up.

    A ``BaseException``, so a reward's ``except Exception`` cannot swallow it.
    """


def call_reward(fn: Callable[[], T], timeout_s: float | None) -> T:
    """Call ``fn`` (user reward code) within ``timeout_s`` seconds.

    Args:
        fn: the call, without arguments.
        timeout_s: the limit in seconds (``None``: no limit).

    Returns:
        What ``fn`` returned.

    Raises:
        RewardTimeout: ``fn`` did not return within ``timeout_s`` (it was stopped).
        RewardRaised: ``fn`` raised (any exception, ``SystemExit`` and ``KeyboardInterrupt``
            included, the original as ``error`` and ``__cause__``).
        BaseException: a ``SIGINT`` / ``SIGTERM`` arrived during the call (see the module).
    """
    if threading.current_thread() is threading.main_thread():
        return _in_main_thread(fn, timeout_s)
    return _in_other_thread(fn, timeout_s)


def _in_main_thread(fn: Callable[[], T], timeout_s: float | None) -> T:
    previous = None
    try:
        if timeout_s is not None:
            previous = signal.signal(signal.SIGALRM, _expire)
            signal.setitimer(signal.ITIMER_REAL, timeout_s)  # one shot
        try:
            result = fn()
        finally:
            if timeout_s is not None:
                signal.setitimer(signal.ITIMER_REAL, 0)
        raise_if_interrupted()  # the reward caught the signal's exception and returned
        return result
    except _Expired:
        raise RewardTimeout(_late(timeout_s)) from None
    except RunInterrupted:
        raise  # a signal stopped the run, not the reward's failure
    except BaseException as error:
        raise RewardRaised(error) from error
    finally:
        if previous is not None:
            signal.signal(signal.SIGALRM, previous)


def _expire(signum: int, frame: FrameType | None) -> None:
    raise _Expired


def _late(timeout_s: float | None) -> str:
    return f"did not return within model.ppo.reward_timeout_s={timeout_s} s and was stopped"


def _in_other_thread(fn: Callable[[], T], timeout_s: float | None) -> T:
    """The call in a thread other than the main one (no signal handlers can be set there)."""
    if timeout_s is None:
        try:
            return fn()
        except BaseException as error:
            raise RewardRaised(error) from error
    lock, ident = threading.Lock(), threading.get_ident()
    state = {"running": True, "expired": False}

    def expire() -> None:
        with lock:  # never raise into the thread once the call is over
            if state["running"]:
                state["expired"] = True
                _raise_in(ident, _Expired)

    timer = threading.Timer(timeout_s, expire)
    timer.daemon = True
    timer.start()
    try:
        try:
            result = fn()
        finally:
            with lock:
                state["running"] = False
                if state["expired"]:
                    _raise_in(ident, None)  # clears it if it is still pending
            timer.cancel()
    except _Expired:
        raise RewardTimeout(_late(timeout_s)) from None
    except BaseException as error:
        raise RewardRaised(error) from error
    if state["expired"]:  # expired as fn returned: the limit passed all the same
        raise RewardTimeout(_late(timeout_s))
    return result


def _raise_in(ident: int, error: type[BaseException] | None) -> None:
    """Raise ``error`` in thread ``ident`` at its next bytecode (``None``: cancel a pending one)."""
    exc = ctypes.py_object(error) if error is not None else None
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), exc)
