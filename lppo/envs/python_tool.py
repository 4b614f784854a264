"""A Python execution tool: the policy's code runs jailed, in a fresh, limited process.

:func:`run_jailed` runs a program in a :class:`~lppo.envs.jail.Jail` (by default
:class:`~lppo.envs.jail.Bubblewrap`: no network, no view of the trainer's files, environment
or processes) in a new temporary working directory that is removed afterwards, with a
near-empty environment, stdin from ``/dev/null``, its own session and ``setrlimit`` caps on
address space, CPU seconds and file size. Output is read incrementally and only the first part
kept, so a printing loop cannot fill the caller's memory. Every process of the call is gone
when it returns. :func:`run_python` runs Python source that way (``python -I``: no user site,
no ``PYTHON*`` variables, no script folder on ``sys.path``).

Not covered: CPU time shared with the trainer, and kernel bugs (see :mod:`lppo.envs.jail`).
"""

from __future__ import annotations

import functools
import math
import os
import resource
import selectors
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from lppo.envs._process import die_with_parent, kill_group, truncate
from lppo.envs.jail import Bubblewrap, Jail
from lppo.validation import check_number

# Largest file the code may write (RLIMIT_FSIZE): keeps a runaway write from filling the disk.
FILE_SIZE_LIMIT_BYTES = 64 * 1024**2
# Python itself needs ~20 MB of address space to start.
MIN_MEMORY_MB = 64


@dataclass(frozen=True)
class ExecResult:
    """How a :func:`run_python` run ended.

    Attributes:
        stdout: what the code printed (cut to ``max_output_chars``, beginning kept).
        stderr: its error output (cut, end kept: a traceback's last line says what failed).
        exit_code: the process's exit status, negative for a signal (``-24``: CPU limit);
            ``None`` when it was stopped for running past the timeout.
        timed_out: it ran past ``timeout_s`` and its process group was killed.
        memory_exceeded: it raised ``MemoryError`` (the address-space limit).
    """

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    memory_exceeded: bool


def _limits(timeout_s: float, memory_mb: int) -> Any:
    """The ``preexec_fn`` that caps the child (runs in the child, between fork and exec)."""
    memory = memory_mb * 1024**2
    # CPU seconds: a backstop should the caller die before it can enforce the timeout.
    cpu = math.ceil(timeout_s) + 1
    parent = os.getpid()

    def apply() -> None:
        die_with_parent(parent)
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT_BYTES, FILE_SIZE_LIMIT_BYTES))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def _collect(
    proc: subprocess.Popen[bytes], timeout_s: float, keep: int
) -> tuple[bytes, bytes, bool]:
    """Read both pipes until they close or the deadline passes; keep ``keep`` bytes of each.

    Returns:
        ``(stdout, stderr, timed_out)``; on a timeout the process group is already killed.
    """
    deadline = time.monotonic() + timeout_s
    kept = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    with selectors.DefaultSelector() as selector:
        for pipe in kept:
            selector.register(pipe, selectors.EVENT_READ)  # type: ignore[arg-type]
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                kill_group(proc.pid)
                return bytes(kept[proc.stdout]), bytes(kept[proc.stderr]), True
            events = selector.select(min(left, 0.1))
            if not events and proc.poll() is not None:
                break  # the program ended; what still holds the pipes is a leftover child
            for key, _ in events:
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                buffer = kept[key.fileobj]  # type: ignore[index]
                # Read on but drop the excess, so the child never blocks on a full pipe.
                buffer += chunk[: max(0, keep - len(buffer))]
    try:  # pipes closed or the program ended; it may still run (it closed them itself)
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        return bytes(kept[proc.stdout]), bytes(kept[proc.stderr]), True
    return bytes(kept[proc.stdout]), bytes(kept[proc.stderr]), False


def run_jailed(
    argv: list[str],
    files: dict[str, str],
    jail: Jail | None = None,
    timeout_s: float = 5.0,
    memory_mb: int = 256,
    max_output_chars: int = 2000,
) -> ExecResult:
    """Run a program the policy wrote, jailed, and return what it printed.

    Args:
        argv: the program and its arguments, as the jail sees them (``jail.python`` names
            the interpreter; relative paths are in the working directory).
        files: text files written into the fresh working directory first (name -> content).
        jail: where it runs (``None``: :class:`~lppo.envs.jail.Bubblewrap`, built once).
        timeout_s: wall-clock seconds before every process of the call is killed.
        memory_mb: address-space limit in MiB (``MemoryError`` beyond it).
        max_output_chars: most characters kept of stdout and of stderr each.

    Returns:
        The run's :class:`ExecResult`. The working directory is already removed and every
        process the program started is killed.

    Raises:
        SettingError: for a bad ``timeout_s``, ``memory_mb`` or ``max_output_chars``.
    """
    _check(timeout_s, memory_mb, max_output_chars, "run_jailed")
    jail = jail if jail is not None else default_jail()
    with tempfile.TemporaryDirectory(prefix="lppo-tool-") as workdir:
        for name, content in files.items():
            with open(os.path.join(workdir, name), "w", encoding="utf-8") as f:
                f.write(content)
        proc = _start(jail, argv, workdir, timeout_s, memory_mb)
        try:
            # 4 bytes per char: enough UTF-8 for max_output_chars characters and the cut note.
            out, err, timed_out = _collect(proc, timeout_s, 4 * max_output_chars + 4096)
        finally:
            # Background children the code left behind die with it (same process group; a
            # jail's die with its first process, the jail's PID namespace ending).
            kill_group(proc.pid)
            proc.wait()
            for pipe in (proc.stdout, proc.stderr):
                pipe.close()  # type: ignore[union-attr]
    stdout = out.decode("utf-8", errors="replace")
    stderr = err.decode("utf-8", errors="replace")
    last = stderr.rstrip().rsplit("\n", 1)[-1]
    return ExecResult(
        stdout=truncate(stdout, max_output_chars),
        stderr=truncate(stderr, max_output_chars, keep="tail"),
        exit_code=None if timed_out else proc.returncode,
        timed_out=timed_out,
        memory_exceeded=last.startswith("MemoryError"),
    )


