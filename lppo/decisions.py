"""Decisions of ``auto`` settings: recorded into the run plan being built, or logged.

A component that can resolve an ``auto`` of its own against what it holds (a module's
``trim_prompt`` against its body, an engine's cache against the policy's layers) reports each
choice through :func:`note`. While :class:`~lppo.run.plan.RunPlan` is being built
(:func:`collecting`) the choices go into the plan, which logs them in one block and saves them
in checkpoints; a component used on its own (a test, a notebook) logs its line at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from lightning.pytorch.utilities import rank_zero_info

__all__ = ["Decision", "collecting", "note"]


@dataclass(frozen=True)
class Decision:
    """One resolved setting.

    Attributes:
        key: the configuration key (``model.ppo.old_logprobs``).
        value: what it resolved to, as the configuration would spell it.
        reason: why (empty: the value was given explicitly, or needs no reason).
        setting: what the configuration says (``auto``, or the explicit value).
        text: the line to log instead of ``key=setting: value (reason)`` (empty: that one).
    """

    key: str
    value: str
    reason: str = ""
    setting: str = "auto"
    text: str = ""

    def line(self) -> str:
        """``key=setting: value (reason)`` (or ``text``): the line this decision logs."""
        if self.text:
            return self.text
        why = f" ({self.reason})" if self.reason else ""
        return f"{self.key}={self.setting}: {self.value}{why}"


_PLAN: ContextVar[list[Decision] | None] = ContextVar("lppo_run_plan", default=None)


def note(key: str, value: str, reason: str = "", setting: str = "auto", text: str = "") -> None:
    """Report a resolved setting: into the plan being built, else logged when it says why.

    A component used on its own logs only its fallbacks (a decision with a reason or a text);
    the plan records every decision.
    """
    decision = Decision(key, value, reason, setting, text)
    plan = _PLAN.get()
    if plan is None:
        if reason or text:
            rank_zero_info(decision.line())
    else:
        plan.append(decision)


@contextmanager
def collecting() -> Iterator[list[Decision]]:
    """Within the block, :func:`note` appends to the yielded list instead of logging."""
    decisions: list[Decision] = []
    token = _PLAN.set(decisions)
    try:
        yield decisions
    finally:
        _PLAN.reset(token)
