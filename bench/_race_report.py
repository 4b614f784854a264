"""The real-model race's report: the goals' figures, the markdown table, the JSON and the plot."""

from __future__ import annotations

import datetime
import json
import os
import sys
from typing import Any

from lppo.callbacks.evaluation import wilson_interval

Curve = list[dict[str, Any]]


def curve(run: dict[str, Any], base: dict[str, Any]) -> Curve:
    """The evaluated points of a run, the base model's at 0 samples and 0 s first."""
    start = {"samples": 0, "seconds": 0.0, **base}
    return [start, *(p for p in run["points"] if "accuracy" in p)]


def time_to_reach(points: Curve, target: float) -> float | None:
    """Seconds at the first trained point (samples > 0) whose accuracy is at least ``target``."""
    return next((p["seconds"] for p in points if p["samples"] and p["accuracy"] >= target), None)


def accuracy_at(points: Curve, samples: int) -> float | None:
    """Accuracy at the evaluated point with ``samples`` trained samples, if there is one."""
    return next((p["accuracy"] for p in points if p["samples"] == samples), None)


def summary(name: str, run: dict[str, Any], base: dict[str, Any], trl: dict | None) -> dict:
    """One variant's figures; ratios and goals against ``trl`` (``None``: no TRL run)."""
    points = curve(run, base)
    last = points[-1]
    low, high = wilson_interval(last["accuracy"], last["n"])
    out: dict[str, Any] = {
        "variant": name,
        "samples": last["samples"],
        "seconds": last["seconds"],
        "accuracy": last["accuracy"],
        "ci95": [low, high],
        "peak_rss_mb": run["peak_rss_mb"],
        "run_digest": run["run_digest"],
    }
    if trl is None or name == "trl":
        return out
    trl_points = curve(trl, base)
    trl_last = trl_points[-1]
    reach = time_to_reach(points, trl_last["accuracy"])
    same = accuracy_at(points, trl_last["samples"])
    out.update(
        same_work=run["run_digest"] == trl["run_digest"],
        wall_ratio=last["seconds"] / trl_last["seconds"],
        reach_s=reach,
        reach_ratio=None if reach is None else reach / trl_last["seconds"],
        accuracy_at_trl_samples=same,
        goal_time=reach is not None and reach <= 0.7 * trl_last["seconds"],
        goal_accuracy=same is not None and same >= trl_last["accuracy"],
        goal_memory=run["peak_rss_mb"] <= trl["peak_rss_mb"],
    )
    return out


def fmt(value: Any, spec: str = ".2f") -> str:
    """``value`` formatted, or a dash for ``None``."""
    return "–" if value is None else format(value, spec)


def table(summaries: list[dict[str, Any]]) -> str:
    """The markdown table of every variant (ratios against TRL)."""
    lines = [
        "| variant | samples | wall-clock s | × TRL | held-out accuracy (95 % CI) "
        "| reaches TRL's final at s | × TRL | accuracy at TRL's samples | peak RSS MB "
        "| prompts digest | same work | goals time / accuracy / memory |",
        "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- | --- | --- |",
    ]
    for s in summaries:
        low, high = s["ci95"]
        goals = ""
        if "goal_time" in s:
            goals = " / ".join(
                "met" if s[k] else "missed" for k in ("goal_time", "goal_accuracy", "goal_memory")
            )
        cells = [
            s["variant"],
            str(s["samples"]),
            f"{s['seconds']:.1f}",
            fmt(s.get("wall_ratio")),
            f"{s['accuracy']:.3f} ({low:.3f}–{high:.3f})",
            fmt(s.get("reach_s"), ".1f"),
            fmt(s.get("reach_ratio")),
            fmt(s.get("accuracy_at_trl_samples"), ".3f"),
            f"{s['peak_rss_mb']:.0f}",
            s["run_digest"][:12],
            {True: "yes", False: "**no**"}.get(s.get("same_work"), ""),
            goals,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(path: str, runs: dict[str, dict[str, Any]], base: dict[str, Any], title: str) -> None:
    """Two panels: held-out accuracy against wall-clock seconds and against trained samples."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_samples) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for name, run in runs.items():
        points = curve(run, base)
        acc = [p["accuracy"] for p in points]
        by_time.plot([p["seconds"] for p in points], acc, marker="o", label=name)
        by_samples.plot([p["samples"] for p in points], acc, marker="o", label=name)
    by_time.set_xlabel("wall-clock s (evaluation and checkpoint writes excluded)")
    by_samples.set_xlabel("trained samples")
    by_time.set_ylabel(f"greedy held-out accuracy ({base['n']} problems)")
    by_time.set_ylim(bottom=0)
    for ax in (by_time, by_samples):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_json(path: str, doc: dict[str, Any]) -> None:
    """The results document, stamped with the date, the CPU count and the command line."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    stamp = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "argv": sys.argv[1:],
    }
    with open(path, "w") as f:
        json.dump({**stamp, **doc}, f, indent=1)
