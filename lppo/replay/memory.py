"""In-process replay store: packed rows in a Python dict, one contiguous tensor per row and column.

See :mod:`lppo.replay.base` for the rules every backend follows. Choices left open there:

* Duplicate ids in one ``put`` / ``write`` / ``claim`` / ``release`` raise ``ValueError``;
  ``read`` / ``meta`` / ``has`` accept repeated ids.
* A call with no ids validates its arguments, then changes nothing (an empty first ``put`` does
  not fix the row schema, an empty ``write`` creates no column).
* ``input_ids`` must be ``int64`` rank 1 and ``response_mask`` ``bool`` rank 1 (``TypeError``).
* ``has`` answers ``False`` for ids that are not live; ``claim`` of a non-live id raises
  ``KeyError``; ``clear`` drops every claim and marks the cleared ids released.
* Tensors are detached and cloned contiguous on ``put`` / ``write`` / ``read`` /
  ``load_state_dict``; ``state_dict`` shares them (the store never mutates a tensor in place).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from operator import index
from typing import Any

import torch

from lppo.types import INPUT_IDS, RESPONSE_MASK, RowMeta

__all__ = ["MemoryReplayStore"]

_Spec = tuple[torch.dtype, int]
_FIXED: dict[str, _Spec] = {INPUT_IDS: (torch.int64, 1), RESPONSE_MASK: (torch.bool, 1)}
_FORMAT = "lppo.replay.memory/1"


@dataclass
class _Row:
    length: int
    valid: int
    data: dict[str, torch.Tensor]


def _pack(t: torch.Tensor) -> torch.Tensor:
    """Return an owned, contiguous copy of ``t`` (no view of the caller's storage)."""
    return t.detach().clone(memory_format=torch.contiguous_format)


def _count_valid(data: Mapping[str, torch.Tensor]) -> int:
    mask = data.get(RESPONSE_MASK)
    return 0 if mask is None else int(torch.count_nonzero(mask))


def _as_ids(op: str, ids: Sequence[int]) -> list[int]:
    """Return ``ids`` as ints, raising ``ValueError`` on duplicates."""
    out = [index(i) for i in ids]
    dups = sorted(i for i, n in Counter(out).items() if n > 1)
    if dups:
        raise ValueError(f"{op}: duplicate row ids {dups}")
    return out


def _as_lists(
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


def _check_tensor(op: str, row: int, name: str, t: torch.Tensor, spec: _Spec, length: int) -> None:
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


def _decode_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)  # "torch.float32" -> float32
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"load_state_dict: unknown dtype {name!r}")
    return dtype


