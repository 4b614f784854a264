"""The single controller: one RL iteration, phase by phase, over streamed replay chunks.

An iteration (:meth:`PPOController.run_iteration`) starts with its rows in the store (the
rollout source put them) and is, in order:

1. **collect**: every rank's row layout is gathered, rows move between ranks to balance tokens
   (:mod:`lppo.iteration.balance`) and are claimed;
2. **score** (:class:`~lppo.iteration.score_phase.ScorePhase`): π_old and reference
   log-probabilities, old values and reward-model scores, streamed chunk by chunk and written back
   as columns
   (π_old during the actor's first epoch with ``ppo.old_logprobs: actor``,
   :mod:`lppo.iteration.old_logprobs`);
3. **advantages** (:class:`~lppo.iteration.critic_targets.AdvantagePhase`): the advantage estimator
   writes advantages and returns (with ``ppo.old_values: critic``, during the critic's first
   epoch);
4. **critic epochs**, then 5. **actor epochs**: ``begin → train_chunk* → finish`` per step;
6. **release**: the rows leave the store exactly once.

Optimizer steps, row retention and abort cleanup are done by the lifecycle callbacks
(``lppo.callbacks.lifecycle()``); the controller imports none and checks that each did its job.

Under data parallelism each rank trains the rows it holds after the collect phase balanced
them; one all-gather of the rows' metadata gives every rank the same plan (global normalizers,
equal chunk counts), and statistics that span rows are reduced over the ranks.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from lppo.config import PPOConfig
from lppo.errors import IterationError
from lppo.estimators import GAE, AdvantageEstimator, EstimatorInputs
from lppo.iteration.balance import balance_metrics
from lppo.iteration.columns import pi_old
from lppo.iteration.critic_targets import AdvantagePhase, FirstEpochTargets
from lppo.iteration.data import ReplayDataModule
from lppo.iteration.hooks import IterationContext, PPOCallback, abort_all
from lppo.iteration.old_logprobs import FirstEpochLogprobs
from lppo.iteration.planner import RowLayout, check_untrained
from lppo.iteration.score_phase import ScorePhase, rollout_stats
from lppo.layouts.base import ParallelContext
from lppo.modules import ActorModule, CriticModule, PPOModule
from lppo.modules.lifecycle import disable_dropout
from lppo.modules.reward_model import RewardModel
from lppo.modules.snapshot import Transaction
from lppo.replay.rollout_rows import StoredRollout
from lppo.run import interrupts
from lppo.run.log import RunLog
from lppo.run.plan import RunPlan, resolve_columns
from lppo.types import (
    GenerationReport,
    IterationResult,
    RolloutStats,
    StepPlan,
)

__all__ = ["PPOController", "disable_dropout"]


class PPOController:
    """Runs RL iterations over a replay-backed data module.

    Args:
        actor: the policy.
        critic: the value model; ``None`` with a critic-free estimator (no critic phase).
        data: replay store + chunk planner.
        config: algorithm settings.
        reference: frozen reference policy for the KL penalty (needed when
            ``config.kl_coef > 0``).
        callbacks: the callbacks receiving the iteration's hooks, in order; they must include
            the lifecycle callbacks (``lppo.callbacks.lifecycle()``: optimizer step, row
            retention, abort cleanup) or an iteration fails with a message naming the missing
            one.
        estimator: the advantage estimator (default :class:`~lppo.estimators.GAE`).
        parallel: the process groups; the actor, critic and planner use its data-parallel
            group.
        trainer: the Lightning trainer when run under one (handed to the hooks).
        reward_model: a learned reward scored in the score phase and combined with the
            task's reward before the advantages.
        run_log: the run's metrics axis and history, handed to the hooks (a new one when
            ``None``).
        plan: the run plan (:class:`~lppo.run.plan.RunPlan`), whose resolved ``ppo`` is the
            controller's config; ``None`` (a controller built on its own): the producers of
            π_old and old values are decided for ``config`` here, with no engine known.
        teacher: the frozen teacher of on-policy distillation, scored in the score phase
            (``teacher_logprobs``); ``None``: none.
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
        run_log: RunLog | None = None,
        plan: RunPlan | None = None,
        teacher: ActorModule | None = None,
    ) -> None:
        self.actor = actor
        self.critic = critic
        self.data = data
        self.estimator: AdvantageEstimator = estimator if estimator is not None else GAE()
        if plan is not None:
            self.config = plan.ppo
        else:
            given = config if config is not None else PPOConfig()
            self.config = resolve_columns(
                given, self.estimator, actor, critic, teacher=teacher is not None
            )
        if (self.config.kl_coef > 0 or actor.needs_reference) and reference is None:
            raise ValueError(
                f"model.ppo.kl_coef={self.config.kl_coef} with model.actor.init_args."
                f"kl_loss_coef={actor.kl_loss_coef} needs a reference policy; pass reference= "
                "(PPOSystem builds a frozen copy of the actor) or set both to 0."
            )
        self.reference = reference
        self.advantages = AdvantagePhase(self.estimator, self.config)
        self.parallel = parallel if parallel is not None else ParallelContext()
        for module in self.trainable_modules():
            module.parallel = self.parallel
        if self.config.disable_dropout:
            for module in (actor, critic, reference, teacher):
                if module is not None:
                    disable_dropout(module)
        self.scorer = ScorePhase(
            actor, critic, reference, reward_model, data, self.config, self.parallel.data, teacher
        )
        self.callbacks: list[PPOCallback] = list(callbacks)
        self.trainer = trainer
        self.run_log = run_log if run_log is not None else RunLog()

    def trainable_modules(self) -> tuple[PPOModule, ...]:
        """The modules that take optimizer steps (critic first, when there is one)."""
        return (self.actor,) if self.critic is None else (self.critic, self.actor)

    def context(self, iteration: int, row_ids: tuple[int, ...] = ()) -> IterationContext:
        """A fresh context of ``iteration`` (what every hook receives)."""
        return IterationContext(
            iteration=iteration,
            store=self.data.store,
            modules=self.trainable_modules(),
            config=self.config,
            row_ids=row_ids,
            trainer=self.trainer,
            run_log=self.run_log,
        )

    def run_iteration(
        self,
        rollout: StoredRollout,
        iteration: int,
        rollout_seconds: float = 0.0,
        generation: GenerationReport | None = None,
    ) -> IterationResult:
        """Run one RL iteration on ``rollout``; rows are released whatever happens.

        Args:
            rollout: this rank's rows of the iteration, already in the store (put by the
                rollout source, or by :func:`~lppo.replay.rollout_rows.put_rollout`); under
                data parallelism each rank passes its own. ``rollout.dropped`` (summed over
                ranks) counts against the drop budget.
            iteration: iteration index (seeds the shuffles; decides critic warmup).
            rollout_seconds: time spent generating ``rollout`` (reported, not used).
            generation: the rollout's lag and generation timing (reported, not used;
                ``None``: generated synchronously, staleness 0).

        Raises:
            IterationError: anything failed; open steps were aborted and rows released.
        """
        ctx = self.context(iteration, rollout.row_ids)  # the release path covers them now
        backup: Transaction | None = None
        try:
            # model.ppo.transactional: actor and critic commit together or not at all
            backup = Transaction(self.trainable_modules()) if self.config.transactional else None
            return self._run(ctx, rollout, rollout_seconds, generation or GenerationReport())
        except BaseException as error:
            where = ctx.where()
            abort_all(self.callbacks, ctx, error)
            if backup is not None:
                backup.rollback()
            if not isinstance(error, Exception):
                raise
            raise IterationError(f"{where}: {type(error).__name__}: {error}") from error

    def end_failed(self, result: IterationResult) -> None:
        """Hand a failed iteration's ``result`` to every ``on_iteration_end``.

        A failed iteration is an iteration: callbacks log and count it like any other (its
        rows were released when it failed).
        """
        ctx = self.context(result.iteration)
        ctx.phase, ctx.rows_released = "release", True
        interrupts.hold()  # counted (as failed) from here, like a finished one
        self._emit("on_iteration_end", ctx, result)

    # ----------------------------------------------------------------- phases
    def _run(
        self,
        ctx: IterationContext,
        rollout: StoredRollout,
        rollout_seconds: float,
        generation: GenerationReport,
    ) -> IterationResult:
        cfg = self.config
        group = self.parallel.data
        seconds = {"rollout": rollout_seconds}
        clock = time.perf_counter()

        # 1. collect (the layout of every rank's rows, re-cut into blocks of equal tokens)
        rows, stats, tokens = self._collect(ctx, rollout, generation)
        dropped = int(stats.dropped_rows)  # every rank's
        clock = _lap(seconds, "collect", clock)
        if rollout.sampling is not None:  # dynamic sampling: did it keep any group?
            stats.extra["untrained"] = float(not rows.meta.ids)
            if not rows.meta.ids:  # every group dropped (all rewards equal): samples lost
                lost = int(stats.extra["short_samples"]) + dropped
                check_untrained(lost, self.data.settings.drop_budget, ctx.iteration)
                empty = IterationResult(ctx.iteration, stats, [], seconds, tokens, {})
                return self._release(ctx, empty, generation)

        # 2. score (each rank its own valid rows; no collective, so chunk counts may differ)
        ctx.phase = "score"
        plan = self.data.plan(rows, "score", ctx.iteration, dropped=dropped, no_grad=True)
        stats.invalid_rows = float(len(plan.invalid_rows))
        padding = {"score": plan.padding_fraction}
        step = plan.steps[0]
        with self.parallel.layout.gathered(self.scorer.models):  # rank-local forwards
            stats.update(self.scorer.run(ctx, step))
        clock = _lap(seconds, "score", clock)

        # 3. advantages (each rank its own rows; statistics reduced over the ranks)
        ctx.phase = "advantages"
        multi_turn = rollout.episodes is not None
        inputs = EstimatorInputs(
            self.data.store, step, group, cfg.kl_coef, cfg.kl_kind, turn_rewards=multi_turn
        )
        targets = self.advantages.start(inputs, stats)
        old_policy = None
        if pi_old(cfg.old_logprobs).stage == "first_epoch":  # the first epoch computes π_old
            old_policy = FirstEpochLogprobs(self.data.store, step, self.actor.off_policy, group)
        clock = _lap(seconds, "advantages", clock)

        # 4. critic epochs, 5. actor epochs (none during critic warmup)
        for phase, module, epochs, minibatches in self._phases(ctx, rollout, rows):
            first = len(ctx.step_stats)
            first_epoch = targets if phase == "critic" else old_policy
            padding[phase] = self._train_phase(
                ctx, rows, (phase, module, epochs, minibatches), dropped, first_epoch, stats
            )
            clock = _lap(seconds, phase, clock)
            tokens[phase] = sum(s.tokens for s in ctx.step_stats[first:])

        # 6. release: RowRetention releases the rows in on_iteration_end
        return self._release(
            ctx, IterationResult(ctx.iteration, stats, [], seconds, tokens, padding), generation
        )

    def _phases(
        self, ctx: IterationContext, rollout: StoredRollout, rows: RowLayout
    ) -> list[tuple[str, PPOModule, int, int]]:
        """``(phase, module, epochs, minibatches)`` of the iteration's training phases, in order."""
        cfg = self.config
        phases: list[tuple[str, PPOModule, int, int]] = []
        if self.critic is not None:
            phases.append(("critic", self.critic, cfg.critic_epochs, cfg.critic_minibatches))
        if ctx.iteration >= cfg.critic_warmup_iterations:
            phases.append(("actor", self.actor, cfg.actor_epochs, cfg.actor_minibatches))
        if rollout.sampling is not None:  # dynamic sampling: train on what there is
            valid = max(sum(1 for n in rows.meta.valid_tokens if n > 0), 1)
            phases = [(p, m, e, min(k, valid)) for p, m, e, k in phases]
        return phases

    def _collect(
        self, ctx: IterationContext, rollout: StoredRollout, generation: GenerationReport
    ) -> tuple[RowLayout, RolloutStats, dict[str, int]]:
        """Gather every rank's rows, balance their tokens over the ranks, claim them.

        Rows this rank received from another (:mod:`lppo.iteration.balance`) join ``ctx.row_ids``
        before ``on_rollout_end`` (where they are claimed), so they are released with the
        rank's own; the rows it sent stay there too, released with the rest.

        Returns:
            The layout the iteration trains on, the rollout statistics and the token counts.
        """
        group = self.parallel.data
        generated = self.data.layout(ctx.row_ids, group)
        rows, moves = self.data.balance(generated, rollout.columns, group)
        ctx.row_ids += moves.received
        self._emit("on_rollout_end", ctx)
        stats, rollout_tokens = rollout_stats(rollout, group)
        stats.staleness = float(generation.staleness)
        if group.size > 1:
            stats.update(balance_metrics(generated, rows, group.size))
        return rows, stats, {"rollout": rollout_tokens}

    def _release(
        self, ctx: IterationContext, result: IterationResult, generation: GenerationReport
    ) -> IterationResult:
        """Close the iteration: its steps and timing into ``result``, rows released by hooks."""
        ctx.phase, ctx.epoch, ctx.minibatch, ctx.chunk = "release", -1, -1, -1
        ctx.module = ctx.plan = None
        result.steps = list(ctx.step_stats)
        result.generation = generation.timing()
        interrupts.hold()  # counted from here: a signal waits for the iteration's checkpoint
        self._emit("on_iteration_end", ctx, result)
        if not ctx.rows_released:
            raise RuntimeError(
                "the iteration's rows were not released in on_iteration_end; keep "
                "lppo.callbacks.RowRetention (or a subclass that calls its release) in the "
                "callbacks (lppo.callbacks.lifecycle())."
            )
        return result

    def _train_phase(
        self,
        ctx: IterationContext,
        rows: RowLayout,
        what: tuple[str, PPOModule, int, int],
        dropped: int,
        targets: FirstEpochTargets | FirstEpochLogprobs | None,
        stats: RolloutStats,
    ) -> float:
        """``epochs`` × ``minibatches`` optimizer steps of ``module`` over streamed chunks.

        Args:
            ctx: the iteration's context.
            rows: every rank's rows (what the plans are made of).
            what: ``(phase, module, epochs, minibatches)``.
            dropped: every rank's dropped samples (against the drop budget).
            targets: the columns the first epoch takes from the module's own forward pass
                (:class:`~lppo.iteration.columns.OwnColumns`, handed to ``begin``): the
                critic's old values and targets under ``old_values: critic`` (the advantages
                are finished after that epoch), or π_old under ``old_logprobs: actor``. They
                are stored after each chunk's backward pass.
            stats: the iteration's statistics (the first epoch's metrics go here).

        Returns:
            The plans' padding fraction, mean over the epochs.
        """
        phase, module, epochs, minibatches = what
        names = module.reads()  # the columns its chunks stream (declared by the module)
        padding = 0.0
        for epoch in range(epochs):
            ctx.phase, ctx.epoch, ctx.minibatch, ctx.chunk = phase, epoch, -1, -1
            plan = self.data.plan(rows, phase, ctx.iteration, epoch, minibatches, dropped)
            padding += plan.padding_fraction / epochs
            self._emit("on_phase_epoch_start", ctx)
            fused = targets if epoch == 0 else None
            columns = fused.columns(names) if fused is not None else names
            for step in plan.steps:
                self._train_step(ctx, module, step, columns, fused)
            self._emit("on_phase_epoch_end", ctx)
            if isinstance(fused, FirstEpochTargets):  # 3. for old_values=critic: whiten
                ctx.phase = "advantages"
            if fused is not None:
                stats.update(fused.finish())
        return padding

    def _train_step(
        self,
        ctx: IterationContext,
        module: PPOModule,
        step: StepPlan,
        columns: list[str],
        fused: FirstEpochTargets | FirstEpochLogprobs | None,
    ) -> None:
        """One optimizer step: ``begin``, every chunk of ``step``, then the callbacks finish it."""
        ctx.minibatch, ctx.chunk, ctx.module, ctx.plan = step.minibatch, -1, module, step
        module.begin(step, fused)
        self._emit("on_train_step_start", ctx)
        for c, chunk in enumerate(self.data.stream(step, columns)):
            ctx.chunk = c
            result = module.train_chunk(chunk)
            if fused is not None:  # the columns the chunk's forward pass produced
                fused.commit()
            self._emit("on_chunk_end", ctx, result)
        ctx.chunk = -1
        self._emit("on_train_step_end", ctx)
        if module.step_open:
            raise RuntimeError(
                f"{ctx.phase} step still open after on_train_step_end: no callback finished "
                "it; keep lppo.callbacks.OptimizerStep in the callbacks "
                "(lppo.callbacks.lifecycle())."
            )
        ctx.module = ctx.plan = None

    def _emit(self, hook: str, ctx: IterationContext, *args: Any) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(ctx, *args)


def _lap(seconds: dict[str, float], phase: str, start: float) -> float:
    """Record the time since ``start`` as ``phase``'s; return the new start."""
    seconds[phase] = (now := time.perf_counter()) - start
    return now
