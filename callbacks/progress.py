"""A console progress display for the RL loop (Lightning's batch progress bar does not apply)."""

from __future__ import annotations

import math
import sys
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_only

from lppo.iteration.hooks import IterationContext, PPOCallback
from lppo.types import IterationResult, iteration_label
from lppo.validation import callback_key, check_number


def _fmt(value: float) -> str:
    return "n/a" if not math.isfinite(value) else f"{value:.4g}"


def _mean_last_epoch_loss(result: Any, role: str) -> float:
    steps = result.phase_steps(role)
    if not steps:
        return math.nan
    last = max(s.epoch for s in steps)
    losses = [
        float(s.metrics.get("loss", s.metrics.get("value_loss", s.metrics.get("policy_loss", 0))))
        for s in steps
        if s.epoch == last
    ]
    return sum(losses) / len(losses)


class PPOProgress(PPOCallback):
    r"""Shows where the RL loop is: ``iteration i/N | phase critic | epoch e/E | chunk c/C``.

    On a TTY the line is redrawn in place (``\r``) at every phase epoch start and, at most every
    ``refresh_seconds``, after chunks; otherwise a newline-terminated line is printed once per
    phase (when its last epoch ends), so a log file gets at most three lines per iteration. At
    the end of each iteration a compact line gives reward mean ± std, the critic and actor
    losses (mean over the last epoch's steps) and the iteration's seconds. Output goes to
    stdout, flushed, from the global rank zero only.

    Args:
        refresh_seconds: minimum time between two in-place redraws on a TTY.
        tty: force the TTY (``True``) or log-file (``False``) style; ``None`` detects it from
            ``sys.stdout.isatty()``.
        every_n_iterations: print the iteration-end line every N iterations (the last one is
            always printed).
    """

    def __init__(
        self, refresh_seconds: float = 0.2, tty: bool | None = None, every_n_iterations: int = 1
    ) -> None:
        super().__init__()
        check_number(callback_key(self, "refresh_seconds"), refresh_seconds, low=0)
        check_number(
            callback_key(self, "every_n_iterations"), every_n_iterations, integer=True, low=1
        )
        self.refresh_seconds = refresh_seconds
        self.tty = tty
        self.every_n_iterations = every_n_iterations
        self.total: int | None = None
        self._known_trainer: Any = None
        self._last_draw = 0.0
        self._width = 0
        self._num_chunks: int | None = None
        self._last_chunk = -1

    # ------------------------------------------------------------------ output
    def _is_tty(self) -> bool:
        if self.tty is not None:
            return self.tty
        isatty = getattr(sys.stdout, "isatty", None)
        return bool(isatty and isatty())

    def _rank_zero(self, trainer: Any) -> bool:
        if trainer is not None:
            return bool(trainer.is_global_zero)
        return getattr(rank_zero_only, "rank", 0) == 0

    def _draw(self, line: str) -> None:
        """Redraw the current TTY line in place."""
        pad = " " * max(self._width - len(line), 0)
        sys.stdout.write("\r" + line + pad)
        sys.stdout.flush()
        self._width = len(line)
        self._last_draw = time.monotonic()

    def _println(self, line: str) -> None:
        """Print a finished line (ending an in-place line first on a TTY)."""
        if self._is_tty() and self._width:
            line = "\r" + line + " " * max(self._width - len(line), 0)
        self._width = 0
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    # ------------------------------------------------------------------ text
    def _iteration_text(self, iteration: int) -> str:
        total = self.total if self.total is not None else "?"
        return f"{iteration_label(iteration)}/{total}"

    def position(self, ctx: IterationContext) -> str:
        """The position line for ``ctx``."""
        config = ctx.config
        epochs = getattr(config, f"{ctx.phase}_epochs", None)
        parts = [self._iteration_text(ctx.iteration), f"phase {ctx.phase}"]
        if ctx.epoch >= 0:
            parts.append(f"epoch {ctx.epoch + 1}/{epochs if epochs else '?'}")
        if ctx.minibatch > 0:
            minibatches = getattr(config, f"{ctx.phase}_minibatches", None)
            parts.append(f"minibatch {ctx.minibatch + 1}/{minibatches or '?'}")
        if ctx.chunk >= 0:
            chunks = f"/{self._num_chunks}" if self._num_chunks else ""
            parts.append(f"chunk {ctx.chunk + 1}{chunks}")
        return " | ".join(parts)

    # ------------------------------------------------------------------ Lightning hooks
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Remember the trainer (for ``N = trainer.max_epochs`` and the rank)."""
        self._remember(trainer)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Remember the trainer."""
        self._remember(trainer)

    def _remember(self, trainer: Any) -> None:
        self._known_trainer = trainer
        max_epochs = getattr(trainer, "max_epochs", None)
        self.total = max_epochs if max_epochs is not None and max_epochs >= 0 else None

    def on_iteration_end(self, ctx: IterationContext, result: IterationResult) -> None:
        """Print the iteration's compact summary line."""
        if not self._rank_zero(self._ctx_trainer(ctx)):
            return
        iteration = int(result.iteration)
        last = self.total is not None and iteration + 1 >= self.total
        if (iteration + 1) % self.every_n_iterations and not last:
            return
        if result.failed:
            self._println(f"{self._iteration_text(iteration)} | failed: {result.failed}")
            return
        reward, std = result.rollout.reward_mean, result.rollout.reward_std
        seconds = float(sum(result.seconds.values()))
        line = (
            f"{self._iteration_text(iteration)} | reward {_fmt(reward)} ± {_fmt(std)}"
            f" | critic loss {_fmt(_mean_last_epoch_loss(result, 'critic'))}"
            f" | actor loss {_fmt(_mean_last_epoch_loss(result, 'actor'))}"
            f" | {seconds:.1f}s"
        )
        self._println(line)

    # ------------------------------------------------------------------ lppo hooks
    def _ctx_trainer(self, ctx: IterationContext) -> Any:
        trainer = ctx.trainer if ctx.trainer is not None else self._known_trainer
        if trainer is not None and trainer is not self._known_trainer:
            self._remember(trainer)
        return trainer

    def on_phase_epoch_start(self, ctx: IterationContext) -> None:
        """Redraw the position line (TTY only)."""
        self._num_chunks = None
        self._last_chunk = -1
        if self._rank_zero(self._ctx_trainer(ctx)) and self._is_tty():
            self._draw(self.position(ctx))

    def on_train_step_start(self, ctx: IterationContext) -> None:
        """Note the number of chunks of the step."""
        self._num_chunks = ctx.plan.num_chunks if ctx.plan is not None else None

    def on_chunk_end(self, ctx: IterationContext, result: Any) -> None:
        """Redraw the position line, throttled (TTY only)."""
        self._last_chunk = ctx.chunk
        if not self._is_tty() or time.monotonic() - self._last_draw < self.refresh_seconds:
            return
        if self._rank_zero(self._ctx_trainer(ctx)):
            self._draw(self.position(ctx))

    def on_phase_epoch_end(self, ctx: IterationContext) -> None:
        """On a log file, print one line when a phase's last epoch ends."""
        if self._is_tty() or not self._rank_zero(self._ctx_trainer(ctx)):
            return
        config = ctx.config
        epochs = getattr(config, f"{ctx.phase}_epochs", None)
        if epochs is not None and ctx.epoch + 1 < epochs:
            return
        steps = [s for s in ctx.step_stats if s.role == ctx.phase]
        parts = [
            self._iteration_text(ctx.iteration),
            f"phase {ctx.phase}",
            f"epoch {ctx.epoch + 1}/{epochs if epochs else '?'}",
        ]
        if self._last_chunk >= 0:
            chunks = f"/{self._num_chunks}" if self._num_chunks else ""
            parts.append(f"chunk {self._last_chunk + 1}{chunks}")
        parts.append(f"steps {len(steps)}")
        if steps:
            loss = steps[-1].metrics.get("loss")
            if loss is not None:
                parts.append(f"loss {_fmt(float(loss))}")
        self._println(" | ".join(parts))

    def on_ppo_abort(self, ctx: IterationContext, error: BaseException) -> None:
        """End an in-place line so the traceback starts on a fresh line."""
        if self._width and self._rank_zero(self._ctx_trainer(ctx)):
            sys.stdout.write("\n")
            sys.stdout.flush()
            self._width = 0
