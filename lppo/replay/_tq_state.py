"""``TransferQueueReplayStore.state_dict``: built from the catalog, checked before loading."""

from __future__ import annotations

from collections.abc import Mapping
from operator import index
from typing import Any

import torch

from lppo.replay._checks import decode_dtype
from lppo.replay._ids import IdRanges
from lppo.replay._segments import count_true
from lppo.types import INPUT_IDS, RESPONSE_MASK

__all__ = ["decode_state", "encode_state"]

Batch = tuple[list[int], dict[str, list[torch.Tensor]]]


def _split(name: str, values: torch.Tensor, spec: tuple[torch.dtype, int], sizes: list[int]):
    dtype, rank = spec
    if not isinstance(values, torch.Tensor) or values.dtype != dtype:
        raise ValueError(f"column {name!r}: values must be a {dtype} tensor")
    if rank == 0:
        if values.dim() != 1 or values.shape[0] != len(sizes):
            raise ValueError(f"column {name!r}: expected {len(sizes)} stacked row values")
        return list(values.unbind(0))
    if values.dim() != rank or values.shape[0] != sum(sizes):
        raise ValueError(f"column {name!r}: expected rank {rank} values of {sum(sizes)} tokens")
    return [t.clone() for t in values.split(sizes)]


def encode_state(
    st: dict[str, Any], values: dict[str, list[torch.Tensor]], fmt: str
) -> dict[str, Any]:
    """The state dict of a partition from the catalog's ``state`` and the columns' tensors.

    Args:
        st: the catalog's ``state`` reply (ids, lengths, columns, rows holding each column...).
        values: ``column -> tensors of st["held"][column]``, in that order.
        fmt: the format tag.

    Returns:
        Only tensors, dicts, lists, str, int and ``None`` (dtypes as strings), so it loads
        with ``torch.load(weights_only=True)``; column values are concatenated along the
        first dimension in ``rows`` order (row-level columns stacked).
    """
    lengths = dict(zip(st["ids"], st["lengths"], strict=True))
    data = {}
    for name, tensors in values.items():
        rows, rank = st["held"][name], st["columns"][name][1]
        data[name] = {
            "rows": rows,
            "values": torch.stack(tensors) if rank == 0 else torch.cat(tensors),
        }
        assert rank == 0 or sum(lengths[i] for i in rows) == data[name]["values"].shape[0]
    return {
        "format": fmt,
        "schema": st["schema"],
        "columns": st["columns"],
        "ids": st["ids"],
        "lengths": torch.tensor(st["lengths"], dtype=torch.int64),
        "data": data,
        "claims": st["claims"],
        "released": st["released"],
        "next_id": st["next_id"],
    }


def decode_state(state: Mapping[str, Any], fmt: str) -> tuple[dict[str, Any], list[Batch]]:
    """Validate ``state``; return the catalog's part and the row batches to transfer.

    The catalog part holds ``schema``, ``columns`` (``[dtype name, rank]``), ``claims``,
    ``released``, ``next_id`` and ``rows`` (``id -> [length, valid tokens, {column: bytes}]``,
    in put order). Batches group the columns held by the same rows, the row schema first.

    Raises:
        ValueError: naming what is inconsistent.
    """
    if state.get("format") != fmt:
        raise ValueError(f"load_state_dict: expected format {fmt!r}, got {state.get('format')!r}")
    try:
        return _decode(state)
    except (KeyError, TypeError, IndexError, AttributeError, ValueError) as e:
        raise ValueError(f"load_state_dict: inconsistent state: {e}") from e


def _decode(state: Mapping[str, Any]) -> tuple[dict[str, Any], list[Batch]]:
    schema = None if state["schema"] is None else [str(n) for n in state["schema"]]
    specs = {str(n): (decode_dtype(d), int(r)) for n, (d, r) in state["columns"].items()}
    ids = [index(i) for i in state["ids"]]
    lengths = [int(n) for n in state["lengths"].tolist()]
    if len(lengths) != len(ids) or len(set(ids)) != len(ids):
        raise ValueError("ids repeated or not one length per id")
    length_of = dict(zip(ids, lengths, strict=True))
    held: dict[int, dict[str, int]] = {i: {} for i in ids}
    groups: dict[tuple[int, ...], dict[str, list[torch.Tensor]]] = {}
    valid = dict.fromkeys(ids, 0)
    for name, col in state["data"].items():
        rows = [index(i) for i in col["rows"]]
        if name not in specs or len(set(rows)) != len(rows) or not set(rows) <= held.keys():
            raise ValueError(f"column {name!r}: unknown column, or rows repeated or not live")
        values = _split(name, col["values"], specs[name], [length_of[i] for i in rows])
        for i, t in zip(rows, values, strict=True):
            held[i][name] = t.numel() * t.element_size()
        if name == RESPONSE_MASK:
            valid.update(zip(rows, count_true(values), strict=True))
        groups.setdefault(tuple(rows), {})[name] = values
    if any(set(schema or [INPUT_IDS]) - held[i].keys() for i in ids):
        raise ValueError("a row lacks a schema column")
    claims = [[index(i), str(o)] for i, o in state["claims"]]
    released = IdRanges.from_ranges((index(a), index(b)) for a, b in state["released"])
    next_id = index(state["next_id"])
    if not {i for i, _ in claims} <= held.keys() or any(i in released for i in ids):
        raise ValueError("claims must name live rows, released ids none")
    if any(i >= next_id for i in ids):
        raise ValueError(f"next_id={next_id} is not above every live id")
    meta = {
        "schema": schema,
        "columns": {n: [str(d), r] for n, (d, r) in specs.items()},
        "claims": claims,
        "released": released.ranges(),
        "next_id": next_id,
        "rows": {i: [length_of[i], valid[i], held[i]] for i in ids},
    }
    batches = sorted(groups.items(), key=lambda g: INPUT_IDS not in g[1])
    return meta, [(list(rows), cols) for rows, cols in batches]
