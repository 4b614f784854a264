"""TransferQueue in an lppo process: started here (and stopped here) or attached to.

:func:`acquire_tq` gets Ray through :mod:`lppo.ray_runtime`, then either starts TransferQueue's
controller and ``num_storage_units`` SimpleStorage units (when the cluster has none) or attaches
a client to the running ones, and gets the replay catalog actor (started here when missing).
The last :func:`release_tq` stops exactly what was started here (also when start-up itself
failed half-way) and only detaches from what was found running; then it releases Ray.
TransferQueue's controller and each storage unit reserve one Ray CPU, and bind their ZMQ
sockets to the node's Ray address (``127.0.0.1`` for a Ray started by lppo).
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass
from typing import Any

from lppo.ray_runtime import RaySettings, acquire_ray, ray_module, release_ray
from lppo.replay import _ids, _tq_catalog

__all__ = ["TQSettings", "acquire_tq", "release_tq", "tq_controller", "tq_module"]

_CONTROLLER = ("TransferQueueController", "transfer_queue")  # (actor name, namespace)


@dataclass(frozen=True)
class TQSettings:
    """How lppo gets TransferQueue.

    Args:
        ray: the Ray cluster (local on loopback, or attached by address).
        num_storage_units: SimpleStorage units to start (each reserves one Ray CPU; the
            controller one more). Ignored when attaching to a running TransferQueue.
    """

    ray: RaySettings
    num_storage_units: int = 1

    def __post_init__(self) -> None:
        n = self.num_storage_units
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"num_storage_units={n!r} must be an integer >= 1")
        if self.ray.address is None and n + 1 > self.ray.num_cpus:
            raise ValueError(
                f"num_storage_units={n} needs {n + 1} Ray CPUs (one per storage unit plus the "
                f"controller) but num_cpus={self.ray.num_cpus}: TransferQueue would wait "
                f"forever for them; raise num_cpus to at least {n + 1} (logical CPUs, not cores)"
            )


class _State:
    lock = threading.Lock()
    refs = 0
    settings: TQSettings | None = None
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
        return ray_module().get_actor(_CONTROLLER[0], namespace=_CONTROLLER[1])
    except ValueError:
        return None


def acquire_tq(settings: TQSettings) -> Any:
    """Start or attach to TransferQueue (module docstring); returns the catalog actor.

    Raises:
        ValueError: held already in this process with other settings, or the cluster lacks
            the CPUs TransferQueue reserves.
        ImportError: the ``[tq]`` extra is missing.
    """
    tq = tq_module()
    with _State.lock:
        if _State.refs > 0:
            if settings != _State.settings:
                raise ValueError(
                    f"TransferQueue is already held in this process with {_State.settings}; "
                    f"got {settings}. Give every TransferQueueReplayStore the same settings."
                )
            _State.refs += 1
            return _State.catalog
        acquire_ray(settings.ray)
        try:
            _start(tq, settings)
        except BaseException:
            _stop(tq)
            release_ray()
            raise
        _State.settings, _State.refs = settings, 1
        return _State.catalog


def _start(tq: Any, settings: TQSettings) -> None:
    ray = ray_module()
    if tq_controller() is None:
        free = ray.available_resources().get("CPU", 0)
        need = settings.num_storage_units + 1
        if free < need:
            raise ValueError(
                f"TransferQueue needs {need} free Ray CPUs (controller + {need - 1} storage "
                f"units) but the cluster has {free:g}; lower num_storage_units or give Ray more "
                "CPUs (logical CPUs, not cores)"
            )
        _State.started_tq = True
        tq.init({"backend": {"SimpleStorage": {"num_data_storage_units": need - 1}}})
    else:
        tq.init()  # attaches a client to the running controller and storage
    _State.catalog = _get_catalog(ray)


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


def _stop(tq: Any) -> None:
    """Stop what was started here; detach from the rest."""
    ray = ray_module()
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
        _State.settings = None
        try:
            _stop(tq_module())
        finally:
            release_ray()
