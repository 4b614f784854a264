"""Run as a script by :mod:`lppo.runtime.ray_runtime`: stop a local Ray whose lppo process died.

``python _ray_reaper.py PID RAY_DIR``: while process ``PID`` (the lppo process that started a
local Ray) lives, note every process of that Ray: its children started from Ray's package
directory ``RAY_DIR`` (GCS, raylet, monitors) and all their descendants (agents, workers,
actors). When ``PID`` is gone without shutting Ray down (``kill -9``), kill the noted ones still
running: Ray's own agents outlive a dead raylet for minutes, holding their ports. If instead
the raylet dies while ``PID`` lives, Ray ends ``PID`` from its C++ core (no Python error, no
cleanup), so this watcher writes the lppo error to the stderr it shares with ``PID`` first.
Imports only psutil (a dependency of Ray), never lppo or torch, so it starts in a blink.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import psutil

#: Seconds between looks at the lppo process and its Ray.
INTERVAL_S = 0.5


def _ray_processes(owner: psutil.Process, ray_dir: str) -> list[psutil.Process]:
    """``owner``'s Ray processes: children started from ``ray_dir`` and their descendants."""
    found = []
    for child in owner.children():
        try:
            if any(ray_dir in part for part in [child.exe(), *child.cmdline()]):
                found += [child, *child.children(recursive=True)]
        except psutil.Error:  # gone meanwhile, or not ours to read
            continue
    return found


def _name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.Error:
        return ""


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def log_dir(raylet: psutil.Process) -> str:
    """The raylet's log directory (read while it lives: a dead one's command line is gone)."""
    try:
        args = raylet.cmdline()
    except psutil.Error:
        args = []
    return next((a.split("=", 1)[1] for a in args if a.startswith("--log_dir=")), "")


def raylet_died(raylet: int, logs: str, pid: int) -> str:
    """The lppo error for raylet ``raylet`` (logging to ``logs``) dead under a live ``pid``."""
    return (
        f"lppo: RayError: the raylet (pid {raylet}) of the local Ray this lppo process "
        f"(pid {pid}) started has died, and Ray ends the process with it (the run stops here; "
        "resume from the last checkpoint). Check: the kernel log for the OOM killer (dmesg, "
        f"journalctl -k), the raylet's log {os.path.join(logs, 'raylet.out')}, and whether "
        "something else stopped Ray (ray stop, a kill of Ray's processes)."
    )


def main(pid: int, ray_dir: str) -> None:
    """Watch ``pid``'s Ray until ``pid`` is gone, then kill what of it still runs."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the lppo process's to handle
    try:
        owner = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    noted: dict[int, psutil.Process] = {}
    raylet: psutil.Process | None = None
    reported, logs = False, ""
    while _alive(owner):
        noted.update((p.pid, p) for p in _ray_processes(owner, ray_dir))
        if raylet is None:
            raylet = next((p for p in noted.values() if _name(p) == "raylet"), None)
            logs = "" if raylet is None else log_dir(raylet)
        elif not reported and not _alive(raylet) and _alive(owner):
            print(raylet_died(raylet.pid, logs, pid), file=sys.stderr, flush=True)
            reported = True
        time.sleep(INTERVAL_S)
    for proc in noted.values():
        try:
            if proc.is_running():  # the same process (psutil checks its start time)
                proc.kill()
        except psutil.NoSuchProcess:
            pass


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
