"""What a rollout engine offers beyond :class:`~lppo.rollout.RolloutEngine`: one typed record.

The run plan (:mod:`lppo.run.plan`) and the rollout source read an engine's optional abilities
only through :func:`capabilities_of`, never by probing attribute names: an engine states them
in :meth:`CapableEngine.capabilities`, and an engine that implements only the protocol
(a user's own) offers none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from lppo.rollout.settings import RolloutSettings
from lppo.tasks.base import Task

__all__ = ["CapableEngine", "EngineCapabilities", "capabilities_of"]


@dataclass(frozen=True)
class EngineCapabilities:
    """An engine's optional abilities (the defaults: none).

    Attributes:
        generates_elsewhere: generation runs in processes of the engine's own (Ray rollout
            workers), so an asynchronous run drives a copy of it from a thread, not from a
            background process.
        policy_logprob_obstacles: ``(policy, dtype) -> reasons``: why the engine's log-probs
            of π at the sampled tokens would not be the actor's π_old when ``policy`` (the
            module the engine samples from) computes in ``dtype`` (``None``: its own dtype);
            an empty list: they are, to round-off. ``None``: the engine cannot give them.
        enable_policy_logprobs: from now on fill ``GenerationOutput.policy_logprobs`` (the
            run plan calls it when it picks ``model.ppo.old_logprobs: engine``).
        take_restarts: ``() -> int``: rollout workers replaced since the last call (``None``:
            the engine has no workers).
        max_row_tokens: the longest row the engine can put, prompt included (``None``: the
            task's longest prompt, one separator and ``model.rollout.max_new_tokens``).
        multi_turn: a row holds several policy turns, each bounded by
            ``model.rollout.max_new_tokens`` (a per-turn limit, not the row's).
        check_setup: ``(tokenizer, task, sampling)``: refuses, with a
            :class:`~lppo.validation.SettingError`, what the engine could not run with the run's
            tokenizer, task and sampling settings; the run plan calls it before anything starts
            (``None``: nothing to check).
        encode_prompt: ``(tokenizer, text) -> ids``: a prompt's token ids as the engine will
            encode them, known before its setup (``None``: the engine cannot tell).
        ray_cpus: logical Ray CPUs the engine's workers reserve once set up; every copy a
            runner sets up (asynchronous rollouts) reserves as many again. The run plan counts
            them against ``trainer.ray.num_cpus``.
    """

    generates_elsewhere: bool = False
    policy_logprob_obstacles: Callable[[torch.nn.Module, torch.dtype | None], list[str]] | None = (
        None
    )
    enable_policy_logprobs: Callable[[], None] | None = None
    take_restarts: Callable[[], int] | None = None
    max_row_tokens: int | None = None
    multi_turn: bool = False
    check_setup: Callable[[Any, Task, RolloutSettings], None] | None = None
    encode_prompt: Callable[[Any, str], list[int]] | None = None
    ray_cpus: int = 0


@runtime_checkable
class CapableEngine(Protocol):
    """An engine that declares its :class:`EngineCapabilities`."""

    def capabilities(self) -> EngineCapabilities:
        """This engine's optional abilities (read at setup by the run plan)."""
        ...


def capabilities_of(engine: object) -> EngineCapabilities:
    """``engine``'s declared abilities; none for an engine that declares nothing."""
    if isinstance(engine, CapableEngine):
        return engine.capabilities()
    return EngineCapabilities()
