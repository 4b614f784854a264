"""``PPOSystem``: the LightningModule composing actor, critic, task, engine and estimator."""

from __future__ import annotations

import copy
import time
from typing import Any, ClassVar

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_info

from lppo.checkpointing import (
    ROLLOUTS_KEY,
    RUN_LOG_KEY,
    SETTINGS_KEY,
    CheckpointError,
    run_settings,
    settings_changes,
    upgrade_layout,
)
from lppo.config import PPOConfig
from lppo.controller import PPOController
from lppo.data import ReplayDataModule
from lppo.errors import IterationError
from lppo.estimators import GAE, AdvantageEstimator
from lppo.failure_policy import FailurePolicy
from lppo.hooks import PPOCallback
from lppo.loop import attached_trainer, instantiated_by_cli
from lppo.modules import ActorModule, CriticModule, RewardModel
from lppo.parallel import ParallelContext
from lppo.ray_runtime import RaySettings, configure_ray
from lppo.rollout import HFGenerateEngine, RolloutEngine, RolloutSettings, RolloutSource
from lppo.rollout.pipeline import RolloutPipeline, stale_correction
from lppo.rollout.runners import RolloutRunner, default_runner
from lppo.run_log import RunLog
from lppo.strategy import check_strategy, parallel_context
from lppo.tasks import Task
from lppo.tokenizer import build_char_tokenizer
from lppo.types import IterationResult
from lppo.validation import SettingError, check_number

__all__ = ["PPOSystem", "RolloutSettings"]


