"""Process plumbing of the tool layer: the ToolBox worker, text cutting, dying with the parent."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import multiprocessing.forkserver
import os
import pickle
import signal
import sys
from collections.abc import Callable
from typing import Any

# prctl(2) option that asks the kernel to signal us when our parent dies (linux/prctl.h).
_PR_SET_PDEATHSIG = 1


def _load_prctl() -> Callable[..., int] | None:
    # Resolved once in the parent: dlopen in a child forked from a multi-threaded process can
    # deadlock on the loader lock, so the child only calls an already-resolved function.
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        return libc.prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()


def die_with_parent(parent_pid: int | None = None) -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux; no-op elsewhere).

    Args:
        parent_pid: the parent's pid seen before the fork; if the parent already died (we were
            re-parented meanwhile), exit at once instead of running orphaned.
    """
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)


def kill_group(pid: int) -> None:
    """SIGKILL the process group led by ``pid`` (the process itself if it leads none)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def truncate(text: str, limit: int, *, keep: str = "head") -> str:
    """Cut ``text`` to at most ``limit`` characters, saying how much was dropped.

    Args:
        text: the text to cut.
        limit: the most characters returned (the note included).
        keep: ``"head"`` keeps the beginning (program output), ``"tail"`` the end (a
            traceback's last lines say what went wrong).

    Returns:
        ``text`` itself when short enough, else its kept part and a ``[... N chars cut]`` note.
    """
    if len(text) <= limit:
        return text
    # The note's widest form (every char dropped) bounds its length, so the result fits.
    room = limit - len(f"[... {len(text)} chars cut]") - 1
    if room <= 0:
        return text[:limit] if keep == "head" else text[len(text) - limit :]
    note = f"[... {len(text) - room} chars cut]"
    if keep == "head":
        return f"{text[:room]}\n{note}"
    return f"{note}\n{text[len(text) - room :]}"


def to_text(value: Any) -> str:
    """A tool's return value as the text the model reads."""
    if isinstance(value, dict | list):
        try:
            return json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError):
            pass
    return str(value)


# -- the worker process --------------------------------------------------------------------------


def serve_tools(
    conn: multiprocessing.connection.Connection,
    sys_path: list[str],
    max_chars: int,
    blob: bytes,
) -> None:
    """Worker main loop: answer ``(name, arguments)`` requests with ``(ok, text)`` replies.

    The first message sent is ``(True, "")`` once the tools are loaded, or ``(False, why)``.
    """
    # Its own process group, so a timeout kills whatever the tool started, too.
    os.setsid()
    # Our parent is the fork server, which exits with the caller: a hung tool dies then too.
    die_with_parent()
    # The fork server kept the sys.path of the moment it started; the tools' modules may only
    # be importable with the caller's current one (pytest adds test folders, for instance).
    sys.path[:] = sys_path
    try:
        tools = pickle.loads(blob)
    except BaseException as e:  # the tools' modules may fail to import here
        conn.send((False, f"{type(e).__name__}: {e}"))
        return
    conn.send((True, ""))
    while True:
        try:
            name, arguments = conn.recv()
        except (EOFError, OSError):  # the caller closed the pipe or died
            return
        try:
            reply = (True, truncate(to_text(tools[name](**arguments)), max_chars))
        except BaseException as e:  # SystemExit from a tool must not end the worker either
            reply = (False, truncate(f"error: {type(e).__name__}: {e}", max_chars, keep="tail"))
        conn.send(reply)


def worker_context() -> multiprocessing.context.BaseContext:
    """The ``forkserver`` context, with this module preloaded in the server if it starts now.

    Not ``fork``: the caller is a large multi-threaded torch process. A fork server that
    imported lppo (and torch) once makes every worker start, and every restart after a
    timeout, a fork of a ready process: milliseconds instead of seconds of imports.
    """
    server = multiprocessing.forkserver._forkserver  # type: ignore[attr-defined]
    preload = list(getattr(server, "_preload_modules", ["__main__"]))
    if __name__ not in preload:
        multiprocessing.forkserver.set_forkserver_preload([*preload, __name__])
    return multiprocessing.get_context("forkserver")
