"""Content digests of checkpoints, and the temporary files of their atomic writes.

Beside every checkpoint ``<path>`` lppo writes ``<path>.sha256``, one ``sha256sum`` line
(``<hex>  <basename>``, so ``sha256sum -c last.ckpt.sha256`` checks it from the folder). The
digest is computed while ``torch.save`` writes (:class:`HashingWriter`), never by reading a
large file back; a load compares it with the file's content
(:func:`lppo.run.checkpointing.verify_digest`), so a file changed after it was written is
refused instead of trained on.

A checkpoint and its digest are each written to ``<target>.tmp-lppo-<pid>`` and renamed into
place, the checkpoint first (:class:`lppo.run.checkpointing.AtomicCheckpointIO`). A writer
killed between the two renames leaves the new checkpoint, the old digest and the new digest's
temporary: :func:`remove_stale_temporaries` renames that temporary into place (it matches the
checkpoint) and deletes every other temporary of a gone writer, so after it no kill at any
instant leaves a checkpoint that disagrees with its digest.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
from typing import Any, BinaryIO

#: Marks the temporary file of an atomic write: ``<target>.tmp-lppo-<pid of the writer>``.
TMP_MARK = ".tmp-lppo-"
#: A checkpoint's digest file is ``<checkpoint><SUFFIX>``.
SUFFIX = ".sha256"
#: Read size when hashing a file that exists (a checkpoint can be many GB).
CHUNK = 1 << 20


class HashingWriter:
    """Forwards writes to ``file`` and hashes them (SHA-256) on the way.

    ``torch.save`` writes its zip archive strictly in order through ``write`` (it never seeks
    a file-like object), so the hash of the writes is the hash of the file written.

    Args:
        file: the open binary file the bytes go to.
    """

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        self.sha256 = hashlib.sha256()

    def write(self, data: Any) -> int:
        """Hash ``data`` (bytes or a memoryview), then write it to the file."""
        self.sha256.update(data)
        return self.file.write(data)

    def flush(self) -> None:
        """Flush the file."""
        self.file.flush()

    def hexdigest(self) -> str:
        """The SHA-256 of everything written so far, as hex."""
        return self.sha256.hexdigest()


def temporary(path: str) -> str:
    """The temporary file this process writes ``path`` through."""
    return f"{path}{TMP_MARK}{os.getpid()}"


def digest_path(path: str) -> str:
    """The digest file of the checkpoint ``path``."""
    return f"{path}{SUFFIX}"


def file_sha256(path: str) -> str:
    """The SHA-256 of the file ``path``, as hex, read in chunks."""
    sha256 = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            sha256.update(chunk)
    return sha256.hexdigest()


def write_digest_file(dest: str, hexdigest: str, name: str) -> None:
    """Write the ``sha256sum`` line of ``name`` to ``dest``, synced to disk.

    Synced before the caller renames anything into place: a rename must never publish a digest
    file whose content is still only in the page cache.
    """
    with open(dest, "w", encoding="utf-8") as f:
        f.write(f"{hexdigest}  {name}\n")
        f.flush()
        os.fsync(f.fileno())


def write_digest(path: str) -> str:
    """Compute the digest of the existing checkpoint ``path`` and write it beside it.

    For a file lppo did not write through :class:`~lppo.run.checkpointing.AtomicCheckpointIO`
    that should load: a checkpoint written before lppo wrote digests, one copied without its
    digest, or (in tests) one crafted or edited on purpose. Equivalent to
    ``sha256sum FILE > FILE.sha256`` in the file's folder.

    Returns:
        The digest (hex).
    """
    path = os.fspath(path)
    hexdigest = file_sha256(path)
    dest = digest_path(path)
    tmp = temporary(dest)
    try:
        write_digest_file(tmp, hexdigest, os.path.basename(path))
        os.replace(tmp, dest)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
    return hexdigest


def read_digest(path: str) -> str | None:
    """The digest recorded in the digest file ``path`` (``None``: there is no such file).

    The first word of its first line, lower-cased (``sha256sum`` writes lower case); whatever
    it holds, a comparison with a real digest tells whether it matches.
    """
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            words = f.readline().split()
    except FileNotFoundError:
        return None
    return words[0].lower() if words else ""


def remove_stale_temporaries(directory: str | None) -> list[str]:
    """Settle the temporary files interrupted checkpoint writes left in ``directory``.

    Only files whose writer (the pid in the name) is gone: a live process's file is a write
    in progress. A digest temporary matching its checkpoint's content is renamed into place
    (:func:`roll_forward`); every other one is deleted.

    Returns:
        The stale temporaries found (each now renamed or deleted).
    """
    if not directory or not os.path.isdir(directory):
        return []
    found = glob.glob(os.path.join(glob.escape(directory), f"*{TMP_MARK}*"))
    stale = [path for path in found if not writer_alive(path)]
    for path in stale:
        if not roll_forward(path):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
    return stale


def writer_alive(path: str) -> bool:
    """Whether the process that writes the temporary file ``path`` still runs."""
    pid = path.rsplit(TMP_MARK, 1)[1]
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def roll_forward(tmp: str, checkpoint_sha256: str | None = None) -> bool:
    """Rename the digest temporary ``tmp`` into place if it matches its checkpoint.

    Such a temporary is what a writer killed between renaming the checkpoint and renaming its
    digest leaves; one that does not match (killed before the checkpoint's rename: the
    checkpoint is still the previous one) is not renamed.

    Args:
        tmp: a temporary file of a gone writer.
        checkpoint_sha256: the checkpoint's digest when the caller has it (else computed).

    Returns:
        Whether ``tmp`` was renamed into place.
    """
    digest = tmp.rsplit(TMP_MARK, 1)[0]
    checkpoint = digest.removesuffix(SUFFIX)
    if checkpoint == digest or not os.path.isfile(checkpoint):
        return False
    recorded = read_digest(tmp)
    if recorded is None or recorded != (checkpoint_sha256 or file_sha256(checkpoint)):
        return False
    os.replace(tmp, digest)
    return True


def roll_forward_beside(path: str, checkpoint_sha256: str) -> bool:
    """Roll forward a gone writer's digest temporary of the checkpoint ``path`` (if any).

    What the next run's :func:`remove_stale_temporaries` would do, for a load that comes first
    (a ``--ckpt_path`` file checked at parse time, an export).

    Returns:
        Whether a digest temporary matching ``checkpoint_sha256`` was renamed into place.
    """
    pattern = glob.escape(digest_path(path)) + f"{TMP_MARK}*"
    stale = [tmp for tmp in glob.glob(pattern) if not writer_alive(tmp)]
    return any(roll_forward(tmp, checkpoint_sha256) for tmp in stale)
