"""Parallel layouts: how lppo's modules are held over the launched processes.

:data:`LAYOUTS` names each layout for ``--trainer.strategy`` (registered in Lightning's
``StrategyRegistry`` by :mod:`lppo.runtime.strategy`). Adding a layout: a file implementing
:class:`~lppo.parallel.ParallelLayout` and one entry here. The data-parallel layout lives in
:mod:`lppo.parallel` (it is every context's default); the others live here, each with what it
owns (FSDP's mesh, megatron-core's groups). Code outside this package reaches a layout only
through the protocol (``module.parallel.layout``), not by importing its module; the one
exception is the megatron backend's model spec, which takes megatron's groups itself when it
is built outside lppo's strategy (``tests/test_architecture.py`` lists it).
"""

from __future__ import annotations

from lppo.layouts.base import DataParallelLayout, ParallelLayout
from lppo.layouts.fsdp import FSDPLayout
from lppo.layouts.megatron import MegatronLayout

#: ``--trainer.strategy`` name → (layout class, description); each builds a
#: :class:`~lppo.runtime.strategy.PPOStrategy` with that layout.
LAYOUTS: dict[str, tuple[type[ParallelLayout], str]] = {
    "ppo_ddp": (DataParallelLayout, "lppo data parallelism: full replicas, no DDP wrapper"),
    "ppo_fsdp": (FSDPLayout, "lppo FSDP2: parameters, gradients and optimizer state sharded"),
    "ppo_megatron": (MegatronLayout, "lppo megatron-core: data x tensor parallelism, its DDP"),
}

__all__ = ["LAYOUTS", "DataParallelLayout", "FSDPLayout", "MegatronLayout", "ParallelLayout"]
