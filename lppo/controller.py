"""The single controller: one RL iteration, phase by phase, over streamed replay chunks.

An iteration (:meth:`PPOController.run_iteration`) is, in order:

1. **collect**: the rollout's rows get ids from the store and are ``put`` into it;
2. **score**: π_old log-probabilities (or the engine's: ``ppo.old_logprobs``), reference
   log-probabilities, old values and the reward model's scores, streamed chunk by chunk and
   written back as columns (a reward model's score is then combined with the task's reward,
   row by row);
3. **advantages**: the advantage estimator (``GAE`` by default) writes advantages and returns
   (with ``ppo.old_values: critic``, the critic's first epoch writes the old values too);
4. **critic epochs**, then 5. **actor epochs**: ``begin → train_chunk* → finish`` per step;
6. **release**: the rows leave the store exactly once.

Optimizer steps, row retention and abort cleanup are done by callbacks (:mod:`lppo.callbacks`)
that receive the controller's hooks; the controller installs the three built-ins when they
are absent (the one place they are installed) and checks that the rows were released.

Under data parallelism each rank puts the rows it generated (its own store, or its own row ids
of a shared store) and every phase splits by owner: each rank scores, estimates and trains only
its own rows. One all-gather of the rows' metadata per iteration gives every rank the same plan
(global normalizers, equal chunk counts); statistics that span rows (rollout moments, whitening,
group baselines, reward-model moments) are reduced through the parallel context.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn

from lppo.algorithms.off_policy import Mismatch
from lppo.chunks import unpad
from lppo.config import PPOConfig
from lppo.critic_targets import FirstEpochTargets, check_old_values
from lppo.data import ReplayDataModule
from lppo.estimators import GAE, AdvantageEstimator, EstimatorInputs, ValueTargets
from lppo.hooks import IterationContext, PPOCallback
from lppo.modules import ActorModule, CriticModule, PPOModule
from lppo.modules.reward_model import RewardModel
from lppo.modules.snapshot import Transaction
from lppo.parallel import ParallelContext
from lppo.planner import RowLayout
from lppo.replay.rollout_rows import RowRules, StoredRollout, put_rollout
from lppo.stats import Moments
from lppo.types import (
    ADVANTAGES,
    GEN_LOGPROBS,
    OLD_LOGPROBS,
    REF_LOGPROBS,
    RETURNS,
    REWARD,
    RM_SCORE,
    TASK_REWARD,
    VALUES,
    IterationResult,
    Rollout,
    StepPlan,
)

__all__ = ["IterationError", "IterationResult", "PPOController", "disable_dropout"]


class IterationError(RuntimeError):
    """An iteration failed; the message says where (iteration, phase, epoch, chunk)."""


def disable_dropout(module: nn.Module) -> None:
    """Set the probability of every ``nn.Dropout`` (and subclass) inside ``module`` to 0."""
    for m in module.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0


class PPOController:
    """Runs RL iterations over a replay-backed data module.

    Args:
        actor: the policy.
        critic: the value model; ``None`` with a critic-free estimator (no critic phase).
        data: replay store + chunk planner.
        config: algorithm settings.
        reference: frozen reference policy for the KL penalty (needed when
            ``config.kl_coef > 0``).
        callbacks: extra callbacks; the built-in optimizer-step, row-retention and
            abort-cleanup callbacks are added after them when not given.
        estimator: the advantage estimator (default :class:`~lppo.estimators.GAE`).
        parallel: the process groups; the actor, critic and planner use its data-parallel
            group.
        trainer: the Lightning trainer when run under one (handed to the hooks).
        reward_model: a learned reward scored in the score phase and combined with the
            task's reward before the advantages.
    """

    def __init__(
        self,
        actor: ActorModule,
        critic: CriticModule | None,
        data: ReplayDataModule,
        config: PPOConfig | None = None,
        reference: ActorModule | None = None,
        callbacks: Sequence[PPOCallback] = (),
        estimator: AdvantageEstimator | None = None,
        parallel: ParallelContext | None = None,
        trainer: Any = None,
        reward_model: RewardModel | None = None,
    ) -> None:
        from lppo.callbacks import AbortCleanup, OptimizerStep, RowRetention

        self.actor = actor
        self.critic = critic
        self.data = data
        self.config = config if config is not None else PPOConfig()
        if self.config.kl_coef > 0 and reference is None:
            raise ValueError(
                f"model.ppo.kl_coef={self.config.kl_coef} needs a reference policy; pass "
                "reference= (PPOSystem builds a frozen copy of the actor) or set kl_coef=0."
            )
        self.reference = reference
        self.reward_model = reward_model
        self.estimator: AdvantageEstimator = estimator if estimator is not None else GAE()
        check_critic(critic, self.estimator)
        check_old_values(self.config, self.estimator)
        self.parallel = parallel if parallel is not None else ParallelContext()
        for module in self.trainable_modules():
            module.parallel = self.parallel
        if self.config.disable_dropout:
            for module in (actor, critic, reference):
                if module is not None:
                    disable_dropout(module)
        self.callbacks: list[PPOCallback] = list(callbacks)
        #: The built-ins installed here (not among the trainer's callbacks, so Lightning does
        #: not checkpoint them; :meth:`installed_state` does).
        self.installed: tuple[PPOCallback, ...] = tuple(
            builtin()
            for builtin in (OptimizerStep, RowRetention, AbortCleanup)
            if not any(isinstance(cb, builtin) for cb in self.callbacks)
        )
        self.callbacks.extend(self.installed)
        self.trainer = trainer

    def installed_state(self) -> dict[str, dict[str, Any]]:
        """``class name -> state_dict()`` of the built-in callbacks installed here."""
        return {type(cb).__name__: cb.state_dict() for cb in self.installed}

    def load_installed_state(self, state: dict[str, dict[str, Any]]) -> None:
        """Restore :meth:`installed_state` (callbacks missing from ``state`` keep theirs)."""
        for cb in self.installed:
            if type(cb).__name__ in state:
                cb.load_state_dict(state[type(cb).__name__])

    def trainable_modules(self) -> tuple[PPOModule, ...]:
        """The modules that take optimizer steps (critic first, when there is one)."""
        return (self.actor,) if self.critic is None else (self.critic, self.actor)

    def run_iteration(
        self,
        rollout: Rollout | StoredRollout,
        iteration: int,
        dropped: int = 0,
        rollout_seconds: float = 0.0,
    ) -> IterationResult:
        """Run one RL iteration on ``rollout``; rows are released whatever happens.

        Args:
            rollout: this rank's samples of the iteration (already scored by the reward
                function), or their rows already in the store (put by the engine's workers);
                under data parallelism each rank passes its own.
            iteration: iteration index (seeds the shuffles; decides critic warmup).
            dropped: this rank's samples lost before reaching the store (summed over ranks,
                they count against the drop budget).
            rollout_seconds: time spent generating ``rollout`` (reported, not used).

        Raises:
            IterationError: anything failed; open steps were aborted and rows released.
        """
        ctx = IterationContext(
            iteration=iteration,
            store=self.data.store,
            modules=self.trainable_modules(),
            config=self.config,
            trainer=self.trainer,
        )
        # model.ppo.transactional: an iteration commits actor and critic together or not at all
        backup = Transaction(self.trainable_modules()) if self.config.transactional else None
        try:
            return self._run(ctx, rollout, dropped, rollout_seconds)
        except BaseException as error:
            where = ctx.where()
            self._abort(ctx, error)
            if backup is not None:
                backup.rollback()
            if not isinstance(error, Exception):
                raise
            raise IterationError(f"{where}: {type(error).__name__}: {error}") from error

    # ----------------------------------------------------------------- phases
    def _run(
        self,
        ctx: IterationContext,
        rollout: Rollout | StoredRollout,
        dropped: int,
        rollout_seconds: float,
    ) -> IterationResult:
        cfg = self.config
        seconds = {"rollout": rollout_seconds}
        clock = time.perf_counter()

        # 1. collect (each rank its own rows; the layout of every rank's rows is gathered once)
        stats, rollout_tokens = self._collect(ctx, rollout, dropped)
        tokens = {"rollout": rollout_tokens}
        rows = self.data.layout(ctx.row_ids, self.parallel.data)
        dropped = int(stats["dropped_rows"])  # every rank's
        clock = _lap(seconds, "collect", clock)

        # 2. score (each rank its own valid rows; no collective, so chunk counts may differ)
        ctx.phase = "score"
        plan = self.data.plan(rows, "score", ctx.iteration, dropped=dropped, no_grad=True)
        stats["invalid_rows"] = float(len(plan.invalid_rows))
        padding = {"score": plan.padding_fraction}
        step = plan.steps[0]
        stats.update(self._score(ctx, step))
        clock = _lap(seconds, "score", clock)

        # 3. advantages (each rank its own rows; statistics reduced over the ranks)
        ctx.phase = "advantages"
        group = self.parallel.data
        inputs = EstimatorInputs(self.data.store, step, group, cfg.kl_coef, cfg.kl_kind)
        targets = None
        if cfg.old_values == "critic":  # the critic's first epoch writes them (4.)
            targets = FirstEpochTargets(cast(ValueTargets, self.estimator), inputs)
        else:
            stats.update(self.estimator.estimate(inputs))
        clock = _lap(seconds, "advantages", clock)

        # 4. critic epochs, 5. actor epochs (none during critic warmup)
        phases: list[tuple[str, PPOModule, int, int]] = []
        if self.critic is not None:
            phases.append(("critic", self.critic, cfg.critic_epochs, cfg.critic_minibatches))
        if ctx.iteration >= cfg.critic_warmup_iterations:
            phases.append(("actor", self.actor, cfg.actor_epochs, cfg.actor_minibatches))
        for phase, module, epochs, minibatches in phases:
            first = len(ctx.step_stats)
            first_epoch = targets if phase == "critic" else None
            padding[phase] = self._train_phase(
                ctx, rows, phase, module, epochs, minibatches, dropped, first_epoch
            )
            if first_epoch is not None:  # 3. for old_values=critic: whiten (before the actor)
                ctx.phase = "advantages"
                stats.update(first_epoch.finish())
            clock = _lap(seconds, phase, clock)
            tokens[phase] = sum(s.tokens for s in ctx.step_stats[first:])

        # 6. release: RowRetention releases the rows in on_iteration_end
        ctx.phase, ctx.epoch, ctx.minibatch, ctx.chunk = "release", -1, -1, -1
        ctx.module = ctx.plan = None
        steps = list(ctx.step_stats)
        result = IterationResult(ctx.iteration, stats, steps, seconds, tokens, padding)
        self._emit("on_iteration_end", ctx, result)
        if not ctx.rows_released:
            raise RuntimeError(
                "the iteration's rows were not released in on_iteration_end; keep "
                "lppo.callbacks.RowRetention (or a subclass that calls its release) in the "
                "callbacks."
            )
        return result

    def _collect(
        self, ctx: IterationContext, rollout: Rollout | StoredRollout, dropped: int
    ) -> tuple[dict[str, float], int]:
        """Put the rollout into the store (unless its rows are there), report its statistics.

        A :class:`~lppo.rollout.RolloutSource` with a store hands over a :class:`StoredRollout`
        (it put the rows, or its engine's workers did); a :class:`Rollout` handed to
        :meth:`run_iteration` directly is put here, by the same :func:`put_rollout`.

        Returns:
            The statistics over every rank's rollout, and every rank's response tokens.
        """
        if isinstance(rollout, Rollout):
            store = self.data.store
            ids = store.allocate(len(rollout))
            rollout = put_rollout(store, ids, rollout, RowRules.of(self.config))
        ctx.row_ids = rollout.row_ids  # from here on the release path covers them
        self._emit("on_rollout_end", ctx)
        return self._rollout_stats(rollout, dropped)

    def _rollout_stats(self, rows: StoredRollout, dropped: int) -> tuple[dict[str, float], int]:
        """Reward and length moments and loss counts of every rank's rows (as generated)."""
        group = self.parallel.data
        reward, length = Moments(), Moments()
        reward.update(rows.reward[torch.isfinite(rows.reward)])
        length.update(rows.response_tokens)
        reward.all_reduce(group)
        length.all_reduce(group)
        counts = torch.tensor(
            [dropped, rows.bad_rewards, length.count * length.mu], dtype=torch.float64
        )
        dropped_all, bad_all, tokens = group.all_reduce(counts).tolist()
        stats = {
            "reward_mean": reward.mu if reward.count else float("nan"),
            "reward_std": math.sqrt(reward.var) if reward.count else float("nan"),
            "response_length_mean": length.mu,
            "dropped_rows": dropped_all,
            "bad_rewards": bad_all,
        }
        return stats, round(tokens)

    @torch.no_grad()
    def _score(self, ctx: IterationContext, step: StepPlan) -> dict[str, float]:
        """Write π_old and reference log-probabilities, old values and reward-model rewards.

        Also measures the engine/trainer mismatch on every sampled token (π_old against the
        engine's ``gen_logprobs``): ``mismatch_kl``, ``mismatch_max_abs_log_ratio`` and
        ``mismatch_outside_fraction`` (bounds of ``actor.off_policy``), always on.
        """
        scores: dict[int, float] = {}
        reuse = self.config.old_logprobs == "rollout"
        mismatch = Mismatch()
        for c, chunk in enumerate(self.data.stream(step, [GEN_LOGPROBS])):
            if chunk.is_padding:
                continue
            ctx.chunk = c
            gen = chunk.gen_logprobs
            assert gen is not None
            if reuse:  # the engine's sampling log-probabilities, masked as actor.score masks
                old = torch.where(chunk.response_mask, gen, torch.zeros_like(gen))
            else:
                old = self.actor.score(chunk)
            # With old_logprobs=rollout, π_old is μ: the mismatch (and every IS weight) is 0 / 1.
            mismatch.add(old.cpu(), gen, chunk.response_mask, self.actor.off_policy)
            columns = {OLD_LOGPROBS: unpad(chunk, old)}
            if self.critic is not None and self.config.old_values == "score":
                columns[VALUES] = unpad(chunk, self.critic.score(chunk))
            if self.reference is not None:
                columns[REF_LOGPROBS] = unpad(chunk, self.reference.score(chunk))
            if self.reward_model is not None:
                rows = self.reward_model.score(chunk).tolist()
                scores.update(zip(chunk.row_ids, rows, strict=True))
            self.data.store.write(chunk.row_ids, columns)
        ctx.chunk = -1
        mismatch.all_reduce(self.parallel.data)  # each rank scored only its own rows
        stats = mismatch.metrics()
        if self.reward_model is not None:
            stats.update(self._combine_rewards(scores))
        return stats

    def _combine_rewards(self, scores: dict[int, float]) -> dict[str, float]:
        """Replace each scored row's reward by the reward model's combination (row scalars).

        The task's reward is kept as ``task_reward`` and the raw score as ``rm_score``.
        """
        assert self.reward_model is not None
        ids = list(scores)  # may be empty on a rank without valid rows: it still reduces
        read = self.data.store.read(ids, [REWARD])[REWARD] if ids else []
        task = torch.stack(read) if read else torch.zeros(0)
        raw = torch.tensor([scores[i] for i in ids], dtype=torch.float64)
        combined = self.reward_model.combine(task, raw, self.parallel.data).to(task.dtype)
        if ids:
            self.data.store.write(
                ids,
                {
                    REWARD: list(combined.unbind(0)),
                    TASK_REWARD: list(task.unbind(0)),
                    RM_SCORE: list(raw.unbind(0)),
                },
            )
        group = self.parallel.data
        moments = {"rm_score": Moments(), "reward_combined": Moments()}
        moments["rm_score"].update(raw)
        moments["reward_combined"].update(combined)
        for m in moments.values():
            m.all_reduce(group)
        return {
            "rm_score_mean": moments["rm_score"].mean,
            "rm_score_std": math.sqrt(moments["rm_score"].var),
            "reward_combined_mean": moments["reward_combined"].mean,
        }

    def _train_phase(
        self,
        ctx: IterationContext,
        rows: RowLayout,
        phase: str,
        module: PPOModule,
        epochs: int,
        minibatches: int,
        dropped: int,
        targets: FirstEpochTargets | None = None,
    ) -> float:
        """``epochs`` × ``minibatches`` optimizer steps of ``module`` over streamed chunks.

        With ``targets`` (the critic under ``old_values=critic``) the first epoch's chunks
        carry them instead of the old values and returns, which that epoch writes.

        Returns:
            The plans' padding fraction, mean over the epochs.
        """
        names = [VALUES, RETURNS] if phase == "critic" else [OLD_LOGPROBS, ADVANTAGES]
        if phase == "actor" and self.actor.off_policy.enabled:
            names.append(GEN_LOGPROBS)
        padding = 0.0
        for epoch in range(epochs):
            ctx.phase, ctx.epoch, ctx.minibatch, ctx.chunk = phase, epoch, -1, -1
            plan = self.data.plan(rows, phase, ctx.iteration, epoch, minibatches, dropped)
            padding += plan.padding_fraction / epochs
            self._emit("on_phase_epoch_start", ctx)
            for step in plan.steps:
                ctx.minibatch, ctx.chunk, ctx.module, ctx.plan = step.minibatch, -1, module, step
                module.begin(step)
                self._emit("on_train_step_start", ctx)
                fused = targets if epoch == 0 else None
                columns = fused.columns if fused is not None else names
                for c, chunk in enumerate(self.data.stream(step, columns)):
                    ctx.chunk = c
                    if fused is not None:
                        chunk = dataclasses.replace(chunk, targets=fused)
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
        return padding

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
        if ctx.row_ids and not ctx.rows_released:
            error.add_note(
                f"lppo: rows {ctx.row_ids[0]}..{ctx.row_ids[-1]} of the failed iteration were "
                "not released (no RowRetention callback released them)."
            )

    def _emit(self, hook: str, ctx: IterationContext, *args: Any) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(ctx, *args)


def check_critic(critic: CriticModule | None, estimator: AdvantageEstimator) -> None:
    """Reject a critic the estimator ignores, or a missing critic it needs.

    Raises:
        ValueError: naming ``model.critic``, ``model.estimator`` and the fix.
    """
    name = type(estimator).__name__
    uses = bool(getattr(estimator, "uses_critic", True))
    if uses and critic is None:
        raise ValueError(
            f"model.critic is null but model.estimator={name} needs a critic (its values and "
            "returns); give model.critic, or pick a critic-free estimator "
            "(lppo.estimators.GRPO, RLOO, ReinforcePP)."
        )
    if not uses and critic is not None:
        raise ValueError(
            f"model.estimator={name} is critic-free: the critic would train on targets nobody "
            "writes; set model.critic: null (or use lppo.estimators.GAE)."
        )


def _lap(seconds: dict[str, float], phase: str, start: float) -> float:
    """Record the time since ``start`` as ``phase``'s; return the new start."""
    now = time.perf_counter()
    seconds[phase] = now - start
    return now
