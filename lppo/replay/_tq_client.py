"""``TransferQueueReplayStore``'s plumbing: catalog calls and TransferQueue transfers.

Every wait is bounded by the store's ``timeout_s``, so a dead actor or storage unit fails the
call with :class:`~lppo.replay._tq_runtime.StoreTimeoutError` instead of hanging.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lppo.replay._tq_fields import ERRORS, rows_of
from lppo.replay._tq_runtime import acquire_tq, bounded, timeout_error, tq_module
from lppo.runtime.ray_runtime import ray_module

__all__ = ["TQClient"]


class TQClient:
    """Calls on the catalog actor and on TransferQueue for one partition.

    The base of :class:`~lppo.replay.TransferQueueReplayStore`, which sets the attributes
    below; kept apart so the store module reads as the replay-store contract alone.

    Attributes:
        partition: TransferQueue partition (and catalog entry) holding the store's rows.
        num_storage_units: TransferQueue SimpleStorage units to start on first use.
        timeout_s: longest wait for any one call on TransferQueue or the catalog.
    """

    partition: str
    num_storage_units: int
    timeout_s: float
    _catalog: Any

    def _open(self) -> Any:
        """The catalog actor; the first use starts (or attaches to) Ray and TransferQueue."""
        if self._catalog is None:
            self._catalog = acquire_tq(self.num_storage_units)
        return self._catalog

    def _submit(self, method: str, *args: Any) -> tuple[str, Any]:
        """Start a catalog method for this partition; returns its name and Ray object ref."""
        return method, getattr(self._open(), method).remote(self.partition, *args)

    def _result(self, call: tuple[str, Any]) -> Any:
        """Wait for a catalog call; raise its error here."""
        err, value = self._get(call)
        if err is not None:
            raise ERRORS[err](value)
        return value

    def _get(self, call: tuple[str, Any]) -> Any:
        """``ray.get`` of a catalog call, waiting at most ``timeout_s``."""
        ray = ray_module("tq")
        try:
            return ray.get(call[1], timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise timeout_error(self.partition, f"catalog {call[0]}", self.timeout_s) from None

    def _call(self, method: str, *args: Any) -> Any:
        """Run a catalog method for this partition; raise its error here."""
        return self._result(self._submit(method, *args))

    def _clear_keys(self, ids: Sequence[int]) -> None:
        """Clear rows ``ids`` from TransferQueue (nothing when ``ids`` is empty)."""
        if ids:
            self._tq("clear", keys=[str(i) for i in ids])

    def _tq(self, op: str, **kwargs: Any) -> Any:
        """TransferQueue's ``kv_<op>`` on this partition, waiting at most ``timeout_s``."""
        run = getattr(tq_module(), f"async_kv_{op}")
        make = lambda: run(partition_id=self.partition, **kwargs)  # noqa: E731
        return bounded(make, self.partition, f"TransferQueue kv_{op}", self.timeout_s)

    def _transfer(self, ids: list[int], batch: Any) -> None:
        """Put ``batch`` (from ``to_batch``) into TransferQueue as the keys of ``ids``."""
        self._tq("batch_put", keys=[str(i) for i in ids], fields=batch)

    def _fetch(self, id_list: list[int], names: list[str]) -> dict[str, list[torch.Tensor]]:
        """Columns ``names`` of rows ``id_list`` from TransferQueue, one tensor per id asked."""
        unique = list(dict.fromkeys(id_list))
        got = self._tq("batch_get", keys=[str(i) for i in unique], select_fields=names)
        pos = {i: k for k, i in enumerate(unique)}
        out = {}
        for name in names:
            rows = rows_of(got[name])
            seen: set[int] = set()
            col = []
            for i in id_list:  # a repeated id gets its own copy
                t = rows[pos[i]]
                col.append(t.clone() if i in seen else t)
                seen.add(i)
            out[name] = col
        return out
