"""``ppo_megatron``: megatron-core modules over data-parallel x tensor-parallel ranks.

A megatron model spec (:class:`~lppo.modules.megatron.MegatronGPT`) splits each layer over
``tensor_parallel_size`` consecutive ranks. This layout owns megatron-core's groups: the
strategy calls :meth:`MegatronLayout.build_context` before the models are built, which
initializes megatron's model-parallel state at the specs' size (:func:`megatron_context`) and
hands the groups to the specs. The data-parallel group has one rank per tensor-parallel
replica, so rollout, scoring, the planner, statistics and the setup broadcast span the
replicas while every tensor-parallel rank of a replica sees the same rows.

Gradients: chunks accumulate into megatron DDP's contiguous buffer (``param.main_grad``) with
no data-parallel sync; :meth:`MegatronLayout.reduce_gradients` runs megatron's
``finalize_model_grads`` once per step (the step's one data-parallel reduce, a sum) and takes
the global norm with tensor-parallel shards counted once; clipping scales the buffer. Modules
without a megatron DDP model (a Hugging Face critic beside a megatron actor) are reduced as
``ppo_ddp`` reduces them. Everything else (full replicas per tensor rank, whole-tensor state
dicts through the megatron modules' own hooks, so :meth:`~DataParallelLayout.full` and
:meth:`~DataParallelLayout.local` return tensors as they are) is
:class:`~lppo.parallel.DataParallelLayout`'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from lppo.layouts.base import DataParallelLayout, ParallelContext
from lppo.parallel import ProcessGroup, default_world, start_local_group
from lppo.validation import SettingError

#: Why ``ppo_megatron`` cannot lay a run out that has no megatron-core module.
NO_MEGATRON_MODULE = (
    "trainer.strategy=ppo_megatron lays out megatron-core modules, but the run built none; "
    "use lppo.modules.megatron.MegatronActor / MegatronCritic for model.actor / model.critic, "
    "or trainer.strategy=ppo_ddp / ppo_fsdp for Hugging Face models."
)


@runtime_checkable
class MegatronSpec(Protocol):
    """What the layout reads and sets of a megatron model spec (``MegatronGPT`` is one).

    Attributes:
        tensor_parallel_size: ranks each layer is split over.
        key: where ``tensor_parallel_size`` lives in the config (messages).
        context: the groups the model is built over (``None`` until handed or built).
    """

    tensor_parallel_size: int
    key: str
    context: ParallelContext | None


@dataclass(frozen=True)
class MegatronLayout(DataParallelLayout):
    """megatron-core's data x tensor-parallel groups and its DDP gradient reduce."""

    def build_context(self, root: nn.Module, world_size: int, rank: int) -> ParallelContext:
        """Initialize megatron-core's groups at the specs' size and hand them to every spec.

        Raises:
            SettingError: no megatron module under ``root``, specs of different sizes, or
                groups that do not span the ``world_size`` launched processes.
        """
        specs = megatron_specs(root)
        if not specs:
            raise SettingError(NO_MEGATRON_MODULE)
        for spec in specs:
            spec.context = self.groups(spec.tensor_parallel_size, spec.key)
        return self.context(world_size, rank)

    def groups(self, tensor_parallel_size: int, key: str) -> ParallelContext:
        """megatron-core's groups at ``tensor_parallel_size`` (initialized once), this layout's.

        What a spec built outside a strategy (a script, a test) takes for itself.
        """
        groups = megatron_context(tensor_parallel_size, key)
        return ParallelContext(data=groups.data, tensor=groups.tensor, layout=self)

    def context(self, world_size: int, rank: int) -> ParallelContext:
        """megatron-core's data- and tensor-parallel groups of this rank.

        Raises:
            SettingError: megatron-core's groups were not initialized (no megatron module was
                built), or they do not span the ``world_size`` launched processes.
        """
        if not megatron_ready():
            raise SettingError(NO_MEGATRON_MODULE)
        groups = megatron_groups()
        if groups.data.size * groups.tensor.size != world_size:
            raise SettingError(
                f"megatron-core's groups ({groups.data.size} data- x {groups.tensor.size} "
                f"tensor-parallel ranks) do not span the run's {world_size} processes "
                "(trainer.devices x trainer.num_nodes); megatron was initialized outside "
                "lppo's launch with another world size."
            )
        return ParallelContext(data=groups.data, tensor=groups.tensor, layout=self)

    def reduce_gradients(
        self, module: nn.Module, params: Sequence[nn.Parameter], group: ProcessGroup
    ) -> float:
        """``finalize_model_grads`` once (an all-reduce over megatron's data-parallel group).

        An all-reduce even for the distributed optimizer (which would reduce-scatter): lppo
        checks and clips the norm of the whole gradient, so every rank needs all of it.
        """
        ddp = getattr(module, "ddp", None)
        if ddp is None:
            return super().reduce_gradients(module, params, group)
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([ddp], force_all_reduce=True)
        return tensor_parallel_grad_norm(ddp.module, params, module.parallel.tensor)

    def clip_gradients(self, params: Sequence[nn.Parameter], max_norm: float, norm: float) -> None:
        """Scale megatron's gradient buffer as torch's clipping rule (coefficient in float64)."""
        if not all(hasattr(p, "main_grad") for p in params):
            super().clip_gradients(params, max_norm, norm)
            return
        coefficient = min(max_norm / (norm + 1e-6), 1.0)
        for p in params:
            p.main_grad.mul_(coefficient)


