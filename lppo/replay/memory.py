"""In-process replay store: each column packed into a few flat tensors (segments).

See :mod:`lppo.replay.base` for the rules every backend follows. Choices left open there:

* Duplicate ids in one ``put`` / ``write`` / ``claim`` / ``release`` raise ``ValueError``;
  ``read`` / ``meta`` / ``has`` accept repeated ids.
* A call with no ids validates its arguments, then changes nothing (an empty first ``put`` does
  not fix the row schema, an empty ``write`` creates no column).
* ``input_ids`` must be ``int64`` rank 1 and ``response_mask`` ``bool`` rank 1 (``TypeError``).
* ``has`` answers ``False`` for ids that are not live; ``claim`` of a non-live id raises
  ``KeyError``; ``clear`` drops every claim and marks the cleared ids released.
* Values are detached and copied into the store on ``put`` / ``write`` / ``load_state_dict``.
  ``read`` returns fresh copies (per column and call, views of one new buffer that the store
  does not hold, one non-overlapping view per row). ``state_dict`` returns views of the store's
  segments, which the store never changes afterwards (it never writes a filled element).
* ``nbytes`` is the size of the segment tensors actually held: the live values plus what is
  not compacted yet: dead runs (overwritten or released values), the unused room of each
  column's open tail segment (at most max(1/32 of its live bytes, 16 KiB)) and the unused
  ends of sealed tails (at most 1/32 of each); see :mod:`lppo.replay._segments`. No segment
  with a dead run is left more than half dead or unused, so ``nbytes`` stays under about twice
  the live bytes; a store whose rows all went holds 0.
* ``state_dict`` keeps that layout, so a loaded store holds the same ``nbytes``.
* Released ids are kept as ranges of consecutive ids (:class:`~lppo.replay._ids.IdRanges`),
  so remembering them costs nothing per row when ids are handed out in sequence.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from operator import index
from typing import Any

import torch

from lppo.parallel import ProcessGroup
from lppo.replay._checks import FIXED_SPECS, Spec, as_ids, as_lists, check_tensor, decode_dtype
from lppo.replay._ids import IdRanges
from lppo.replay._segments import Column, column_state, count_true, load_column
from lppo.types import INPUT_IDS, RESPONSE_MASK, RowMeta

__all__ = ["MemoryReplayStore"]

_FORMAT = "lppo.replay.memory/2"


class MemoryReplayStore:
    """:class:`~lppo.replay.base.ReplayStore` kept in this process's memory.

    Storage is packed per column (:class:`~lppo.replay._segments.Column`): a few flat tensors
    on the device the values were given on. Each live row has a dense *slot* ``k`` (its dict
    entry ``row id -> k`` is the only per-row Python object) indexing compact tables of
    lengths, valid-token counts and per-column locations. Valid-token counts are cached when
    ``response_mask`` is put or written, so :meth:`meta` reads no tensor.
    """

    def __init__(self) -> None:
        self._schema: tuple[str, ...] | None = None
        self._columns: dict[str, Spec] = {}
        self._claims: dict[int, str] = {}
        self._released = IdRanges()
        self._next_id = 0
        self._reset_rows()

    @property
    def shared(self) -> bool:
        """``False``: rows live in this process only (each data-parallel rank has its own)."""
        return False

    def allocate(self, n: int) -> tuple[int, ...]:
        """``n`` fresh row ids: above every id this store has put or handed out before.

        Raises:
            ValueError: ``n < 0``.
        """
        if n < 0:
            raise ValueError(f"allocate: n={n} must be >= 0")
        ids = tuple(range(self._next_id, self._next_id + n))
        self._next_id += n
        return ids

    def _reset_rows(self) -> None:
        """Drop every row and every stored value (specs, claims and released ids untouched)."""
        self._index: dict[int, int] = {}  # live row id -> slot, in put order
        self._lengths = array("q")  # slot -> row length (shared with the columns)
        self._valid = array("q")  # slot -> valid-token count
        self._free: list[int] = []  # slots of released rows, reused first
        self._data: dict[str, Column] = {}

    def _add_rows(self, ids: list[int], lengths: list[int], valid: list[int]) -> list[int]:
        ks = []
        for i, length, v in zip(ids, lengths, valid, strict=True):
            if self._free:
                k = self._free.pop()
                self._lengths[k], self._valid[k] = length, v
            else:
                k = len(self._lengths)
                self._lengths.append(length)
                self._valid.append(v)
            self._index[i] = k
            ks.append(k)
        return ks

    def _store(self, name: str, ks: list[int], tensors: list[torch.Tensor]) -> None:
        col = self._data.get(name)
        if col is None:
            col = self._data[name] = Column(*self._columns[name], self._lengths)
        col.write(ks, tensors)

    def _check_live(self, op: str, ids: Sequence[int]) -> None:
        bad = [i for i in ids if i not in self._index]
        if bad:
            why = [f"{i} ({'released' if i in self._released else 'unknown'})" for i in bad]
            raise KeyError(f"{op}: rows not live: {', '.join(why)}")

    def _check_columns(
        self, op: str, ids: list[int], cols: dict[str, list[torch.Tensor]], lengths: list[int]
    ) -> dict[str, Spec]:
        """Check every tensor against its column's spec; return the specs of new columns."""
        new: dict[str, Spec] = {}
        for name, tensors in cols.items():
            spec = self._columns.get(name) or FIXED_SPECS.get(name)
            if spec is None and tensors:
                spec = (tensors[0].dtype, tensors[0].dim())
            if spec is None:
                continue
            for i, t, length in zip(ids, tensors, lengths, strict=True):
                check_tensor(op, i, name, t, spec, length)
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
        id_list = as_ids("put", ids)
        if INPUT_IDS not in columns:
            raise ValueError(f"put: missing column {INPUT_IDS!r}; got {sorted(columns)}")
        cols = as_lists("put", columns, len(id_list))
        if self._schema is not None and set(cols) != set(self._schema):
            missing, extra = set(self._schema) - set(cols), set(cols) - set(self._schema)
            raise KeyError(
                f"put: columns differ from the row schema {sorted(self._schema)}: "
                f"missing {sorted(missing)}, unexpected {sorted(extra)}"
            )
        live = [i for i in id_list if i in self._index]
        if live:
            raise KeyError(f"put: rows already live: {live}")
        for i, t in zip(id_list, cols[INPUT_IDS], strict=True):
            check_tensor(
                "put", i, INPUT_IDS, t, FIXED_SPECS[INPUT_IDS], t.shape[0] if t.dim() else 0
            )
        lengths = [int(t.shape[0]) for t in cols[INPUT_IDS]]
        new = self._check_columns("put", id_list, cols, lengths)
        if not id_list:
            return
        valid = count_true(cols[RESPONSE_MASK]) if RESPONSE_MASK in cols else [0] * len(id_list)
        self._columns.update(new)
        if self._schema is None:
            self._schema = tuple(cols)
        for i in id_list:
            self._released.discard(i)
        self._next_id = max(self._next_id, max(id_list) + 1)
        ks = self._add_rows(id_list, lengths, valid)
        for name, tensors in cols.items():
            self._store(name, ks, tensors)

    def write(self, ids: Sequence[int], columns: Mapping[str, Sequence[torch.Tensor]]) -> None:
        """Add or overwrite columns of existing rows (any subset of live rows).

        Raises:
            KeyError: an id is unknown or released, or ``input_ids`` is written.
            ValueError: a token-level tensor's length differs from its row's length, a column
                list has the wrong length, or ``ids`` repeats an id.
            TypeError: dtype or rank differs from the column's.

        """
        id_list = as_ids("write", ids)
        if INPUT_IDS in columns:
            raise KeyError(f"write: column {INPUT_IDS!r} is fixed at put and cannot be written")
        cols = as_lists("write", columns, len(id_list))
        self._check_live("write", id_list)
        ks = [self._index[i] for i in id_list]
        new = self._check_columns("write", id_list, cols, [self._lengths[k] for k in ks])
        if not id_list:
            return
        valid = count_true(cols[RESPONSE_MASK]) if RESPONSE_MASK in cols else None
        self._columns.update(new)
        for name, tensors in cols.items():
            self._store(name, ks, tensors)
        if valid is not None:
            for k, v in zip(ks, valid, strict=True):
                self._valid[k] = v

    def read(self, ids: Sequence[int], names: Sequence[str]) -> dict[str, list[torch.Tensor]]:
        """Return ``name -> [tensor of ids[0], tensor of ids[1], ...]`` in the order asked.

        The tensors are fresh copies: mutating them does not change the store. Those of one
        column are non-overlapping views of one new buffer that only the caller holds.

        Raises:
            KeyError: an id is unknown or released, or a row lacks a column asked for.

        """
        id_list = [index(i) for i in ids]
        self._check_live("read", id_list)
        ks = [self._index[i] for i in id_list]
        for name in names:
            col = self._data.get(name)
            lacking = [id_list[j] for j in col.missing(ks)] if col else id_list
            if lacking:
                raise KeyError(f"read: rows {lacking} lack column {name!r}")
        return {name: self._data[name].gather(ks) if ks else [] for name in names}

    def meta(self, ids: Sequence[int] | None = None) -> RowMeta:
        """Lengths and valid-token counts of ``ids`` (all live rows, ascending, when ``None``).

        Raises:
            KeyError: an id is unknown or released.

        """
        id_list = sorted(self._index) if ids is None else [index(i) for i in ids]
        self._check_live("meta", id_list)
        ks = [self._index[i] for i in id_list]
        return RowMeta(
            ids=tuple(id_list),
            lengths=tuple(self._lengths[k] for k in ks),
            valid_tokens=tuple(self._valid[k] for k in ks),
        )

    def columns(self) -> dict[str, tuple[torch.dtype, int]]:
        """Known columns, ``name -> (dtype, rank)``; rank 0 is a row-level column."""
        return dict(self._columns)

    def has(self, name: str, ids: Sequence[int]) -> bool:
        """Whether every row of ``ids`` is live and holds column ``name``."""
        ks = [self._index.get(index(i)) for i in ids]
        col = self._data.get(name)
        return all(k is not None and col is not None and col.holds(k) for k in ks)

    def claim(self, ids: Sequence[int], owner: str) -> None:
        """Retain live rows ``ids`` for ``owner`` until they are released.

        Raises:
            KeyError: an id is unknown or released.
            RuntimeError: a row is claimed already (by any owner).
            ValueError: ``ids`` repeats an id.

        """
        id_list = as_ids("claim", ids)
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

        Storage emptied by the release is freed; segments left more than half dead are
        compacted.

        Raises:
            KeyError: an id is unknown or released.
            ValueError: ``ids`` repeats an id.

        """
        id_list = as_ids("release", ids)
        self._check_live("release", id_list)
        if not id_list:
            return
        ks = [self._index.pop(i) for i in id_list]
        for i in id_list:
            self._claims.pop(i, None)
            self._released.add(i)
        if not self._index:
            self._reset_rows()
            return
        for col in self._data.values():
            col.drop(ks)
        self._free.extend(ks)

    def discard(self, ids: Sequence[int]) -> None:
        """Release those of ``ids`` that are live (a put here is never left half-way).

        Raises:
            ValueError: ``ids`` repeats an id.
        """
        self.release([i for i in as_ids("discard", ids) if i in self._index])

    def clear(self) -> None:
        """Delete every live row (schema and column specs kept; the ids become released)."""
        for i in self._index:
            self._released.add(i)
        self._claims.clear()
        self._reset_rows()

    def nbytes(self) -> int:
        """Bytes of the segment tensors held (live values, dead runs and open tail room)."""
        return sum(col.nbytes() for col in self._data.values())

    def __len__(self) -> int:
        """Return the number of live rows."""
        return len(self._index)

    def connect(self, group: ProcessGroup) -> None:
        """Nothing to share: a local store (every rank has its own rows)."""

    def close(self) -> None:
        """Nothing to let go of: the rows live in this process (they are kept)."""

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to rebuild the store exactly (rows, schema, claims, released ids).

        The layout is kept too (segments with their dead runs and room, per-row locations), so
        a loaded store holds the same ``nbytes``. Holds only tensors, dicts, lists, str, int and
        ``None`` (dtypes as strings), so it loads with ``torch.load(weights_only=True)``. Its
        segment tensors are views of the store's (never changed by the store afterwards).
        """
        ks = list(self._index.values())
        return {
            "format": _FORMAT,
            "schema": None if self._schema is None else list(self._schema),
            "columns": {n: [str(d), r] for n, (d, r) in self._columns.items()},
            "ids": list(self._index),
            "lengths": torch.tensor([self._lengths[k] for k in ks], dtype=torch.int64),
            "data": {n: column_state(c, ks) for n, c in self._data.items()},
            "claims": [[i, o] for i, o in self._claims.items()],
            "released": self._released.ranges(),
            "next_id": self._next_id,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the store's content with ``state`` (from ``state_dict``); tensors are copied.

        Raises:
            ValueError: ``state`` is not a consistent state of this backend (store unchanged).

        """
        if state.get("format") != _FORMAT:
            raise ValueError(
                f"load_state_dict: expected format {_FORMAT!r}, got {state.get('format')!r}"
            )
        try:
            schema = None if state["schema"] is None else tuple(state["schema"])
            specs = {n: (decode_dtype(d), int(r)) for n, (d, r) in state["columns"].items()}
            ids = [index(i) for i in state["ids"]]
            lengths = array("q", state["lengths"].tolist())
            if len(lengths) != len(ids) or len(set(ids)) != len(ids):
                raise ValueError("ids repeated or not one length per id")
            data = {n: load_column(*specs[n], lengths, c) for n, c in state["data"].items()}
            ks = list(range(len(ids)))
            if ids and any(
                not (c := data.get(n)) or not all(map(c.holds, ks)) for n in schema or [INPUT_IDS]
            ):
                raise ValueError("a row lacks a schema column")
            mask = data.get(RESPONSE_MASK)
            valid = [0] * len(ids)
            if mask is not None:
                held = [k for k in ks if mask.holds(k)]
                for k, v in zip(held, count_true(mask.gather(held)), strict=True):
                    valid[k] = v
            claims = {index(i): str(o) for i, o in state["claims"]}
            released = IdRanges.from_ranges((index(a), index(b)) for a, b in state["released"])
            next_id = index(state.get("next_id", max(ids, default=-1) + 1))
        except (KeyError, TypeError, IndexError, AttributeError, ValueError) as e:
            raise ValueError(f"load_state_dict: inconsistent state: {e}") from e
        if not claims.keys() <= set(ids) or any(i in released for i in ids):
            raise ValueError("load_state_dict: claims must name live rows, released ids none")
        if any(i >= next_id for i in ids):
            raise ValueError(f"load_state_dict: next_id={next_id} is not above every live id")
        self._next_id = next_id
        self._schema, self._columns = schema, specs
        self._claims, self._released = claims, released
        self._index, self._free, self._data = dict(zip(ids, ks, strict=True)), [], data
        self._lengths, self._valid = lengths, array("q", valid)