class MemoryReplayStore:
    """:class:`~lppo.replay.base.ReplayStore` kept in this process's memory.

    Rows are stored packed: each row's column is its own contiguous tensor, on the device it
    was given on. Valid-token counts are cached when ``response_mask`` is put or written, so
    :meth:`meta` reads no tensor.
    """

    def __init__(self) -> None:
        self._rows: dict[int, _Row] = {}
        self._schema: tuple[str, ...] | None = None
        self._columns: dict[str, _Spec] = {}
        self._claims: dict[int, str] = {}
        self._released: dict[int, None] = {}  # insertion-ordered set

    def _check_live(self, op: str, ids: Sequence[int]) -> None:
        bad = [i for i in ids if i not in self._rows]
        if bad:
            why = [f"{i} ({'released' if i in self._released else 'unknown'})" for i in bad]
            raise KeyError(f"{op}: rows not live: {', '.join(why)}")

    def _check_columns(
        self, op: str, ids: list[int], cols: dict[str, list[torch.Tensor]], lengths: list[int]
    ) -> dict[str, _Spec]:
        """Check every tensor against its column's spec; return the specs of new columns."""
        new: dict[str, _Spec] = {}
        for name, tensors in cols.items():
            spec = self._columns.get(name) or _FIXED.get(name)
            if spec is None and tensors:
                spec = (tensors[0].dtype, tensors[0].dim())
            if spec is None:
                continue
            for i, t, length in zip(ids, tensors, lengths, strict=True):
                _check_tensor(op, i, name, t, spec, length)
            if name not in self._columns:
                new[name] = spec
        return new

    def put(self, ids: Sequence[int], columns: Mapping[str, Sequence[torch.Tensor]]) -> None:
        """Create rows ``ids``; ``columns[name][i]`` is row ``ids[i]``'s tensor for ``name``.

        Raises:
            ValueError: lengths disagree with ``input_ids``, duplicate ids in the call, missing
                ``input_ids``, or column lists of the wrong length.
            KeyError: an id is live already, or the columns differ from the row schema.
            TypeError: a column's dtype or rank differs from the one it was created with.

        """
        id_list = _as_ids("put", ids)
        if INPUT_IDS not in columns:
            raise ValueError(f"put: missing column {INPUT_IDS!r}; got {sorted(columns)}")
        cols = _as_lists("put", columns, len(id_list))
        if self._schema is not None and set(cols) != set(self._schema):
            missing, extra = set(self._schema) - set(cols), set(cols) - set(self._schema)
            raise KeyError(
                f"put: columns differ from the row schema {sorted(self._schema)}: "
                f"missing {sorted(missing)}, unexpected {sorted(extra)}"
            )
        live = [i for i in id_list if i in self._rows]
        if live:
            raise KeyError(f"put: rows already live: {live}")
        for i, t in zip(id_list, cols[INPUT_IDS], strict=True):
            _check_tensor("put", i, INPUT_IDS, t, _FIXED[INPUT_IDS], t.shape[0] if t.dim() else 0)
        lengths = [int(t.shape[0]) for t in cols[INPUT_IDS]]
        new = self._check_columns("put", id_list, cols, lengths)
        if not id_list:
            return
        self._columns.update(new)
        if self._schema is None:
            self._schema = tuple(cols)
        for j, i in enumerate(id_list):
            data = {name: _pack(tensors[j]) for name, tensors in cols.items()}
            self._rows[i] = _Row(lengths[j], _count_valid(data), data)
            self._released.pop(i, None)

    def write(self, ids: Sequence[int], columns: Mapping[str, Sequence[torch.Tensor]]) -> None:
        """Add or overwrite columns of existing rows (any subset of live rows).

        Raises:
            KeyError: an id is unknown or released, or ``input_ids`` is written.
            ValueError: a token-level tensor's length differs from its row's length, a column
                list has the wrong length, or ``ids`` repeats an id.
            TypeError: dtype or rank differs from the column's.

        """
        id_list = _as_ids("write", ids)
        if INPUT_IDS in columns:
            raise KeyError(f"write: column {INPUT_IDS!r} is fixed at put and cannot be written")
        cols = _as_lists("write", columns, len(id_list))
        self._check_live("write", id_list)
        lengths = [self._rows[i].length for i in id_list]
        new = self._check_columns("write", id_list, cols, lengths)
        if not id_list:
            return
        self._columns.update(new)
        for j, i in enumerate(id_list):
            row = self._rows[i]
            row.data.update({name: _pack(tensors[j]) for name, tensors in cols.items()})
            if RESPONSE_MASK in cols:
                row.valid = _count_valid(row.data)

    def read(self, ids: Sequence[int], names: Sequence[str]) -> dict[str, list[torch.Tensor]]:
        """Return ``name -> [tensor of ids[0], tensor of ids[1], ...]`` in the order asked.

        The tensors are copies: mutating them does not change the store.

        Raises:
            KeyError: an id is unknown or released, or a row lacks a column asked for.

        """
        id_list = [index(i) for i in ids]
        self._check_live("read", id_list)
        for name in names:
            lacking = [i for i in id_list if name not in self._rows[i].data]
            if lacking:
                raise KeyError(f"read: rows {lacking} lack column {name!r}")
        return {name: [_pack(self._rows[i].data[name]) for i in id_list] for name in names}

    def meta(self, ids: Sequence[int] | None = None) -> RowMeta:
        """Lengths and valid-token counts of ``ids`` (all live rows, ascending, when ``None``).

        Raises:
            KeyError: an id is unknown or released.

        """
        id_list = sorted(self._rows) if ids is None else [index(i) for i in ids]
        self._check_live("meta", id_list)
        rows = [self._rows[i] for i in id_list]
        return RowMeta(
            ids=tuple(id_list),
            lengths=tuple(r.length for r in rows),
            valid_tokens=tuple(r.valid for r in rows),
        )

    def columns(self) -> dict[str, tuple[torch.dtype, int]]:
        """Known columns, ``name -> (dtype, rank)``; rank 0 is a row-level column."""
        return dict(self._columns)

    def has(self, name: str, ids: Sequence[int]) -> bool:
        """Whether every row of ``ids`` is live and holds column ``name``."""
        rows = [self._rows.get(index(i)) for i in ids]
        return all(r is not None and name in r.data for r in rows)

    def claim(self, ids: Sequence[int], owner: str) -> None:
        """Retain live rows ``ids`` for ``owner`` until they are released.

        Raises:
            KeyError: an id is unknown or released.
            RuntimeError: a row is claimed already (by any owner).
            ValueError: ``ids`` repeats an id.

        """
        id_list = _as_ids("claim", ids)
        self._check_live("claim", id_list)
        taken = {i: self._claims[i] for i in id_list if i in self._claims}
        if taken:
            raise RuntimeError(f"claim by {owner!r}: rows already claimed (id -> owner): {taken}")
        self._claims.update(dict.fromkeys(id_list, owner))

    def claimed(self) -> dict[int, str]:
        """Live claimed rows, ``id -> owner``."""
        return dict(self._claims)

    def release(self, ids: Sequence[int]) -> None:
        """Delete rows ``ids`` (exactly once; a second release raises ``KeyError``).

        Raises:
            KeyError: an id is unknown or released.
            ValueError: ``ids`` repeats an id.

        """
        id_list = _as_ids("release", ids)
        self._check_live("release", id_list)
        for i in id_list:
            del self._rows[i]
            self._claims.pop(i, None)
            self._released[i] = None

    def clear(self) -> None:
        """Delete every live row (schema and column specs kept; the ids become released)."""
        self._released.update(dict.fromkeys(self._rows))
        self._rows.clear()
        self._claims.clear()

    def nbytes(self) -> int:
        """Bytes held by the stored tensors."""
        return sum(
            t.numel() * t.element_size() for r in self._rows.values() for t in r.data.values()
        )

    def __len__(self) -> int:
        """Return the number of live rows."""
        return len(self._rows)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to rebuild the store exactly (rows, schema, claims, released ids).

        Holds only tensors, dicts, lists, str, int and ``None`` (dtypes as strings), so it loads
        with ``torch.load(weights_only=True)``. Its tensors are shared with the store.
        """
        return {
            "format": _FORMAT,
            "schema": None if self._schema is None else list(self._schema),
            "columns": {n: [str(d), r] for n, (d, r) in self._columns.items()},
            "rows": [{"id": i, "data": dict(r.data)} for i, r in self._rows.items()],
            "claims": [[i, o] for i, o in self._claims.items()],
            "released": list(self._released),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the store's content with ``state`` (from ``state_dict``).

        Raises:
            ValueError: ``state`` is not a consistent state of this backend (store unchanged).

        """
        if state.get("format") != _FORMAT:
            raise ValueError(
                f"load_state_dict: expected format {_FORMAT!r}, got {state.get('format')!r}"
            )
        schema = None if state["schema"] is None else tuple(state["schema"])
        specs = {n: (_decode_dtype(d), int(r)) for n, (d, r) in state["columns"].items()}
        rows: dict[int, _Row] = {}
        try:
            for entry in state["rows"]:
                i, data = index(entry["id"]), entry["data"]
                if i in rows or (schema is not None and not set(schema) <= set(data)):
                    raise ValueError(f"row {i} is repeated or lacks a schema column")
                length = int(data[INPUT_IDS].shape[0])
                for name, t in data.items():
                    _check_tensor("load_state_dict", i, name, t, specs[name], length)
                packed = {name: _pack(t) for name, t in data.items()}
                rows[i] = _Row(length, _count_valid(packed), packed)
        except (KeyError, TypeError, IndexError, AttributeError) as e:
            raise ValueError(f"load_state_dict: inconsistent state: {e}") from e
        claims = {index(i): str(o) for i, o in state["claims"]}
        released = dict.fromkeys(index(i) for i in state["released"])
        if not claims.keys() <= rows.keys() or not released.keys().isdisjoint(rows):
            raise ValueError("load_state_dict: claims must name live rows, released ids none")
        self._rows, self._schema, self._columns = rows, schema, specs
        self._claims, self._released = claims, released