class PPOSystem(LightningModule):
    """Actor, critic, task, engine and estimator composed by injection.

    Driven by :class:`lppo.loop.PPOFitLoop`: one trainer epoch is one RL iteration, in order
    (:meth:`run_iteration`): 1. the rollout source samples prompts, generates with the engine
    and rewards the samples; 2. the controller runs score → advantages → critic epochs → actor
    epochs → release; 3. the engine is synced to the actor's new weights.

    Data parallelism: with ``trainer.strategy=ppo_ddp`` (:class:`lppo.strategy.PPODDPStrategy`)
    and several devices, each rank generates and rewards its own blocks of prompts
    (``model.rollout.prompts_per_block``), puts them into the store (its own, or its own row ids
    of a shared one), and scores, estimates and trains only those rows; gradients, diagnostics
    and iteration statistics are reduced across ranks, so the result is the single-process
    one. Lightning's own multi-process strategies (``ddp``, ``fsdp``, ...) are rejected.

    Args:
        actor: the policy (subclass :class:`ActorModule` to customize it).
        critic: the value model (subclass :class:`CriticModule` to customize it); ``null``
            with a critic-free estimator (``lppo.estimators.GRPO``, ``RLOO``, ``ReinforcePP``).
        task: prompt source and verifiable reward (subclass :class:`~lppo.tasks.Task`).
        engine: the rollout engine, any class implementing
            :class:`~lppo.rollout.RolloutEngine` (``null``: ``lppo.rollout.HFGenerateEngine``
            with its defaults).
        estimator: the advantage estimator, any class implementing
            :class:`~lppo.estimators.AdvantageEstimator` (``null``: ``lppo.estimators.GAE``
            with its defaults).
        reward_model: a learned reward (:class:`~lppo.modules.RewardModel`) scored in the
            streamed score phase and combined with the task's reward (``null``: the task's
            reward alone).
        rollout: sampling settings, the one source of them (the actor scores with the same
            temperature).
        ppo: algorithm settings.
        tokenizer_path: local tokenizer directory; ``null`` builds a character tokenizer from
            the task's vocabulary.
        seed: seed of prompt sampling and generation (iteration ``i`` uses a seed derived from
            ``(seed, i)``, so a resumed run samples exactly what the uninterrupted run would).
        num_threads: ``torch.set_num_threads`` at setup (``null`` leaves torch's default).
        runner: where rollouts are generated, any class implementing
            :class:`~lppo.rollout.runners.RolloutRunner` (``null``: in the trainer when
            ``model.rollout.max_staleness`` is 0, else ``lppo.rollout.ProcessRunner``, one
            background process, or ``lppo.rollout.ThreadRunner`` for Ray rollout workers;
            ``lppo.rollout.InlineRunner`` generates stale rollouts in the trainer, without
            overlap: the same rows).
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
    ) -> None:
        super().__init__()
        # Under LightningCLI the hparams are the parsed config (class_path / init_args), from
        # which `PPOSystem.load_from_checkpoint` rebuilds everything; from Python, objects are
        # kept out of the hparams so checkpoints stay loadable with weights_only=True.
        objects = [
            "actor",
            "critic",
            "task",
            "engine",
            "estimator",
            "reward_model",
            "rollout",
            "ppo",
            "runner",
        ]
        self.save_hyperparameters(ignore=[] if instantiated_by_cli() else objects, logger=False)
        self.automatic_optimization = False
        self.actor = actor
        self.critic = critic
        self.task = task
        self.engine: RolloutEngine = engine if engine is not None else HFGenerateEngine()
        self.estimator: AdvantageEstimator = estimator if estimator is not None else GAE()
        self.reward_model = reward_model
        self.rollout = rollout
        self.ppo = ppo
        self.tokenizer_path = tokenizer_path
        check_number("model.seed", seed, integer=True, low=0)
        check_number(
            "model.num_threads",
            num_threads,
            integer=True,
            low=1,
            optional=True,
            fix="null keeps torch's default.",
        )
        self.seed = seed
        self.num_threads = num_threads
        self.runner = runner or default_runner(rollout.max_staleness, self.engine)
        self.reference: ActorModule | None = None
        self.tokenizer: Any = None
        self.controller: PPOController | None = None
        self.rollout_source: RolloutSource | None = None
        self.rollouts: RolloutPipeline | None = None
        self._rollouts_state: dict[str, Any] | None = None
        #: The run's metrics axis and history (handed to every hook; saved in checkpoints).
        self.run_log = RunLog()
        self.failures = FailurePolicy(ppo.max_failed_iterations, self.run_log)

    # ------------------------------------------------------------------ setup
    def configure_model(self) -> None:
        """Build tokenizer, models, reference, rollout source and controller (idempotent)."""
        if self.controller is not None:
            return
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        self._configure_modules()
        trainer = attached_trainer(self)
        parallel = ParallelContext()
        callbacks: list[PPOCallback] = []
        if trainer is not None:
            check_strategy(trainer.strategy, trainer.world_size)
            parallel = parallel_context(trainer.strategy)
            callbacks = [cb for cb in trainer.callbacks if isinstance(cb, PPOCallback)]
        if isinstance(ray := getattr(trainer, "ray", None), RaySettings):
            configure_ray(ray)  # trainer.ray, before the store or the engine needs Ray
        data = self._datamodule(trainer)
        r = self.rollout
        data.configure(
            world_size=parallel.data.size,
            rank=parallel.data.rank,
            max_row_length=self.task.max_prompt_length() + 1 + r.max_new_tokens,
            rows_per_iteration=r.rows_per_iteration,
            minibatches=max(self.ppo.actor_minibatches, self.ppo.critic_minibatches),
            group=parallel.data,
        )
        self.controller = PPOController(
            self.actor,
            self.critic,
            data,
            self.ppo,
            self.reference,
            callbacks,
            estimator=self.estimator,
            parallel=parallel,
            trainer=trainer,
            reward_model=self.reward_model,
            run_log=self.run_log,
        )
        if parallel.data.size > 1 and self.ppo.max_failed_iterations:
            raise SettingError(
                f"model.ppo.max_failed_iterations={self.ppo.max_failed_iterations} under data "
                f"parallelism ({parallel.data.size} ranks): a failure on one rank would leave "
                "the others waiting in a collective; set it to 0."
            )
        template = copy.deepcopy(self.engine)  # runners set their own copies up
        self.engine.setup(self.actor.policy(), self.tokenizer, r)
        self.rollout_source = RolloutSource(
            self.task,
            self.engine,
            self.actor,
            r,
            seed=self.seed,
            group=parallel.data,
            store=data.store,
            rules=self.ppo.row_rules(),
            tokenizer=self.tokenizer,
        )
        stop_at = getattr(trainer, "max_epochs", None)
        self.rollouts = RolloutPipeline(
            self.rollout_source,
            self.runner,
            template,
            staleness=r.max_staleness,
            warmup_iterations=self.ppo.critic_warmup_iterations,
            stop_at=stop_at if stop_at is not None and stop_at >= 0 else None,
        )
        if self._rollouts_state is not None:
            self.rollouts.load_state_dict(self._rollouts_state)

    def _configure_modules(self) -> None:
        """Build the tokenizer, actor, critic, reward model and the frozen reference."""
        self.tokenizer = tok = self._tokenizer()
        ids = (len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
        self.actor.configure_model(*ids)
        for module in (self.critic, self.reward_model):
            if module is not None:
                module.configure_model(*ids)
        self.actor.temperature = self.rollout.temperature
        self.actor.off_policy = stale_correction(
            self.rollout, self.ppo.old_logprobs, self.actor.off_policy
        )
        if self.ppo.kl_coef > 0:
            self.reference = copy.deepcopy(self.actor)
            self.reference.requires_grad_(False)
            self.reference.eval()

    def _tokenizer(self) -> Any:
        if self.tokenizer_path is None:
            return build_char_tokenizer(self.task.vocabulary())
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.tokenizer_path, local_files_only=True)

    def _datamodule(self, trainer: Any) -> ReplayDataModule:
        data = getattr(trainer, "datamodule", None) if trainer is not None else None
        if data is None:
            data = getattr(self, "_standalone_data", None) or ReplayDataModule()
            self._standalone_data = data
        if not isinstance(data, ReplayDataModule):
            raise TypeError(
                f"PPOSystem needs a ReplayDataModule (got {type(data).__name__}); "
                "use `data: class_path: lppo.data.ReplayDataModule`."
            )
        return data

    def configure_optimizers(self) -> Any:
        """Actor and critic optimizers (and schedulers), so checkpoints hold their state."""
        modules = [m for m in (self.actor, self.critic) if m is not None]
        optimizers = [m.configure_optimizer() for m in modules]
        schedulers = [m.scheduler for m in modules if m.scheduler is not None]
        return (optimizers, schedulers) if schedulers else optimizers

    def teardown(self, stage: str) -> None:
        """Stop the rollout runner and what the engine started (Ray rollout workers)."""
        if self.rollouts is not None:
            self.rollouts.close()
        self.engine.close()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add the task's state, the run log (with the failure count) and the run's settings."""
        checkpoint["lppo_task"] = self.task.state_dict()
        checkpoint[RUN_LOG_KEY] = self.run_log.state_dict()
        if self.rollouts is not None:
            checkpoint[ROLLOUTS_KEY] = self.rollouts.state_dict()
        checkpoint[SETTINGS_KEY] = run_settings(self, self._datamodule(attached_trainer(self)))

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
        current = run_settings(self, self._datamodule(trainer))
        applicable, refused = settings_changes(saved, current)
        if refused:
            raise CheckpointError(
                "resuming with settings that differ from the checkpoint's:\n  "
                + "\n  ".join(refused)
                + "\nThese cannot be applied to a restored run: restore them, or start a new "
                "run from the trained weights (lppo.export / HFExport)."
            )
        if applicable:
            rank_zero_info("resuming with changed settings (applied): " + "; ".join(applicable))
        self._resumed_lrs = {
            m: saved[f"{m.config_key}.lr"]
            for m in (self.actor, self.critic)
            if m is not None and saved.get(f"{m.config_key}.lr", m.lr) != m.lr
        }

    def on_train_start(self) -> None:
        """Give the restored optimizers a learning rate changed on resume (scaled schedules)."""
        for module, old in getattr(self, "_resumed_lrs", {}).items():
            ratio = module.lr / old
            assert module.optimizer is not None
            for group in module.optimizer.param_groups:
                group["lr"] *= ratio
                if "initial_lr" in group:
                    group["initial_lr"] *= ratio
            if module.scheduler is not None:
                module.scheduler.base_lrs = [lr * ratio for lr in module.scheduler.base_lrs]
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
        self.rollouts.publish(iteration)
        return result
