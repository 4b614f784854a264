"""The parallel context: the ONLY module of lppo that calls collectives.

Every all-reduce, all-gather and broadcast of lppo (gradient sums, step diagnostics, whitening
moments, the row-layout gather, the initial module-state broadcast) goes through a
:class:`ProcessGroup` of a :class:`ParallelContext`. The context names the data-parallel group
today; a tensor-parallel group (megatron-core) sits beside it as another field, so algorithms
that reduce over data-parallel ranks never learn about tensor parallelism.
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


#: The single-process group: no communication.
SINGLE = ProcessGroup()


@dataclass(frozen=True)
class ParallelContext:
    """The process groups of one training process.

    Attributes:
        data: the data-parallel group (ranks that train different chunks of every step and
            sum their gradients, diagnostics and statistics).
    """

    data: ProcessGroup = SINGLE

    @classmethod
    def from_default_group(cls) -> ParallelContext:
        """Data parallelism over the whole default process group (single when there is none)."""
        if not default_group_ready():
            return cls()
        return cls(data=ProcessGroup(size=dist.get_world_size(), rank=dist.get_rank()))
