"""The parallel context: the ONLY module of lppo that calls collectives.

Every all-reduce, all-gather and broadcast of lppo (gradient sums, step diagnostics, whitening
moments, the row-layout gather, the initial module-state broadcast, the gathering of
tensor-parallel shards) goes through a :class:`ProcessGroup` of a :class:`ParallelContext`. The
context names the data-parallel group and, beside it, the tensor-parallel group (megatron-core,
:func:`megatron_context`), so algorithms that reduce over data-parallel ranks never learn about
tensor parallelism. Collectives *inside* megatron-core's layers are megatron's own.
``tests/test_parallel.py`` scans the package and fails if collectives are called anywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

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


@dataclass(frozen=True)
class ParallelContext:
    """The process groups of one training process.

    Attributes:
        data: the data-parallel group (ranks that train different chunks of every step and
            sum their gradients, diagnostics and statistics).
        tensor: the tensor-parallel group (ranks holding shards of the same layers and
            seeing the same chunks); single unless a megatron-core model splits its layers.
    """

    data: ProcessGroup = SINGLE
    tensor: ProcessGroup = SINGLE

    @classmethod
    def from_default_group(cls) -> ParallelContext:
        """Data parallelism over the whole default process group (single when there is none)."""
        if not default_group_ready():
            return cls()
        return cls(data=ProcessGroup(size=dist.get_world_size(), rank=dist.get_rank()))


def megatron_context(tensor_parallel_size: int) -> ParallelContext:
    """Initialize megatron-core's model-parallel state (once) and name its groups.

    megatron-core needs a default process group even in one process: without one, a
    single-rank group is created (NCCL when CUDA is available, gloo otherwise). Ranks are
    split into data-parallel replicas of ``tensor_parallel_size`` consecutive ranks each.

    Args:
        tensor_parallel_size: ranks each layer is split over; must divide the world size.

    Returns:
        The data-parallel and tensor-parallel groups of this rank.

    Raises:
        ValueError: the world size is not a multiple of ``tensor_parallel_size``, or
            megatron-core was initialized before with another size.
    """
    from megatron.core import parallel_state

    if not dist.is_initialized():
        import tempfile

        backend = "nccl" if torch.cuda.is_available() else "gloo"
        store = tempfile.NamedTemporaryFile(prefix="lppo-megatron-", delete=False)
        dist.init_process_group(backend, init_method=f"file://{store.name}", rank=0, world_size=1)
    world = dist.get_world_size()
    if tensor_parallel_size < 1 or world % tensor_parallel_size:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} must be >= 1 and divide the world "
            f"size {world}; set it to a divisor of the number of processes."
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size)
    have = parallel_state.get_tensor_model_parallel_world_size()
    if have != tensor_parallel_size:
        raise ValueError(
            f"megatron-core is already initialized with tensor parallelism {have}; every "
            f"megatron module of a run needs the same tensor_parallel_size (got "
            f"{tensor_parallel_size})."
        )
    tp = parallel_state.get_tensor_model_parallel_group()
    dp = parallel_state.get_data_parallel_group()
    return ParallelContext(
        data=ProcessGroup(size=dist.get_world_size(dp), rank=dist.get_rank(dp), handle=dp),
        tensor=ProcessGroup(size=dist.get_world_size(tp), rank=dist.get_rank(tp), handle=tp),
    )
