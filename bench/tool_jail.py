"""The jail's cost per tool call: ``PythonTool`` in ``Bubblewrap`` against ``Unjailed``.

From the repository root, in the main venv::

    PYTHONPATH=. .venv/bin/python bench/tool_jail.py            # 200 calls each
    PYTHONPATH=. .venv/bin/python bench/tool_jail.py --calls 50  # quicker

Each call runs ``print(sum(range(1000)))`` through the tool's real path (a fresh temporary
directory, rlimits, output capture): the jailed one inside a fresh ``bwrap`` jail (user, PID,
network, mount namespaces), the unjailed one as a plain child process. The two alternate call
by call, so load on the machine hits both alike. Wall-clock milliseconds per call: median, p90,
p99 and the median ratio. The markdown report goes to stdout.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time

from lppo.envs import Bubblewrap, PythonTool, Unjailed

CODE = "print(sum(range(1000)))"


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``values``, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per variant")
    args = parser.parse_args()
    tools = {
        "Bubblewrap (default)": PythonTool(jail=Bubblewrap()),
        "Unjailed": PythonTool(jail=Unjailed()),
    }
    times: dict[str, list[float]] = {name: [] for name in tools}
    for name, tool in tools.items():  # warm-up: page cache, imports
        assert tool(CODE) == "499500", name
    for _ in range(args.calls):
        for name, tool in tools.items():
            start = time.perf_counter()
            out = tool(CODE)
            times[name].append((time.perf_counter() - start) * 1e3)
            assert out == "499500", (name, out)
    when = datetime.date.today().isoformat()
    cores = os.cpu_count()
    print(f"{args.calls} calls each, {when}, {platform.machine()}, {cores} cores\n")
    print("| jail | median ms | p90 ms | p99 ms |")
    print("|---|---|---|---|")
    for name, values in times.items():
        row = [statistics.median(values), percentile(values, 0.9), percentile(values, 0.99)]
        print(f"| {name} | " + " | ".join(f"{v:.1f}" for v in row) + " |")
    ratio = statistics.median(times["Bubblewrap (default)"]) / statistics.median(times["Unjailed"])
    print(f"\nmedian ratio jailed / unjailed: {ratio:.2f}x")


if __name__ == "__main__":
    main()
