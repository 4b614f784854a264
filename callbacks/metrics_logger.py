"""Logs every iteration's rollout, per-step and performance metrics under stable names."""

from __future__ import annotations

import math
import resource
import sys
from typing import Any

import lightning.pytorch as pl
import torch

from lppo.iteration.hooks import IterationContext, PPOCallback
from lppo.run.log import RunLog
from lppo.types import IterationResult, RolloutStats, StepStats, iteration_number

#: Rollout statistics always logged as ``rollout/<name>`` (NaN when not measured).
ROLLOUT_KEYS: tuple[str, ...] = RolloutStats.names()

#: ``StepStats.metrics`` keys always present in a ``<role>/...`` row (NaN when not reported).
STEP_METRIC_KEYS: dict[str, tuple[str, ...]] = {
    "critic": ("loss", "explained_variance", "clip_fraction", "value_mean", "return_mean"),
    "actor": ("loss", "clip_fraction", "approx_kl", "entropy"),
}

#: Phases with a ``perf/tokens_per_second/<phase>`` entry.
THROUGHPUT_PHASES: tuple[str, ...] = ("rollout", "critic", "actor")

_LOSS_FALLBACK = {"critic": "value_loss", "actor": "policy_loss"}


def peak_memory_bytes(module: pl.LightningModule | None = None) -> int:
    """Peak memory of this process, in bytes.

    ``torch.cuda.max_memory_allocated`` on the module's device when it is a CUDA device (or
    on the current CUDA device when CUDA has been initialized); otherwise the peak resident set
    size of the process.
    """
    device = getattr(module, "device", None)
    if isinstance(device, torch.device) and device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return int(peak if sys.platform == "darwin" else peak * 1024)


def step_row(stats: StepStats) -> dict[str, float]:
    """The ``<role>/...`` metrics of one optimizer step (without ``iteration``)."""
    role = stats.role
    metrics = dict(stats.metrics)
    if "loss" not in metrics and _LOSS_FALLBACK.get(role) in metrics:
        metrics["loss"] = metrics[_LOSS_FALLBACK[role]]
    row: dict[str, float] = {
        f"{role}/{name}": float(metrics.get(name, math.nan))
        for name in STEP_METRIC_KEYS.get(role, ("loss",))
    }
    row.update({f"{role}/{k}": float(v) for k, v in metrics.items() if f"{role}/{k}" not in row})
    row.update(
        {
            f"{role}/grad_norm": float(stats.grad_norm),
            f"{role}/lr": float(stats.lr),
            f"{role}/stepped": float(stats.stepped),
            f"{role}/epoch": float(stats.epoch),
            f"{role}/minibatch": float(stats.minibatch),
            f"{role}/chunks_skipped": float(stats.chunks_skipped),
            f"{role}/chunks_trained": float(stats.chunks_trained),
            f"{role}/valid_tokens": float(stats.valid_tokens),
            f"{role}/tokens": float(stats.tokens),
        }
    )
    return row


def _last_epoch_mean_loss(steps: list[StepStats]) -> float:
    """Mean loss over the steps of the last epoch (NaN without steps)."""
    if not steps:
        return math.nan
    last = max(s.epoch for s in steps)
    losses = [step_row(s)[f"{s.role}/loss"] for s in steps if s.epoch == last]
    return sum(losses) / len(losses)


