"""Argument checks shared by the replay backends (same errors, same messages)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from operator import index

import torch

from lppo.types import INPUT_IDS, RESPONSE_MASK

__all__ = ["FIXED_SPECS", "Spec", "as_ids", "as_lists", "check_tensor", "decode_dtype"]

Spec = tuple[torch.dtype, int]
FIXED_SPECS: dict[str, Spec] = {INPUT_IDS: (torch.int64, 1), RESPONSE_MASK: (torch.bool, 1)}


def as_ids(op: str, ids: Sequence[int]) -> list[int]:
    """Return ``ids`` as ints, raising ``ValueError`` on duplicates."""
    out = [index(i) for i in ids]
    dups = sorted(i for i, n in Counter(out).items() if n > 1)
    if dups:
        raise ValueError(f"{op}: duplicate row ids {dups}")
    return out


def as_lists(
    op: str, columns: Mapping[str, Sequence[torch.Tensor]], n: int
) -> dict[str, list[torch.Tensor]]:
    """Return ``columns`` as lists of ``n`` tensors each (``ValueError`` / ``TypeError``)."""
    out: dict[str, list[torch.Tensor]] = {}
    for name, seq in columns.items():
        tensors = list(seq)
        if len(tensors) != n:
            raise ValueError(f"{op}: column {name!r} has {len(tensors)} tensors for {n} ids")
        for j, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(
                    f"{op}: column {name!r} entry {j} is {type(t).__name__}, not Tensor"
                )
        out[name] = tensors
    return out


def check_tensor(op: str, row: int, name: str, t: torch.Tensor, spec: Spec, length: int) -> None:
    """Raise ``TypeError`` on a dtype / rank mismatch, ``ValueError`` on a length mismatch."""
    dtype, rank = spec
    if t.dtype != dtype or t.dim() != rank:
        raise TypeError(
            f"{op}: row {row} column {name!r}: expected dtype {dtype} rank {rank}, "
            f"got dtype {t.dtype} rank {t.dim()}"
        )
    if rank >= 1 and t.shape[0] != length:
        raise ValueError(
            f"{op}: row {row} column {name!r}: expected first dim {length} (row length), "
            f"got {t.shape[0]}"
        )


def decode_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)  # "torch.float32" -> float32
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"load_state_dict: unknown dtype {name!r}")
    return dtype
