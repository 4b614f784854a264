"""A run directory belongs to one run: the lock, the "already holds a run" rule, ``last``.

The rule (docs/guides/run-directories.md): ``<default_root_dir>`` holds the checkpoints
of one run. ``lppo fit`` without ``--ckpt_path`` into a directory whose ``checkpoints/``
already holds checkpoints is refused (resume it, pick another directory, or pass
``--trainer.overwrite true`` to delete them first); so ``--ckpt_path last`` always means the
latest checkpoint of the run being resumed. ``--ckpt_path last`` without a checkpoint is an
error naming the folder; ``--ckpt_path auto`` resumes when ``last.ckpt`` exists and starts a
fresh run otherwise. A run resumed from a named file continues in the directory given, and its
checkpoints replace the ones there of the same name (``last.ckpt`` is never versioned).

While a run is in progress its directory is locked (an advisory ``flock`` on the directory
itself and on ``<root>/.lppo.lock``, which names the holder; the kernel drops both when the
process dies, even by ``kill -9``): a second ``lppo fit`` into it is refused with the process
holding it, even after ``.lppo.lock`` was deleted.
"""

from __future__ import annotations

import fcntl
import glob
import os
import shutil
import socket
import sys
import time
from typing import IO, Literal

from lppo.errors import SetupError
from lppo.run.checkpointing import CheckpointError

__all__ = ["RunDirectory", "RunDirectoryError", "is_launching_rank_zero"]

LOCK_NAME = ".lppo.lock"
#: ``--ckpt_path`` value that resumes when a checkpoint exists and starts fresh otherwise.
AUTO = "auto"
LAST = "last"


class RunDirectoryError(SetupError):
    """The run directory cannot be used by this run (in use, or holding another run)."""