class PPOMetricsLogger(PPOCallback):
    """Sends each RL iteration's metrics to every logger of the trainer.

    At ``on_iteration_end`` it takes the iteration's :class:`~lppo.types.IterationResult` and
    calls ``logger.log_metrics(row, step=...)`` on each of the trainer's loggers (nothing is
    logged without a trainer):

    * one row per critic / actor optimizer step of the iteration (every epoch and minibatch):
      ``<role>/loss``, ``<role>/grad_norm``, ``<role>/clip_fraction``, ``<role>/lr``,
      ``<role>/stepped``, ``<role>/epoch``, ``<role>/minibatch``, ``<role>/chunks_skipped``, plus
      ``critic/explained_variance``, ``critic/value_mean``, ``critic/return_mean``,
      ``actor/approx_kl``, ``actor/entropy`` and any further ``StepStats.metrics``;
    * one iteration row: ``rollout/<name>`` for :data:`ROLLOUT_KEYS`,
      ``perf/tokens_per_second/<phase>`` (rollout: per second of generation),
      ``perf/seconds/<phase>``,
      ``perf/padding_fraction/<phase>`` (score, critic, actor), ``perf/generation/<k>``
      (the rollout's wait, generation, overlap and generator-idle seconds) and
      ``perf/peak_memory_bytes``.

    A failed iteration gets one row: ``iteration/failed`` (1) and ``iteration/failed_total``.

    Every row carries ``iteration`` and gets its own step on the run log's axis
    (:class:`~lppo.run.log.RunLog`, saved with the run, so a resumed run continues it); the
    run log's ``history`` keeps one summary dict per iteration for other callbacks.

    Args:
        log_steps: log the per-step critic / actor rows (the iteration row is always logged).
        flush: call ``logger.save()`` after each iteration so files such as ``metrics.csv``
            are current while the run goes on.
    """

    def __init__(self, log_steps: bool = True, flush: bool = True) -> None:
        super().__init__()
        self.log_steps = log_steps
        self.flush = flush
        self.run_log = RunLog()

    @property
    def history(self) -> list[dict[str, float]]:
        """The run log's per-iteration summaries (``iteration``, ``step``, rewards, losses)."""
        return self.run_log.history

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Take the system's run log (restored on resume before the first iteration)."""
        self.run_log = pl_module.run_log

    def on_iteration_end(self, ctx: IterationContext, result: IterationResult) -> None:
        """Log the iteration that just finished (or failed)."""
        trainer = ctx.trainer
        if trainer is None:
            return
        self.run_log = run_log = ctx.run_log
        iteration = iteration_number(result.iteration)
        if run_log.history and run_log.history[-1]["iteration"] == iteration:
            return  # already logged (hook called twice for the same iteration)
        if result.failed:
            failed = {"iteration/failed": 1, "iteration/failed_total": run_log.failed}
            run_log.log(trainer.loggers, {"iteration": iteration, **failed})
            return
        if self.log_steps:
            for stats in result.steps:
                run_log.log(trainer.loggers, {"iteration": iteration, **step_row(stats)})
        row = {"iteration": iteration, **self.iteration_row(result, trainer.lightning_module)}
        step = run_log.log(trainer.loggers, row)
        if self.flush:
            for logger in trainer.loggers:
                logger.save()
        run_log.history.append(
            {
                "iteration": iteration,
                "step": step,
                **{k: row[f"rollout/{k}"] for k in ROLLOUT_KEYS},
                "critic_loss": _last_epoch_mean_loss(result.phase_steps("critic")),
                "actor_loss": _last_epoch_mean_loss(result.phase_steps("actor")),
                "seconds": float(sum(result.seconds.values())),
            }
        )

    # ------------------------------------------------------------------ rows
    @staticmethod
    def iteration_row(result: Any, pl_module: pl.LightningModule | None = None) -> dict[str, float]:
        """The ``rollout/*`` and ``perf/*`` metrics of one iteration result."""
        row = {f"rollout/{k}": float(v) for k, v in result.rollout.as_dict().items()}
        generation = getattr(result, "generation", {})
        for phase in THROUGHPUT_PHASES:
            seconds = result.seconds.get(phase)
            if phase == "rollout" and generation.get("generation", 0.0) > 0:
                # the generator's own seconds: with stale rollouts the trainer's rollout
                # phase is only the wait for rows generated while earlier iterations trained
                seconds = generation["generation"]
            tokens = result.tokens.get(phase)
            if seconds is not None and tokens is not None:
                row[f"perf/tokens_per_second/{phase}"] = tokens / seconds if seconds > 0 else 0.0
        row.update({f"perf/seconds/{k}": float(v) for k, v in result.seconds.items()})
        row.update({f"perf/generation/{k}": float(v) for k, v in generation.items()})
        padding = getattr(result, "padding", {})
        row.update({f"perf/padding_fraction/{k}": float(v) for k, v in padding.items()})
        row["perf/peak_memory_bytes"] = float(peak_memory_bytes(pl_module))
        return row
