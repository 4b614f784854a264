"""What both sides of the real-model race share (runs in lppo's venv and in the TRL venv).

Standard library and ``psutil`` only (``accelerate``, hence TRL, depends on it): the race's
spec file, the reward both sides score with, the digests that show both sides did the same
work, the clock that leaves out what is not training, and the peak-memory probe. A worker
builds one :class:`Recorder` first thing (before its heavy imports), calls
:meth:`Recorder.iteration_end` after each iteration and prints :meth:`Recorder.result`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import _turns
from _memory import MiB, release_free_heap, status_kib

INTEGER = re.compile(r"-?\d+")


def load_spec(path: str) -> dict[str, Any]:
    """The race's spec (``real_model_race.write_spec``): settings, problems and paths."""
    with open(path) as f:
        return json.load(f)


def start(argv: Sequence[str], known: set[str]) -> tuple[dict[str, Any], Recorder, dict[str, str]]:
    """A side's start: ``argv`` is ``[prog, SPEC, OUT_DIR, KEY=VALUE, ...]``.

    Returns:
        The spec, its :class:`Recorder` (made first: it waits for the turn and starts the
        clock) and the ``KEY=VALUE`` settings.

    Raises:
        SystemExit: a setting not in ``known``.
    """
    spec_path, out_dir = argv[1:3]
    opts = dict(a.split("=", 1) for a in argv[3:])
    if set(opts) - known:
        raise SystemExit(f"unknown settings {sorted(set(opts) - known)}; known: {sorted(known)}")
    spec = load_spec(spec_path)
    return spec, Recorder(spec, out_dir), opts


def last_integer(text: str) -> str | None:
    """The last integer written in ``text`` (``"3 + 4 = 7."`` -> ``"7"``), or ``None``.

    The verifier of ``examples/smollm2/smollm2_task.py``'s ``ChatArithmeticTask`` (commas
    dropped first), restated without lppo so the TRL venv can score with it.
    """
    found = INTEGER.findall(text.replace(",", ""))
    return found[-1] if found else None


def reward(answer: str, completion: str) -> float:
    """1.0 when the completion's last integer is ``answer``, else 0.0 (no partial credit)."""
    return 1.0 if last_integer(completion) == answer else 0.0


def prompt_digest(rows: Iterable[Sequence[int]]) -> str:
    """SHA-256 of one iteration's prompts as token ids: one entry per trained row.

    The rows are sorted first, so the digest names the multiset of prompts (each prompt once
    per sample of its group) whatever order a framework keeps its rows in.
    """
    lines = sorted(",".join(str(int(t)) for t in row) for row in rows)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def run_digest(digests: Sequence[str]) -> str:
    """SHA-256 of a run's per-iteration prompt digests, in iteration order."""
    return hashlib.sha256("".join(digests).encode()).hexdigest()


def problems_digest(problems: Sequence[dict[str, Any]]) -> str:
    """SHA-256 of a problem list's texts and answers, in order."""
    text = "\n".join(f"{p['text']}\t{p['answer']}" for p in problems)
    return hashlib.sha256(text.encode()).hexdigest()


class Clock:
    """Wall-clock seconds of one side: runs from construction, stopped while paused."""

    def __init__(self) -> None:
        self._start = time.perf_counter()
        self._paused_at: float | None = None
        self._paused = 0.0

    def pause(self) -> None:
        """Stop counting (a checkpoint write, the other side's turn)."""
        if self._paused_at is None:
            self._paused_at = time.perf_counter()

    def resume(self) -> None:
        """Count again."""
        if self._paused_at is not None:
            self._paused += time.perf_counter() - self._paused_at
            self._paused_at = None

    def elapsed(self) -> float:
        """Seconds counted so far."""
        now = self._paused_at if self._paused_at is not None else time.perf_counter()
        return now - self._start - self._paused


