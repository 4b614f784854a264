"""A copy of a module's training state (parameters, optimizer, scheduler) that can be restored.

Two features restore state that an optimizer step already changed, and both use this one
class: the finite-parameter guard of :meth:`PPOModule.finish` (a step that leaves a
non-finite parameter is undone) and the transactional iteration of the controller (an
iteration that fails after some of its steps committed is undone for actor and critic).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from lppo.layouts.base import ParallelContext


class Trainable(Protocol):
    """What a snapshot reads and restores of a module (every :class:`PPOModule` is one).

    Attributes:
        role: the module's name in messages (``actor`` / ``critic``).
        optimizer: its optimizer (``None`` before the first step).
        scheduler: its learning-rate scheduler, if any.
        weights_version: bumped when its weights change outside a step (engines resync).
        parallel: its process groups (sharded parameters are checked over the data group).
    """

    role: str
    parallel: ParallelContext
    optimizer: torch.optim.Optimizer | None
    scheduler: Any
    weights_version: int

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters its optimizer steps, in a fixed order."""
        ...


@dataclass
class TrainingState:
    """Everything an optimizer step changes in a :class:`PPOModule`.

    Attributes:
        parameters: clones of ``module.trainable_parameters()``, in that order.
        optimizer: deep copy of ``optimizer.state_dict()`` (``None``: no optimizer yet, so a
            restore drops the one built since and the next step builds a fresh one).
        scheduler: deep copy of ``scheduler.state_dict()`` (``None``: no scheduler yet).
    """

    parameters: list[torch.Tensor]
    optimizer: dict[str, Any] | None
    scheduler: dict[str, Any] | None

    @classmethod
    @torch.no_grad()
    def capture(cls, module: Trainable) -> TrainingState:
        """Copy ``module``'s parameters, optimizer and scheduler state."""
        optimizer = module.optimizer
        scheduler = module.scheduler
        return cls(
            parameters=[p.detach().clone() for p in module.trainable_parameters()],
            optimizer=None if optimizer is None else _copied(optimizer.state_dict()),
            scheduler=None if scheduler is None else copy.deepcopy(scheduler.state_dict()),
        )

    @torch.no_grad()
    def restore(self, module: Trainable) -> None:
        """Put the captured state back, bitwise (the copy stays usable for another restore)."""
        params = module.trainable_parameters()
        if len(params) != len(self.parameters):
            raise RuntimeError(
                f"{module.role}: {len(params)} trainable parameters now, "
                f"{len(self.parameters)} when the state was captured"
            )
        for param, saved in zip(params, self.parameters, strict=True):
            param.copy_(saved)
        if self.optimizer is None:
            module.optimizer = module.scheduler = None
        elif module.optimizer is not None:
            module.optimizer.load_state_dict(copy.deepcopy(self.optimizer))
        if module.scheduler is not None and self.scheduler is not None:
            module.scheduler.load_state_dict(copy.deepcopy(self.scheduler))

    @property
    def nbytes(self) -> int:
        """Bytes held by the copy (parameters and optimizer tensors)."""
        total = sum(t.numel() * t.element_size() for t in self.parameters)
        for state in (self.optimizer or {}).get("state", {}).values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    total += value.numel() * value.element_size()
        return total


def _copied(value: Any) -> Any:
    """A deep copy of a state dict: tensors cloned, dicts and lists walked, the rest deep-copied.

    Same result as ``copy.deepcopy`` for an optimizer's state dict, in about half the time
    (no memo bookkeeping per tensor).
    """
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_copied(v) for v in value)
    return copy.deepcopy(value)


class Transaction:
    """The training state of several modules at one point; :meth:`rollback` restores all.

    Args:
        modules: the modules to capture (actor and critic for an iteration).
    """

    def __init__(self, modules: Sequence[Trainable]) -> None:
        self.states = [(m, TrainingState.capture(m)) for m in modules]

    def rollback(self) -> None:
        """Restore every module; their weights versions move on so engines resync."""
        for module, state in self.states:
            state.restore(module)
            module.weights_version += 1


def parameters_finite(module: Trainable) -> bool:
    """Whether every trainable parameter is finite (one max-abs reduction, no overflow).

    Sharded parameters (under ``ppo_fsdp``) are checked shard by shard (each rank its own
    part, through the module's layout), and the ranks agree through one all-reduce, so every
    rank takes the same branch.
    """
    layout = module.parallel.layout
    params = [p.detach() for p in module.trainable_parameters()]
    if not params:
        return True
    # min and max of each tensor: NaN propagates through both, ±inf is one of them, and
    # aminmax is one cheap pass (an inf-norm is several times slower on CPU).
    local = [layout.local(p) for p in params]  # each rank checks its own part
    bounds = [torch.stack(torch.aminmax(t)) for t in local if t.numel()]
    finite = torch.isfinite(torch.cat(bounds)).all() if bounds else torch.tensor(True)
    if not any(layout.is_sharded(p) for p in params):
        return bool(finite)
    group = module.parallel.data
    return bool(group.all_reduce(finite.to(torch.int32).reshape(1), op="min").item())
