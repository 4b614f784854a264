"""Tool calls in the Hugging Face / Hermes convention, and a :class:`ToolBox` that runs them.

The policy asks for a tool by writing ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
in its turn (the Hermes / Qwen convention that ``tokenizer.apply_chat_template(tools=...)``
templates render). :func:`parse_tool_calls` reads those blocks back, :func:`format_tool_call`
writes one, :func:`tool_schema` describes a Python function for the chat template, and
:class:`ToolBox` runs the calls in a separate worker process with a timeout, turning every
failure (unknown tool, bad arguments, an exception, a hang) into a :class:`ToolResult` the
model reads back instead of an exception in the trainer.
"""

from __future__ import annotations

import inspect
import json
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import pickle
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lppo.envs._process import kill_group, serve_tools, worker_context
from lppo.envs._tool_schema import tool_name, tool_schema  # public here too
from lppo.validation import SettingError, check_number

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
# Seconds a (re)started worker may take to import the tools' modules before it counts as
# broken; separate from the per-call timeout, which must not pay for imports.
WORKER_START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class ToolCall:
    """One call the policy asked for.

    Attributes:
        name: the tool's name (``"python"``, ``"add"``).
        arguments: keyword arguments, JSON values keyed by parameter name.
    """

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ToolResult:
    """What a tool call gave back, as the text the model reads.

    Attributes:
        name: the tool that was called (as the policy spelled it).
        content: the tool's return value as text, or an error message the model can learn from
            (``"error: no tool named 'foo'; available: add, python"``).
        error: the call failed (unknown tool, bad arguments, an exception, a timeout).
        timed_out: the call ran past the :class:`ToolBox` timeout and was stopped.
    """

    name: str
    content: str
    error: bool = False
    timed_out: bool = False


# -- the Hermes text format --------------------------------------------------------------------


def call_from_json(obj: Any, arguments_key: str = "arguments") -> ToolCall | str:
    """A decoded JSON value as a :class:`ToolCall`, or why it is not one (every format's rule).

    The value is an object with a non-empty string ``"name"`` and an object under
    ``arguments_key`` (or ``"arguments"``; missing: no arguments). Arguments written as a JSON
    string holding the object (OpenAI style) and an OpenAI-style
    ``{"type": "function", "function": {...}}`` wrapper are read too.
    """
    if isinstance(obj, dict) and isinstance(obj.get("function"), dict):
        obj = obj["function"]
    if not isinstance(obj, dict):
        return f"a tool call must be a JSON object, got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return f'a tool call needs a non-empty string "name", got {name!r}'
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            return f'"{arguments_key}" of {name!r} is a string but not JSON: {e.msg}'
    if not isinstance(arguments, dict):
        kind = type(arguments).__name__
        return f'"{arguments_key}" of {name!r} must be a JSON object, got {kind}'
    return ToolCall(name=name, arguments=arguments)


