"""Module-level tools for the ToolBox tests (light imports: the worker unpickles them)."""

from __future__ import annotations

import os
import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer.
        b: the second integer.
    """
    return a + b


def fail(message: str) -> str:
    """Raise a ValueError.

    Args:
        message: the error message.
    """
    raise ValueError(message)


def sleep(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: how long to sleep.
    """
    time.sleep(seconds)
    return f"slept {seconds}"


def pid() -> int:
    """The worker's process id."""
    return os.getpid()


def crash() -> str:
    """End the worker process abruptly."""
    os._exit(7)


def listing(n: int) -> list[int]:
    """A list of the first integers.

    Args:
        n: how many.
    """
    return list(range(n))
