"""Process groups and their collectives: the ONLY module of lppo that calls them.

Every all-reduce, all-gather and broadcast of lppo (gradient sums, step diagnostics, whitening
moments, the row-layout gather, the initial module-state broadcast, the gathering of
tensor-parallel shards) goes through a :class:`ProcessGroup`, held by the run's
:class:`~lppo.layouts.base.ParallelContext` (its data-parallel group and, beside it, the
tensor-parallel one), so algorithms that reduce over data-parallel ranks never learn about
tensor parallelism. Collectives *inside* a model library's layers are that library's own.
``tests/test_parallel.py`` scans the package and fails if collectives are called anywhere else
(FSDP2's own API aside, in :mod:`lppo.layouts.fsdp`).

The layout seam (``ParallelLayout``, ``ParallelContext``, ``DataParallelLayout``) lives in
:mod:`lppo.layouts.base`; importing those names from here still works.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
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


def close_process_group() -> None:
    """Destroy the default process group, if any, once a fit is over and nothing collects.

    Its gloo worker threads then stop while the interpreter still runs: left to interpreter
    exit, a thread releasing a finished collective's tensor can take the GIL during
    finalization and abort the process (SIGABRT after a successful fit, seen under
    TransferQueue).
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def __getattr__(name: str) -> Any:
    """``from lppo.parallel import ParallelContext`` (the layout seam's names) still works.

    They moved to :mod:`lppo.layouts.base`, which builds on this module, so they are looked up
    there on first use, never imported at load.
    """
    base = importlib.import_module("lppo.layouts.base")
    if name in base.__all__:
        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
