"""Whole tensors in the state dicts of tensor-parallel megatron models and their optimizers.

Each tensor-parallel rank holds a shard of the split tensors
(:func:`~lppo.modules.megatron.convert.split_dim`), and of their optimizer moments. A checkpoint
is written by one rank and read by every rank, so the state dicts say the whole tensors: saving
gathers the shards over the tensor-parallel group (a collective: every rank saves, as Lightning
does), loading takes this rank's shard of each whole tensor. The checkpoint then equals the
single-process one and resumes under any ``tensor_parallel_size``. Installed only when the
group has more than one rank (one rank's state is already whole).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lppo.modules.megatron.convert import shard, split_dim, unshard
from lppo.parallel import ProcessGroup


def _whole(name: str, tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return unshard(name, group.all_gather(tensor.detach()))


def _split(name: str, tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return shard(name, tensor, group.rank, group.size).clone()


def install_model_hooks(gpt: nn.Module, group: ProcessGroup) -> None:
    """``gpt.state_dict()`` holds whole tensors; ``load_state_dict`` takes whole ones."""
    split = [name for name, _ in gpt.named_parameters() if split_dim(name) is not None]

    def save(module: nn.Module, state: dict[str, Any], prefix: str, meta: Any) -> None:
        for name in split:
            state[prefix + name] = _whole(name, state[prefix + name], group)

    def load(module: nn.Module, state: dict[str, Any], prefix: str, *args: Any) -> None:
        mine = dict(module.named_parameters())
        for name in split:
            key = prefix + name
            if key in state and state[key].shape != mine[name].shape:  # whole: take my shard
                state[key] = _split(name, state[key], group)

    gpt.register_state_dict_post_hook(save)
    gpt.register_load_state_dict_pre_hook(load)


def install_optimizer_hooks(
    optimizer: torch.optim.Optimizer, model: nn.Module, group: ProcessGroup
) -> None:
    """The optimizer's state dict holds whole moments of split parameters (and loads them).

    Args:
        optimizer: a torch optimizer over ``model``'s parameters (state tensors shaped as the
            parameter, e.g. AdamW's ``exp_avg``; scalars such as ``step`` are left alone).
        model: the megatron GPTModel whose parameter names say which tensors are split.
        group: the tensor-parallel group.
    """
    names = {id(p): name for name, p in model.named_parameters()}

    def split_params() -> list[tuple[int, str, nn.Parameter]]:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        return [
            (i, names[id(p)], p)
            for i, p in enumerate(params)
            if id(p) in names and split_dim(names[id(p)]) is not None
        ]

    def save(opt: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        per_param = dict(state["state"])  # new dicts: the packed state is the live one
        for i, name, p in split_params():
            if i in per_param:
                per_param[i] = {
                    k: _whole(name, v, group) if _is_moment(v, p) else v
                    for k, v in per_param[i].items()
                }
        return {**state, "state": per_param}

    def load(opt: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        per_param = dict(state["state"])
        for i, name, p in split_params():
            if i in per_param:
                per_param[i] = {
                    k: _split(name, v, group) if _is_whole(v, p, group) else v
                    for k, v in per_param[i].items()
                }
        return {**state, "state": per_param}

    optimizer.register_state_dict_post_hook(save)
    optimizer.register_load_state_dict_pre_hook(load)


def _is_moment(value: Any, param: nn.Parameter) -> bool:
    return isinstance(value, torch.Tensor) and value.shape == param.shape


def _is_whole(value: Any, param: nn.Parameter, group: ProcessGroup) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.dim() == param.dim() > 0
        and value.numel() == param.numel() * group.size
    )