def is_launching_rank_zero() -> bool:
    """Whether this process is the one that owns the run directory.

    Decided from the launcher's environment before any process group exists: a process that
    torchrun, SLURM or Lightning's own launcher started as another rank is not.
    """
    names = ("RANK", "SLURM_PROCID", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK")
    return all(os.environ.get(name, "0") == "0" for name in names)


class RunDirectory:
    """The run directory ``root`` and its checkpoint folder ``checkpoints``.

    Args:
        root: ``trainer.default_root_dir``.
        checkpoints: the iteration checkpoints' folder (``None`` without checkpointing).
    """

    def __init__(self, root: str, checkpoints: str | None) -> None:
        self.root = os.path.realpath(root)
        self.checkpoints = os.path.realpath(checkpoints) if checkpoints else None
        self._lock: IO[str] | None = None
        self._directory_lock: int | None = None

    # ------------------------------------------------------------------ lock
    def lock(self) -> None:
        """Take the directory's lock for this process, or refuse naming its holder.

        Two ``flock``s, both held for the whole run: one on the directory itself (it cannot be
        deleted from under the run, unlike a file: a run whose ``.lppo.lock`` was deleted
        still holds it) and one on ``.lppo.lock``, which also names the holder (and is the
        lock where a file system refuses to lock a directory, e.g. NFS).

        Raises:
            RunDirectoryError: another live process holds the lock.
        """
        os.makedirs(self.root, exist_ok=True)
        directory = _lock_directory(self.root)
        if directory is False:
            raise self._in_use()
        handle = open(os.path.join(self.root, LOCK_NAME), "a+")  # held open (and locked)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            if directory is not None:
                os.close(directory)
            raise self._in_use() from None
        handle.seek(0)
        handle.truncate()
        argv = " ".join(sys.argv)[:200]
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        handle.write(f"pid {os.getpid()} on {socket.gethostname()} ({argv}), since {started}\n")
        handle.flush()
        self._lock, self._directory_lock = handle, directory

    def _in_use(self) -> RunDirectoryError:
        """The refusal, naming the holder as its ``.lppo.lock`` says (when it still exists)."""
        try:
            with open(os.path.join(self.root, LOCK_NAME)) as info:
                holder = info.read().strip()
        except OSError:
            holder = ""
        holder = holder or f"another process (its {LOCK_NAME} was deleted)"
        return RunDirectoryError(
            f"run directory {self.root!r} is in use by {holder}; wait for that run to end "
            "(or stop it), or choose another --trainer.default_root_dir."
        )

    def unlock(self) -> None:
        """Release the lock (also released by the kernel when the process ends)."""
        if self._lock is not None:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()
            self._lock = None
        if self._directory_lock is not None:
            os.close(self._directory_lock)  # closing the last descriptor drops its flock
            self._directory_lock = None

    # ------------------------------------------------------------------ checkpoints
    def existing_checkpoints(self) -> list[str]:
        """The checkpoint files already in the checkpoint folder, sorted."""
        if self.checkpoints is None:
            return []
        return sorted(glob.glob(os.path.join(glob.escape(self.checkpoints), "*.ckpt")))

    def latest(self) -> str | None:
        """``last.ckpt``, else the newest other checkpoint of the folder (``None``: none).

        A run killed inside its first ``last.ckpt`` write (atomic: the file never appears
        half written) has only the iteration checkpoint written just before it; that one is
        the run's latest, so ``last`` and ``auto`` resume from it instead of stranding the run.
        """
        if self.checkpoints is None:
            return None
        last = os.path.join(self.checkpoints, "last.ckpt")
        others = [p for p in self.existing_checkpoints() if os.path.basename(p) != "last.ckpt"]
        if os.path.isfile(last) or not others:
            return last
        return max(others, key=os.path.getmtime)

    def resolve(self, ckpt_path: str | None, overwrite: bool) -> str | None:
        """Apply the run-directory rule; returns the checkpoint to resume from (or ``None``).

        Args:
            ckpt_path: ``--ckpt_path`` as given: ``None``, ``"last"``, ``"auto"`` or a file.
            overwrite: delete the checkpoints of an earlier run instead of refusing.

        Raises:
            CheckpointError: ``last`` without a checkpoint in the folder.
            RunDirectoryError: a fresh run into a directory holding a run's checkpoints.
        """
        last = self.latest()
        if ckpt_path == AUTO:
            ckpt_path = LAST if last and os.path.isfile(last) else None
        if ckpt_path == LAST:
            if last is None or not os.path.isfile(last):
                raise CheckpointError(
                    f"--ckpt_path last: no last.ckpt in {self.checkpoints or self.root!r}. "
                    "Check --trainer.default_root_dir, start a fresh run without --ckpt_path, "
                    "or pass --ckpt_path auto to resume when a checkpoint exists."
                )
            if os.path.basename(last) != "last.ckpt":
                print(f"lppo: no last.ckpt in {self.checkpoints}; resuming from {last}", flush=True)
            return last
        if ckpt_path is not None:  # a named file: the user chose what this run continues
            return os.fspath(ckpt_path)
        existing = self.existing_checkpoints()
        if existing and not overwrite:
            names = ", ".join(os.path.basename(p) for p in existing[:4])
            raise RunDirectoryError(
                f"run directory {self.root!r} already holds a run ({names} in "
                f"{self.checkpoints}); a fresh run there would mix two runs' checkpoints. "
                "Resume it with --ckpt_path last, choose another --trainer.default_root_dir, "
                "or pass --trainer.overwrite true to delete its checkpoints first."
            )
        if overwrite:
            self._clear()
        return None

    def _clear(self) -> None:
        """Delete the earlier runs' checkpoints, metrics, summary and curve (``overwrite``).

        Also the ``version_*`` folders of earlier runs that failed before any checkpoint.
        What is deleted is printed first, so nothing goes without a word.
        """
        folders = sorted(glob.glob(os.path.join(glob.escape(self.root), "version_*")))
        if self.checkpoints is not None and os.path.isdir(self.checkpoints):
            folders.insert(0, self.checkpoints)
        files = [os.path.join(self.root, n) for n in ("summary.json", "reward_curve.png")]
        files = [path for path in files if os.path.isfile(path)]
        if not folders and not files:
            return
        what = [f"{os.path.basename(f)}/ ({_count_files(f)} files)" for f in folders]
        what += [os.path.basename(path) for path in files]
        print(f"lppo: --trainer.overwrite true: deleting in {self.root}: {', '.join(what)}")
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
        for path in files:
            os.remove(path)


def _count_files(folder: str) -> int:
    return sum(len(names) for _, _, names in os.walk(folder))


def _lock_directory(root: str) -> int | Literal[False] | None:
    """``flock`` the directory ``root`` itself: its descriptor, held for the run.

    Returns:
        The descriptor; ``False`` when another process holds the lock; ``None`` where the
        file system cannot lock a directory (NFS emulates ``flock`` with write locks, which a
        directory opened read-only cannot take): the ``.lppo.lock`` file's lock stands alone.
    """
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    except OSError:  # EBADF / ENOLCK / EOPNOTSUPP: no directory locks here
        os.close(fd)
        return None
    return fd
