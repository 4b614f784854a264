"""Procedurally generated, verifiable tasks and a registry of them by short name."""

from __future__ import annotations

from lppo.tasks.arithmetic import ArithmeticTask
from lppo.tasks.base import Prompt, Task
from lppo.tasks.copy import CopyTask
from lppo.tasks.dataset import DatasetTask

#: Short name -> task class.
TASKS: dict[str, type[Task]] = {
    CopyTask.name: CopyTask,
    ArithmeticTask.name: ArithmeticTask,
}


def get_task(name: str) -> type[Task]:
    """Return the task class registered under ``name``.

    Args:
        name: a short task name (e.g. ``"copy"``, ``"arithmetic"``).

    Returns:
        The task class (instantiate it with its own keyword arguments).

    Raises:
        ValueError: if ``name`` is not registered; the message lists the known names.
    """
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; known tasks: {sorted(TASKS)}") from None


__all__ = ["TASKS", "ArithmeticTask", "CopyTask", "DatasetTask", "Prompt", "Task", "get_task"]