class PeakMemory:
    """Peak resident memory of this process plus its children, checkpoint writes left out.

    This process: the kernel's high-water mark (``VmHWM``), read before each checkpoint write
    and reset after it (``/proc/self/clear_refs``; where the kernel refuses the reset the
    writes stay in, :attr:`writes_excluded` says so). Children (a rollout process, a vLLM
    worker): their summed RSS, polled every 100 ms while not paused.
    """

    def __init__(self) -> None:
        self.own_peak = 0
        self.children_peak = 0
        self.writes_excluded = True
        self._polling = threading.Event()
        self._polling.set()
        threading.Thread(target=self._poll, daemon=True).start()

    def _poll(self) -> None:
        import psutil

        proc = psutil.Process()
        while True:
            self._polling.wait()
            total = 0
            for child in proc.children(recursive=True):
                try:
                    total += child.memory_info().rss
                except psutil.Error:
                    pass
            self.children_peak = max(self.children_peak, total)
            time.sleep(0.1)

    def pause(self) -> None:
        """Take this process's peak so far and stop the children's poll (a write follows)."""
        self.own_peak = max(self.own_peak, status_kib("VmHWM") * 1024)
        self._polling.clear()

    def resume(self) -> None:
        """Hand freed heap back, reset the high-water mark to the current RSS, poll again."""
        release_free_heap()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self.writes_excluded = False
        self._polling.set()

    def peak_mb(self) -> float:
        """Peak so far (this process + children) in MB."""
        own = max(self.own_peak, status_kib("VmHWM") * 1024)
        return (own + self.children_peak) / MiB


class Recorder:
    """One side's curve: clock, samples, digests and checkpoints after every iteration.

    Constructed first thing in a worker: it waits for the driver's first turn (``_turns``)
    and starts the clock, so set-up (imports, model loading) counts; checkpoint writes and the
    waits for the next turn do not.

    Args:
        spec: the race's spec (:func:`load_spec`).
        out_dir: where checkpoints go (``samples-NNNNNN``).
    """

    def __init__(self, spec: dict[str, Any], out_dir: str) -> None:
        _turns.begin()
        self.clock = Clock()
        self.memory = PeakMemory()
        self.spec = spec
        self.out_dir = out_dir
        self.samples_per_iteration = spec["prompts_per_iteration"] * spec["samples_per_prompt"]
        self.points: list[dict[str, Any]] = []
        self.digests: list[str] = []

    def iteration_end(
        self, digest: str, extras: dict[str, float], save: Callable[[str], Any]
    ) -> None:
        """Record the iteration just ended; write a checkpoint when its sample count is due.

        Args:
            digest: :func:`prompt_digest` of the iteration's rows.
            extras: per-iteration figures for the JSON (generated tokens, reward mean).
            save: writes the current policy as a Hugging Face directory at the given path.
        """
        self.clock.pause()
        self.memory.pause()
        seconds = self.clock.elapsed()
        self.digests.append(digest)
        samples = len(self.digests) * self.samples_per_iteration
        point: dict[str, Any] = {"samples": samples, "seconds": seconds, "digest": digest}
        point.update(extras)
        if samples % self.spec["eval_every"] == 0 or samples == self.spec["samples_budget"]:
            path = os.path.join(self.out_dir, f"samples-{samples:06d}")
            save(path)
            point["checkpoint"] = path
        self.points.append(point)
        self.memory.resume()
        _turns.next_turn()
        self.clock.resume()

    def result(self, side: str, settings: dict[str, Any]) -> dict[str, Any]:
        """The JSON line of the run: points, digests, peak memory, settings."""
        return {
            "side": side,
            "settings": settings,
            "points": self.points,
            "run_digest": run_digest(self.digests),
            "peak_rss_mb": self.memory.peak_mb(),
            "checkpoint_writes_excluded_from_peak": self.memory.writes_excluded,
        }


def emit(result: dict[str, Any]) -> None:
    """Print the worker's one JSON line (the driver reads the last line starting with ``{``)."""
    print(json.dumps(result), flush=True)
