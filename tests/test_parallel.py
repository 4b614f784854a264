"""The parallel context owns every collective: nothing else in lppo calls one."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from lppo.layouts.base import ParallelContext
from lppo.parallel import SINGLE, ProcessGroup
from lppo.stats import Moments, SumStats

ROOT = pathlib.Path(__file__).resolve().parents[1]
COLLECTIVES = {
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "all_to_all",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "reduce",
    "reduce_scatter",
    "scatter",
    "send",
    "recv",
}


def dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def offenders(path: pathlib.Path) -> list[str]:
    """Uses of torch.distributed, or collectives of a Lightning strategy, in one file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute):
            names = [dotted(node)]
        for name in names:
            if name.startswith("torch.distributed") or name == "torch.distributed":
                found.append(f"{path.name}:{node.lineno} {name}")
            last = name.rsplit(".", 1)
            if len(last) == 2 and last[1] in COLLECTIVES and "strategy" in last[0]:
                found.append(f"{path.name}:{node.lineno} {name}")
    return found


#: FSDP2's own API, used by the FSDP layout only: its collectives are FSDP's (as megatron-core's
#: are megatron's); lppo's own collectives still go through the parallel context.
FSDP_API = ("torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.device_mesh")


def test_parallel_context_is_the_only_user_of_collectives():
    files = [p for folder in ("lppo", "callbacks") for p in (ROOT / folder).rglob("*.py")]
    assert ROOT / "lppo" / "parallel.py" in files
    fsdp = ROOT / "lppo" / "layouts" / "fsdp.py"
    bad = [o for p in files if p.name != "parallel.py" and p != fsdp for o in offenders(p)]
    assert bad == []
    found = offenders(fsdp)
    assert found and all(o.split()[1].startswith(FSDP_API) for o in found), found
    # The scan does see what it forbids.
    assert offenders(ROOT / "lppo" / "parallel.py")


def test_single_process_group_runs_no_communication():
    t = torch.arange(3.0)
    assert SINGLE.all_reduce(t) is t
    assert SINGLE.all_gather_object({"a": 1}) == [{"a": 1}]
    assert SINGLE.broadcast_object([1, 2]) == [1, 2]
    ctx = ParallelContext.from_default_group()
    assert ctx.data == SINGLE  # no process group initialized in this test process
    m = Moments()
    m.update(torch.tensor([1.0, 3.0]))
    m.all_reduce(ctx.data)
    assert (m.count, m.mean, m.var) == (2.0, 2.0, 1.0)
    s = SumStats()
    s.add("x", 2.0)
    s.all_reduce(ctx.data)
    assert s.get("x") == 2.0


@pytest.mark.parametrize(("size", "rank"), [(0, 0), (2, 2), (2, -1)])
def test_inconsistent_group_is_rejected(size, rank):
    with pytest.raises(ValueError, match="inconsistent"):
        ProcessGroup(size=size, rank=rank)
