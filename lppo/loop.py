"""The PPO fit loop: the ONLY module that touches Lightning's private APIs.

Lightning removed public loop customization in 2.0; ``trainer.fit_loop`` can still be replaced
by a ``_FitLoop`` subclass. Every private name used here is listed in :data:`PRIVATE_NAMES`, and
``tests/test_loop_contract.py`` asserts they exist in the pinned Lightning (``>=2.6,<2.7``).

One trainer epoch runs one RL iteration through ``PPOSystem.run_iteration``; each actor optimizer
step that was taken advances ``trainer.global_step``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.core.mixins.hparams_mixin import _given_hyperparameters
from lightning.pytorch.loops.fit_loop import _FitLoop
from lightning.pytorch.trainer import call

from lppo.run import interrupts

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer

#: (object, attribute) pairs of Lightning private API this module relies on.
PRIVATE_NAMES: tuple[tuple[str, str], ...] = (
    ("lightning.pytorch.loops.fit_loop", "_FitLoop"),
    ("lightning.pytorch.trainer.call", "_call_callback_hooks"),
    ("lightning.pytorch.trainer.call", "_call_lightning_module_hook"),
    ("lightning.pytorch.loops.fit_loop._FitLoop", "epoch_progress"),
    ("lightning.pytorch.loops.fit_loop._FitLoop", "epoch_loop"),
    ("lightning.pytorch.loops.fit_loop._FitLoop", "_combined_loader"),
    ("lightning.pytorch.loops.training_epoch_loop._TrainingEpochLoop", "manual_optimization"),
    ("lightning.pytorch.loops.optimization.manual._ManualOptimization", "optim_step_progress"),
    ("lightning.pytorch.callbacks.ModelCheckpoint", "_last_global_step_saved"),
    ("lightning.pytorch.core.mixins.hparams_mixin", "_given_hyperparameters"),
    ("lightning.pytorch.LightningModule", "_trainer"),
)


class PPOFitLoop(_FitLoop):
    """Fit loop whose epoch is one RL iteration; no Lightning dataloader is involved.

    Chunks are streamed by :class:`~lppo.iteration.data.ReplayDataModule` inside the iteration,
    from a replay that is filled *during* the epoch, so Lightning's ``setup_data`` (which iterates
    the
    train dataloader before training starts) is skipped.
    """

    def on_run_start(self) -> None:
        """Start the run; from here SIGTERM / SIGINT interrupt it (:mod:`lppo.run.interrupts`).

        Installed after setup, so lppo's handlers replace those Ray installs when it starts.
        """
        super().on_run_start()
        interrupts.install()

    def setup_data(self) -> None:
        """No Lightning dataloader: the replay data module streams chunks per step."""
        self._combined_loader = None

    def on_advance_start(self) -> None:
        """Call ``on_train_epoch_start`` hooks (no sampler to reseed)."""
        trainer = self.trainer
        if not self.restarted_mid_epoch and not self.restarted_on_epoch_end:
            if not self.restarted_on_epoch_start:
                self.epoch_progress.increment_ready()
            call._call_callback_hooks(trainer, "on_train_epoch_start")
            call._call_lightning_module_hook(trainer, "on_train_epoch_start")
            self.epoch_progress.increment_started()

    def advance(self) -> None:
        """Run one RL iteration and count the actor's optimizer steps as global steps."""
        system: Any = self.trainer.lightning_module
        try:
            result = system.run_iteration(self.epoch_progress.current.processed)
        except BaseException as error:
            interrupts.release()  # a signal held meanwhile wins: the run stops interrupted
            interrupts.replace_if_interrupted(error)  # e.g. Ray's SystemExit(1) for our signal
            raise
        progress = self.epoch_loop.manual_optimization.optim_step_progress
        for stats in result.phase_steps("actor"):
            if stats.stepped:
                progress.increment_ready()
                progress.increment_completed()

    def on_advance_end(self) -> None:
        """Mark the iteration processed, call ``on_train_epoch_end`` hooks (checkpoints)."""
        trainer = self.trainer
        self.epoch_progress.increment_processed()
        try:
            call._call_callback_hooks(trainer, "on_train_epoch_end", monitoring_callbacks=False)
            call._call_lightning_module_hook(trainer, "on_train_epoch_end")
            call._call_callback_hooks(trainer, "on_train_epoch_end", monitoring_callbacks=True)
            self.epoch_progress.increment_completed()
        finally:  # the iteration is checkpointed: a signal held since it was counted stops now
            interrupts.release()


def install(trainer: Trainer) -> PPOFitLoop:
    """Replace ``trainer.fit_loop`` by a :class:`PPOFitLoop` keeping its limits."""
    old = trainer.fit_loop
    loop = PPOFitLoop(trainer, min_epochs=old.min_epochs, max_epochs=old.max_epochs)
    loop.epoch_loop = old.epoch_loop
    trainer.fit_loop = loop
    return loop


def allow_checkpoint_without_new_step(callback: ModelCheckpoint) -> None:
    """Let ``callback`` save again although ``global_step`` did not move.

    ``ModelCheckpoint`` skips a save when ``global_step`` equals the last saved one; critic
    warmup iterations take no actor step, yet each iteration boundary must be checkpointed.
    """
    callback._last_global_step_saved = -1


def attached_trainer(module: LightningModule) -> Trainer | None:
    """The trainer ``module`` is attached to, or ``None`` (``module.trainer`` raises then)."""
    return module._trainer


def instantiated_by_cli() -> bool:
    """Whether the LightningModule being built is instantiated by LightningCLI.

    Then ``save_hyperparameters`` records the parsed config (``class_path`` / ``init_args``)
    instead of the init arguments' objects, so nested modules can be kept in the hparams and
    ``load_from_checkpoint`` rebuilds the whole system.
    """
    return _given_hyperparameters.get() is not None


def plain_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a Lightning ``LightningOptimizer`` wrapper (else itself)."""
    from lightning.pytorch.core.optimizer import LightningOptimizer

    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
