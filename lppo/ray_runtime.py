"""The one owner of Ray in an lppo process: start a local Ray on loopback, or attach to one.

Every lppo component that needs Ray (the TransferQueue replay store, Ray rollout workers) calls
:func:`acquire_ray` with its :class:`RaySettings` and :func:`release_ray` when done. The first
acquire decides: with ``address=None`` it starts a local single-node Ray bound to ``127.0.0.1``
(nothing listens on other interfaces) with settings that work on a 2-CPU machine; with an
address it attaches to that running cluster as a driver. A Ray that was already initialized in
this process (by the user) is used as it is. The last release shuts down only what the first
acquire started: a local Ray started here is stopped (its GCS, raylet and workers with it); an
attached cluster is only disconnected from; a Ray the user initialized is left alone.

Needs the ``[tq]`` (or ``[ray]``) extra.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

__all__ = ["RaySettings", "acquire_ray", "ray_module", "ray_owned_here", "release_ray"]

LOOPBACK = "127.0.0.1"
# Environment Ray reads at start-up: no auth-token warning, no usage-stats upload attempt.
_RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


@dataclass(frozen=True)
class RaySettings:
    """How lppo gets a Ray cluster.

    Args:
        address: ``None`` starts a local Ray on loopback (``127.0.0.1``); ``"auto"`` or
            ``"HOST:PORT"`` attaches to a running cluster (``ray start --head`` elsewhere).
        num_cpus: logical CPUs of a local Ray (ignored when attaching). TransferQueue's
            controller and each storage unit reserve one; rollout workers reserve their own.
            Logical CPUs are a scheduling budget, not cores: 4 is fine on a 2-core machine.
        object_store_memory: bytes of Ray's shared-memory object store of a local Ray (rows
            travel over TransferQueue's own ZMQ channels, not the object store, so it is small).
        temp_dir: Ray's session directory root of a local Ray (``None``: Ray's default
            ``/tmp/ray``); give each concurrent user their own.
    """

    address: str | None = None
    num_cpus: int = 4
    object_store_memory: int = 256 * 2**20
    temp_dir: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.num_cpus, int) or self.num_cpus < 1:
            raise ValueError(f"num_cpus={self.num_cpus!r} must be an integer >= 1")
        if not isinstance(self.object_store_memory, int) or self.object_store_memory < 80 * 2**20:
            raise ValueError(
                f"object_store_memory={self.object_store_memory!r} must be an integer >= "
                f"{80 * 2**20} (80 MiB, Ray's minimum)"
            )
        if self.address is not None and not (isinstance(self.address, str) and self.address):
            raise ValueError(f"address={self.address!r} must be null, 'auto' or 'HOST:PORT'")


class _State:
    """Process-wide: how many holders, who started Ray, with which settings."""

    lock = threading.Lock()
    refs = 0
    owned = False  # ray.init was called by acquire_ray (so release_ray calls ray.shutdown)
    settings: RaySettings | None = None


def ray_module() -> Any:
    """Import Ray, or raise ``ImportError`` naming the extra that installs it."""
    try:
        import ray
    except ImportError as e:
        raise ImportError(
            "Ray is not installed; it comes with lppo's optional extra: "
            "pip install -c constraints.txt -e '.[tq]'"
        ) from e
    return ray


def acquire_ray(settings: RaySettings) -> None:
    """Start or attach to Ray as ``settings`` say (see the module docstring); count a holder.

    Raises:
        ValueError: Ray is already held in this process with different settings.
        ImportError: Ray is not installed.
    """
    ray = ray_module()
    with _State.lock:
        if _State.refs > 0:
            if _State.owned and settings != _State.settings:
                raise ValueError(
                    f"Ray is already running in this process with {_State.settings}; got "
                    f"{settings}. Give every lppo component the same Ray settings."
                )
            _State.refs += 1
            return
        if not ray.is_initialized():
            for key, value in _RAY_ENV.items():
                os.environ.setdefault(key, value)
            _init(ray, settings)
            _State.owned = True
        _State.settings, _State.refs = settings, 1


def _init(ray: Any, settings: RaySettings) -> None:
    if settings.address is not None:
        ray.init(**_init_kwargs(settings))
        return
    # Ray turns a node IP of 127.0.0.1 into the machine's reachable IP unless it runs in
    # single-machine mode; that switch is read from this private constant at call time, and
    # is restored at once (an attach later in this process must resolve the real IP).
    from ray._private import ray_constants

    saved, ray_constants.ENABLE_RAY_CLUSTER = ray_constants.ENABLE_RAY_CLUSTER, False
    try:
        ray.init(**_init_kwargs(settings))
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


def _init_kwargs(settings: RaySettings) -> dict[str, Any]:
    common: dict[str, Any] = {"log_to_driver": False, "configure_logging": False}
    if settings.address is not None:
        return {"address": settings.address, **common}
    kwargs: dict[str, Any] = {
        "address": "local",  # never join a cluster found through RAY_ADDRESS by accident
        "num_cpus": settings.num_cpus,
        "object_store_memory": settings.object_store_memory,
        "include_dashboard": False,
        "_node_ip_address": LOOPBACK,
        **common,
    }
    if settings.temp_dir is not None:
        os.makedirs(settings.temp_dir, exist_ok=True)
        kwargs["_temp_dir"] = settings.temp_dir
    return kwargs


def release_ray() -> None:
    """Drop a holder; the last one shuts down what :func:`acquire_ray` started (if anything).

    Extra releases (more than acquires) do nothing, so cleanup paths may call it freely.
    """
    ray = ray_module()
    with _State.lock:
        if _State.refs == 0:
            return
        _State.refs -= 1
        if _State.refs > 0:
            return
        owned, _State.owned, _State.settings = _State.owned, False, None
        if owned:
            ray.shutdown()


def ray_owned_here() -> bool:
    """Whether this process started (or attached) Ray through :func:`acquire_ray` and holds it."""
    return _State.owned and _State.refs > 0
