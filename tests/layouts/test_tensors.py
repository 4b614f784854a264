"""The tensors a layout owns: ``full`` / ``local`` / ``is_sharded``, state dicts, ``layout_of``.

The data-parallel layout holds whole tensors and hands them back as they are. The FSDP layout
is checked in this process over a one-rank gloo group (its shards are then ``DTensor``s
holding the whole tensor): sharded tensors are recognized, gathered and unwrapped, whole ones
pass through, and the models it prepares carry it for code handed only the model.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from _builders import tiny_lm
from torch import nn

from lppo.layouts import FSDPLayout
from lppo.layouts.base import DataParallelLayout, ParallelContext, layout_of
from lppo.parallel import ProcessGroup, start_local_group


def test_data_parallel_tensors_are_whole_and_returned_as_they_are():
    layout = DataParallelLayout()
    t = torch.arange(6.0).reshape(2, 3)
    assert layout.full(t) is t
    assert layout.local(t) is t
    assert not layout.is_sharded(t)
    model = nn.Linear(3, 2)
    state = layout.full_state_dict(model)
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_a_model_no_layout_marked_is_held_as_full_replicas():
    assert isinstance(layout_of(nn.Linear(2, 2)), DataParallelLayout)


@pytest.fixture
def one_rank_group() -> Iterator[ProcessGroup]:
    """A default gloo group of this process alone (torn down after, if this test made it)."""
    made = not dist.is_initialized()
    start_local_group("lppo-test-layouts-")
    try:
        yield ProcessGroup()
    finally:
        if made:
            dist.destroy_process_group()


def test_fsdp_tensors_are_recognized_gathered_and_unwrapped(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    layout = FSDPLayout()
    whole = torch.arange(12.0, dtype=torch.float64).reshape(4, 3)
    shard = distribute_tensor(whole, init_device_mesh("cpu", (1,)), [Shard(0)])
    assert layout.is_sharded(shard) and not layout.is_sharded(whole)
    full = layout.full(shard)
    local = layout.local(shard)
    for t in (full, local):
        assert type(t) is torch.Tensor and torch.equal(t, whole)
    assert layout.full(whole) is whole and layout.local(whole) is whole


def test_fsdp_prepared_models_carry_their_layout(one_rank_group):
    layout = FSDPLayout()
    root = nn.ModuleDict({"lm": tiny_lm()})
    before = {k: v.clone() for k, v in root["lm"].state_dict().items()}
    layout.prepare(root, ParallelContext(data=one_rank_group, layout=layout))
    assert layout_of(root["lm"]) is layout
    params = list(root["lm"].parameters())
    assert params and all(layout.is_sharded(p) for p in params)
    state = layout_of(root["lm"]).full_state_dict(root["lm"])
    assert state.keys() == before.keys()
    for key, value in before.items():
        assert not layout.is_sharded(state[key]) and torch.equal(state[key], value), key
