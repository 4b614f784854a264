"""Sets of row ids kept as ranges (torch-free: also loaded inside the replay catalog actor)."""

from __future__ import annotations

from bisect import bisect_right
from typing import Any

__all__ = ["IdRanges"]


class IdRanges:
    """A set of ints kept as sorted, disjoint, non-adjacent ranges ``[lo, hi)``.

    The released ids of a store: consecutive ids (the usual case) cost one range, so the set
    does not grow with the iterations of a training run.
    """

    __slots__ = ("hi", "lo")

    def __init__(self) -> None:
        self.lo: list[int] = []
        self.hi: list[int] = []

    def _find(self, i: int) -> int:
        """Index of the last range starting at or before ``i`` (-1 if none)."""
        return bisect_right(self.lo, i) - 1

    def __contains__(self, i: int) -> bool:
        j = self._find(i)
        return j >= 0 and i < self.hi[j]

    def add(self, i: int) -> None:
        """Add ``i``, merging it with the ranges it touches."""
        j = self._find(i)
        if j >= 0 and i < self.hi[j]:
            return
        left = j >= 0 and self.hi[j] == i
        right = j + 1 < len(self.lo) and self.lo[j + 1] == i + 1
        if left and right:
            self.hi[j] = self.hi.pop(j + 1)
            del self.lo[j + 1]
        elif left:
            self.hi[j] = i + 1
        elif right:
            self.lo[j + 1] = i
        else:
            self.lo.insert(j + 1, i)
            self.hi.insert(j + 1, i + 1)

    def discard(self, i: int) -> None:
        """Remove ``i`` if present (splitting its range)."""
        j = self._find(i)
        if j < 0 or i >= self.hi[j]:
            return
        lo, hi = self.lo[j], self.hi[j]
        if lo == i and hi == i + 1:
            del self.lo[j], self.hi[j]
        elif lo == i:
            self.lo[j] = i + 1
        elif hi == i + 1:
            self.hi[j] = i
        else:
            self.hi[j] = i
            self.lo.insert(j + 1, i + 1)
            self.hi.insert(j + 1, hi)

    def ranges(self) -> list[list[int]]:
        """The ranges as ``[[lo, hi], ...]``, ascending (canonical)."""
        return [[lo, hi] for lo, hi in zip(self.lo, self.hi, strict=True)]

    @classmethod
    def from_ranges(cls, pairs: Any) -> IdRanges:
        """Rebuild from :meth:`ranges` (ranges may touch; they may not overlap).

        Raises:
            ValueError: a range is empty or overlaps another.
        """
        out = cls()
        for lo, hi in sorted((int(lo), int(hi)) for lo, hi in pairs):
            if lo >= hi or (out.hi and lo < out.hi[-1]):
                raise ValueError(f"released range [{lo}, {hi}) is empty or overlaps another")
            if out.hi and lo == out.hi[-1]:
                out.hi[-1] = hi
            else:
                out.lo.append(lo)
                out.hi.append(hi)
        return out
