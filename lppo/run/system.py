"""``PPOSystem``: the LightningModule composing actor, critic, task, engine and estimator."""

from __future__ import annotations

import copy
import sys
import time
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch
from lightning.pytorch import LightningModule

from lppo.config import PPOConfig
from lppo.decisions import collecting
from lppo.errors import IterationError
from lppo.estimators import GAE, AdvantageEstimator
from lppo.iteration.controller import PPOController
from lppo.iteration.data import ReplayDataModule
from lppo.iteration.failure_policy import FailurePolicy
from lppo.iteration.hooks import PPOCallback
from lppo.layouts.base import ParallelContext
from lppo.loop import attached_trainer, instantiated_by_cli
from lppo.modules import ActorModule, CriticModule, RewardModel, Teacher
from lppo.modules.tokenizer import check_vocabularies, run_tokenizer
from lppo.rollout import HFGenerateEngine, RolloutEngine, RolloutSettings, RolloutSource
from lppo.rollout.capabilities import capabilities_of
from lppo.rollout.pipeline import RolloutPipeline
from lppo.rollout.runners import RolloutRunner
from lppo.run.checkpointing import (
    ROLLOUTS_KEY,
    RUN_LOG_KEY,
    SETTINGS_KEY,
    check_resume,
    run_settings,
    scale_resumed_lrs,
    upgrade_layout,
)
from lppo.run.log import RunLog
from lppo.run.plan import PLAN_KEY, RunParts, RunPlan, plan_changes, with_decisions
from lppo.runtime.lifetimes import RunResources
from lppo.runtime.ray_runtime import RaySettings, configure_ray
from lppo.runtime.strategy import check_strategy, parallel_context
from lppo.tasks import Task
from lppo.types import IterationResult
from lppo.validation import SettingError, check_number

__all__ = ["PPOSystem", "RolloutSettings"]