def _parse_block(body: str) -> ToolCall | str:
    """One ``<tool_call>`` body as a :class:`ToolCall`, or why it is not one."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return f"invalid JSON in <tool_call>: {e.msg} at char {e.pos}: {body.strip()[:80]!r}"
    return call_from_json(obj)


def parse_tool_calls(text: str) -> tuple[list[ToolCall], list[str]]:
    """Read every ``<tool_call>{json}</tool_call>`` block of a policy turn.

    Each block holds a JSON object with a string ``"name"`` and an object ``"arguments"``
    (a JSON string holding an object is accepted too; a missing ``"arguments"`` means no
    arguments). Whitespace around the JSON is allowed; text outside blocks is ignored.

    Args:
        text: the decoded policy turn.

    Returns:
        ``(calls, errors)``: the well-formed calls in order, and one human-readable message per
        malformed block (invalid JSON, missing or non-string name, arguments not an object, a
        ``<tool_call>`` never closed). Nothing raises.
    """
    calls: list[ToolCall] = []
    errors: list[str] = []
    pos = text.find(TOOL_CALL_OPEN)
    while pos != -1:
        start = pos + len(TOOL_CALL_OPEN)
        close = text.find(TOOL_CALL_CLOSE, start)
        reopen = text.find(TOOL_CALL_OPEN, start)
        # A block that another <tool_call> interrupts was never closed either.
        if close == -1 or (reopen != -1 and reopen < close):
            errors.append(f"<tool_call> at char {pos} is never closed by {TOOL_CALL_CLOSE}")
            pos = reopen
            continue
        parsed = _parse_block(text[start:close])
        (calls if isinstance(parsed, ToolCall) else errors).append(parsed)  # type: ignore[arg-type]
        pos = text.find(TOOL_CALL_OPEN, close + len(TOOL_CALL_CLOSE))
    return calls, errors


def format_tool_call(call: ToolCall) -> str:
    r"""The Hermes text of one call, byte for byte what :data:`HERMES_CHATML` renders.

    Args:
        call: the call.

    Returns:
        ``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>``.
    """
    # ensure_ascii=False and the default separators: what transformers' ``tojson`` filter writes.
    body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


class ToolBox:
    """Runs tool calls for many episodes in one long-lived worker process.

    The worker starts on the first call (or :meth:`start`), from a ``forkserver`` so nothing a
    tool does touches the caller's state. A call that runs past ``timeout_s`` kills the worker's
    whole process group and gives a ``timed_out`` result; a worker that dies gives an error
    result; either way the next call starts a fresh worker. Calls are serialised (one worker);
    :meth:`call` is thread-safe.

    A tool with its own ``timeout_s`` (:class:`~lppo.envs.python_tool.PythonTool`) must use one
    below the box's, so that it reports its own timeout and the worker survives; the box's
    timeout is the backstop for tools that hang.

    As with any ``spawn``/``forkserver`` process, the worker imports the caller's main module
    (as ``__mp_main__``): a script that builds a box must keep its work under
    ``if __name__ == "__main__":``. The first start in a process warms the fork server (it
    imports lppo and torch once, seconds); later starts and restarts take milliseconds.

    Args:
        tools: functions (typed, Google docstrings) or picklable callable objects with a
            ``name`` (and optionally a ``schema``); module-level, so the worker can unpickle them.
        timeout_s: seconds one call may run before it is stopped.
        max_output_chars: longest result text; longer ones are cut with a note.
        key_prefix: the settings key of this box, for error messages
            (``model.engine.init_args.environment.init_args``).

    Raises:
        SettingError: for a bad number, or a tool timeout not below ``timeout_s``.
        ValueError: for duplicate names, an undescribable or unpicklable tool.
    """

    def __init__(
        self,
        tools: Sequence[Callable[..., Any]],
        timeout_s: float = 5.0,
        max_output_chars: int = 2000,
        key_prefix: str = "tools",
    ) -> None:
        check_number(
            f"{key_prefix}.timeout_s", timeout_s, low=0, low_open=True,
            fix="Seconds one tool call may run; 5 is typical.",
        )  # fmt: skip
        check_number(
            f"{key_prefix}.max_output_chars", max_output_chars, integer=True, low=64,
            fix="Characters of a tool result the model reads back; 2000 is typical.",
        )  # fmt: skip
        self.timeout_s = float(timeout_s)
        self.max_output_chars = int(max_output_chars)
        self._tools: dict[str, Callable[..., Any]] = {}
        for tool in tools:
            name = tool_name(tool)
            if name in self._tools:
                raise ValueError(f"{key_prefix}: two tools are named {name!r}; rename one.")
            self._check_timeout(key_prefix, name, tool)
            self._tools[name] = tool
        self.schemas: list[dict[str, Any]] = [tool_schema(t) for t in self._tools.values()]
        self._signatures = {n: inspect.signature(t) for n, t in self._tools.items()}
        self._blob = self._pickle_tools()
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: multiprocessing.connection.Connection | None = None
        self._lock = threading.Lock()

    def _check_timeout(self, key_prefix: str, name: str, tool: Callable[..., Any]) -> None:
        own = getattr(tool, "timeout_s", None)
        if isinstance(own, int | float) and own >= self.timeout_s:
            raise SettingError(
                f"{key_prefix}.timeout_s={self.timeout_s:g} must exceed the timeout_s={own:g} "
                f"of tool {name!r}: the tool reports its own timeouts and the box only stops "
                "hung calls. Raise the box's timeout_s or lower the tool's."
            )

    def _pickle_tools(self) -> bytes:
        for name, tool in self._tools.items():
            try:
                pickle.dumps(tool)
            except Exception as e:
                raise ValueError(
                    f"tool {name!r} cannot be pickled ({type(e).__name__}: {e}); tools run in a "
                    "worker process: define functions at module level (no lambdas or closures) "
                    "and make callable objects picklable."
                ) from e
        return pickle.dumps(self._tools)

    @property
    def names(self) -> list[str]:
        """The tools' names, in the order given."""
        return list(self._tools)

    @property
    def worker_pid(self) -> int | None:
        """Pid of the running worker process, ``None`` while none runs."""
        return None if self._process is None else self._process.pid

    def start(self) -> None:
        """Start the worker now (the first call does otherwise).

        Raises:
            RuntimeError: if the worker cannot load the tools or does not come up in time.
        """
        with self._lock:
            self._ensure_worker()

    def _ensure_worker(self) -> multiprocessing.connection.Connection:
        if self._conn is not None:
            return self._conn
        ctx = worker_context()
        parent_conn, child_conn = ctx.Pipe()
        args = (child_conn, list(sys.path), self.max_output_chars, self._blob)
        process = ctx.Process(target=serve_tools, args=args, name="lppo-toolbox", daemon=True)
        process.start()
        child_conn.close()
        self._process, self._conn = process, parent_conn
        ready = parent_conn.poll(WORKER_START_TIMEOUT_S)
        try:
            ok, why = parent_conn.recv() if ready else (False, "it did not answer")
        except (EOFError, OSError):
            process.join(timeout=5)
            ok, why = False, f"it exited with code {process.exitcode}"
        if not ok:
            self._stop_worker()
            raise RuntimeError(
                f"the tool worker could not load the tools {self.names}: {why}. Tools must be "
                "importable in a fresh process (module-level, on sys.path)."
            )
        return parent_conn

    def _stop_worker(self) -> int | None:
        """Kill the worker's process group; its exit code (``None`` if none ran)."""
        process, conn = self._process, self._conn
        self._process = self._conn = None
        if conn is not None:
            conn.close()
        if process is None:
            return None
        if process.exitcode is None:
            kill_group(process.pid)  # type: ignore[arg-type]
        process.join(timeout=10)
        return process.exitcode

    def call(self, call: ToolCall) -> ToolResult:
        """Run one call; every failure is a result the model reads, never an exception.

        Args:
            call: the tool and its arguments.

        Returns:
            The tool's text; or an error result for an unknown tool, arguments that do not bind
            to its signature, an exception (``"error: ValueError: ..."``), a dead worker, or a
            call past ``timeout_s`` (``timed_out=True``; the hung worker is killed).
        """
        name = call.name
        if name not in self._tools:
            message = f"error: no tool named {name!r}; available: {', '.join(self._tools)}"
            return ToolResult(name, message, error=True)
        signature = self._signatures[name]
        try:
            signature.bind(**call.arguments)
        except TypeError as e:
            return ToolResult(name, f"error: bad arguments for {name}{signature}: {e}", error=True)
        with self._lock:
            return self._run(call)

    def _run(self, call: ToolCall) -> ToolResult:
        conn = self._ensure_worker()
        try:
            conn.send((call.name, call.arguments))
            finished = conn.poll(self.timeout_s)
            if finished:
                ok, text = conn.recv()
                return ToolResult(call.name, text, error=not ok)
        except (EOFError, OSError):
            code = self._stop_worker()
            message = f"error: the tool process died while running {call.name} (exit code {code})"
            return ToolResult(call.name, message, error=True)
        self._stop_worker()
        message = f"error: {call.name} did not finish within {self.timeout_s:g} s and was stopped"
        return ToolResult(call.name, message, error=True, timed_out=True)

    def calls_many(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """Run ``calls`` one after another (one worker), results in the same order."""
        return [self.call(c) for c in calls]

    def close(self) -> None:
        """Stop the worker; safe to call more than once. A later call starts a new one."""
        with self._lock:
            self._stop_worker()

    def __enter__(self) -> ToolBox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self._stop_worker()
        except Exception:  # interpreter shutdown: modules may be half gone
            pass

    def __getstate__(self) -> dict[str, Any]:
        # A live process and pipe cannot travel; the copy starts its own worker on first use.
        state = self.__dict__.copy()
        state.update(_process=None, _conn=None, _lock=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
