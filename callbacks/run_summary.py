"""Prints a closing summary of the run and writes it to ``<run dir>/summary.json``."""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger
from lppo.callbacks.reward_plot import run_dir

from lppo.hooks import IterationContext, PPOCallback
from lppo.interrupts import RunInterrupted
from lppo.run_log import RunLog
from lppo.types import IterationResult, iteration_number
from lppo.validation import callback_key, check_number


def _finite_mean(values: list[float]) -> float | None:
    vals = [v for v in values if math.isfinite(v)]
    return sum(vals) / len(vals) if vals else None


def _abs(path: str | None) -> str | None:
    """``path`` made absolute (every path in the summary is), ``None`` for none."""
    return os.path.realpath(path) if path else None


def _json_float(value: float | None) -> float | None:
    """``None`` for missing / non-finite values (JSON has no NaN)."""
    return value if value is not None and math.isfinite(value) else None


class RunSummary(PPOCallback):
    """At ``on_train_end`` prints a closing summary (global rank zero) and saves it as JSON.

    The summary holds: iterations run, reward of the first and last iteration, mean reward of
    the first and last ``window`` iterations, wall time (accumulated over resumes), and where
    the outputs are: each logger's folder and ``metrics.csv`` (for a
    :class:`~lightning.pytorch.loggers.CSVLogger`), the reward-curve PNG (the run log's
    ``files``), and the checkpoint folder / best and last checkpoints of
    ``trainer.checkpoint_callback``; with held-out evaluations in the run log,
    ``evaluation`` holds each prefix's latest metrics.

    Rewards are collected from the ``IterationResult`` of each ``on_iteration_end`` and kept
    in :meth:`state_dict`.

    Args:
        filename: name of the JSON file written to the run directory.
        window: number of iterations averaged for the "first" and "last" reward means.
        print_summary: print the summary to stdout (the JSON file is written either way).
    """

    def __init__(
        self, filename: str = "summary.json", window: int = 3, print_summary: bool = True
    ) -> None:
        super().__init__()
        check_number(callback_key(self, "window"), window, integer=True, low=1)
        self.filename = filename
        self.window = window
        self.print_summary = print_summary
        self.rewards: list[tuple[int, float]] = []
        self.elapsed_before = 0.0
        self._start: float | None = None
        self.summary: dict[str, Any] | None = None
        self.path: str | None = None
        self.resumed_from: dict[str, Any] | None = None

    # ------------------------------------------------------------------ hooks
    def on_iteration_end(self, ctx: IterationContext, result: IterationResult) -> None:
        """Record the reward of the iteration that just finished (a failed one has none)."""
        if result.failed:
            return
        iteration = int(result.iteration)
        reward = result.rollout.reward_mean
        self.rewards = [r for r in self.rewards if r[0] != iteration]
        self.rewards.append((iteration, reward))
        self.rewards.sort(key=lambda r: r[0])

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Start the wall clock; note the checkpoint the run resumed from."""
        self._start = time.monotonic()
        self.resumed_from = None
        if trainer.ckpt_path:
            done = trainer.current_epoch  # iterations the checkpoint had completed
            self.resumed_from = {"path": os.path.realpath(trainer.ckpt_path), "iteration": done}
            if trainer.is_global_zero:
                print(
                    f"lppo: resumed from {self.resumed_from['path']} after iteration {done}; "
                    f"continuing with iteration {done + 1}",
                    flush=True,
                )

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Build the summary; rank zero writes ``summary.json`` and prints it."""
        self.finish(trainer, pl_module, "completed")

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """Write the summary of an interrupted (signal) or failed run."""
        if isinstance(exception, RunInterrupted):
            self.finish(trainer, pl_module, "interrupted", str(exception))
        else:
            self.finish(trainer, pl_module, "failed", f"{type(exception).__name__}: {exception}")

    def finish(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, status: str, reason: str = ""
    ) -> None:
        """Build the summary with ``status``; rank zero writes ``summary.json`` and prints it."""
        self.summary = self.build(trainer, pl_module.run_log)
        self.summary["status"] = status
        self.summary["reason"] = reason[:500] or None
        if not trainer.is_global_zero:
            return
        self.path = os.path.join(run_dir(trainer), self.filename)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "w") as f:
            json.dump(self.summary, f, indent=2)
        if self.print_summary:
            print(self.format(self.summary), flush=True)

    # ------------------------------------------------------------------ content
    def wall_seconds(self) -> float:
        """Training wall time so far, including the time before a resume."""
        now = time.monotonic() - self._start if self._start is not None else 0.0
        return self.elapsed_before + now

    def build(self, trainer: pl.Trainer, run_log: RunLog) -> dict[str, Any]:
        """The summary as a JSON-ready dict (``run_log``: evaluations and files)."""
        rewards = [r for _, r in self.rewards]
        first = rewards[0] if rewards else None
        last = rewards[-1] if rewards else None
        loggers = []
        metrics_csv = None
        for logger in trainer.loggers:
            log_dir = _abs(getattr(logger, "log_dir", None) or logger.save_dir)
            entry: dict[str, Any] = {"type": type(logger).__name__, "log_dir": log_dir}
            if isinstance(logger, CSVLogger):
                entry["metrics_csv"] = _abs(os.path.join(logger.log_dir, "metrics.csv"))
                metrics_csv = metrics_csv or entry["metrics_csv"]
            loggers.append(entry)
        curve_path = _abs(run_log.files.get("reward_curve"))
        ckpt = trainer.checkpoint_callback
        checkpoints = None
        if ckpt is not None:
            checkpoints = {
                "dirpath": _abs(getattr(ckpt, "dirpath", None)),
                "last": _abs(getattr(ckpt, "last_model_path", None)),
            }
            if getattr(ckpt, "monitor", None):  # "best" only means something with a monitor
                checkpoints["best"] = _abs(getattr(ckpt, "best_model_path", None))
        evaluation = {
            prefix: {k: _json_float(float(v)) for k, v in entries[-1].items()}
            for prefix, entries in run_log.evaluations.items()
            if entries
        }
        return {
            "iterations": len(self.rewards),
            "max_iterations": trainer.max_epochs,
            "first_iteration": iteration_number(self.rewards[0][0]) if self.rewards else None,
            "last_iteration": iteration_number(self.rewards[-1][0]) if self.rewards else None,
            "reward_first": _json_float(first),
            "reward_last": _json_float(last),
            "reward_first_mean": _json_float(_finite_mean(rewards[: self.window])),
            "reward_last_mean": _json_float(_finite_mean(rewards[-self.window :])),
            "window": self.window,
            "wall_seconds": self.wall_seconds(),
            "run_dir": _abs(run_dir(trainer)),
            "resumed_from": self.resumed_from,
            "metrics_csv": metrics_csv,
            "loggers": loggers,
            "reward_curve": curve_path,
            "checkpoints": checkpoints,
            "evaluation": evaluation or None,
        }

    @staticmethod
    def format(summary: dict[str, Any]) -> str:
        """Human-readable, multi-line rendering of :meth:`build`'s dict."""

        def num(v: float | None) -> str:
            return "n/a" if v is None else f"{v:.4f}"

        w = summary["window"]
        status = summary.get("status", "completed")
        lines = [
            "lppo run summary" + ("" if status == "completed" else f" ({status})"),
            f"  iterations      : {summary['iterations']} (max {summary['max_iterations']})",
            f"  reward          : {num(summary['reward_first'])} → {num(summary['reward_last'])}",
            f"  reward (mean of first/last {w}): {num(summary['reward_first_mean'])} → "
            f"{num(summary['reward_last_mean'])}",
            f"  wall time       : {summary['wall_seconds']:.1f} s",
            f"  run dir         : {summary['run_dir']}",
        ]
        if summary.get("reason"):
            lines.append(f"  stopped         : {summary['reason']}")
        if summary.get("resumed_from"):
            done = summary["resumed_from"]
            after = f"after iteration {done['iteration']}"
            lines.append(f"  resumed from    : {done['path']} ({after})")
        if summary["metrics_csv"]:
            lines.append(f"  metrics.csv     : {summary['metrics_csv']}")
        for entry in summary["loggers"]:
            if "metrics_csv" not in entry:
                lines.append(f"  {entry['type']:<16}: {entry['log_dir']}")
        for prefix, last in (summary.get("evaluation") or {}).items():
            passes = ", ".join(f"{k} {num(v)}" for k, v in last.items() if k.startswith("pass@"))
            lines.append(
                f"  {prefix + ' (held-out)':<16}: iteration {int(last['iteration'] or 0)} | "
                f"reward {num(last['reward_mean'])} | accuracy {num(last['accuracy'])} | {passes}"
            )
        if summary["reward_curve"]:
            lines.append(f"  reward curve    : {summary['reward_curve']}")
        ckpt = summary["checkpoints"]
        if ckpt:
            lines.append(f"  checkpoints     : {ckpt['dirpath']}")
            if ckpt.get("best"):
                lines.append(f"  best checkpoint : {ckpt['best']}")
            if ckpt["last"]:
                lines.append(f"  last checkpoint : {ckpt['last']}")
        return "\n".join(lines)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Collected rewards and wall time so far."""
        return {"rewards": [list(r) for r in self.rewards], "elapsed": self.wall_seconds()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the wall clock continues from the saved time."""
        self.rewards = [(int(i), float(r)) for i, r in state_dict.get("rewards", [])]
        self.elapsed_before = float(state_dict.get("elapsed", 0.0))
        self._start = None
