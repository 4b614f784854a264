"""The single controller: one RL iteration, phase by phase, over streamed replay chunks.

Under data parallelism every rank holds all of the iteration's rows in its own replay store:
scoring and advantages run over every row on every rank (identical results), and only the
critic and actor steps are sharded across ranks.

``collect → score → advantages → critic epochs → actor epochs → release``. Optimizer steps,
row retention and abort cleanup are done by callbacks (:mod:`lppo.callbacks`) that receive the
controller's hooks; the three built-ins are always installed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lppo.algorithms import Moments, advantages_and_returns, kl_penalty, token_rewards, whiten
from lppo.config import PPOConfig
from lppo.data import ReplayDataModule
from lppo.hooks import IterationContext, PPOCallback
from lppo.modules import ActorModule, CriticModule, PPOModule
from lppo.types import (
    ADVANTAGES,
    OLD_LOGPROBS,
    REF_LOGPROBS,
    RESPONSE_MASK,
    RETURNS,
    REWARD,
    VALUES,
    Chunk,
    Rollout,
    StepStats,
)


class IterationError(RuntimeError):
    """An iteration failed; the message says where (iteration, phase, epoch, chunk)."""


@dataclass
class IterationResult:
    """What one RL iteration did.

    Attributes:
        iteration: RL iteration index.
        rollout: rollout metrics (``reward_mean``, ``reward_std``, ``response_length_mean``,
            ``invalid_rows``, ``dropped_rows``, ``kl_mean``).
        steps: stats of every critic and actor step, in order.
        seconds: wall time per phase.
        tokens: real tokens processed per training phase.
    """

    iteration: int
    rollout: dict[str, float]
    steps: list[StepStats]
    seconds: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)

    def phase_steps(self, role: str) -> list[StepStats]:
        """Steps of ``role`` (``actor`` or ``critic``)."""
        return [s for s in self.steps if s.role == role]


def _unpad(chunk: Chunk, values: torch.Tensor) -> list[torch.Tensor]:
    """Split ``[B, T]`` back into one ``[L_i]`` tensor per row of ``chunk``."""
    lengths = chunk.attention_mask.sum(dim=1).tolist()
    return [values[b, :n].detach().cpu().clone() for b, n in enumerate(lengths)]


class PPOController:
    """Runs RL iterations over a replay-backed data module.

    Args:
        actor: the policy.
        critic: the value model.
        data: replay store + chunk planner.
        config: algorithm settings.
        reference: frozen reference policy for the KL penalty (needed when
            ``config.kl_coef > 0``).
        callbacks: extra callbacks; the built-in optimizer-step, row-retention and
            abort-cleanup callbacks are added when not given.
    """

    def __init__(
        self,
        actor: ActorModule,
        critic: CriticModule,
        data: ReplayDataModule,
        config: PPOConfig | None = None,
        reference: ActorModule | None = None,
        callbacks: Sequence[PPOCallback] = (),
    ) -> None:
        from lppo.callbacks import AbortCleanup, OptimizerStep, RowRetention

        self.actor = actor
        self.critic = critic
        self.data = data
        self.config = config if config is not None else PPOConfig()
        self.config.validate()
        if self.config.kl_coef > 0 and reference is None:
            raise ValueError(
                f"ppo.kl_coef={self.config.kl_coef} needs a reference policy; pass reference= "
                "(PPOSystem builds a frozen copy of the actor) or set ppo.kl_coef=0."
            )
        self.reference = reference
        self.callbacks: list[PPOCallback] = list(callbacks)
        for builtin in (OptimizerStep, RowRetention, AbortCleanup):
            if not any(isinstance(cb, builtin) for cb in self.callbacks):
                self.callbacks.append(builtin())
        self.next_row_id = 0
        self.trainer: Any = None

    # ----------------------------------------------------------------- public
    def trainable_modules(self) -> list[PPOModule]:
        """The modules that take optimizer steps."""
        return [self.critic, self.actor]

    def run_iteration(self, rollout: Rollout, iteration: int, dropped: int = 0) -> IterationResult:
        """Run one RL iteration on ``rollout``; rows are released whatever happens.

        Args:
            rollout: the iteration's samples (already scored by the reward function).
            iteration: iteration index (seeds the shuffles; decides critic warmup).
            dropped: samples lost before reaching the store (count against the drop budget).

        Raises:
            IterationError: anything failed; open steps were aborted and rows released.
        """
        ctx = IterationContext(controller=self, iteration=iteration, trainer=self.trainer)
        try:
            return self._run(ctx, rollout, dropped)
        except BaseException as error:
            where = ctx.where()
            self._abort(ctx, error)
            if not isinstance(error, Exception):
                raise
            raise IterationError(f"{where}: {type(error).__name__}: {error}") from error

    def state_dict(self) -> dict[str, Any]:
        """Controller state at an iteration boundary."""
        return {"next_row_id": self.next_row_id}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.next_row_id = int(state["next_row_id"])

    # ----------------------------------------------------------------- phases
    def _run(self, ctx: IterationContext, rollout: Rollout, dropped: int) -> IterationResult:
        cfg = self.config
        clock = time.perf_counter()
        seconds: dict[str, float] = {}
        stats = self._collect(ctx, rollout, dropped)
        seconds["collect"] = time.perf_counter() - clock

        ctx.phase = "score"
        clock = time.perf_counter()
        score_plan = self.data.plan(
            ctx.row_ids, "score", ctx.iteration, dropped=dropped, shard=False
        )
        valid = score_plan.valid_rows
        stats["invalid_rows"] = float(len(score_plan.invalid_rows))
        self._score(ctx, valid)
        seconds["score"] = time.perf_counter() - clock

        ctx.phase = "advantages"
        clock = time.perf_counter()
        stats["kl_mean"] = self._advantages(ctx, valid)
        seconds["advantages"] = time.perf_counter() - clock

        tokens: dict[str, int] = {}
        phases = [("critic", self.critic, cfg.critic_epochs, cfg.critic_minibatches)]
        if ctx.iteration >= cfg.critic_warmup_iterations:
            phases.append(("actor", self.actor, cfg.actor_epochs, cfg.actor_minibatches))
        for phase, module, epochs, minibatches in phases:
            clock = time.perf_counter()
            first = len(ctx.step_stats)
            self._train_phase(ctx, phase, module, epochs, minibatches, dropped)
            seconds[phase] = time.perf_counter() - clock
            tokens[phase] = sum(s.tokens for s in ctx.step_stats[first:])

        ctx.phase, ctx.epoch, ctx.minibatch, ctx.chunk = "release", -1, -1, -1
        ctx.module = ctx.plan = None
        self._emit("on_iteration_end", ctx)
        ctx.release_rows()  # no-op when RowRetention already released them
        return IterationResult(ctx.iteration, stats, list(ctx.step_stats), seconds, tokens)

    def _collect(self, ctx: IterationContext, rollout: Rollout, dropped: int) -> dict[str, float]:
        """Mark invalid rows, put the rollout into the store, report rollout statistics."""
        columns = rollout.columns()
        masks = columns[RESPONSE_MASK]
        rewards = columns[REWARD]
        truncated = columns.pop("truncated", None)
        for i, reward in enumerate(rewards):
            bad_reward = not math.isfinite(float(reward))
            overlong = self.config.mask_truncated and truncated is not None and bool(truncated[i])
            if bad_reward or overlong:
                masks[i] = torch.zeros_like(masks[i])
            if bad_reward:
                rewards[i] = torch.zeros_like(reward)
        ids = tuple(range(self.next_row_id, self.next_row_id + len(rollout)))
        self.data.store.put(ids, columns)
        self.next_row_id += len(rollout)
        ctx.row_ids = ids
        self._emit("on_rollout_end", ctx)
        finite = rollout.reward[torch.isfinite(rollout.reward)].double()
        lengths = torch.tensor([float(m.sum()) for m in rollout.response_mask])
        return {
            "reward_mean": float(finite.mean()) if finite.numel() else float("nan"),
            "reward_std": float(finite.std(unbiased=False)) if finite.numel() else float("nan"),
            "response_length_mean": float(lengths.mean()) if len(lengths) else 0.0,
            "dropped_rows": float(dropped),
        }

    @torch.no_grad()
    def _score(self, ctx: IterationContext, rows: Sequence[int]) -> None:
        """Write π_old log-probabilities, reference log-probabilities and old values."""
        step = self.data.plan(rows, "score", ctx.iteration, shard=False).steps[0]
        for c, chunk in enumerate(self.data.stream(step, [])):
            if chunk.is_padding:
                continue
            ctx.chunk = c
            columns = {
                OLD_LOGPROBS: _unpad(chunk, self.actor.score(chunk)),
                VALUES: _unpad(chunk, self.critic.score(chunk)),
            }
            if self.reference is not None:
                columns[REF_LOGPROBS] = _unpad(chunk, self.reference.score(chunk))
            self.data.store.write(chunk.row_ids, columns)
        ctx.chunk = -1

    @torch.no_grad()
    def _advantages(self, ctx: IterationContext, rows: Sequence[int]) -> float:
        """GAE with the KL penalty in the reward; whitening over all valid tokens."""
        cfg = self.config
        use_kl = self.reference is not None
        names = [REWARD, VALUES, OLD_LOGPROBS] + ([REF_LOGPROBS] if use_kl else [])
        step = self.data.plan(rows, "advantages", ctx.iteration, shard=False).steps[0]
        moments, kl_sum, kl_count = Moments(), 0.0, 0
        for c, chunk in enumerate(self.data.stream(step, names)):
            if chunk.is_padding:
                continue
            ctx.chunk = c
            mask = chunk.response_mask
            assert chunk.reward is not None and chunk.values is not None
            kl = None
            if use_kl:
                assert chunk.old_logprobs is not None and chunk.ref_logprobs is not None
                kl = kl_penalty(chunk.old_logprobs, chunk.ref_logprobs, cfg.kl_kind)
                kl_sum += float(kl[mask].double().sum())
                kl_count += int(mask.sum())
            rewards = token_rewards(chunk.reward, mask, kl, cfg.kl_coef)
            adv, ret = advantages_and_returns(
                rewards, chunk.values, mask, cfg.gamma, cfg.lam, cfg.lam_returns
            )
            moments.update(adv, mask)
            self.data.store.write(
                chunk.row_ids, {ADVANTAGES: _unpad(chunk, adv), RETURNS: _unpad(chunk, ret)}
            )
        ctx.chunk = -1
        if cfg.whiten_advantages:
            moments.all_reduce()
            for chunk in self.data.stream(step, [ADVANTAGES]):
                if chunk.is_padding:
                    continue
                assert chunk.advantages is not None
                white = whiten(chunk.advantages, chunk.response_mask, moments)
                self.data.store.write(chunk.row_ids, {ADVANTAGES: _unpad(chunk, white)})
        return kl_sum / kl_count if kl_count else 0.0

    def _train_phase(
        self,
        ctx: IterationContext,
        phase: str,
        module: PPOModule,
        epochs: int,
        minibatches: int,
        dropped: int,
    ) -> None:
        """``epochs`` × ``minibatches`` optimizer steps of ``module`` over streamed chunks."""
        names = [VALUES, RETURNS] if phase == "critic" else [OLD_LOGPROBS, ADVANTAGES]
        for epoch in range(epochs):
            ctx.phase, ctx.epoch, ctx.minibatch, ctx.chunk = phase, epoch, -1, -1
            plan = self.data.plan(ctx.row_ids, phase, ctx.iteration, epoch, minibatches, dropped)
            self._emit("on_phase_epoch_start", ctx)
            for step in plan.steps:
                ctx.minibatch, ctx.chunk, ctx.module, ctx.plan = step.minibatch, -1, module, step
                module.begin(step)
                self._emit("on_train_step_start", ctx)
                for c, chunk in enumerate(self.data.stream(step, names)):
                    ctx.chunk = c
                    result = module.train_chunk(chunk)
                    self._emit("on_chunk_end", ctx, result)
                ctx.chunk = -1
                self._emit("on_train_step_end", ctx)
                if module.step_open:
                    raise RuntimeError(
                        f"{phase} step still open after on_train_step_end: no callback finished "
                        "it; keep lppo.callbacks.OptimizerStep in the callbacks."
                    )
                ctx.module = ctx.plan = None
            self._emit("on_phase_epoch_end", ctx)

    def _abort(self, ctx: IterationContext, error: BaseException) -> None:
        """Run every ``on_ppo_abort`` hook; a failing one never hides the original error."""
        for cb in self.callbacks:
            try:
                cb.on_ppo_abort(ctx, error)
            except Exception as cleanup_error:
                error.add_note(
                    f"lppo: {type(cb).__name__}.on_ppo_abort failed during cleanup: "
                    f"{type(cleanup_error).__name__}: {cleanup_error}"
                )

    def _emit(self, hook: str, ctx: IterationContext, *args: Any) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(ctx, *args)