class PPOSystem(LightningModule):
    """Actor, critic, task, engine and estimator composed by injection.

    Driven by :class:`lppo.loop.PPOFitLoop`: one trainer epoch is one RL iteration
    (:meth:`run_iteration`): 1. its rollout from the fixed-lag scheduler
    (:class:`~lppo.rollout.pipeline.RolloutPipeline`); 2. the controller's score → advantages →
    critic epochs → actor epochs → release; 3. the new weights published, and the iteration
    ``max_staleness + 1`` ahead admitted with them.

    Data parallelism (``trainer.strategy=ppo_ddp``, several devices): each rank generates, scores
    and trains its own blocks of prompts; gradients and statistics are reduced across ranks.

    Args:
        actor: the policy (subclass :class:`ActorModule` to customize it).
        critic: the value model (subclass :class:`CriticModule` to customize it); ``null``
            with a critic-free estimator (``lppo.estimators.GRPO``, ``RLOO``, ``ReinforcePP``).
        task: prompt source and verifiable reward (subclass :class:`~lppo.tasks.Task`).
        engine: the rollout engine, any :class:`~lppo.rollout.RolloutEngine` (``null``:
            ``lppo.rollout.HFGenerateEngine`` with its defaults).
        estimator: the advantage estimator, any :class:`~lppo.estimators.AdvantageEstimator`
            (``null``: ``lppo.estimators.GAE`` with its defaults).
        reward_model: a learned reward (:class:`~lppo.modules.RewardModel`), scored in the
            score phase and combined with the task's (``null``: the task's reward alone).
        rollout: sampling settings, the one source of them (the actor scores with the same
            temperature).
        ppo: algorithm settings.
        tokenizer_path: local tokenizer directory; ``null`` builds a character tokenizer from
            the task's vocabulary.
        seed: seed of prompt sampling and generation (iteration ``i`` uses a seed derived from
            ``(seed, i)``, so a resumed run samples exactly what the uninterrupted run would).
        num_threads: ``torch.set_num_threads`` at setup (``null`` leaves torch's default).
        runner: where rollouts are generated, any class implementing
            :class:`~lppo.rollout.runners.RolloutRunner` (``null``: the run plan picks the
            trainer at ``max_staleness`` 0, else ``lppo.rollout.ProcessRunner``, or
            ``ThreadRunner`` for Ray rollout workers).
        resize_embeddings: resize a checkpoint's token embeddings (actor, critic or reward
            model) to the run's tokenizer when their vocabularies differ (rows it adds start
            untrained); ``false`` (default): such a checkpoint is refused at setup.
        teacher: a frozen model for on-policy distillation (:class:`~lppo.modules.Teacher`),
            scored in the score phase; ``model.estimator`` must read its log-probs
            (``lppo.estimators.Distill``). ``null``: none.
    """

    #: ``model.num_threads`` is applied at setup, so a resumed run may change it.
    resume_safe: ClassVar[tuple[str, ...]] = ("num_threads",)

    def __init__(
        self,
        actor: ActorModule,
        critic: CriticModule | None,
        task: Task,
        engine: RolloutEngine | None = None,
        estimator: AdvantageEstimator | None = None,
        reward_model: RewardModel | None = None,
        rollout: RolloutSettings = RolloutSettings(),
        ppo: PPOConfig = PPOConfig(),
        tokenizer_path: str | None = None,
        seed: int = 0,
        num_threads: int | None = None,
        runner: RolloutRunner | None = None,
        resize_embeddings: bool = False,
        teacher: Teacher | None = None,
    ) -> None:
        super().__init__()
        _check_own_settings(seed, num_threads, resize_embeddings)
        self.resize_embeddings = resize_embeddings
        # Under LightningCLI the hparams are the parsed config, from which load_from_checkpoint
        # rebuilds everything; from Python, objects stay out (weights_only=True loads).
        objects = "actor critic task engine estimator reward_model rollout ppo runner teacher"
        ignore = [] if instantiated_by_cli() else objects.split()
        self.save_hyperparameters(ignore=ignore, logger=False)
        self.automatic_optimization = False
        self.actor, self.critic = actor, critic
        self.task = task
        self.engine: RolloutEngine = engine if engine is not None else HFGenerateEngine()
        self.estimator: AdvantageEstimator = estimator if estimator is not None else GAE()
        self.reward_model = reward_model
        self.rollout = rollout
        self.ppo = ppo
        # the limit travels with the task, to every process that rewards (rollout, Ray workers)
        task.reward_timeout_s = ppo.reward_timeout_s
        self.tokenizer_path = tokenizer_path
        self.seed = seed
        self.num_threads = num_threads
        #: ``model.runner`` as given; the run plan picks one for ``null`` (``self.plan.runner``).
        self.runner: RolloutRunner | None = runner
        self.plan: RunPlan | None = None
        #: What the run started (Ray, store, engine, runner), closed by :meth:`teardown`.
        self.resources = RunResources()
        self.reference: ActorModule | None = None
        self.teacher = teacher
        self.tokenizer: Any = None
        self.controller: PPOController | None = None
        self.rollout_source: RolloutSource | None = None
        self.rollouts: RolloutPipeline | None = None
        self._rollouts_state: dict[str, Any] | None = None
        self._standalone_data: ReplayDataModule | None = None
        #: The run's metrics axis and history (handed to every hook; saved in checkpoints).
        self.run_log = RunLog()
        self.failures = FailurePolicy(ppo.max_failed_iterations, self.run_log)

    # ------------------------------------------------------------------ setup
    def configure_model(self) -> None:
        """Build → plan → wire: models, then every ``auto`` decided, then the iteration's parts.

        Idempotent. The run plan (:class:`~lppo.run.plan.RunPlan`) decides once the models
        exist, at the dtype the trainer's precision gives them; everything wired after it
        receives what it decided, and its decisions are logged as one block.
        """
        if self.controller is not None:
            return
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        trainer = attached_trainer(self)
        with collecting() as decisions:
            # 1. build: the layout's process groups; tokenizer, models (in it), reference
            parallel, callbacks = ParallelContext(), []
            if trainer is not None:
                check_strategy(trainer.strategy, trainer.world_size)
                parallel = parallel_context(trainer.strategy)
                callbacks = [cb for cb in trainer.callbacks if isinstance(cb, PPOCallback)]
            self._configure_modules(parallel)
            if trainer is not None:  # in trainer.precision's dtype before anything copies them
                trainer.strategy.precision_plugin.convert_module(self)
            data = self._datamodule(trainer)
            # 2. plan: every auto and every rule across setting groups
            plan = RunPlan.resolve(self._parts(trainer, parallel, data))
            # 3. wire: Ray, the store, the controller, the engine, the rollout pipeline
            self._wire(plan, trainer, parallel, data, callbacks)
        self.plan = with_decisions(plan, decisions)
        self.plan.log()

    def _parts(self, trainer: Any, parallel: ParallelContext, data: ReplayDataModule) -> RunParts:
        """What the run plan decides for."""
        return RunParts(
            actor=self.actor,
            critic=self.critic,
            reference=self.reference,
            teacher=self.teacher,
            engine=self.engine,
            estimator=self.estimator,
            ppo=self.ppo,
            rollout=self.rollout,
            data=data.settings,
            runner=self.runner,
            parallel=parallel,
            precision=str(getattr(trainer, "precision", "32-true")),
            strategy=type(trainer.strategy).__name__ if trainer is not None else "none",
            task=self.task,
            tokenizer=self.tokenizer,
            store=data.store,
            ray=getattr(trainer, "ray", None),
        )

    def _wire(
        self,
        plan: RunPlan,
        trainer: Any,
        parallel: ParallelContext,
        data: ReplayDataModule,
        callbacks: list[PPOCallback],
    ) -> None:
        """Start and connect what an iteration uses, as ``plan`` decided."""
        r, started = self.rollout, self.resources
        self.runner = plan.runner
        if isinstance(ray := getattr(trainer, "ray", None), RaySettings):
            configure_ray(ray)  # trainer.ray, before the store or the engine needs Ray
        # Ray is held by its users (store, engine) and stops with the last of them, so it
        # outlives both; a rank > 0 attaches to rank 0's Ray only when its store connects.
        started.enter("store", data.hand_over_close())  # entered first: a failed connect too
        data.configure(
            world_size=parallel.data.size,
            rank=parallel.data.rank,
            max_row_length=self._max_row_length(),
            rows_per_iteration=r.rows_per_iteration,
            minibatches=max(self.ppo.actor_minibatches, self.ppo.critic_minibatches),
            group=parallel.data,
            share_prompts=plan.share_prompts,
        )
        self.controller = PPOController(
            self.actor,
            self.critic,
            data,
            reference=self.reference,  # config: the plan's resolved model.ppo (plan=)
            teacher=self.teacher,
            callbacks=callbacks,
            estimator=self.estimator,
            parallel=parallel,
            trainer=trainer,
            reward_model=self.reward_model,
            run_log=self.run_log,
            plan=plan,
        )
        self._wire_rollouts(plan, trainer, parallel, data)

    def _wire_rollouts(
        self, plan: RunPlan, trainer: Any, parallel: ParallelContext, data: ReplayDataModule
    ) -> None:
        """Set the engine up and start the rollout pipeline (its runner), as ``plan`` decided."""
        r, started = self.rollout, self.resources
        template = copy.deepcopy(self.engine)  # runners set their own copies up
        started.enter("engine", self.engine)  # with its tool servers (multi-turn)
        self.engine.setup(self.actor.policy(), self.tokenizer, r)
        self.rollout_source = RolloutSource(
            self.task,
            self.engine,
            self.actor,
            r,
            seed=self.seed,
            group=parallel.data,
            store=data.store,
            rules=plan.ppo.row_rules(r.max_new_tokens),
            tokenizer=self.tokenizer,
        )
        stop_at = getattr(trainer, "max_epochs", None)
        self.rollouts = RolloutPipeline(
            self.rollout_source,
            plan.runner,
            template,
            staleness=r.max_staleness,
            warmup_iterations=self.ppo.critic_warmup_iterations,
            stop_at=stop_at if stop_at is not None and stop_at >= 0 else None,
        )
        started.enter("runner", self.rollouts)
        if self._rollouts_state is not None:
            self.rollouts.load_state_dict(self._rollouts_state)

    def _max_row_length(self) -> int:
        """The longest row a rollout can put: the engine's bound, else prompt + response."""
        single = self.task.max_prompt_length() + 1 + self.rollout.max_new_tokens
        bound = capabilities_of(self.engine).max_row_tokens  # a multi-turn engine's max_tokens
        return single if bound is None else bound

    def _configure_modules(self, parallel: ParallelContext) -> None:
        """Build the tokenizer, actor, critic, reward model and the frozen reference.

        Actor and critic are handed the run's ``parallel`` first: what they decide while built
        (``trim_prompt``) depends on whether its layout shards the weights.
        """
        self.tokenizer = tok = run_tokenizer(self.task, self.tokenizer_path)
        roles = [m for m in (self.actor, self.critic) if m is not None]
        for role in roles:
            role.parallel = parallel
        modules = (self.actor, self.critic, self.reward_model)
        check_vocabularies(tok, modules, self.resize_embeddings)
        ids = (len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
        self.actor.configure_model(*ids)
        for module in (self.critic, self.reward_model):
            if module is not None:
                module.configure_model(*ids)
        self.actor.temperature = self.rollout.temperature
        for role in roles:
            role.max_response_tokens = self.rollout.max_new_tokens
        if self.ppo.kl_coef > 0 or self.actor.needs_reference:
            self.reference = self.actor.reference_policy()
        if self.teacher is not None:
            self.teacher.prepare(tok, parallel, self.rollout.temperature)

    def _datamodule(self, trainer: Any) -> ReplayDataModule:
        data = getattr(trainer, "datamodule", None) if trainer is not None else None
        if data is None:  # a system used without a trainer keeps one of its own
            data = self._standalone_data = self._standalone_data or ReplayDataModule()
        return ReplayDataModule.check(data)

    def configure_optimizers(self) -> Any:
        """Actor and critic optimizers (and schedulers), so checkpoints hold their state."""
        modules = [m for m in (self.actor, self.critic) if m is not None]
        optimizers = [m.configure_optimizer() for m in modules]
        schedulers = [m.scheduler for m in modules if m.scheduler is not None]
        return (optimizers, schedulers) if schedulers else optimizers

    def teardown(self, stage: str) -> None:
        """Close what the run started, in reverse start order, once (:mod:`lppo.runtime.lifetimes`).

        Runner, engine (its workers and tool servers), store (Ray stops with the last of its
        users). After a failure a failing close is logged: the run's own error stays raised.
        """
        self.resources.close(raise_errors=sys.exc_info()[0] is None)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add the task's state, the run log (with the failure count) and the run's settings."""
        checkpoint["lppo_task"] = self.task.state_dict()
        checkpoint[RUN_LOG_KEY] = self.run_log.state_dict()
        if self.rollouts is not None:
            checkpoint[ROLLOUTS_KEY] = self.rollouts.state_dict()
        if self.plan is not None:
            checkpoint[PLAN_KEY] = self.plan.state_dict()
        trainer = attached_trainer(self)
        checkpoint[SETTINGS_KEY] = run_settings(self, self._datamodule(trainer), trainer)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Restore the task's state, so a resumed run continues its prompts where it stopped."""
        self.task.load_state_dict(checkpoint.get("lppo_task", {}))
        upgrade_layout(checkpoint)  # before Lightning restores the callbacks from it
        self.run_log.load_state_dict(checkpoint[RUN_LOG_KEY])
        self._rollouts_state = checkpoint.get(ROLLOUTS_KEY)
        if self.rollouts is not None and self._rollouts_state is not None:
            self.rollouts.load_state_dict(self._rollouts_state)
        saved = checkpoint.get(SETTINGS_KEY)
        trainer = attached_trainer(self)
        if saved is None or trainer is None:  # not a resume (e.g. load_from_checkpoint)
            return
        current = run_settings(self, self._datamodule(trainer), trainer)
        # an auto that now resolves otherwise would compute otherwise: refused like a setting
        planned = plan_changes(checkpoint.get(PLAN_KEY, {}), self.plan) if self.plan else []
        check_resume(saved, current, planned)
        self._resumed_lrs = {
            m: saved[f"{m.config_key}.lr"]
            for m in (self.actor, self.critic)
            if m is not None and saved.get(f"{m.config_key}.lr", m.lr) != m.lr
        }

    def on_train_start(self) -> None:
        """Give the restored optimizers a learning rate changed on resume (scaled schedules)."""
        scale_resumed_lrs(getattr(self, "_resumed_lrs", {}))
        self._resumed_lrs = {}

    def training_step(self, *args: Any, **kwargs: Any) -> None:
        """Not used: the PPO loop drives training through :meth:`run_iteration`."""
        raise RuntimeError(
            "PPOSystem is driven by lppo.loop.PPOFitLoop; train it with lppo.PPOTrainer "
            "(or `lppo fit`), not a plain lightning Trainer."
        )

    # -------------------------------------------------------------- iteration
    def run_iteration(self, iteration: int) -> IterationResult:
        """One RL iteration: take the rollout, run the controller, publish the new policy."""
        self.configure_model()
        assert self.controller is not None and self.rollouts is not None
        clock = time.perf_counter()
        fatal: IterationError | None = None
        try:
            # 1. rollout: admitted s iterations ago, generated meanwhile (s = 0: here, now)
            with self._full_policy():
                rollout, generation = self.rollouts.take(iteration)
            # 2. score → advantages → critic epochs → actor epochs → release
            seconds = time.perf_counter() - clock
            result = self.controller.run_iteration(rollout, iteration, seconds, generation)
        except IterationError as error:  # cleaned up already; skipped or re-raised
            result, fatal = self.failures.absorb(iteration, error)
            self.controller.end_failed(result)  # a failed iteration is an iteration
        if fatal is not None:
            raise fatal
        # 3. publish the actor's weights: iteration + s + 1 is admitted with them
        with self._full_policy():
            self.rollouts.publish(iteration)
        return result

    def _full_policy(self) -> AbstractContextManager[None]:
        """The actor's full weights for the engine (gathered once, under a sharding layout)."""
        assert self.controller is not None
        return self.controller.parallel.layout.gathered([self.actor])


def _check_own_settings(seed: int, num_threads: int | None, resize_embeddings: bool) -> None:
    """``model.seed``, ``model.num_threads`` and ``model.resize_embeddings``, checked eagerly."""
    if not isinstance(resize_embeddings, bool):
        raise SettingError(
            f"model.resize_embeddings={resize_embeddings!r} must be true or false (false: "
            "a checkpoint whose vocabulary is not the tokenizer's is refused)."
        )
    check_number("model.seed", seed, integer=True, low=0)
    fix = "null keeps torch's default."
    check_number("model.num_threads", num_threads, integer=True, low=1, optional=True, fix=fix)
