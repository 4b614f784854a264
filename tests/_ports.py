"""Rendezvous ports for the distributed runs the tests launch.

Lightning (and ``free_port``-style helpers) pick a free *ephemeral* port, close it, and bind
it again later in the launched process; under ``pytest -n 2`` the other worker's Ray,
TransferQueue and gloo processes take ephemeral ports in that gap (CI failed with
``EADDRINUSE`` on a TCPStore). Ports handed out here come from below Linux's ephemeral range
(32768-60999) and above Ray's worker ports (10002-19999), from a block of their own per xdist
worker, so no other process is given them by the kernel and the two workers never share one.
"""

from __future__ import annotations

import itertools
import os
import socket

_BASE, _BLOCK = 20000, 3000


def _worker_index() -> int:
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(name.removeprefix("gw") or 0) % 4


_offsets = itertools.count()


def next_port() -> int:
    """A port no earlier call in this process returned, bindable on 127.0.0.1 right now."""
    start = _BASE + _BLOCK * _worker_index()
    for _ in range(_BLOCK):
        port = start + next(_offsets) % _BLOCK
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {start}..{start + _BLOCK - 1}")
