"""``TransferQueueReplayStore``: the replay rows in TransferQueue, shared by every process.

See :mod:`lppo.replay.base` for the rules every backend follows; the conformance suite
(``tests/replay/test_conformance.py``) runs against this backend for real. How it is built:

* **Data plane: TransferQueue** (``pip install -c constraints.txt -e '.[tq]'``). A store is one
  TransferQueue *partition*; row ``i`` is the key ``str(i)``; each column is a field. Token-level
  columns travel as jagged nested tensors, row-level ones as ``[B]`` tensors, through
  TransferQueue's key-value API (``kv_batch_put`` / ``kv_batch_get`` / ``kv_clear``). Released
  rows are cleared from TransferQueue's controller and storage at once.
* **Metadata: the catalog** (:mod:`lppo.replay._tq_catalog`), one named Ray actor per cluster:
  live rows, lengths, valid-token counts, bytes, schema, column specs, claims, released ids
  and the id counter. Each call is atomic across processes, so every process sees the same
  rows and :meth:`allocate` hands out ids that are unique across all processes using the store
  (one counter per partition). :meth:`meta` and :meth:`has` ask the catalog only (no tensor).
* **Runtime** (:mod:`lppo.replay._tq_runtime`): :meth:`connect` at setup (or the first use)
  starts a local Ray bound to ``127.0.0.1`` plus TransferQueue's controller and storage (or
  attaches to a running cluster by ``trainer.ray.address``); :meth:`close` (called by
  ``ReplayDataModule`` at the end of fit and on failure) stops only what this process started.
  Under data parallelism every rank uses rank 0's cluster and partition (:meth:`connect`).
* **Plumbing** (:mod:`lppo.replay._tq_client`, the store's base class): each catalog call and
  TransferQueue transfer, bounded by ``timeout_s``.

Semantics beyond :mod:`lppo.replay.base`, the same as :class:`~lppo.replay.MemoryReplayStore`
(duplicate ids in ``put`` / ``write`` / ``claim`` / ``release`` raise ``ValueError``; empty calls
change nothing; ``input_ids`` is ``int64`` rank 1, ``response_mask`` ``bool`` rank 1; ``clear``
drops every claim and marks the ids released; values are copied on the way in and ``read``
returns fresh tensors), and:

* ``shared`` is ``True``. Pickling the store (to a Ray worker, a spawned rank) keeps its
  partition and ``num_storage_units``; the copy attaches to the same cluster on first use and never
  drops the partition (only the original does, at :meth:`close`).
* Every call that fails validation raises before changing anything, in every process's view.
  A put becomes visible only after its tensors are in TransferQueue; if the transfer fails,
  the reservation is undone. A write whose transfer fails may leave the written column
  partly overwritten (the rows keep their previous bookkeeping).
* ``nbytes`` is the bytes of the tensors put and written and still held (live rows only).
* ``state_dict`` holds every live row's tensors (read back from TransferQueue), so a
  checkpoint taken inside an iteration is complete; ``load_state_dict`` replaces the
  partition's rows.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping, Sequence
from operator import index
from typing import Any

import torch

from lppo.parallel import ProcessGroup
from lppo.replay._checks import as_ids, as_lists, decode_dtype
from lppo.replay._segments import count_true
from lppo.replay._tq_client import TQClient
from lppo.replay._tq_fields import checked_specs, nbytes_of, row_lengths, to_batch
from lppo.replay._tq_runtime import TIMEOUT_KEY, StoreTimeoutError, release_tq
from lppo.replay._tq_state import decode_state, encode_state
from lppo.runtime.ray_runtime import cluster_address, configure_ray, configured_ray
from lppo.types import INPUT_IDS, RESPONSE_MASK, RowMeta
from lppo.validation import SettingError, check_number

__all__ = ["StoreTimeoutError", "TransferQueueReplayStore"]

_FORMAT = "lppo.replay.transfer_queue/1"


class TransferQueueReplayStore(TQClient):
    """:class:`~lppo.replay.base.ReplayStore` over TransferQueue, shared across processes.

    Nothing starts at construction; :meth:`connect` (called by ``ReplayDataModule`` at setup)
    or the first call starts (or attaches to) Ray and TransferQueue. Ray comes from
    :mod:`lppo.runtime.ray_runtime`, configured by ``trainer.ray`` (local on loopback, or a cluster
    address). Choose it in YAML with
    ``data.store: {class_path: lppo.replay.TransferQueueReplayStore}``.

    Args:
        partition: TransferQueue partition (and catalog entry) holding this store's rows;
            ``None``: a fresh unique name. Processes that must see the same rows share one
            store object (pickled) or the same name; data-parallel ranks use rank 0's
            (:meth:`connect`).
        num_storage_units: TransferQueue SimpleStorage units to start (each reserves one Ray
            CPU, the controller one more: ``trainer.ray.num_cpus`` must cover them).
        timeout_s: longest wait for any one call on TransferQueue or the catalog (transfers
            take well under a second here; TransferQueue alone would retry a dead storage
            unit for minutes); on expiry :class:`StoreTimeoutError` names the store and call.
    """

    def __init__(
        self, partition: str | None = None, num_storage_units: int = 1, timeout_s: float = 60.0
    ) -> None:
        if partition is not None and not (isinstance(partition, str) and partition):
            raise SettingError(
                f"data.store.init_args.partition={partition!r}: use a non-empty string, or "
                "null for a fresh unique name."
            )
        self.partition = partition or f"lppo-{uuid.uuid4().hex[:12]}"
        check_number(
            "data.store.init_args.num_storage_units", num_storage_units, integer=True, low=1
        )
        self.num_storage_units = num_storage_units
        fix = "Seconds any one call on TransferQueue may take (a transfer takes under 1 s)."
        check_number(TIMEOUT_KEY, timeout_s, low=0, low_open=True, fix=fix)
        self.timeout_s = float(timeout_s)
        self._catalog: Any = None
        self._owner = True  # the original drops the partition at close; pickled copies don't

    @property
    def ray_cpus(self) -> int:
        """Logical Ray CPUs TransferQueue reserves: one per storage unit, one for its controller."""
        return self.num_storage_units + 1

    # ------------------------------------------------------------------ lifecycle
    def __getstate__(self) -> dict[str, Any]:
        keep = ("partition", "num_storage_units", "timeout_s")
        return {name: getattr(self, name) for name in keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.partition, self.num_storage_units = state["partition"], state["num_storage_units"]
        self.timeout_s = state["timeout_s"]
        self._catalog, self._owner = None, False

    def connect(self, group: ProcessGroup) -> None:
        """Start (or attach to) Ray and TransferQueue now; every rank of ``group`` shares them.

        Collective: every rank of ``group`` calls it, at setup. Rank 0 opens the store first
        (starting what is not running yet), then sends its Ray cluster address and partition
        to the others, which attach to that cluster (unless ``trainer.ray.address`` names one
        already) and use that partition as a pickled copy would: they never drop it. Rank 0
        drops it and stops what it started at :meth:`close`, which ``ReplayDataModule`` calls
        on rank 0 only after every other rank has closed.
        """
        if group.rank == 0:
            self._open()
        info = (cluster_address(), self.partition) if group.rank == 0 else None
        address, partition = group.broadcast_object(info)
        if group.rank == 0:
            return
        if configured_ray().address is None:  # rank 0's local Ray, on this machine's loopback
            configure_ray(dataclasses.replace(configured_ray(), address=address))
        self.partition, self._owner = partition, False
        self._open()

    def close(self) -> None:
        """Drop this store's rows (the original store only) and release TransferQueue / Ray.

        Stops what this process started (Ray, TransferQueue, the catalog) once nothing else in
        the process holds them. Idempotent; the store reconnects if used again.
        """
        if self._catalog is None:
            return
        try:
            if self._owner:
                self._clear_keys(self._get(self._submit("drop_partition")))
        finally:
            self._catalog = None
            release_tq()

    @property
    def shared(self) -> bool:
        """``True``: every process using this store (or its pickled copies) sees its rows."""
        return True

    def allocate(self, n: int) -> tuple[int, ...]:
        """``n`` fresh row ids, unique across every process using this partition.

        Raises:
            ValueError: ``n < 0``.
        """
        if n < 0:
            raise ValueError(f"allocate: n={n} must be >= 0")
        return tuple(self._call("allocate", n)) if n else ()

    # ------------------------------------------------------------------ put / write
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
        try:
            lengths = row_lengths(id_list, cols)
            specs = checked_specs("put", id_list, cols, lengths, {})
        except (TypeError, ValueError):
            if id_list:  # raise what every backend raises: schema / live ids first, then the
                self._call("check_rows", id_list, list(cols))  # first column in error
                checked_specs("put", id_list, cols, row_lengths(id_list, cols), self.columns())
            raise
        if not id_list:
            return
        valid = count_true(cols[RESPONSE_MASK]) if RESPONSE_MASK in cols else [0] * len(id_list)
        nbytes = {n: [nbytes_of(t) for t in ts] for n, ts in cols.items()}
        reserve = self._submit("reserve_put", id_list, specs, lengths, valid, nbytes)
        batch = to_batch(cols, specs)  # while the catalog validates and reserves
        self._result(reserve)
        try:
            self._transfer(id_list, batch)
        except BaseException:
            self._call("abort_put", id_list)
            raise
        try:
            self._call("commit_put", id_list)
        except KeyError:  # discarded meanwhile (discard): take back what was transferred
            self._clear_keys(id_list)
            raise

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
        if not id_list:
            return
        # Each column must agree with itself first (dims are checked against rows remotely).
        dims = {n: [int(t.shape[0]) if t.dim() else 0 for t in ts] for n, ts in cols.items()}
        try:
            specs = checked_specs("write", id_list, cols, None, {})
        except (TypeError, ValueError):
            self._call("check_write", id_list, {}, {})  # unknown ids come first
            checked_specs("write", id_list, cols, None, self.columns())
            raise
        self._call("check_write", id_list, specs, dims)
        valid = count_true(cols[RESPONSE_MASK]) if RESPONSE_MASK in cols else None
        nbytes = {n: [nbytes_of(t) for t in ts] for n, ts in cols.items()}
        self._transfer(id_list, to_batch(cols, specs))
        self._call("commit_write", id_list, specs, valid, nbytes)

    # ------------------------------------------------------------------ read side
    def read(self, ids: Sequence[int], names: Sequence[str]) -> dict[str, list[torch.Tensor]]:
        """Return ``name -> [tensor of ids[0], tensor of ids[1], ...]`` in the order asked.

        Raises:
            KeyError: an id is unknown or released, or a row lacks a column asked for.
        """
        id_list, names = [index(i) for i in ids], list(names)
        check = self._submit("check_read", id_list, names)
        if not id_list or not names:
            self._result(check)
            return {name: [] for name in names}
        # Reads change nothing: fetch while the catalog checks, and report its error first.
        try:
            rows = self._fetch(id_list, names)
        except Exception:
            self._result(check)
            raise
        self._result(check)
        return rows

    def meta(self, ids: Sequence[int] | None = None) -> RowMeta:
        """Lengths and valid-token counts of ``ids`` (all live rows, ascending, when ``None``).

        Raises:
            KeyError: an id is unknown or released.
        """
        id_list = None if ids is None else [index(i) for i in ids]
        got, lengths, valid = self._call("meta", id_list)
        return RowMeta(ids=tuple(got), lengths=tuple(lengths), valid_tokens=tuple(valid))

    def columns(self) -> dict[str, tuple[torch.dtype, int]]:
        """Known columns, ``name -> (dtype, rank)``; rank 0 is a row-level column."""
        specs = self._call("summary")[2]
        return {n: (decode_dtype(d), int(r)) for n, (d, r) in specs.items()}

    def has(self, name: str, ids: Sequence[int]) -> bool:
        """Whether every row of ``ids`` is live and holds column ``name``."""
        return bool(self._call("has", name, [index(i) for i in ids]))

    def claim(self, ids: Sequence[int], owner: str) -> None:
        """Retain live rows ``ids`` for ``owner`` until they are released.

        Raises:
            KeyError: an id is unknown or released.
            RuntimeError: a row is claimed already (by any owner, in any process).
            ValueError: ``ids`` repeats an id.
        """
        self._call("claim", as_ids("claim", ids), str(owner))

    def claimed(self) -> dict[int, str]:
        """Live claimed rows, ``id -> owner``."""
        return {int(i): o for i, o in self._call("claimed").items()}

    def release(self, ids: Sequence[int]) -> None:
        """Delete rows ``ids`` from the catalog and from TransferQueue (exactly once).

        Raises:
            KeyError: an id is unknown or released.
            ValueError: ``ids`` repeats an id.
        """
        id_list = as_ids("release", ids)
        self._call("release", id_list)
        self._clear_keys(id_list)

    def discard(self, ids: Sequence[int]) -> None:
        """Delete what ``ids`` hold: live rows, and puts reserved whose writer died half-way.

        Every id's key is cleared from TransferQueue (keys it does not hold are skipped), so
        tensors a dead writer transferred before its put was committed go too.

        Raises:
            ValueError: ``ids`` repeats an id.
        """
        id_list = as_ids("discard", ids)
        if id_list:
            self._call("discard", id_list)
            self._clear_keys(id_list)

    def clear(self) -> None:
        """Delete every live row (schema and column specs kept; the ids become released)."""
        self._clear_keys(self._call("clear"))

    def nbytes(self) -> int:
        """Bytes of the tensors put and written that live rows still hold."""
        return int(self._call("summary")[1])

    def __len__(self) -> int:
        """Return the number of live rows."""
        return int(self._call("summary")[0])

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Every live row with its tensors, the schema, claims, released ids and id counter.

        Holds only tensors, dicts, lists, str, int and ``None`` (dtypes as strings), so it
        loads with ``torch.load(weights_only=True)``. Column values are concatenated along
        the first dimension in ``rows`` order (row-level columns stacked).
        """
        st = self._call("state")
        return encode_state(
            st, {n: self._fetch(rows, [n])[n] for n, rows in st["held"].items() if rows}, _FORMAT
        )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the store's rows with ``state`` (from :meth:`state_dict`).

        Raises:
            ValueError: ``state`` is not a consistent state of this backend (store unchanged).
        """
        meta, batches = decode_state(state, _FORMAT)
        self._clear_keys(self._call("clear"))
        for ids, cols in batches:
            specs = {n: meta["columns"][n] for n in cols}
            self._transfer(ids, to_batch(cols, specs))
        rows = meta.pop("rows")
        self._call("load", meta, rows)
