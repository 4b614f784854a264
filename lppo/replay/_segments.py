"""Packed storage of one replay column: flat segments plus compact per-row locations.

A :class:`Column` keeps its values in a few *segments*, each ONE flat contiguous 1-D tensor of
the column's dtype on one device. A row's value is a contiguous run of a segment (token-level:
``numel`` elements, row-level: 1 element); where it lies is kept in two int32 ``array`` tables
(widened to int64 if ever needed) indexed by the row's dense *slot*: segment id and first
element. No per-row Python object or tensor exists. Filled elements are never changed in place:
an overwrite appends the new value and leaves the old run dead, so a read copy or a state-dict
view never sees a later change.

Appends fill the column's open *tail* segment's room first (whole runs, in order). What does
not fit goes to ONE new segment: exact when it is at least ``reserve`` elements (the tail stays
open), else a new tail with room for ``reserve`` more elements; the old tail is sealed, trimmed
to its filled part when more than 1/32 of it is unused. ``reserve`` = the column's live bytes
/ 32, at least 16 KiB, at most 1 MiB, never more than the live bytes (a column's first call
is stored exact). Dead runs are reclaimed per segment, after each call: a segment without live
run is freed, one with a dead run and more than half of it dead or unused is compacted (its
live runs copied into a new exact tensor). So no sealed segment is more than half dead, and
the only other held bytes are the tail's room and the seals' unused ends (<= 1/32 each).
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_right
from itertools import accumulate
from typing import Any

import torch

__all__ = ["Column", "column_state", "count_true", "load_column"]

_TAIL_FRACTION = 32
_TAIL_MIN_BYTES = 16 << 10
_TAIL_MAX_BYTES = 1 << 20
_TRIM_FRACTION = 32
_I32 = 2**31 - 1


def _ints(values: Any) -> array:
    """A compact int table: int32 while every value fits, else int64."""
    try:
        return array("i", values)
    except OverflowError:
        return array("q", values)


def _int64(values: list[Any]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


class _Segment:
    """One flat tensor: ``used`` elements filled, ``live`` of them in the ``runs`` live runs."""

    __slots__ = ("data", "live", "runs", "used")

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self.used = 0
        self.live = 0
        self.runs = 0  # live runs, empty ones included: the segment is freed at 0


class Column:
    """One column's values for the rows of a store, addressed by dense slot ``k``.

    ``lengths`` is the store's slot -> row length table (shared, read only here).
    """

    __slots__ = (
        "_devices",
        "_next",
        "dtype",
        "lengths",
        "live",
        "rank",
        "seg",
        "segs",
        "shapes",
        "start",
        "tail",
    )

    def __init__(self, dtype: torch.dtype, rank: int, lengths: array) -> None:
        self.dtype, self.rank, self.lengths = dtype, rank, lengths
        self.segs: dict[int, _Segment] = {}
        self.seg = array("i")  # slot -> segment id, -1 when the row lacks the column
        self.start = array("i")  # slot -> first element of its run in that segment
        self.shapes: dict[int, tuple[int, ...]] = {}  # slot -> shape, rank >= 2 only
        self.tail: int | None = None
        self.live = 0  # live elements over all segments
        self._next = 0
        self._devices: set[torch.device] = set()  # of every segment made so far

    # ------------------------------------------------------------------ lookups
    def holds(self, k: int) -> bool:
        """Whether slot ``k`` has a value in this column."""
        return k < len(self.seg) and self.seg[k] >= 0

    def missing(self, ks: list[int]) -> list[int]:
        """Positions in ``ks`` of the slots without a value in this column."""
        seg, n = self.seg, len(self.seg)
        return [j for j, k in enumerate(ks) if k >= n or seg[k] < 0]

    def _numel(self, k: int) -> int:
        if self.rank == 1:
            return self.lengths[k]
        return 1 if self.rank == 0 else math.prod(self.shapes[k])

    def _shape(self, k: int) -> tuple[int, ...]:
        if self.rank == 1:
            return (self.lengths[k],)
        return () if self.rank == 0 else self.shapes[k]

    def nbytes(self) -> int:
        """Bytes of every segment tensor (dead runs and the tail's unused room included)."""
        return sum(s.data.numel() for s in self.segs.values()) * self.dtype.itemsize

    def gather(self, ks: list[int]) -> list[torch.Tensor]:
        """Fresh copies of the values of slots ``ks`` (views of one new buffer, no overlap)."""
        segs, seg, start = self.segs, self.seg, self.start
        if self.rank == 1:
            sizes = [self.lengths[k] for k in ks]
        else:
            sizes = [self._numel(k) for k in ks]
        pieces = [
            segs[seg[k]].data[(s := start[k]) : s + n] for k, n in zip(ks, sizes, strict=True)
        ]
        if not pieces:
            return []
        if len(self._devices) > 1 and len({p.device for p in pieces}) > 1:
            out = [p.clone() for p in pieces]
        else:
            flat = torch.cat(pieces)
            if self.rank == 0:
                return list(flat.unbind(0))
            out = list(flat.split(sizes))
        if self.rank != 1:
            out = [t.view(self._shape(k)) for t, k in zip(out, ks, strict=True)]
        return out

    # ------------------------------------------------------------------ changes
    def write(self, ks: list[int], tensors: list[torch.Tensor]) -> None:
        """Set slot ``ks[j]``'s value to a copy of ``tensors[j]`` (already validated)."""
        need = max(ks, default=-1) + 1 - len(self.seg)
        if need > 0:
            self.seg.extend([-1] * need)
            self.start.extend([0] * need)
        flats = [t.detach() if t.requires_grad else t for t in tensors]
        if self.rank >= 2:  # rank 1 concatenates as is, rank 0 is stacked
            flats = [t.reshape(-1) for t in flats]
        devices = {t.device for t in flats}
        touched: set[int] = set()
        if len(devices) == 1:
            self._append(ks, flats, tensors, devices.pop(), touched)
        else:  # one pass per device
            for device in devices:
                js = [j for j, t in enumerate(flats) if t.device == device]
                pick = [tensors[j] for j in js]
                self._append([ks[j] for j in js], [flats[j] for j in js], pick, device, touched)
        self._tidy(touched)

    def _append(
        self,
        ks: list[int],
        flats: list[torch.Tensor],
        tensors: list[torch.Tensor],
        device: torch.device,
        touched: set[int],
    ) -> None:
        """Copy ``flats`` (all on ``device``) to the ends of segments; locate slots ``ks``."""
        sizes = [t.numel() for t in flats]
        done = 0
        while done < len(ks):  # the tail's room first, then one new segment
            sid, count = self._place(sizes[done:], device)
            seg, end = self.segs[sid], done + count
            off, total = seg.used, sum(sizes[done:end])
            if total:
                join = torch.stack if self.rank == 0 else torch.cat
                join(flats[done:end], out=seg.data[off : off + total])
            seg.used += total
            seg.live += total
            seg.runs += count
            self.live += total
            for j in range(done, end):
                k = ks[j]
                if self.seg[k] >= 0:
                    touched.add(self._kill(k))
                if self.rank >= 2:
                    self.shapes[k] = tuple(tensors[j].shape)
                self.seg[k], self.start[k] = sid, off
                off += sizes[j]
            done = end

    def drop(self, ks: list[int]) -> None:
        """Delete the values of the slots of ``ks`` that have one."""
        self._tidy({self._kill(k) for k in ks if self.holds(k)})

    def _kill(self, k: int) -> int:
        """Mark slot ``k``'s run dead; return its segment id."""
        sid, n = self.seg[k], self._numel(k)
        seg = self.segs[sid]
        seg.live -= n
        seg.runs -= 1
        self.live -= n
        self.seg[k] = -1
        if self.rank >= 2:
            del self.shapes[k]
        return sid

    def _new(self, capacity: int, device: torch.device) -> int:
        sid, self._next = self._next, self._next + 1
        if sid >= _I32 and self.seg.typecode == "i":
            self.seg = array("q", self.seg)
        if capacity >= _I32 and self.start.typecode == "i":
            self.start = array("q", self.start)
        self._devices.add(device)
        # zeros, not empty: a state-dict view saves its whole storage, room included
        self.segs[sid] = _Segment(torch.zeros(capacity, dtype=self.dtype, device=device))
        return sid

    def _place(self, sizes: list[int], device: torch.device) -> tuple[int, int]:
        """Segment for the leading runs of ``sizes`` on ``device``, and how many go there.

        As many as fit in the tail's room, else all of them in a new segment: exact when
        they are large next to the reserve (the tail stays open), else a new tail with room
        for ``reserve`` more elements (the old tail is sealed).
        """
        tail = None if self.tail is None else self.segs[self.tail]
        if tail is not None and tail.data.device == device:
            room = tail.data.numel() - tail.used
            fit = bisect_right(list(accumulate(sizes)), room)
            if fit:
                return self.tail, fit  # type: ignore[return-value]
        n, size = sum(sizes), self.dtype.itemsize
        live = self.live * size
        reserve = min(max(live // _TAIL_FRACTION, _TAIL_MIN_BYTES), _TAIL_MAX_BYTES, live) // size
        if n >= reserve:
            return self._new(n, device), len(sizes)
        if (
            tail is not None
            and (tail.data.numel() - tail.used) * _TRIM_FRACTION > tail.data.numel()
        ):
            tail.data = tail.data[: tail.used].clone()  # seal: trim a sizeable unused end
        self.tail = self._new(n + reserve, device)
        return self.tail, len(sizes)

    def _tidy(self, sids: set[int]) -> None:
        """Free segments without live runs; compact those more than half dead or unused."""
        for sid in sids:
            seg = self.segs[sid]
            capacity = seg.data.numel()
            if seg.runs == 0:
                del self.segs[sid]
            elif seg.used > seg.live and 2 * (capacity - seg.live) > capacity:
                self._compact(sid, seg)
            else:
                continue
            if sid == self.tail:
                self.tail = None

    def _compact(self, sid: int, seg: _Segment) -> None:
        # the slots located in this segment (a transient tensor over the table's buffer)
        wide = self.seg.typecode == "q"
        table = torch.frombuffer(self.seg, dtype=torch.int64 if wide else torch.int32)
        live = torch.nonzero(table == sid)[:, 0].tolist()
        del table
        pieces = [seg.data[(s := self.start[k]) : s + self._numel(k)] for k in live]
        seg.data = torch.cat(pieces)
        offsets = accumulate((p.numel() for p in pieces[:-1]), initial=0)
        for k, off in zip(live, offsets, strict=True):
            self.start[k] = off
        seg.used = seg.live = seg.data.numel()
        seg.runs = len(live)


def count_true(masks: list[torch.Tensor]) -> list[int]:
    """Number of ``True`` entries of each of ``masks`` (one sync when all on one device)."""
    if any(m.device.type != "cpu" for m in masks) and len({m.device for m in masks}) == 1:
        return torch.stack([torch.count_nonzero(m) for m in masks]).tolist()
    return [int(torch.count_nonzero(m)) for m in masks]  # no pile of 0-dim temporaries


# ---------------------------------------------------------------------- state
def column_state(col: Column, ks: list[int]) -> dict[str, Any]:
    """Exact, canonical state of ``col`` for the rows at slots ``ks`` (in that order).

    Segments are renumbered in creation order and given as views of their filled part (never
    changed by the store afterwards); ``capacity`` restores the tail's room, which holds zeros.
    """
    sids = sorted(col.segs)
    pos = {sid: j for j, sid in enumerate(sids)}
    held = [col.holds(k) for k in ks]
    state: dict[str, Any] = {
        "segments": [col.segs[s].data[: col.segs[s].used] for s in sids],
        "capacity": [col.segs[s].data.numel() for s in sids],
        "tail": None if col.tail is None else pos[col.tail],
        "seg": _int64([pos[col.seg[k]] if h else -1 for k, h in zip(ks, held, strict=True)]),
        "start": _int64([col.start[k] if h else 0 for k, h in zip(ks, held, strict=True)]),
    }
    if col.rank >= 2:
        blank = (0,) * col.rank
        shapes = [col.shapes[k] if h else blank for k, h in zip(ks, held, strict=True)]
        state["shape"] = _int64(shapes).reshape(len(ks), col.rank)
    return state


def load_column(dtype: torch.dtype, rank: int, lengths: array, state: Any) -> Column:
    """Rebuild a :class:`Column` from :func:`column_state` (slots ``0..n-1`` = rows).

    Raises:
        ValueError: the state is not consistent (wrong dtype / rank, a run out of its
            segment's filled part, a segment without live run, a bad tail index).
    """
    col = Column(dtype, rank, lengths)
    n = len(lengths)
    caps = [int(c) for c in state["capacity"]]
    for sid, (data, cap) in enumerate(zip(state["segments"], caps, strict=True)):
        if data.dtype != dtype or data.dim() != 1 or data.numel() > cap:
            raise ValueError(f"segment {sid}: expected {dtype} 1-D of at most {cap} elements")
        seg = col.segs[sid] = _Segment(torch.zeros(cap, dtype=dtype, device=data.device))
        col._devices.add(data.device)
        seg.data[: data.numel()] = data
        seg.used = data.numel()
    col._next = len(caps)
    if state["tail"] is not None:
        col.tail = int(state["tail"])
        if col.tail not in col.segs:
            raise ValueError(f"tail {col.tail} names no segment")
    seg_ids, starts = state["seg"].tolist(), state["start"].tolist()
    if len(seg_ids) != n or len(starts) != n:
        raise ValueError(f"locations given for {len(seg_ids)} rows, expected {n}")
    col.seg, col.start = _ints(seg_ids), _ints(starts)
    shapes = state["shape"].tolist() if rank >= 2 else None
    for k, (sid, s) in enumerate(zip(seg_ids, starts, strict=True)):
        if sid == -1:
            continue
        if shapes is not None:
            col.shapes[k] = tuple(shapes[k])
            if shapes[k][0] != lengths[k] or min(shapes[k]) < 0:
                raise ValueError(f"row {k}: shape {shapes[k]} does not match length {lengths[k]}")
        elif rank == 1 and lengths[k] < 0:
            raise ValueError(f"row {k}: negative length")
        seg, size = col.segs.get(sid), col._numel(k)
        if seg is None or s < 0 or s + size > seg.used:
            raise ValueError(f"row {k}: run [{s}, {s + size}) out of segment {sid}")
        seg.live += size
        seg.runs += 1
        col.live += size
    if any(seg.runs == 0 for seg in col.segs.values()):
        raise ValueError("a segment holds no live row")
    return col
