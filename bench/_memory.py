"""Probes of the benchmark: peak RSS from a reset point, and the CPU load of other processes.

Linux only (``/proc``); the peak probe falls back to polling ``psutil`` every 5 ms where the
kernel's high-water mark cannot be reset.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import threading
import time

import psutil

MiB = 1024 * 1024


def status_kib(key: str) -> int:
    """Return one ``/proc/self/status`` field (``VmRSS``, ``VmHWM``, ...) in KiB.

    Raises:
        KeyError: the field is not there.
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def rss_bytes() -> int:
    """Resident memory of this process, in bytes."""
    return status_kib("VmRSS") * 1024


def anon_bytes() -> int:
    """Anonymous resident memory (heap): what the store's data occupies, without code pages."""
    return status_kib("RssAnon") * 1024


def release_free_heap() -> None:
    """Collect garbage and hand the allocator's free heap back to the kernel (glibc only).

    Without it, a baseline RSS taken after a larger earlier phase still counts the heap that
    phase freed but glibc kept, and a peak measured from there hides the growth it reuses.
    """
    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc is not None and hasattr(ctypes.CDLL(libc), "malloc_trim"):
        ctypes.CDLL(libc).malloc_trim(0)


class PeakProbe:
    """Peak RSS from a reset point: kernel high-water mark, or a 5 ms poller as fallback.

    Attributes:
        base: RSS in bytes at :meth:`start`.
        method: how the peak is measured, for the report.
    """

    def __init__(self) -> None:
        self.base = 0
        self.method = "VmHWM reset"
        self._poll_peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Take the baseline now (free heap released first): reset ``VmHWM`` or poll."""
        release_free_heap()
        try:
            self._reset_high_water_mark()
        except OSError:
            self._start_poller()

    def peak_beyond(self) -> int:
        """Peak RSS since :meth:`start` minus the baseline, in bytes (stops the poller)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            return self._poll_peak - self.base
        return status_kib("VmHWM") * 1024 - self.base

    def _reset_high_water_mark(self) -> None:
        """Reset ``VmHWM`` to the current RSS and take that RSS as the baseline."""
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        self.base = rss_bytes()
        # Some kernels / containers accept the write and ignore it: check it took effect.
        if status_kib("VmHWM") * 1024 > self.base + MiB:
            raise OSError("VmHWM did not reset")

    def _start_poller(self) -> None:
        """Fallback: take the baseline now and poll the RSS every 5 ms in a thread."""
        self.method = "psutil poll 5 ms"
        proc = psutil.Process()
        self.base = proc.memory_info().rss
        self._poll_peak = self.base

        def poll() -> None:
            while not self._stop.is_set():
                self._poll_peak = max(self._poll_peak, proc.memory_info().rss)
                time.sleep(0.005)

        self._thread = threading.Thread(target=poll, daemon=True)
        self._thread.start()


def cpu_busy_s() -> float:
    """CPU seconds spent busy by the whole machine (all cores) since boot."""
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    busy = sum(parts[:8]) - parts[3] - parts[4]  # minus idle and iowait
    return busy / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """User + system CPU seconds of this process so far."""
    return sum(os.times()[:2])


class ForeignLoad:
    """Average number of cores other processes kept busy since construction (contention)."""

    def __init__(self) -> None:
        self.t, self.busy, self.own = time.perf_counter(), cpu_busy_s(), own_cpu_s()

    def cores(self) -> float:
        """Cores kept busy by other processes, on average, since construction."""
        dt = time.perf_counter() - self.t
        own = own_cpu_s() - self.own
        return max(0.0, (cpu_busy_s() - self.busy - own) / max(dt, 1e-9))


def wait_for_quiet(max_wait: float, threshold: float = 0.25) -> float:
    """Wait (up to ``max_wait`` s) until other processes use < ``threshold`` cores.

    Returns:
        Seconds waited.
    """
    t0 = time.perf_counter()
    while True:
        load = ForeignLoad()
        time.sleep(1.0)
        if load.cores() < threshold or time.perf_counter() - t0 > max_wait:
            return time.perf_counter() - t0
