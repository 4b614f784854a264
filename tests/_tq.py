"""One Ray + TransferQueue for the whole test session (starting them costs 20-40 s here).

The first :func:`tq_store` configures lppo's Ray as :data:`RAY` (own ``_temp_dir``), starts a
local Ray on loopback and TransferQueue through lppo's own runtime and holds them; every store
made here (and every fit given the same Ray settings, :data:`RAY` / :data:`RAY_ARGS`) shares
them. ``tests/conftest.py`` releases the hold when the session ends, which stops them.
"""

from __future__ import annotations

import os
import tempfile

from lppo.replay import TransferQueueReplayStore
from lppo.replay._tq_runtime import acquire_tq, release_tq
from lppo.runtime.ray_runtime import RaySettings, configure_ray

TEMP_DIR = os.path.join(tempfile.gettempdir(), f"lppo-tests-{os.getpid()}")
#: The session's Ray settings (``trainer.ray`` of every fit that runs on the session's Ray).
RAY = RaySettings(num_cpus=4, temp_dir=TEMP_DIR)
RAY_ARGS = ["--trainer.ray.num_cpus", "4", "--trainer.ray.temp_dir", TEMP_DIR]
_held: list[bool] = []


def start() -> None:
    """Configure lppo's Ray as :data:`RAY`; start Ray + TransferQueue once per session."""
    configure_ray(RAY)
    if not _held:
        acquire_tq(num_storage_units=1)
        _held.append(True)


def tq_store(**kwargs) -> TransferQueueReplayStore:
    """A fresh store (own partition) on the session's TransferQueue."""
    start()
    return TransferQueueReplayStore(**kwargs)


def shutdown() -> None:
    if _held:
        _held.clear()
        release_tq()


def ray_processes() -> dict[int, str]:
    """This process's live descendants, ``pid -> name``: a Ray started here is all of them
    (GCS, raylet, agents, and every worker and actor, which the raylet spawns)."""
    import psutil

    found = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                found[proc.pid] = proc.name()
        except psutil.NoSuchProcess:
            pass
    return found


def listening_addresses() -> set[str]:
    """IP addresses the descendants of this process listen on (TCP)."""
    import psutil

    out = set()
    for proc in psutil.Process().children(recursive=True):
        try:
            conns = proc.net_connections("inet")
        except psutil.NoSuchProcess:
            continue
        out |= {c.laddr.ip.removeprefix("::ffff:") for c in conns if c.status == "LISTEN"}
    return out
