"""The one owner of Ray in an lppo process: start a local Ray on loopback, or attach to one.

How this process gets Ray is one settings group, :class:`RaySettings`, set at one key,
``trainer.ray`` (:class:`lppo.run.trainer.PPOTrainer`'s ``ray`` argument), and applied by
:func:`configure_ray` before any component needs Ray. Every lppo component that needs Ray (the
TransferQueue replay store, Ray rollout workers) calls :func:`acquire_ray` and
:func:`release_ray` when done; none of them has Ray settings of its own. The first acquire
decides: with ``address=None`` it starts a local single-node Ray bound to ``127.0.0.1``
(nothing listens on other interfaces) with settings that work on a 2-CPU machine; with an
address it attaches to that running cluster as a driver. A Ray that was already initialized in
this process (by the user) is used as it is. The last release shuts down only what the first
acquire started: a local Ray started here is stopped (its GCS, raylet and workers with it); an
attached cluster is only disconnected from; a Ray the user initialized is left alone. A local
Ray started here is watched by a small process of its own (``lppo/runtime/_ray_reaper.py``): if this
process dies without stopping Ray (``kill -9``), the watcher kills what is left of that Ray
(Ray's agents would otherwise outlive it for minutes, holding their ports), and if the raylet
dies under a live process (Ray then ends the process from its C++ core, beyond Python's reach)
it writes lppo's error, naming Ray and what to check, to the process's stderr.

Needs Ray: the ``[ray]`` extra (rollout workers) or the ``[tq]`` extra (TransferQueue).
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

from lppo.validation import SettingError, check_number

__all__ = [
    "RaySettings",
    "acquire_ray",
    "cluster_address",
    "configure_ray",
    "configured_ray",
    "local_ray_cpus",
    "ray_module",
    "ray_owned_here",
    "release_ray",
]

LOOPBACK = "127.0.0.1"
#: The config key of :class:`RaySettings` (every message names its fields under it).
KEY = "trainer.ray"
# Environment Ray reads at start-up: no auth-token warning, no usage-stats upload attempt.
_RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
_MIN_OBJECT_STORE = 80 * 2**20  # Ray's minimum


@dataclass(frozen=True)
class RaySettings:
    """How lppo gets a Ray cluster (one group for every component that uses Ray).

    Args:
        address: ``null`` starts a local Ray on loopback (``127.0.0.1``); ``"auto"`` or
            ``"HOST:PORT"`` attaches to a running cluster (``ray start --head`` elsewhere, or
            ``127.0.0.1:PORT`` for one on this machine's loopback).
        num_cpus: logical CPUs of a local Ray (ignored when attaching). TransferQueue's
            controller and each storage unit reserve one, and so does each rollout worker.
            Logical CPUs are a scheduling budget, not cores: 4 is fine on a 2-core machine.
        object_store_memory: bytes of the shared-memory object store of a local Ray (rows
            travel over TransferQueue's own ZMQ channels, not the object store, so it is small).
        temp_dir: session directory root of a local Ray (``null``: Ray's default
            ``/tmp/ray``); give each concurrent user their own.
    """

    address: str | None = None
    num_cpus: int = 4
    object_store_memory: int = 256 * 2**20
    temp_dir: str | None = None

    def __post_init__(self) -> None:
        """Raise ``SettingError`` naming the key, the value and the fix for a bad setting."""
        check_number(
            f"{KEY}.num_cpus",
            self.num_cpus,
            integer=True,
            low=1,
            fix="Logical CPUs, not cores: one per TransferQueue service and rollout worker.",
        )
        check_number(
            f"{KEY}.object_store_memory",
            self.object_store_memory,
            integer=True,
            low=_MIN_OBJECT_STORE,
            fix="Ray needs at least 80 MiB.",
        )
        if self.address is not None and not (isinstance(self.address, str) and self.address):
            raise SettingError(
                f"{KEY}.address={self.address!r}: use null (a local Ray), 'auto' or 'HOST:PORT'."
            )


class _State:
    """Process-wide: the configured settings, how many holders, who started Ray."""

    lock = threading.Lock()
    configured = RaySettings()
    refs = 0
    owned = False  # ray.init was called by acquire_ray (so release_ray calls ray.shutdown)
    held: RaySettings | None = None  # the settings Ray was acquired with
    reaper: subprocess.Popen | None = None  # watches a local Ray started here (module doc)


def ray_module(extra: Literal["ray", "tq"] = "ray") -> Any:
    """Import Ray, or raise ``ImportError`` naming ``extra``, the extra of the caller."""
    try:
        import ray
    except ImportError as e:
        needs = "Ray rollout workers need" if extra == "ray" else "TransferQueue needs"
        raise ImportError(
            f"Ray is not installed; {needs} it: install lppo's optional extra with  "
            f"pip install -c constraints.txt -e '.[{extra}]'"
        ) from e
    return ray


def configure_ray(settings: RaySettings) -> None:
    """Make ``settings`` the way this process gets Ray from now on (``trainer.ray``)."""
    with _State.lock:
        _State.configured = settings


def configured_ray() -> RaySettings:
    """The settings the next :func:`acquire_ray` uses."""
    return _State.configured


def acquire_ray(extra: Literal["ray", "tq"] = "ray") -> None:
    """Start or attach to Ray as configured (see the module docstring); count a holder.

    Args:
        extra: the caller's optional extra, named when Ray is missing.

    Raises:
        ValueError: Ray is already held in this process with other settings.
        ImportError: Ray is not installed.
    """
    ray = ray_module(extra)
    with _State.lock:
        settings = _State.configured
        if _State.refs > 0:
            if _State.owned and settings != _State.held:
                raise ValueError(
                    f"{KEY}={settings} but Ray is already running in this process with "
                    f"{_State.held}; one process has one Ray: use the same {KEY} settings."
                )
            _State.refs += 1
            return
        if not ray.is_initialized():
            for key, value in _RAY_ENV.items():
                os.environ.setdefault(key, value)
            _init(ray, settings)
            _State.owned = True
        _State.held, _State.refs = settings, 1


def _is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@contextmanager
def _single_machine() -> Any:
    """Keep ``127.0.0.1`` as it is while Ray starts or connects.

    Ray turns a node IP or a cluster address of 127.0.0.1 into the machine's reachable IP
    (where nothing of a loopback cluster listens) unless it runs in single-machine mode; that
    switch is read from this private constant at call time, and is restored at once (an
    attach later in this process to a real cluster must resolve the real IP).
    """
    from ray._private import ray_constants

    saved, ray_constants.ENABLE_RAY_CLUSTER = ray_constants.ENABLE_RAY_CLUSTER, False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


def _init(ray: Any, settings: RaySettings) -> None:
    with _keep_signal_handlers():
        if settings.address is not None and not _is_loopback(settings.address):
            ray.init(**_init_kwargs(settings))
            return
        _start_local(ray, settings)


@contextmanager
def _keep_signal_handlers() -> Iterator[None]:
    """Keep this process's SIGTERM / SIGINT handlers through ``ray.init``.

    ``ray.init`` makes SIGTERM exit the driver at once (``sys.exit(15)``); a run started
    Ray in the middle of an iteration would then skip lppo's interrupt handling
    (:mod:`lppo.run.interrupts`).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


def _start_local(ray: Any, settings: RaySettings) -> None:
    """``ray.init`` of a local Ray on loopback, watched (:mod:`lppo.runtime._ray_reaper`)."""
    with _single_machine():
        ray.init(**_init_kwargs(settings))
    if settings.address is None:
        _State.reaper = _start_reaper(ray)
        # Before Ray's own exit handler (registered earlier, run later): a Ray stopped at exit
        # is no dead raylet to report.
        atexit.register(_stop_reaper)


def _start_reaper(ray: Any) -> subprocess.Popen:
    """The watcher that kills this local Ray if this process dies without stopping it."""
    script = os.path.join(os.path.dirname(__file__), "_ray_reaper.py")
    ray_dir = os.path.dirname(ray.__file__)
    # Its own session: a signal to this process's group (Ctrl-C) must not stop the watcher.
    return subprocess.Popen(
        [sys.executable, script, str(os.getpid()), ray_dir],
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


def _stop_reaper() -> None:
    reaper, _State.reaper = _State.reaper, None
    if reaper is not None:
        reaper.terminate()
        reaper.wait()


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


def cluster_address() -> str:
    """``HOST:PORT`` of the cluster this process holds (for other processes to attach)."""
    return str(ray_module().get_runtime_context().gcs_address)


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
        owned, _State.owned, _State.held = _State.owned, False, None
        if owned:
            _stop_reaper()  # first: the raylet stopping now is no death to report
            ray.shutdown()


def local_ray_cpus(settings: RaySettings | None) -> int | None:
    """The logical CPUs of the local Ray the first :func:`acquire_ray` will start.

    Args:
        settings: ``trainer.ray`` (``None``: the default settings).

    Returns:
        ``settings.num_cpus``; ``None`` when no Ray will start here with them: an address
        (only the cluster knows its CPUs), or Ray already running in this process.
    """
    settings = settings if settings is not None else RaySettings()
    ray = sys.modules.get("ray")
    if settings.address is not None or _State.refs or (ray is not None and ray.is_initialized()):
        return None
    return settings.num_cpus


def ray_owned_here() -> bool:
    """Whether this process started (or attached) Ray through :func:`acquire_ray` and holds it."""
    return _State.owned and _State.refs > 0