def tensor_parallel_grad_norm(
    model: nn.Module, params: Sequence[nn.Parameter], tensor: ProcessGroup
) -> float:
    """L2 norm of the whole model's gradient buffer: shards summed over ``tensor`` once.

    Split tensors (:func:`~lppo.modules.megatron.convert.split_dim`) count on every tensor
    rank, replicated ones (norms, the value head) on tensor rank 0 only (megatron's own
    ``tensor_model_parallel`` flags are not set when its initialization is skipped).

    Args:
        model: the GPTModel inside megatron's DDP wrapper.
        params: the parameters whose ``main_grad`` counts (the trainable ones).
        tensor: the tensor-parallel group.
    """
    from lppo.modules.megatron.convert import split_dim

    if not params:
        return 0.0
    wanted = {id(p) for p in params}
    total = torch.zeros((), dtype=torch.float64, device=params[0].device)
    for name, p in model.named_parameters():
        if id(p) in wanted and (tensor.rank == 0 or split_dim(name) is not None):
            total += p.main_grad.to(torch.float64).square().sum()
    return math.sqrt(float(tensor.all_reduce(total)))


def megatron_specs(root: nn.Module) -> list[MegatronSpec]:
    """The megatron model specs of the modules under ``root`` (each once), in module order."""
    found: dict[int, MegatronSpec] = {}
    for module in root.modules():
        spec = getattr(module, "spec", None)
        if isinstance(spec, MegatronSpec):
            found.setdefault(id(spec), spec)
    return list(found.values())


def megatron_ready() -> bool:
    """Whether megatron-core is installed and its model-parallel groups are initialized."""
    try:
        from megatron.core import parallel_state
    except ImportError:  # no megatron-core: no megatron module can have been built
        return False
    return bool(parallel_state.model_parallel_is_initialized())


def megatron_context(
    tensor_parallel_size: int, key: str = "tensor_parallel_size"
) -> ParallelContext:
    """Initialize megatron-core's model-parallel state (once) and name its groups.

    megatron-core needs a default process group even in one process: without one, a
    single-rank group is created (NCCL when CUDA is available, gloo otherwise). Ranks are
    split into data-parallel replicas of ``tensor_parallel_size`` consecutive ranks each.

    Args:
        tensor_parallel_size: ranks each layer is split over; must divide the world size.
        key: where the setting lives in the config (error messages).

    Returns:
        The data-parallel and tensor-parallel groups of this rank.

    Raises:
        SettingError: the world size is not a multiple of ``tensor_parallel_size``, or
            megatron-core was initialized before with another size.
    """
    from megatron.core import parallel_state

    start_local_group("lppo-megatron-")
    world, _ = default_world()
    if tensor_parallel_size < 1 or world % tensor_parallel_size:
        raise SettingError(
            f"{key}={tensor_parallel_size} must be >= 1 and divide the number of processes, "
            f"trainer.devices x trainer.num_nodes = {world}; set {key} to a divisor of it "
            "(data-parallel ranks = processes / tensor_parallel_size), or change trainer.devices."
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size)
    have = parallel_state.get_tensor_model_parallel_world_size()
    if have != tensor_parallel_size:
        raise SettingError(
            f"megatron-core is already initialized with tensor parallelism {have}; every "
            f"megatron module of a run needs the same tensor_parallel_size (got "
            f"{key}={tensor_parallel_size})."
        )
    return megatron_groups()


def megatron_groups() -> ParallelContext:
    """megatron-core's data- and tensor-parallel groups of this rank (state initialized)."""
    from megatron.core import parallel_state

    return ParallelContext(
        data=ProcessGroup.of(parallel_state.get_data_parallel_group()),
        tensor=ProcessGroup.of(parallel_state.get_tensor_model_parallel_group()),
    )
