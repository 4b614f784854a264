"""Probes of ``async_rollouts.py``: when each iteration ended, and the memory of a fit's processes.

:class:`IterationClock` runs inside the fit (``--trainer.callbacks+=_async_probe.IterationClock``,
with this folder on ``PYTHONPATH``); :class:`TreeProbe` and :class:`MachineLoad` run in the
driver, outside the measured processes.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from typing import Any

import psutil

from lppo.iteration.hooks import IterationContext, PPOCallback
from lppo.types import IterationResult

#: Environment variable naming the file :class:`IterationClock` appends to.
CLOCK_ENV = "LPPO_BENCH_CLOCK"


class IterationClock(PPOCallback):
    """Appends ``{"iteration", "t"}`` (``time.monotonic()``) to ``$LPPO_BENCH_CLOCK`` per iteration.

    The hook sits at the same point of every iteration, so the difference of two consecutive
    entries is one whole iteration: the rollout wait, the training phases, and what lies outside
    ``perf/seconds`` (publishing the weights and admitting the next job, logging).
    """

    def __init__(self) -> None:
        super().__init__()
        self.path = os.environ.get(CLOCK_ENV, "")

    def on_iteration_end(self, ctx: IterationContext, result: IterationResult) -> None:
        """Record the time the iteration ended."""
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps({"iteration": result.iteration, "t": time.monotonic()}) + "\n")


def read_clock(path: str) -> list[float]:
    """Wall seconds of each iteration after the first (from consecutive end times)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        ends = [json.loads(line)["t"] for line in f if line.strip()]
    return [b - a for a, b in itertools.pairwise(ends)]


class TreeProbe:
    """Samples the RSS and CPU time of a process and of all its descendants every ``interval`` s.

    Ray's workers are children of its raylet, not waited for by the fit, so their CPU time
    never reaches the driver's ``RUSAGE_CHILDREN``: the probe keeps every process's last
    sampled CPU time instead.

    Attributes:
        root_peak: highest RSS of the root process seen (bytes).
        others_peak: highest sum of the descendants' RSS seen (bytes): the background rollout
            process, or Ray's processes (workers and daemons). RSS counts shared pages (the
            torch libraries) in every process, so the sum overstates what they add.
        generators_peak: the same over the generating processes only (the background rollout
            process, Ray's ``RolloutWorker`` actors).
    """

    def __init__(self, pid: int, interval: float = 0.5) -> None:
        self.root = psutil.Process(pid)
        self.interval = interval
        self.root_peak = 0
        self.others_peak = 0
        self.generators_peak = 0
        self._cpu: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                children = self.root.children(recursive=True)
            except psutil.Error:
                return
            self.root_peak = max(self.root_peak, self._sample(self.root))
            rss = {p.pid: self._sample(p) for p in children}
            generators = sum(rss[p.pid] for p in children if _generates(p))
            self.others_peak = max(self.others_peak, sum(rss.values()))
            self.generators_peak = max(self.generators_peak, generators)

    def _sample(self, proc: psutil.Process) -> int:
        """``proc``'s RSS (0 when it is gone); records its CPU time."""
        try:
            with proc.oneshot():
                cpu = proc.cpu_times()
                self._cpu[proc.pid] = cpu.user + cpu.system
                return int(proc.memory_info().rss)
        except psutil.Error:
            return 0

    def cpu_s(self) -> float:
        """CPU seconds of the tree, as last sampled (each process's own time)."""
        return sum(self._cpu.values())

    def stop(self) -> None:
        """Stop sampling."""
        self._stop.set()
        self._thread.join()


def _generates(proc: psutil.Process) -> bool:
    """Whether ``proc`` is a rollout generator (the background process, a Ray rollout worker)."""
    try:
        line = " ".join(proc.cmdline())
    except psutil.Error:
        return False
    return "RolloutWorker" in line or ("spawn_main" in line and "resource_tracker" not in line)


def _machine_busy_s() -> float:
    """CPU seconds the whole machine spent busy since boot (all cores)."""
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    return (sum(parts[:8]) - parts[3] - parts[4]) / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    """CPU seconds of this process's waited-for descendants."""
    times = os.times()
    return times.children_user + times.children_system


class MachineLoad:
    """Cores kept busy by processes other than the measured fit (and its reaped descendants)."""

    def __init__(self) -> None:
        self.t = time.perf_counter()
        self.busy = _machine_busy_s()
        self.children = _children_cpu_s()

    def result(self, tree_cpu_s: float = 0.0) -> dict[str, Any]:
        """``wall_s``, ``fit_cores`` (the fit's average busy cores) and ``others_cores``.

        Args:
            tree_cpu_s: the fit's CPU seconds as a :class:`TreeProbe` sampled them (the larger
                of that and the reaped descendants' time counts).
        """
        wall = time.perf_counter() - self.t
        fit = max(_children_cpu_s() - self.children, tree_cpu_s)
        busy = _machine_busy_s() - self.busy
        return {
            "wall_s": wall,
            "fit_cores": fit / wall,
            "others_cores": max(0.0, busy - fit) / wall,
        }


def wait_for_quiet(max_wait: float, threshold: float = 0.3, window: float = 2.0) -> float:
    """Wait (at most ``max_wait`` s) until the machine's busy cores stay below ``threshold``.

    Returns:
        Seconds waited.
    """
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < max_wait:
        busy = _machine_busy_s()
        time.sleep(window)
        if (_machine_busy_s() - busy) / window < threshold:
            break
    return time.perf_counter() - t0
