"""TransferQueue in an lppo process: started here (and stopped here) or attached to.

:func:`acquire_tq` gets Ray through :mod:`lppo.runtime.ray_runtime` (as ``trainer.ray`` says), then
either starts TransferQueue's controller and ``num_storage_units`` SimpleStorage units (when
the cluster has none) or attaches a client to the running ones, and gets the replay catalog
actor (started here when missing).
The last :func:`release_tq` stops exactly what was started here (also when start-up itself
failed half-way) and only detaches from what was found running; then it releases Ray.
TransferQueue's controller and each storage unit reserve one Ray CPU, and bind their ZMQ
sockets to the node's Ray address (``127.0.0.1`` for a Ray started by lppo).

:func:`bounded` is the one wait on TransferQueue's data plane: TransferQueue's own client
retries a storage unit that does not answer for minutes (3 attempts of 200 s each), so every
transfer of the store runs through it with the store's ``timeout_s``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import sys
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from lppo.replay import _ids, _tq_catalog
from lppo.runtime.ray_runtime import KEY as RAY_KEY
from lppo.runtime.ray_runtime import acquire_ray, ray_module, release_ray

__all__ = ["StoreTimeoutError", "acquire_tq", "bounded", "release_tq", "tq_controller", "tq_module"]

#: The store's wait bound, named in every timeout message.
TIMEOUT_KEY = "data.store.init_args.timeout_s"

#: Longest wait for the catalog actor's process to start (a loaded machine takes seconds);
#: kept apart from ``timeout_s``, which bounds calls, not process start-up.
CATALOG_START_S = 120.0


class StoreTimeoutError(TimeoutError):
    """A call of the TransferQueue replay store got no answer within its ``timeout_s``."""


def timeout_error(partition: str, what: str, timeout_s: float) -> StoreTimeoutError:
    """The error of a wait on the store that expired: names the store, the call, the bound."""
    return StoreTimeoutError(
        f"TransferQueueReplayStore (partition {partition!r}): {what} got no answer within "
        f"{TIMEOUT_KEY}={timeout_s:g} s; a TransferQueue storage unit, its controller or the "
        "replay catalog may have died or hung: see the Ray session's logs (trainer.ray."
        "temp_dir), or raise timeout_s if the transfers are just slow."
    )


def bounded(
    make: Callable[[], Coroutine[Any, Any, Any]], partition: str, what: str, timeout_s: float
) -> Any:
    """Run TransferQueue's coroutine ``make()`` on its client's loop, waiting ``timeout_s``.

    On expiry the coroutine is cancelled (which stops TransferQueue's own retries) and
    :class:`StoreTimeoutError` names the store and ``what``.
    """
    loop = tq_module().get_client()._loop  # where TransferQueue's sync API runs it too
    future = asyncio.run_coroutine_threadsafe(make(), loop)
    try:
        return future.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise timeout_error(partition, what, timeout_s) from None


_CONTROLLER = ("TransferQueueController", "transfer_queue")  # (actor name, namespace)


class _State:
    lock = threading.Lock()
    refs = 0
    num_storage_units: int | None = None
    started_tq = False
    catalog: Any = None
    started_catalog = False


def tq_module() -> Any:
    """Import TransferQueue, or raise ``ImportError`` naming the extra that installs it."""
    # Read at import: TransferQueue caps torch's threads during transfers to this (default 8,
    # and it warns on every call when that exceeds the cores).
    os.environ.setdefault("TQ_NUM_THREADS", str(os.cpu_count() or 1))
    try:
        import transfer_queue
    except ImportError as e:
        raise ImportError(
            "TransferQueueReplayStore needs TransferQueue and Ray: install lppo's optional "
            "extra with  pip install -c constraints.txt -e '.[tq]'"
        ) from e
    return transfer_queue


def tq_controller() -> Any:
    """TransferQueue's controller actor (for inspecting its own state), or ``None``."""
    try:
        return ray_module("tq").get_actor(_CONTROLLER[0], namespace=_CONTROLLER[1])
    except ValueError:
        return None


def acquire_tq(num_storage_units: int) -> Any:
    """Start or attach to TransferQueue (module docstring); returns the catalog actor.

    Args:
        num_storage_units: SimpleStorage units to start (each reserves one Ray CPU; the
            controller one more); ignored when TransferQueue is running already.

    Raises:
        ValueError: held already in this process with other settings, or the cluster lacks
            the CPUs TransferQueue reserves.
        ImportError: the ``[tq]`` extra is missing.
    """
    tq = tq_module()
    with _State.lock:
        if _State.refs > 0:
            if num_storage_units != _State.num_storage_units:
                raise ValueError(
                    f"TransferQueue is already held in this process with "
                    f"num_storage_units={_State.num_storage_units}; got {num_storage_units}. "
                    "Give every TransferQueueReplayStore the same num_storage_units."
                )
            _State.refs += 1
            return _State.catalog
        acquire_ray("tq")
        try:
            _start(tq, num_storage_units)
        except BaseException:
            _stop(tq)
            release_ray()
            raise
        _State.num_storage_units, _State.refs = num_storage_units, 1
        return _State.catalog


def _start(tq: Any, num_storage_units: int) -> None:
    ray = ray_module("tq")
    if tq_controller() is None:
        free = ray.available_resources().get("CPU", 0)
        need = num_storage_units + 1
        if free < need:
            # Checked here, not in a config object: only the running cluster knows its CPUs
            # (a local one has trainer.ray.num_cpus, an attached one its own).
            raise ValueError(
                f"data.store.init_args.num_storage_units={num_storage_units} needs {need} "
                f"free Ray CPUs (one per storage unit plus the controller) but the cluster "
                f"has {free:g} ({RAY_KEY}.num_cpus for a local Ray); TransferQueue would wait "
                f"forever for them: lower num_storage_units or raise {RAY_KEY}.num_cpus "
                "(logical CPUs, not cores)"
            )
        _State.started_tq = True
        tq.init({"backend": {"SimpleStorage": {"num_data_storage_units": need - 1}}})
    else:
        tq.init()  # attaches a client to the running controller and storage
    _State.catalog = _get_catalog(ray)  # set first: a failed wait still stops it
    _wait_started(ray, _State.catalog)


def _get_catalog(ray: Any) -> Any:
    name, namespace = _tq_catalog.CATALOG_NAME, _tq_catalog.CATALOG_NAMESPACE
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        pass
    # Shipped by value: the actor process imports neither lppo nor torch.
    for module in (_ids, _tq_catalog):
        ray.cloudpickle.register_pickle_by_value(sys.modules[module.__name__])
    actor = ray.remote(num_cpus=0)(_tq_catalog.Catalog)
    _State.started_catalog = True
    return actor.options(name=name, namespace=namespace, get_if_exists=True).remote()


def _wait_started(ray: Any, catalog: Any) -> None:
    """Wait for the catalog actor's process, so that no call's ``timeout_s`` pays for it."""
    try:
        ray.get(catalog.__ray_ready__.remote(), timeout=CATALOG_START_S)
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(
            f"the replay catalog actor did not start within {CATALOG_START_S:g} s; see the "
            f"Ray session's logs ({RAY_KEY}.temp_dir) for why its process did not come up"
        ) from None


def _stop(tq: Any) -> None:
    """Stop what was started here; detach from the rest."""
    ray = ray_module("tq")
    if _State.started_catalog and _State.catalog is not None:
        ray.kill(_State.catalog)
    if _State.started_tq:
        tq.close()  # storage units, client, controller
    else:
        _detach_client()
    _State.catalog, _State.started_catalog, _State.started_tq = None, False, False


def _detach_client() -> None:
    # TransferQueue's public close() also kills the controller, even one this process only
    # attached to; closing just our client needs its module-level handles (the one place).
    from transfer_queue import interface

    if interface._TQ_CLIENT is not None:
        interface._TQ_CLIENT.close()
    interface._TQ_CLIENT = interface._TQ_CONTROLLER = None


def release_tq() -> None:
    """Drop a holder; the last one stops what :func:`acquire_tq` started, then releases Ray.

    Extra releases do nothing.
    """
    with _State.lock:
        if _State.refs == 0:
            return
        _State.refs -= 1
        if _State.refs > 0:
            return
        _State.num_storage_units = None
        try:
            _stop(tq_module())
        finally:
            release_ray()