def _start(
    jail: Jail, argv: list[str], workdir: str, timeout_s: float, memory_mb: int
) -> subprocess.Popen[bytes]:
    """Start ``argv`` in ``jail`` from ``workdir``: a near-empty environment, own session."""
    env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}
    return subprocess.Popen(
        jail.wrap(argv, workdir, env),
        cwd=workdir,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=_limits(timeout_s, memory_mb),  # setrlimit must run in the child
    )


def run_python(
    code: str,
    timeout_s: float = 5.0,
    memory_mb: int = 256,
    max_output_chars: int = 2000,
    jail: Jail | None = None,
) -> ExecResult:
    """Run Python source with :func:`run_jailed` (``python -I main.py``); see its arguments."""
    _check(timeout_s, memory_mb, max_output_chars, "run_python")
    jail = jail if jail is not None else default_jail()
    return run_jailed(
        [jail.python, "-I", "main.py"], {"main.py": code}, jail, timeout_s, memory_mb,
        max_output_chars,
    )  # fmt: skip


@functools.cache
def default_jail() -> Jail:
    """The :class:`~lppo.envs.jail.Bubblewrap` jail with its defaults, checked once."""
    return Bubblewrap()


def _check(timeout_s: float, memory_mb: int, max_output_chars: int, key_prefix: str) -> None:
    check_number(
        f"{key_prefix}.timeout_s", timeout_s, low=0, low_open=True,
        fix="Wall-clock seconds one run may take; 5 is typical.",
    )  # fmt: skip
    check_number(
        f"{key_prefix}.memory_mb", memory_mb, integer=True, low=MIN_MEMORY_MB,
        fix=f"Address-space limit in MiB; Python needs at least {MIN_MEMORY_MB}, 256 is typical.",
    )  # fmt: skip
    check_number(
        f"{key_prefix}.max_output_chars", max_output_chars, integer=True, low=64,
        fix="Characters of output the model reads back; 2000 is typical.",
    )  # fmt: skip


class PythonTool:
    """The ``python`` tool: runs the policy's code with :func:`run_python` limits.

    Picklable, so it can sit in a :class:`~lppo.envs.tools.ToolBox`. Inside one, keep
    ``timeout_s`` below the box's ``timeout_s``: this tool then reports its own timeouts and
    the box's worker survives (the box refuses the opposite at construction).

    Args:
        timeout_s: wall-clock seconds one run may take.
        memory_mb: address-space limit in MiB.
        max_output_chars: most characters of stdout (and of stderr) returned.
        key_prefix: the settings key of this tool, for error messages.
        jail: where the code runs (:mod:`lppo.envs.jail`; ``null``:
            :class:`~lppo.envs.jail.Bubblewrap` with its defaults). Running it unjailed takes
            ``{class_path: lppo.envs.Unjailed}``, named on purpose.

    Raises:
        SettingError: for a bad number.
        JailError: the jail cannot run here (checked at once, before any iteration).
    """

    name = "python"

    def __init__(
        self,
        timeout_s: float = 5.0,
        memory_mb: int = 256,
        max_output_chars: int = 2000,
        key_prefix: str = "python",
        jail: Jail | None = None,
    ) -> None:
        _check(timeout_s, memory_mb, max_output_chars, key_prefix)
        self.timeout_s = float(timeout_s)
        self.memory_mb = int(memory_mb)
        self.max_output_chars = int(max_output_chars)
        self.jail = jail if jail is not None else default_jail()

    @property
    def schema(self) -> dict[str, Any]:
        """The tool's JSON schema for ``apply_chat_template(tools=...)``."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": (
                    "Run a Python 3 program in a fresh process and return what it prints. "
                    "Nothing persists between calls: print every value you need. Limits: "
                    f"{self.timeout_s:g} s, {self.memory_mb} MB of memory."
                ),
                "parameters": {
                    "type": "object",
                    "properties": {"code": {"type": "string", "description": "the program"}},
                    "required": ["code"],
                },
            },
        }

    def __call__(self, code: str) -> str:
        """Run ``code``; its stdout, then stderr and a note on a timeout or memory error.

        Args:
            code: the program.

        Returns:
            The text the model reads: ``"(no output)"`` when the program printed nothing.
        """
        result = run_python(code, self.timeout_s, self.memory_mb, self.max_output_chars, self.jail)
        parts = [p for p in (result.stdout.rstrip("\n"), result.stderr.rstrip("\n")) if p]
        if result.timed_out:
            parts.append(f"error: timed out after {self.timeout_s:g} s; the program was stopped")
        elif result.memory_exceeded:
            parts.append(f"error: memory limit of {self.memory_mb} MB exceeded")
        elif result.exit_code and not result.stderr:
            parts.append(f"exit code {result.exit_code}")
        return "\n".join(parts) if parts else "(no output)"
