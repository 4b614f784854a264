"""``PPOSystem``: the LightningModule holding actor, critic, task and rollout settings."""

from __future__ import annotations

import copy
import hashlib
import random
import time
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import LightningModule

from lppo.config import PPOConfig
from lppo.controller import IterationResult, PPOController
from lppo.data import ReplayDataModule
from lppo.hooks import PPOCallback
from lppo.loop import instantiated_by_cli
from lppo.modules import ActorModule, CriticModule
from lppo.rollout import HFGenerateEngine, score, to_rollout
from lppo.strategy import check_strategy
from lppo.tasks import Task
from lppo.tokenizer import build_char_tokenizer
from lppo.types import Rollout


@dataclass(frozen=True)
class RolloutSettings:
    """How each iteration's samples are generated.

    Attributes:
        prompts_per_iteration: prompts drawn from the task per iteration.
        samples_per_prompt: responses sampled per prompt.
        max_new_tokens: longest response (EOS included).
        temperature: sampling temperature (the actor scores with the same one).
        top_p: nucleus-sampling mass; 1 disables it.
        batch_size: most samples per ``generate`` call (``null``: all at once).
    """

    prompts_per_iteration: int = 32
    samples_per_prompt: int = 4
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    batch_size: int | None = None

    def validate(self) -> None:
        """Raise ``ValueError`` naming the key for a bad setting."""
        for key in ("prompts_per_iteration", "samples_per_prompt", "max_new_tokens"):
            value = getattr(self, key)
            if value < 1:
                raise ValueError(f"model.rollout.{key}={value} must be >= 1.")
        if self.temperature <= 0:
            raise ValueError(f"model.rollout.temperature={self.temperature} must be > 0.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"model.rollout.top_p={self.top_p} must lie in (0, 1].")

    @property
    def rows_per_iteration(self) -> int:
        """Rows each iteration puts into the replay store."""
        return self.prompts_per_iteration * self.samples_per_prompt


def derive_seed(*parts: object) -> int:
    """A stable 63-bit seed from any parts (independent of Python's hash randomization)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


class PPOSystem(LightningModule):
    """Actor, critic and task composed by injection; driven by :class:`lppo.loop.PPOFitLoop`.

    One trainer epoch is one RL iteration: sample prompts, generate, reward, then the
    controller's score → advantages → critic epochs → actor epochs → release.

    Data parallelism: with ``trainer.strategy=ppo_ddp`` (:class:`lppo.strategy.PPODDPStrategy`)
    and several devices, rank 0 generates and rewards each rollout and broadcasts it, so every
    rank's (rank-local) replay store holds all rows; every rank scores all rows and computes
    all advantages (duplicated work, identical results), then trains only its shard of each
    step's chunks, with gradients and diagnostics summed across ranks once per optimizer step.
    Rollouts are not yet split across ranks (each rank could generate its own share later).
    Lightning's own multi-process strategies (``ddp``, ``fsdp``, ...) are rejected.

    Args:
        actor: the policy (subclass :class:`ActorModule` to customize it).
        critic: the value model (subclass :class:`CriticModule` to customize it).
        task: prompt source and verifiable reward (subclass :class:`~lppo.tasks.Task`).
        rollout: generation settings.
        ppo: algorithm settings.
        tokenizer_path: local tokenizer directory; ``null`` builds a character tokenizer from
            the task's vocabulary.
        seed: seed of prompt sampling and generation (iteration ``i`` uses a seed derived from
            ``(seed, i)``, so a resumed run samples exactly what the uninterrupted run would).
        num_threads: ``torch.set_num_threads`` at setup (``null`` leaves torch's default).
    """

    def __init__(
        self,
        actor: ActorModule,
        critic: CriticModule,
        task: Task,
        rollout: RolloutSettings = RolloutSettings(),
        ppo: PPOConfig = PPOConfig(),
        tokenizer_path: str | None = None,
        seed: int = 0,
        num_threads: int | None = None,
    ) -> None:
        super().__init__()
        # Under LightningCLI the hparams are the parsed config (class_path / init_args), from
        # which `PPOSystem.load_from_checkpoint` rebuilds everything; from Python, objects are
        # kept out of the hparams so checkpoints stay loadable with weights_only=True.
        objects = [] if instantiated_by_cli() else ["actor", "critic", "task", "rollout", "ppo"]
        self.save_hyperparameters(ignore=objects, logger=False)
        self.automatic_optimization = False
        self.actor = actor
        self.critic = critic
        self.task = task
        self.rollout = rollout
        self.rollout.validate()
        self.ppo = ppo
        self.ppo.validate(prefix="model.ppo")
        self.tokenizer_path = tokenizer_path
        self.seed = seed
        self.num_threads = num_threads
        self.reference: ActorModule | None = None
        self.tokenizer: Any = None
        self.engine: HFGenerateEngine | None = None
        self.controller: PPOController | None = None
        self.last_result: IterationResult | None = None
        self.iteration_index = 0
        self._pending_controller_state: dict[str, Any] | None = None

    # ------------------------------------------------------------------ setup
    def configure_model(self) -> None:
        """Build tokenizer, models, reference, rollout engine and controller (idempotent)."""
        if self.controller is not None:
            return
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        if self.tokenizer_path is None:
            self.tokenizer = build_char_tokenizer(self.task.vocabulary())
        else:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(
                self.tokenizer_path, local_files_only=True
            )
        tok = self.tokenizer
        ids = (len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
        self.actor.configure_model(*ids)
        self.critic.configure_model(*ids)
        if self.ppo.kl_coef > 0:
            self.reference = copy.deepcopy(self.actor)
            self.reference.requires_grad_(False)
            self.reference.eval()
        r = self.rollout
        self.engine = HFGenerateEngine(
            self.actor.model,
            tok,
            max_new_tokens=r.max_new_tokens,
            temperature=r.temperature,
            top_p=r.top_p,
            batch_size=r.batch_size,
        )
        data = self._datamodule()
        world = self.trainer.world_size if self._trainer is not None else 1
        rank = self.trainer.global_rank if self._trainer is not None else 0
        if world > 1:
            check_strategy(self.trainer.strategy, world)
        data.configure(
            world_size=world,
            rank=rank,
            max_row_length=self.task.max_prompt_length() + 1 + r.max_new_tokens,
            rows_per_iteration=r.rows_per_iteration,
            minibatches=max(self.ppo.actor_minibatches, self.ppo.critic_minibatches),
        )
        callbacks = []
        if self._trainer is not None:
            callbacks = [cb for cb in self.trainer.callbacks if isinstance(cb, PPOCallback)]
        self.controller = PPOController(
            self.actor, self.critic, data, self.ppo, self.reference, callbacks
        )
        self.controller.trainer = self._trainer
        if self._pending_controller_state is not None:
            self.controller.load_state_dict(self._pending_controller_state)

    def _datamodule(self) -> ReplayDataModule:
        data = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
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
        optimizers = [self.actor.configure_optimizer(), self.critic.configure_optimizer()]
        schedulers = [m.scheduler for m in (self.actor, self.critic) if m.scheduler is not None]
        return (optimizers, schedulers) if schedulers else optimizers

    def training_step(self, *args: Any, **kwargs: Any) -> None:
        """Not used: the PPO loop drives training through :meth:`run_iteration`."""
        raise RuntimeError(
            "PPOSystem is driven by lppo.loop.PPOFitLoop; train it with lppo.PPOTrainer "
            "(or `lppo fit`), not a plain lightning Trainer."
        )

    # -------------------------------------------------------------- iteration
    def run_iteration(self, iteration: int) -> IterationResult:
        """Sample, generate, reward, and run the controller's phases for ``iteration``.

        Under data parallelism only rank 0 generates; its rollout is broadcast to every rank.
        """
        self.configure_model()
        assert self.engine is not None and self.controller is not None
        self.iteration_index = iteration
        clock = time.perf_counter()
        distributed = self._trainer is not None and self.trainer.world_size > 1
        packed = None
        if not distributed or self.trainer.is_global_zero:
            packed = self._generate(iteration)
        if distributed:
            # Rank 0's rollout, so every rank holds bit-identical rows even where generation
            # is not reproducible across devices.
            packed = self.trainer.strategy.broadcast(packed, src=0)
        assert packed is not None
        rollout, rollout_tokens = packed
        rollout_seconds = time.perf_counter() - clock
        result = self.controller.run_iteration(rollout, iteration)
        result.seconds["rollout"] = rollout_seconds
        result.tokens["rollout"] = rollout_tokens
        self.last_result = result
        return result

    def _generate(self, iteration: int) -> tuple[Rollout, int]:
        """Sample prompts, generate and reward: the rollout and its response-token count."""
        assert self.engine is not None
        r = self.rollout
        prompts = self.task.sample_prompts(
            r.prompts_per_iteration, random.Random(derive_seed(self.seed, "prompts", iteration))
        )
        output = self.engine.generate(
            prompts, r.samples_per_prompt, seed=derive_seed(self.seed, "generate", iteration)
        )
        rollout = to_rollout(output, score(self.task, prompts, output))
        return rollout, int(output.response_lengths.sum())

    # ------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add controller state (row-id counter) to the checkpoint."""
        if self.controller is not None:
            checkpoint["lppo_controller"] = self.controller.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Restore controller state (applied when the controller is built)."""
        state = checkpoint.get("lppo_controller")
        if state is None:
            return
        if self.controller is not None:
            self.controller.load_state_dict(state)
        else:
            self._pending_controller_state = state
