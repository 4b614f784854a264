"""``ppo_megatron``: megatron-core modules over data-parallel x tensor-parallel ranks.

A megatron model spec (:class:`~lppo.modules.megatron.MegatronGPT`) splits each layer over
``tensor_parallel_size`` consecutive ranks and initializes megatron-core's groups when it is
built. This layout takes the run's groups from megatron: the data-parallel group has one rank
per tensor-parallel replica, so rollout, scoring, the planner, statistics and the setup
broadcast span the replicas while every tensor-parallel rank of a replica sees the same rows.

Gradients: chunks accumulate into megatron DDP's contiguous buffer (``param.main_grad``) with
no data-parallel sync; :meth:`MegatronLayout.reduce_gradients` runs megatron's
``finalize_model_grads`` once per step (the step's one data-parallel reduce, a sum) and takes
the global norm with tensor-parallel shards counted once; clipping scales the buffer. Modules
without a megatron DDP model (a Hugging Face critic beside a megatron actor) are reduced as
``ppo_ddp`` reduces them. Everything else (full replicas per tensor rank, whole-tensor state
dicts through the megatron modules' own hooks) is :class:`~lppo.parallel.DataParallelLayout`'s.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from lppo.parallel import DataParallelLayout, ParallelContext, ProcessGroup, megatron_groups
from lppo.validation import SettingError


@dataclass(frozen=True)
class MegatronLayout(DataParallelLayout):
    """megatron-core's data x tensor-parallel groups and its DDP gradient reduce."""

    def context(self, world_size: int, rank: int) -> ParallelContext:
        """megatron-core's data- and tensor-parallel groups of this rank.

        Raises:
            SettingError: no megatron module was built (megatron-core not initialized), or its
                groups do not span the ``world_size`` launched processes.
        """
        state = sys.modules.get("megatron.core.parallel_state")  # never imported: no megatron
        if state is None or not state.model_parallel_is_initialized():
            raise SettingError(
                "trainer.strategy=ppo_megatron lays out megatron-core modules, but the run "
                "built none; use lppo.modules.megatron.MegatronActor / MegatronCritic for "
                "model.actor / model.critic, or trainer.strategy=ppo_ddp / ppo_fsdp for "
                "Hugging Face models."
            )
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
