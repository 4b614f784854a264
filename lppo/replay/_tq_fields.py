"""Rows ⇄ TransferQueue fields: how a batch of rows is checked, sent to TransferQueue and back."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lppo.replay._checks import FIXED_SPECS, check_tensor
from lppo.types import INPUT_IDS

__all__ = ["ERRORS", "checked_specs", "field", "nbytes_of", "row_lengths", "rows_of", "to_batch"]

#: Catalog replies name an error by its type's name; these are raised in the caller.
ERRORS: dict[str, type[Exception]] = {
    "KeyError": KeyError,
    "TypeError": TypeError,
    "ValueError": ValueError,
    "RuntimeError": RuntimeError,
}


def nbytes_of(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements."""
    return t.numel() * t.element_size()


def field(tensors: list[torch.Tensor], rank: int) -> torch.Tensor:
    """One column of a batch as TransferQueue takes it: ``[B]`` or jagged ``[B, j, ...]``."""
    if rank == 0:
        return torch.stack([t.detach().cpu() for t in tensors])
    return torch.nested.as_nested_tensor([t.detach().cpu() for t in tensors], layout=torch.jagged)


def rows_of(value: torch.Tensor) -> list[torch.Tensor]:
    """Split a field TransferQueue returned (jagged ``[B, j, ...]`` or ``[B, ...]``) into rows.

    A jagged tensor is split from its packed values by its offsets: views of one buffer,
    2-3x cheaper than ``unbind``.
    """
    if not value.is_nested:
        return list(value.unbind(0))
    return list(value.values().split(value.offsets().diff().tolist()))


def to_batch(cols: dict[str, list[torch.Tensor]], specs: dict[str, tuple[str, int]]) -> Any:
    """The rows' columns as one ``TensorDict`` of fields (``specs``: name -> (dtype, rank))."""
    from tensordict import TensorDict

    n = len(next(iter(cols.values())))
    fields = {name: field(ts, specs[name][1]) for name, ts in cols.items()}
    return TensorDict(fields, batch_size=[n])


def row_lengths(ids: list[int], cols: dict[str, list[torch.Tensor]]) -> list[int]:
    """Row lengths from ``input_ids`` (checked: ``int64`` rank 1)."""
    for i, t in zip(ids, cols[INPUT_IDS], strict=True):
        check_tensor("put", i, INPUT_IDS, t, FIXED_SPECS[INPUT_IDS], t.shape[0] if t.dim() else 0)
    return [int(t.shape[0]) for t in cols[INPUT_IDS]]


def checked_specs(
    op: str,
    ids: list[int],
    cols: dict[str, list[torch.Tensor]],
    lengths: list[int] | None,
    known: Mapping[str, tuple[torch.dtype, int]],
) -> dict[str, tuple[str, int]]:
    """Check every column's tensors against one spec and their first dims.

    The spec is ``known``'s, else the fixed one, else the first tensor's; first dims are
    checked against ``lengths`` (``None``: the rows' lengths are not known here). Returns
    ``name -> (dtype as a string, rank)``, as the catalog keeps it.
    """
    specs = {}
    for name, tensors in cols.items():
        spec = known.get(name) or FIXED_SPECS.get(name) or (tensors[0].dtype, tensors[0].dim())
        for j, (i, t) in enumerate(zip(ids, tensors, strict=True)):
            dim = t.shape[0] if t.dim() else 0
            check_tensor(op, i, name, t, spec, dim if lengths is None else lengths[j])
        specs[name] = (str(spec[0]), spec[1])
    return specs
