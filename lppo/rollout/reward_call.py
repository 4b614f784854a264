"""One call into a task's reward code: bounded in time, its exceptions named, signals honoured.

:func:`call_reward` is the only way lppo calls user reward code (``Task.rewards``, through
:func:`score`, which also checks what comes back). What the user's code raises, ``SystemExit`` and
``KeyboardInterrupt`` included, comes back as :class:`RewardRaised`, so the caller turns it
into a named failure of the iteration instead of ending the run. What a *signal* raises is
not the reward's failure: during a run SIGINT and SIGTERM raise
:class:`~lppo.run.interrupts.RunInterrupted` wherever the main thread is, inside a sleeping or
looping reward too, and it propagates unchanged.

The time limit (``model.ppo.reward_timeout_s``) is enforced with ``SIGALRM`` in the main
thread and, in another thread, by raising the timeout into that thread; either lands between
two Python bytecodes of the reward (a blocking C call, e.g. a sleep, is interrupted in the main
thread only; elsewhere the timeout lands when it returns).
"""

from __future__ import annotations

import ctypes
import numbers
import signal
import threading
from collections.abc import Callable, Sequence
from functools import partial
from types import FrameType
from typing import TypeVar

import torch

from lppo.rollout.base import GenerationOutput
from lppo.run.interrupts import RunInterrupted, raise_if_interrupted
from lppo.tasks.base import Prompt, Task

__all__ = ["RewardError", "RewardRaised", "RewardTimeout", "call_reward", "score"]

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


class RewardError(ValueError):
    """The task's reward function failed or returned something other than one number per sample."""


def score(
    task: Task,
    prompts: Sequence[Prompt],
    output: GenerationOutput,
    timeout_s: float | None = None,
) -> torch.Tensor:
    """Reward every sample of ``output`` with one batch call of ``task.rewards``.

    The call goes through :func:`~lppo.rollout.reward_call.call_reward`: bounded in time,
    everything it raises (``SystemExit`` and ``KeyboardInterrupt`` included) named here as a
    :class:`RewardError`, a signal during it honoured.

    Args:
        task: the task whose reward is used.
        prompts: the prompts passed to ``generate`` (indexed by ``output.prompt_index``).
        output: the generated samples.
        timeout_s: seconds the call may take (``None``: the task's ``reward_timeout_s``, set
            from ``model.ppo.reward_timeout_s``).

    Returns:
        ``float64[n]`` rewards (non-finite ones make their rows invalid later). A multi-turn
        sample's reward is its episode's return: the task's score of the final answer plus
        the sum of its turns' own rewards (``output.turn_rewards``).

    Raises:
        RewardError: ``task.rewards`` raised, ran out of time, or did not return one real
            number per sample; the message names the task, the sample and its prompt.
    """
    answered = [prompts[int(i)] for i in output.prompt_index.tolist()]
    name = f"{type(task).__name__}.rewards"
    completions = list(output.completions)
    limit = task.reward_timeout_s if timeout_s is None else timeout_s
    try:
        rewards = call_reward(partial(task.rewards, answered, completions), limit)
    except RewardTimeout as error:
        raise RewardError(
            f"{name} {error} on a batch of {len(output)} samples (first prompt "
            f"{_text(answered, 0)!r}); make the reward faster or raise the limit."
        ) from None
    except RewardRaised as raised:
        error = raised.error
        raise RewardError(
            f"{name} raised {type(error).__name__}: {error} "
            f"({_locate_failure(task, answered, completions, limit)})"
        ) from error
    values = _checked_values(name, rewards, answered, completions, len(output))
    if output.turn_rewards is not None:  # the episode's return: its turns' rewards too
        values = [
            v + float(t.double().sum()) for v, t in zip(values, output.turn_rewards, strict=True)
        ]
    return torch.tensor(values, dtype=torch.float64)


def _checked_values(
    name: str, rewards: list[float], answered: Sequence[Prompt], completions: list[str], n: int
) -> list[float]:
    """``rewards`` as one float per sample, or a :class:`RewardError` naming what is wrong.

    Args:
        name: the reward function, for messages (``"MathTask.rewards"``).
        rewards: what the reward function returned for the batch (checked here: user code
            may return anything).
        answered: each sample's prompt.
        completions: each sample's completion.
        n: the number of samples in the batch.

    Returns:
        One float per sample, in order.

    Raises:
        RewardError: ``rewards`` is not a sequence (or 1-D array) of one real number per
            sample.
    """
    if getattr(rewards, "ndim", None) == 1:  # a 1-D torch tensor or numpy array
        rewards = rewards.tolist()  # type: ignore[union-attr]
    if isinstance(rewards, str | bytes) or not isinstance(rewards, Sequence | list):
        raise RewardError(
            f"{name} returned {type(rewards).__name__} for a batch of {n} samples "
            f"(first prompt {_text(answered, 0)!r}); return one float per sample."
        )
    if len(rewards) != n:
        raise RewardError(
            f"{name} returned {len(rewards)} rewards for {n} samples (first prompt "
            f"{_text(answered, 0)!r}); return one float per sample, in order."
        )
    values: list[float] = []
    for j, (reward, prompt) in enumerate(zip(rewards, answered, strict=True)):
        value = _as_float(reward)
        if value is None:
            raise RewardError(
                f"{name} returned {type(reward).__name__} {_short_repr(reward)} for sample "
                f"{j + 1} of {n} (prompt {prompt.text!r}, completion "
                f"{completions[j]!r}); return a float (a finite one, or inf / nan to make "
                "the row invalid)."
            )
        values.append(value)
    return values


def _text(prompts: Sequence[Prompt], j: int) -> str | None:
    return prompts[j].text if j < len(prompts) else None


def _as_float(reward: object) -> float | None:
    """``reward`` as a float; ``None`` for a non-number or one no float holds (``10**400``)."""
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
        return None
    try:
        return float(reward)
    except (OverflowError, ValueError, TypeError):
        return None


def _short_repr(value: object) -> str:
    """``repr(value)`` cut to 80 characters (an int over 4300 digits has no ``repr``)."""
    try:
        text = repr(value)
    except Exception as error:  # ValueError: int too large to convert to str
        return f"<{type(value).__name__}: no repr ({error})>"
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


def _locate_failure(
    task: Task, prompts: Sequence[Prompt], completions: list[str], limit: float | None
) -> str:
    """Name the first sample whose reward call fails on its own (only run after a failure).

    The batch call does not say which sample broke it; calling the task once per sample
    does, at the cost of repeating the calls up to the failing one.
    """
    for j, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        try:
            call_reward(partial(task.rewards, [prompt], [completion]), limit)
        except (RewardRaised, RewardTimeout):
            return (
                f"sample {j + 1} of {len(completions)}: prompt {prompt.text!r}, "
                f"completion {completion!r}"
            )
    return (
        f"batch of {len(completions)} samples; every sample alone was rewarded, so the "
        f"failure depends on the batch (first prompt {_text(prompts, 0)!r})"
    )
