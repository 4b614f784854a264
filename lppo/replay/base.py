"""The ``ReplayStore`` protocol every replay backend implements (and ``InspectableStore``).

A replay store holds the rows of the running iteration, packed (one variable-length tensor per
row and column, no padding stored). Columns are either *token-level* (``[L_i, ...]``: first
dimension is the row's length, the length of its ``input_ids``) or *row-level* (0-dim).

Rules every backend follows (the conformance suite in ``tests/replay`` checks them):

* ``put`` creates rows. Every ``put`` carries ``input_ids`` and exactly the columns of the first
  ``put`` (the *row schema*), so no row is ever left without a column its peers have. Written
  columns (``write``) are not part of the row schema.
* ``write`` adds or overwrites columns of existing rows, for any subset of rows (scoring is
  streamed chunk by chunk). Reading a column for a row that lacks it raises ``KeyError``.
* A column keeps the dtype and rank it was created with; a mismatch raises ``TypeError``.
* Every failing call raises before changing anything (all-or-nothing).
* ``release`` deletes rows; reading or releasing a released id raises ``KeyError``. A released
  id may be reused by a later ``put``; a live id may not.
* ``allocate`` hands out fresh row ids: never live, never handed out or put before (ids
  survive ``state_dict`` / ``load_state_dict``), so the store, not its callers, owns row ids.
* ``shared`` says whether other processes see the same rows (a shared store) or each process
  has its own (a local one).
* ``discard`` deletes whatever ids hold, live rows or a put still in flight (its writer died
  half-way), and skips ids that hold nothing: how a writer's caller cleans up after it.
* ``claim`` marks rows as retained by an owner until they are released; claiming a row that is
  already claimed raises ``RuntimeError``.
* ``connect`` is called once at setup by ``ReplayDataModule`` on every data-parallel rank
  (a collective): a local store does nothing; a shared one makes every rank use the same rows
  and starts what it needs (rank 0 first).
* ``close`` lets go of what the store holds outside this process's memory (connections, and
  services it started itself); ``ReplayDataModule`` calls it at the end of fit and on failure.
  It is idempotent and the store stays usable (a later call reconnects).

* ``ray_cpus`` (optional attribute, read by :func:`ray_cpus_of`): the logical Ray CPUs the
  services the store starts reserve; the run plan counts them against ``trainer.ray.num_cpus``.

``ReplayStore`` holds exactly what lppo calls. ``InspectableStore`` is the optional rest, for
tests and benchmarks: ``columns``, ``has``, ``claimed``, ``clear``, ``nbytes`` and ``len``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from lppo.parallel import ProcessGroup
from lppo.types import RowMeta


def ray_cpus_of(store: object) -> int:
    """The logical Ray CPUs ``store``'s services reserve (its optional ``ray_cpus``; else 0)."""
    return int(getattr(store, "ray_cpus", 0))


class ReplayError(Exception):
    """Base class of replay-store errors that are not plain ``KeyError`` / ``TypeError``."""


@runtime_checkable
class ReplayStore(Protocol):
    """Storage of variable-length rows, read back in arbitrary subsets and orders."""

    @property
    def shared(self) -> bool:
        """Whether every process sees the same rows (``False``: each process has its own)."""
        ...

    def allocate(self, n: int) -> tuple[int, ...]:
        """Return ``n`` fresh row ids for a later :meth:`put`."""
        ...

    def put(self, ids: Sequence[int], columns: Mapping[str, Sequence[torch.Tensor]]) -> None:
        """Create rows ``ids``; ``columns[name][i]`` is row ``ids[i]``'s tensor for ``name``.

        Raises:
            ValueError: lengths disagree with ``input_ids``, duplicate ids in the call, missing
                ``input_ids``, or column lists of the wrong length.
            KeyError: an id is live already, or the columns differ from the row schema.
            TypeError: a column's dtype or rank differs from the one it was created with.
        """
        ...

    def write(self, ids: Sequence[int], columns: Mapping[str, Sequence[torch.Tensor]]) -> None:
        """Add or overwrite columns of existing rows (any subset of live rows).

        Raises:
            KeyError: an id is unknown or released, or ``input_ids`` is written.
            ValueError: a token-level tensor's length differs from its row's length.
            TypeError: dtype or rank differs from the column's.
        """
        ...

    def read(self, ids: Sequence[int], names: Sequence[str]) -> dict[str, list[torch.Tensor]]:
        """Return ``name -> [tensor of ids[0], tensor of ids[1], ...]`` in the order asked.

        Raises:
            KeyError: an id is unknown or released, or a row lacks a column asked for.
        """
        ...

    def meta(self, ids: Sequence[int] | None = None) -> RowMeta:
        """Lengths and valid-token counts of ``ids`` (all live rows, ascending, when ``None``).

        A row's valid tokens are the ``True`` entries of its ``response_mask`` column (0 when
        the store has no such column). No tensor is read.
        """
        ...

    def claim(self, ids: Sequence[int], owner: str) -> None:
        """Retain live rows ``ids`` for ``owner`` until they are released."""
        ...

    def release(self, ids: Sequence[int]) -> None:
        """Delete rows ``ids`` (exactly once; a second release raises ``KeyError``)."""
        ...

    def discard(self, ids: Sequence[int]) -> None:
        """Delete whatever ``ids`` hold (live rows, or a put whose writer died half-way).

        Ids that hold nothing (never put, released) are skipped: cleanup after a failed
        writer, whose caller does not know how far it got.

        Raises:
            ValueError: ``ids`` repeats an id.
        """
        ...

    def connect(self, group: ProcessGroup) -> None:
        """At setup, on every rank of ``group``: share the rows across its ranks (if shared)."""
        ...

    def close(self) -> None:
        """Let go of connections and of services the store started (idempotent)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to rebuild the store exactly (rows, schema, claims, released ids)."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the store's content with ``state`` (from ``state_dict``)."""
        ...


@runtime_checkable
class InspectableStore(Protocol):
    """What a store shows of itself beyond :class:`ReplayStore`: for tests and benchmarks.

    lppo's training path never calls these; both stores implement them, so the conformance
    suite and the memory benchmarks can look inside any of them.
    """

    def columns(self) -> dict[str, tuple[torch.dtype, int]]:
        """Known columns, ``name -> (dtype, rank)``; rank 0 is a row-level column."""
        ...

    def has(self, name: str, ids: Sequence[int]) -> bool:
        """Whether every row of ``ids`` holds column ``name``."""
        ...

    def claimed(self) -> dict[int, str]:
        """Live claimed rows, ``id -> owner``."""
        ...

    def clear(self) -> None:
        """Delete every live row (schema kept)."""
        ...

    def nbytes(self) -> int:
        """Bytes held by the stored tensors."""
        ...

    def __len__(self) -> int:
        """Number of live rows."""
        ...
