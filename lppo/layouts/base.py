"""The layout seam: the ``ParallelLayout`` protocol, the context it builds, its default.

A :class:`ParallelContext` holds one training process's groups (data-parallel and, beside it,
tensor-parallel; their collectives are :class:`~lppo.parallel.ProcessGroup`'s) and the run's
:class:`ParallelLayout`: how modules are held over the data-parallel ranks, full replicas
(:class:`DataParallelLayout`, the default) or shards (:class:`lppo.layouts.FSDPLayout`,
megatron's :class:`lppo.layouts.MegatronLayout`). The layout owns the tensors: modules and
engines read a parameter's full tensor, this rank's part of it and full state dicts through it
(:meth:`ParallelLayout.full`, :meth:`ParallelLayout.local`,
:meth:`ParallelLayout.full_state_dict`), never through a concrete layout's helpers.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from lppo.parallel import SINGLE, ProcessGroup, default_world, sum_gradients

__all__ = [
    "LAYOUT_ATTRIBUTE",
    "DataParallelLayout",
    "ParallelContext",
    "ParallelLayout",
    "data_parallel_context",
    "layout_of",
]


@runtime_checkable
class ParallelLayout(Protocol):
    """How a run's modules are laid out over its processes (see the module docstring).

    Every method is called on every rank at the same point of the iteration, so a layout may
    run collectives in any of them except :meth:`abort` (failure paths may reach it on one
    rank only).

    """

    def shards_weights(self) -> bool:
        """Whether ranks hold only part of each model.

        Generation must then run in the training process, inside :meth:`gathered` (no
        background rollouts).
        """
        ...

    def context(self, world_size: int, rank: int) -> ParallelContext:
        """The process groups of this rank of ``world_size`` launched processes."""
        ...

    def build_context(self, root: nn.Module, world_size: int, rank: int) -> ParallelContext:
        """This rank's groups, built before the modules under ``root`` build their models.

        Called once by the strategy, after the default process group is up and before
        ``configure_model``; a layout whose model specs need the groups to build (megatron's
        tensor-parallel shards) creates them here and hands them to those specs.
        """
        ...

    def prepare(self, root: nn.Module, parallel: ParallelContext) -> None:
        """Make every rank hold rank 0's states of ``root`` and wrap or shard its models.

        Called once, after the modules are built (and a checkpoint's weights loaded) and
        before the optimizers are created.
        """
        ...

    def reduce_gradients(
        self, module: nn.Module, params: Sequence[nn.Parameter], group: ProcessGroup
    ) -> float:
        """Sum the step's gradients of ``params`` over ``group`` (data-parallel); global L2 norm.

        Called once per optimizer step, in :meth:`~lppo.modules.PPOModule.finish`.
        """
        ...

    def clip_gradients(self, params: Sequence[nn.Parameter], max_norm: float, norm: float) -> None:
        """Scale the gradients by ``min(1, max_norm / (norm + 1e-6))`` (torch's clipping rule)."""
        ...

    def idle_chunk(self, module: nn.Module) -> None:
        """What a rank runs for a chunk it does not train (padding, or no valid token)."""
        ...

    def abort(self, module: nn.Module) -> None:
        """Drop whatever the layout holds of the open step's gradients (local, no collective)."""
        ...

    def gathered(self, modules: Sequence[nn.Module | None]) -> AbstractContextManager[None]:
        """Inside: ``modules`` hold full weights and forwards run rank-local (any count)."""
        ...

    def full_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """``module``'s state dict with every tensor whole (plain tensors, ordinary keys)."""
        ...

    def full(self, tensor: torch.Tensor) -> torch.Tensor:
        """The full tensor of a possibly sharded ``tensor`` (a collective if it is sharded)."""
        ...

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``tensor`` as a plain tensor (``tensor`` itself when whole)."""
        ...

    def is_sharded(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is split over the data-parallel ranks (local, no collective)."""
        ...

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state dict with every state tensor whole (for a checkpoint)."""
        ...

    def local_optimizer_state(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> dict[str, Any]:
        """A state written by :meth:`optimizer_state`, as this rank's optimizer loads it."""
        ...


def data_parallel_context(layout: ParallelLayout, world_size: int, rank: int) -> ParallelContext:
    """One data-parallel group of every launched process, no tensor parallelism, ``layout``'s."""
    return ParallelContext(data=ProcessGroup(size=world_size, rank=rank), layout=layout)


@dataclass(frozen=True)
class DataParallelLayout:
    """Data parallelism without a wrapper: full replicas, one gradient all-reduce per step.

    Every rank holds the whole actor, critic, reference and their optimizer state. Rank 0's
    module states are broadcast once at setup; in :meth:`reduce_gradients` the step's
    gradients (accumulated locally over any number of chunks) are summed over the
    data-parallel ranks in one coalesced all-reduce. Forwards are rank-local, so ranks may run
    different numbers of them and a rank with nothing to train runs nothing.
    """

    def shards_weights(self) -> bool:
        """No: every rank holds whole models."""
        return False

    def context(self, world_size: int, rank: int) -> ParallelContext:
        """Data parallelism over every launched process."""
        return data_parallel_context(self, world_size, rank)

    def build_context(self, root: nn.Module, world_size: int, rank: int) -> ParallelContext:
        """:meth:`context`: the models need no groups to build."""
        return self.context(world_size, rank)

    def prepare(self, root: nn.Module, parallel: ParallelContext) -> None:
        """Copy rank 0's parameters and buffers into every rank (one broadcast per dtype)."""
        parallel.data.broadcast_module(root)

    def reduce_gradients(
        self, module: nn.Module, params: Sequence[nn.Parameter], group: ProcessGroup
    ) -> float:
        """Sum gradients over data-parallel ranks; the total L2 norm of the summed gradient.

        A parameter with no gradient on any rank keeps ``grad = None`` (as with one process,
        so optimizers skip it); one with a gradient on some rank gets zeros where it has none
        (e.g. a rank holding only padding chunks).
        """
        sum_gradients(list(params), group)
        grads = [p.grad for p in params if p.grad is not None]
        return float(torch.nn.utils.get_total_norm(grads, norm_type=2.0)) if grads else 0.0

    def clip_gradients(self, params: Sequence[nn.Parameter], max_norm: float, norm: float) -> None:
        """Clip as torch's ``clip_grads_with_norm_``, with the coefficient in the grads' precision.

        A default float32 norm would round the coefficient of float64 gradients to ~1e-7.
        """
        grads = [p.grad for p in params if p.grad is not None]
        dtype = functools.reduce(torch.promote_types, (g.dtype for g in grads), torch.float32)
        coefficient_norm = torch.tensor(norm, dtype=dtype)
        torch.nn.utils.clip_grads_with_norm_(list(params), max_norm, coefficient_norm)

    def idle_chunk(self, module: nn.Module) -> None:
        """Nothing: gradients are only exchanged in :meth:`reduce_gradients`."""

    def abort(self, module: nn.Module) -> None:
        """Nothing beyond the module's own ``grad = None``."""

    def gathered(self, modules: Sequence[nn.Module | None]) -> AbstractContextManager[None]:
        """Nothing to gather: every rank holds full weights."""
        return nullcontext()

    def full_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """The module's own state dict (already whole)."""
        return module.state_dict()

    def full(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` itself: every rank holds whole tensors."""
        return tensor

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` itself: this rank's part is all of it."""
        return tensor

    def is_sharded(self, tensor: torch.Tensor) -> bool:
        """No: nothing is split over the data-parallel ranks."""
        return False

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's own state dict (already whole)."""
        return optimizer.state_dict()

    def local_optimizer_state(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> dict[str, Any]:
        """``state`` itself (every rank holds the whole optimizer)."""
        return state


@dataclass(frozen=True)
class ParallelContext:
    """The process groups of one training process, and the layout that uses them.

    Attributes:
        data: the data-parallel group (ranks that train different chunks of every step and
            sum their gradients, diagnostics and statistics).
        tensor: the tensor-parallel group (ranks holding shards of the same layers and
            seeing the same chunks); single unless the layout splits layers over ranks.
        layout: how the modules are held over the data-parallel ranks (full replicas by
            default; see :mod:`lppo.layouts`).
    """

    data: ProcessGroup = SINGLE
    tensor: ProcessGroup = SINGLE
    layout: ParallelLayout = field(default_factory=lambda: DataParallelLayout())

    @classmethod
    def from_default_group(cls) -> ParallelContext:
        """Data parallelism over the whole default process group (single when there is none)."""
        size, rank = default_world()
        if size <= 1:
            return cls()
        return cls(data=ProcessGroup(size=size, rank=rank))


#: Attribute a layout's :meth:`~ParallelLayout.prepare` sets on each model it holds otherwise
#: than as a full replica: the layout itself, for code handed only the model (an engine's sync).
LAYOUT_ATTRIBUTE = "_lppo_layout"


def layout_of(model: nn.Module) -> ParallelLayout:
    """The layout holding ``model``'s tensors: the one that marked it, else full replicas."""
    layout: ParallelLayout | None = getattr(model, LAYOUT_ATTRIBUTE, None)
    return DataParallelLayout() if layout is None else layout
