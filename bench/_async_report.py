"""The markdown report of ``async_rollouts.py``: one table per setting, then the goal check."""

from __future__ import annotations

import statistics
from typing import Any

MiB = 1024 * 1024
GOAL = 0.75  # s = 1 at most this many times the synchronous iteration (long responses)

Result = dict[str, Any]


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def summarize(result: Result, window: tuple[int, int]) -> dict[str, float]:
    """Means of one fit's clock and metrics over its iterations but the first and last few.

    Args:
        result: what ``async_rollouts.fit`` returned.
        window: ``(warmup, cooldown)``: the first iterations (start-up, the lag filling up)
            and the last ones (the runner has nothing left to generate for them) left out.
    """
    warmup, cooldown = max(window[0], 1), window[1]
    rows = result["rows"][warmup : len(result["rows"]) - cooldown]
    # read_clock's entry k is iteration k + 1 (iteration 0 has no start mark)
    clock = result["iteration_s"]
    wall = clock[warmup - 1 : len(clock) - cooldown]

    def col(name: str) -> list[float]:
        return [float(r[name]) for r in rows if r.get(name)]

    rate = col("perf/tokens_per_second/rollout")
    secs = col("perf/generation/generation")  # the rate is per second of generation
    tokens = _mean([a * b for a, b in zip(rate, secs, strict=False)])
    iteration = _mean(wall)
    generation = _mean(col("perf/generation/generation"))
    return {
        "iteration": iteration,
        "sd": statistics.stdev(wall) if len(wall) > 1 else 0.0,
        "n": float(len(wall)),
        "generation": generation,
        "share": generation / iteration,
        "overlap": _mean(col("perf/generation/overlap")),
        "wait": _mean(col("perf/generation/wait")),
        "idle": _mean(col("perf/generation/generator_idle")),
        "staleness": _mean(col("rollout/staleness")),
        "tokens": tokens,
        "tok_s": tokens / iteration,
        "gen_tok_s": tokens / generation if generation > 0 else float("nan"),
        "trainer_peak": max(col("perf/peak_memory_bytes"), default=float("nan")),
        "others_peak": float(result["others_peak"]),
        "generators_peak": float(result["generators_peak"]),
        "others_cores": float(result["others_cores"]),
        "fit_s": float(result["wall_s"]),
    }


def baselines(stats: dict[str, dict[str, float]]) -> dict[str, float]:
    """The s = 0 iteration time per engine (``hf``: mean of both synchronous runs) and fastest."""
    base: dict[str, float] = {}
    sync = [stats[k]["iteration"] for k in ("sync", "sync-again") if k in stats]
    if sync:
        base["hf"] = _mean(sync)
    if "ray-s0" in stats:
        base["ray"] = stats["ray-s0"]["iteration"]
    s0 = [v["iteration"] for k, v in stats.items() if k.startswith(("sync", "ray-s0"))]
    if s0:
        base["fastest"] = min(s0)
    return base


def print_table(
    setting: str, results: dict[str, Result], window: tuple[int, int]
) -> dict[str, float]:
    """One setting's table; return the ratio of each variant to its engine's s = 0 run."""
    stats = {k: summarize(r, window) for k, r in results.items()}
    base = baselines(stats)
    print(f"\n### {setting} responses\n")
    print(
        "| variant | s | threads (trainer + generator) | iteration s (mean ± sd, n) | × s = 0 "
        "(same engine) | × fastest s = 0 | generation / iteration | generation s | overlap s "
        "| trainer wait s | generator idle s | tokens / iteration | tok/s (iteration) | "
        "tok/s (generator) | trainer peak RSS MiB | generator / all other processes peak RSS "
        "MiB | "
        "others' load (cores) | fit wall s |"
    )
    print("| --- | ---: | --- |" + " ---: |" * 15)
    ratios: dict[str, float] = {}
    for key, st in stats.items():
        v = results[key]["variant"]
        ratios[key] = st["iteration"] / base.get(v.engine, float("nan"))
        fastest = st["iteration"] / base.get("fastest", float("nan"))
        others = "–"
        if st["others_peak"]:
            others = f"{st['generators_peak'] / MiB:.0f} / {st['others_peak'] / MiB:.0f}"
        print(
            f"| {v.label} | {v.staleness} | {v.threads} | {st['iteration']:.2f} ± "
            f"{st['sd']:.2f} ({st['n']:.0f}) | **{ratios[key]:.2f}** | {fastest:.2f} | "
            f"{st['share']:.0%} | {st['generation']:.2f} | {st['overlap']:.2f} | "
            f"{st['wait']:.2f} | {st['idle']:.2f} | {st['tokens']:.0f} | {st['tok_s']:.0f} | "
            f"{st['gen_tok_s']:.0f} | {st['trainer_peak'] / MiB:.0f} | {others} | "
            f"{st['others_cores']:.2f} | {st['fit_s']:.0f} |"
        )
    return ratios


def print_goal(ratios: dict[str, float]) -> None:
    """The issue's goal on the long setting: s = 1 at most 0.75× the synchronous iteration."""
    print(f"\nGoal (long responses): s = 1 at most {GOAL}× the synchronous iteration time.\n")
    for key, what in (
        ("process-s1", "ProcessRunner (1 + 1 threads)"),
        ("process-s1-2t", "ProcessRunner (2 + 2 threads)"),
        ("thread-s1", "ThreadRunner with the HF engine"),
        ("ray-s1", "Ray worker + ThreadRunner (vs Ray at s = 0)"),
    ):
        if key in ratios:
            r = ratios[key]
            print(f"- {what}: {r:.2f}× — {'met' if r <= GOAL else 'NOT met'}")


def print_report(results: dict[str, dict[str, Result]], header: dict[str, Any]) -> None:
    """The header line, one table per setting and the goal check, to stdout."""
    print(
        f"`.venv/bin/python {header['command']}` — {header['date']}, {header['cpus']} CPUs, "
        f"load average {header['load_before']:.2f} before the run, {header['wall_s']:.0f} s "
        f"in all ({header['waited_s']:.0f} s of it waiting for other processes to idle); "
        f"means over the iterations after the first {header['warmup']} and before the last "
        f"{header['cooldown']}."
    )
    window = (header["warmup"], header["cooldown"])
    all_ratios: dict[str, dict[str, float]] = {}
    for setting, res in results.items():
        all_ratios[setting] = print_table(setting, res, window)
    if "long" in all_ratios:
        print_goal(all_ratios["long"])
    print(
        "\nIteration s: wall time between consecutive iteration ends (publishing the weights "
        "and logging included). × s = 0: against the same engine's synchronous run (HF: the "
        "mean of the two synchronous 1-thread runs). Generation s: the generator's busy time "
        "per iteration (`perf/generation/generation`); overlap s: the part of it that ran "
        "while the trainer was not waiting. Tokens: response tokens generated per iteration. "
        "Generator / all other processes: the RSS of the generating processes (the background "
        "rollout process; Ray's `RolloutWorker` actors, the trainer's own idle one included) / "
        "of all the fit's descendants (for Ray also its daemons), sampled every 0.5 s and "
        "summed, shared library pages counted in each. Others' load: cores kept busy by "
        "processes outside the fit while it ran."
    )
