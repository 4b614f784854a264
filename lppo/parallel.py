"""The parallel context: the ONLY module of lppo that calls collectives.

Every all-reduce, all-gather and broadcast of lppo (gradient sums, step diagnostics, whitening
moments, the row-layout gather, the initial module-state broadcast, the gathering of
tensor-parallel shards) goes through a :class:`ProcessGroup` of a :class:`ParallelContext`. The
context names the data-parallel group and, beside it, the tensor-parallel group (built by a
layout that splits layers, :mod:`lppo.layouts`), so algorithms that reduce over data-parallel
ranks never learn about tensor parallelism. Collectives *inside* a model library's layers are
that library's own.
``tests/test_parallel.py`` scans the package and fails if collectives are called anywhere else.

The context also carries the run's :class:`ParallelLayout`, the seam that decides how modules
are held over the data-parallel ranks: full replicas (:class:`DataParallelLayout`, here, the
default) or shards (:class:`lppo.layouts.FSDPLayout`); see :mod:`lppo.layouts`. The layout
owns the tensors too: modules and engines read a parameter's full tensor, this rank's part of
it and full state dicts through it (:meth:`ParallelLayout.full`, :meth:`ParallelLayout.local`,
:meth:`ParallelLayout.full_state_dict`), never through a concrete layout's helpers.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

ReduceOp = Literal["sum", "min", "max"]

#: Collective timeout used by lppo's strategy (the ``torch.distributed`` default).
DEFAULT_TIMEOUT: timedelta = dist.constants.default_pg_timeout

_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


def default_group_ready() -> bool:
    """Whether a default process group of more than one rank is initialized."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def default_world() -> tuple[int, int]:
    """``(world_size, rank)`` of the default process group; ``(1, 0)`` without one."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(), dist.get_rank()


def start_local_group(prefix: str) -> None:
    """Initialize a default process group of this one process, unless one exists.

    For libraries that need a default group even in one process (megatron-core): NCCL when
    CUDA is available, gloo otherwise, over a file store named ``prefix…`` in the temp dir.
    """
    if dist.is_initialized():
        return
    import tempfile

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    store = tempfile.NamedTemporaryFile(prefix=prefix, delete=False)
    dist.init_process_group(backend, init_method=f"file://{store.name}", rank=0, world_size=1)


@dataclass(frozen=True)
class ProcessGroup:
    """One group of ranks and the collectives lppo runs over it.

    A group of size 1 runs no communication at all: every collective returns its input.

    Attributes:
        size: number of ranks in the group.
        rank: this process's rank inside the group.
        handle: the ``torch.distributed`` group (``None``: the default group).
    """

    size: int = 1
    rank: int = 0
    handle: Any = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(
                f"process group rank={self.rank} size={self.size} is inconsistent; need "
                "size >= 1 and 0 <= rank < size."
            )

    @classmethod
    def of(cls, handle: Any) -> ProcessGroup:
        """This rank's place in the ``torch.distributed`` group ``handle`` (a library's own)."""
        return cls(size=dist.get_world_size(handle), rank=dist.get_rank(handle), handle=handle)

    @property
    def device(self) -> torch.device:
        """Device tensors must live on for this group's backend (CUDA under NCCL)."""
        if self.size > 1 and dist.get_backend(self.handle) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """Reduce ``tensor`` over the group; returns the result on ``tensor``'s device."""
        if self.size == 1:
            return tensor
        moved = tensor.to(self.device)
        dist.all_reduce(moved, op=_OPS[op], group=self.handle)
        return moved.to(tensor.device)

    def sum_partials(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's partial ``tensor``, differentiable.

        For a sum over a dimension split across the group (e.g. a vocabulary split over
        tensor-parallel ranks) whose result every rank then uses identically: the gradient of
        each rank's part is the incoming gradient unchanged.
        """
        if self.size == 1:
            return tensor
        return _SumPartials.apply(tensor, self)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape and dtype everywhere), in rank order."""
        if self.size == 1:
            return [tensor]
        moved = tensor.contiguous().to(self.device)
        out = [torch.empty_like(moved) for _ in range(self.size)]
        dist.all_gather(out, moved, group=self.handle)
        return [t.to(tensor.device) for t in out]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order."""
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.handle)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``src``'s ``obj`` on every rank (other ranks may pass ``None``)."""
        if self.size == 1:
            return obj
        payload = [obj if self.rank == src else None]
        dist.broadcast_object_list(payload, src=self._global(src), group=self.handle)
        return payload[0]

    def exchange_objects(
        self, pairs: Sequence[tuple[int, int]], outgoing: dict[int, Any]
    ) -> dict[int, Any]:
        """Point-to-point transfers: for each ``(src, dst)`` of ``pairs``, ``src`` sends one object.

        Every rank passes the same ``pairs`` and takes part in the ones that name it, in that
        order (each pair's rank blocks on its own first open pair, so the earliest open pair
        always completes: no deadlock). Ranks not named by a pair send and receive nothing.

        Args:
            pairs: the transfers, the same list on every rank (no pair twice, no ``(r, r)``).
            outgoing: this rank's object for each ``dst`` it sends to.

        Returns:
            The object received from each ``src`` that sends to this rank.
        """
        received: dict[int, Any] = {}
        for src, dst in pairs:
            if src == self.rank:
                payload = [outgoing[dst]]
                dist.send_object_list(payload, self._global(dst), self.handle, self.device)
            elif dst == self.rank:
                box: list[Any] = [None]
                dist.recv_object_list(box, self._global(src), self.handle, self.device)
                received[src] = box[0]
        return received

    def broadcast_module(self, module: nn.Module, src: int = 0) -> None:
        """Copy ``src``'s parameters and buffers into every rank (one broadcast per dtype)."""
        if self.size == 1:
            return
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        seen: set[int] = set()
        for tensor in [*module.parameters(), *module.buffers()]:
            if id(tensor) in seen or tensor.numel() == 0:
                continue
            seen.add(id(tensor))
            groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
        with torch.no_grad():
            for (_, dtype), tensors in sorted(groups.items(), key=lambda kv: str(kv[0])):
                flat = torch.cat([t.detach().reshape(-1) for t in tensors])
                if dtype == torch.bool:
                    flat = flat.to(torch.uint8)
                moved = flat.to(self.device)
                dist.broadcast(moved, src=self._global(src), group=self.handle)
                flat = moved.to(flat.device)
                offset = 0
                for t in tensors:
                    n = t.numel()
                    t.copy_(flat[offset : offset + n].view_as(t).to(dtype))
                    offset += n

    def _global(self, rank: int) -> int:
        """The global rank of group rank ``rank`` (collectives name sources globally)."""
        if self.handle is None:
            return rank
        return dist.get_global_rank(self.handle, rank)


class _SumPartials(torch.autograd.Function):
    """All-reduce (sum) forward, identity backward: see :meth:`ProcessGroup.sum_partials`."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        out = tensor.detach().clone()
        return group.all_reduce(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


#: The single-process group: no communication.
SINGLE = ProcessGroup()


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


def sum_gradients(params: list[nn.Parameter], group: ProcessGroup) -> None:
    """Sum the ``.grad`` of ``params`` over ``group`` in one all-reduce (see above)."""
    if group.size == 1 or not params:
        return
    present = torch.tensor(
        [p.grad is not None for p in params], dtype=torch.int32, device=params[0].device
    )
    present = group.all_reduce(present)
    params = [p for p, n in zip(params, present.tolist(), strict=True) if n > 0]
    if not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = group.all_reduce(torch.cat([p.grad.reshape(-1) for p in params]))
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p))
        offset += n


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
        if not default_group_ready():
            return cls()
        return cls(data=ProcessGroup(size=dist.get_world_size(), rank=dist.get_rank()))


#: Attribute a layout's :meth:`~ParallelLayout.prepare` sets on each model it holds otherwise
#: than as a full replica: the layout itself, for code handed only the model (an engine's sync).
LAYOUT_ATTRIBUTE = "_lppo_layout"


def layout_of(model: nn.Module) -> ParallelLayout:
    """The layout holding ``model``'s tensors: the one that marked it, else full replicas."""
    layout: ParallelLayout | None = getattr(model, LAYOUT_ATTRIBUTE, None)
    return DataParallelLayout() if layout is None else layout


def close_process_group() -> None:
    """Destroy the default process group, if any, once a fit is over and nothing collects.

    Its gloo worker threads then stop while the interpreter still runs: left to interpreter
    exit, a thread releasing a finished collective's tensor can take the GIL during
    finalization and abort the process (SIGABRT after a successful fit, seen under
    TransferQueue).
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
