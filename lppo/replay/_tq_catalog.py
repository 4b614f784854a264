"""The row catalog of :class:`~lppo.replay.transfer_queue.TransferQueueReplayStore`.

TransferQueue holds the rows' tensors; this catalog holds what the ``ReplayStore`` protocol
promises about them, for every process at once: live rows with their lengths, valid-token
counts and bytes per column, the row schema and column specs, claims, released ids and the id
counter. It runs as ONE named Ray actor per cluster (:data:`CATALOG_NAME`, no CPU reserved),
one :class:`_Partition` per store, so each of its calls is atomic across processes: a put is
validated and reserved before its tensors reach TransferQueue and becomes visible only once
they are there.

Torch-free and lppo-free (dtypes travel as strings): Ray ships this module by value, so the
actor process imports neither torch nor lppo. Methods return :data:`Reply` instead of
raising, so the caller raises a clean ``KeyError`` / ``TypeError`` / ``ValueError``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lppo.replay._ids import IdRanges

CATALOG_NAME = "lppo_replay_catalog"
CATALOG_NAMESPACE = "lppo"
INPUT_IDS, RESPONSE_MASK = "input_ids", "response_mask"

Spec = tuple[str, int]  # (dtype name, rank)
Reply = tuple[str | None, Any]  # (exception class name or None, message or result)


def _ok(value: Any = None) -> Reply:
    return None, value


def _spec_error(op: str, row: int, name: str, want: Spec, got: Spec) -> Reply:
    return "TypeError", (
        f"{op}: row {row} column {name!r}: expected dtype {want[0]} rank {want[1]}, "
        f"got dtype {got[0]} rank {got[1]}"
    )


@dataclass
class _Row:
    length: int
    valid: int
    nbytes: dict[str, int]  # column -> bytes of this row's tensor


@dataclass
class _Partition:
    schema: tuple[str, ...] | None = None
    columns: dict[str, Spec] = field(default_factory=dict)
    rows: dict[int, _Row] = field(default_factory=dict)  # live, in put order
    pending: dict[int, _Row] = field(default_factory=dict)  # put reserved, tensors in flight
    claims: dict[int, str] = field(default_factory=dict)
    released: IdRanges = field(default_factory=IdRanges)
    next_id: int = 0
    pending_schema: bool = False  # the schema was fixed by a put still pending
    pending_columns: tuple[str, ...] = ()


class Catalog:
    """Metadata of every ``TransferQueueReplayStore`` partition of a Ray cluster."""

    def __init__(self) -> None:
        self._parts: dict[str, _Partition] = {}

    def _p(self, partition: str) -> _Partition:
        return self._parts.setdefault(partition, _Partition())

    def drop_partition(self, partition: str) -> list[int]:
        """Forget ``partition``; returns the ids it still held (live or pending)."""
        p = self._parts.pop(partition, None)
        return [] if p is None else [*p.rows, *p.pending]

    def partitions(self) -> dict[str, int]:
        """``partition -> live + pending rows`` (what a leak check looks at)."""
        return {name: len(p.rows) + len(p.pending) for name, p in self._parts.items()}

    # ------------------------------------------------------------------ ids
    def allocate(self, partition: str, n: int) -> Reply:
        p = self._p(partition)
        ids = list(range(p.next_id, p.next_id + n))
        p.next_id += n
        return _ok(ids)

    def _not_live(self, p: _Partition, op: str, ids: list[int]) -> Reply | None:
        bad = [i for i in ids if i not in p.rows]
        if not bad:
            return None
        why = [f"{i} ({'released' if i in p.released else 'unknown'})" for i in bad]
        return "KeyError", f"{op}: rows not live: {', '.join(why)}"

    def _check_specs(
        self, p: _Partition, op: str, ids: list[int], specs: dict[str, Spec]
    ) -> Reply | None:
        for name, spec in specs.items():
            known = p.columns.get(name)
            if known is not None and tuple(known) != tuple(spec) and ids:
                return _spec_error(op, ids[0], name, known, spec)
        return None

    # ------------------------------------------------------------------ put
    def check_rows(self, partition: str, ids: list[int], names: list[str]) -> Reply:
        """A put's first checks: its columns are the row schema, its ids are not live."""
        p = self._p(partition)
        if p.schema is not None and set(names) != set(p.schema):
            missing, extra = set(p.schema) - set(names), set(names) - set(p.schema)
            return "KeyError", (
                f"put: columns differ from the row schema {sorted(p.schema)}: "
                f"missing {sorted(missing)}, unexpected {sorted(extra)}"
            )
        live = [i for i in ids if i in p.rows or i in p.pending]
        if live:
            return "KeyError", f"put: rows already live: {live}"
        return _ok()

    def reserve_put(
        self,
        partition: str,
        ids: list[int],
        specs: dict[str, Spec],
        lengths: list[int],
        valid: list[int],
        nbytes: dict[str, list[int]],
    ) -> Reply:
        """Validate a put against the schema, specs and live ids; reserve its ids."""
        p = self._p(partition)
        first = self.check_rows(partition, ids, list(specs))
        if first[0] is not None:
            return first
        bad = self._check_specs(p, "put", ids, specs)
        if bad is not None:
            return bad
        if p.schema is None:
            p.schema, p.pending_schema = tuple(specs), True
        new = tuple(n for n in specs if n not in p.columns)
        p.columns.update({n: tuple(specs[n]) for n in new})
        p.pending_columns += new
        for j, i in enumerate(ids):
            p.pending[i] = _Row(lengths[j], valid[j], {n: b[j] for n, b in nbytes.items()})
        return _ok()

    def commit_put(self, partition: str, ids: list[int]) -> Reply:
        """Make reserved rows live (their tensors are in TransferQueue now)."""
        p = self._p(partition)
        gone = [i for i in ids if i not in p.pending]
        if gone:
            return "KeyError", f"put: rows {gone} were discarded while their put was in flight"
        for i in ids:
            p.rows[i] = p.pending.pop(i)
            p.released.discard(i)
        p.next_id = max(p.next_id, max(ids) + 1)
        if not p.pending:
            p.pending_schema, p.pending_columns = False, ()
        return _ok()

    def abort_put(self, partition: str, ids: list[int]) -> Reply:
        """Undo a reservation whose tensors did not reach TransferQueue."""
        p = self._p(partition)
        for i in ids:
            p.pending.pop(i, None)
        if not p.pending:
            if p.pending_schema and not p.rows:
                p.schema = None
            held = {n for r in p.rows.values() for n in r.nbytes}
            for n in p.pending_columns:
                if n not in held:
                    p.columns.pop(n, None)
            p.pending_schema, p.pending_columns = False, ()
        return _ok()

    # ------------------------------------------------------------------ write
    def check_write(
        self, partition: str, ids: list[int], specs: dict[str, Spec], dims: dict[str, list[int]]
    ) -> Reply:
        """Validate a write: live rows, column specs, first dims equal to row lengths."""
        p = self._p(partition)
        bad = self._not_live(p, "write", ids) or self._check_specs(p, "write", ids, specs)
        if bad is not None:
            return bad
        for name, spec in specs.items():
            if spec[1] < 1:
                continue
            for i, d in zip(ids, dims[name], strict=True):
                if d != p.rows[i].length:
                    return "ValueError", (
                        f"write: row {i} column {name!r}: expected first dim "
                        f"{p.rows[i].length} (row length), got {d}"
                    )
        return _ok()

    def commit_write(
        self,
        partition: str,
        ids: list[int],
        specs: dict[str, Spec],
        valid: list[int] | None,
        nbytes: dict[str, list[int]],
    ) -> Reply:
        """Record a write whose tensors are in TransferQueue.

        Re-checked: another process may have released a row or created a column meanwhile.
        """
        p = self._p(partition)
        bad = self._not_live(p, "write", ids) or self._check_specs(p, "write", ids, specs)
        if bad is not None:
            return bad
        p.columns.update({n: tuple(s) for n, s in specs.items() if n not in p.columns})
        for j, i in enumerate(ids):
            row = p.rows[i]
            row.nbytes.update({n: b[j] for n, b in nbytes.items()})
            if valid is not None:
                row.valid = valid[j]
        return _ok()

    # ------------------------------------------------------------------ read side
    def check_read(self, partition: str, ids: list[int], names: list[str]) -> Reply:
        """Validate a read."""
        p = self._p(partition)
        bad = self._not_live(p, "read", ids)
        if bad is not None:
            return bad
        for name in names:
            lacking = [i for i in ids if name not in p.rows[i].nbytes]
            if lacking:
                return "KeyError", f"read: rows {lacking} lack column {name!r}"
        return _ok()

    def meta(self, partition: str, ids: list[int] | None) -> Reply:
        p = self._p(partition)
        ids = sorted(p.rows) if ids is None else ids
        bad = self._not_live(p, "meta", ids)
        if bad is not None:
            return bad
        rows = [p.rows[i] for i in ids]
        return _ok((ids, [r.length for r in rows], [r.valid for r in rows]))

    def summary(self, partition: str) -> Reply:
        """``(live rows, bytes held, columns)`` in one call."""
        p = self._p(partition)
        held = sum(b for r in p.rows.values() for b in r.nbytes.values())
        return _ok((len(p.rows), held, dict(p.columns)))

    def has(self, partition: str, name: str, ids: list[int]) -> Reply:
        p = self._p(partition)
        return _ok(all(i in p.rows and name in p.rows[i].nbytes for i in ids))

    # ------------------------------------------------------------------ claim / release
    def claim(self, partition: str, ids: list[int], owner: str) -> Reply:
        p = self._p(partition)
        bad = self._not_live(p, "claim", ids)
        if bad is not None:
            return bad
        taken = {i: p.claims[i] for i in ids if i in p.claims}
        if taken:
            return "RuntimeError", (
                f"claim by {owner!r}: rows already claimed (id -> owner): {taken}"
            )
        p.claims.update(dict.fromkeys(ids, owner))
        return _ok()

    def claimed(self, partition: str) -> Reply:
        return _ok(dict(self._p(partition).claims))

    def release(self, partition: str, ids: list[int]) -> Reply:
        """Delete live rows; the caller then clears their tensors in TransferQueue."""
        p = self._p(partition)
        bad = self._not_live(p, "release", ids)
        if bad is not None:
            return bad
        for i in ids:
            del p.rows[i]
            p.claims.pop(i, None)
            p.released.add(i)
        return _ok()

    def discard(self, partition: str, ids: list[int]) -> Reply:
        """Delete live rows and undo pending puts among ``ids``; skip the others."""
        p = self._p(partition)
        pending = [i for i in ids if i in p.pending]
        if pending:
            self.abort_put(partition, pending)
        live = [i for i in ids if i in p.rows]
        return self.release(partition, live) if live else _ok()

    def clear(self, partition: str) -> Reply:
        """Release every live row; returns their ids."""
        p = self._p(partition)
        ids = list(p.rows)
        for i in ids:
            p.released.add(i)
        p.rows.clear()
        p.claims.clear()
        return _ok(ids)

    # ------------------------------------------------------------------ state
    def state(self, partition: str) -> Reply:
        """Everything but the tensors, in put order (ids, columns each row holds)."""
        p = self._p(partition)
        return _ok(
            {
                "schema": None if p.schema is None else list(p.schema),
                "columns": {n: list(s) for n, s in p.columns.items()},
                "ids": list(p.rows),
                "lengths": [r.length for r in p.rows.values()],
                "held": {n: [i for i, r in p.rows.items() if n in r.nbytes] for n in p.columns},
                "claims": [[i, o] for i, o in p.claims.items()],
                "released": p.released.ranges(),
                "next_id": p.next_id,
            }
        )

    def load(self, partition: str, state: dict[str, Any], rows: dict[int, list[Any]]) -> Reply:
        """Replace the partition's rows (their tensors are in TransferQueue already).

        ``rows[i] = [length, valid, {column: bytes}]``, in put order.
        """
        p = _Partition(
            schema=None if state["schema"] is None else tuple(state["schema"]),
            columns={n: tuple(s) for n, s in state["columns"].items()},
            rows={i: _Row(r[0], r[1], dict(r[2])) for i, r in rows.items()},
            claims={int(i): str(o) for i, o in state["claims"]},
            released=IdRanges.from_ranges(state["released"]),
            next_id=int(state["next_id"]),
        )
        self._parts[partition] = p
        return _ok()
