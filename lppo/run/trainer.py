"""``PPOTrainer``: a Lightning ``Trainer`` wired for PPO (custom loop, defaults, callbacks)."""

from __future__ import annotations

import os
import warnings
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger, WandbLogger
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.utilities import rank_zero_info
from lppo.callbacks import IterationCheckpoint, defaults

from lppo.loop import install
from lppo.run.checkpointing import AtomicCheckpointIO, check_checkpoint
from lppo.run.digests import remove_stale_temporaries
from lppo.run.directory import AUTO, LAST, RunDirectory, is_launching_rank_zero
from lppo.runtime.ray_runtime import RaySettings
from lppo.runtime.strategy import STRATEGY_NAME, check_strategy  # also registers "ppo_ddp"
from lppo.validation import SettingError

# The frozen reference policy is in eval mode on purpose.
warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode")


#: The run directory when ``default_root_dir`` is not given.
DEFAULT_ROOT_DIR = os.path.join("runs", "lppo")

_DEFAULTS: dict[str, Any] = {
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
    "limit_val_batches": 0,
    "use_distributed_sampler": False,
}


def _processes(kwargs: dict[str, Any]) -> int:
    """``devices × num_nodes`` where both are given as numbers (1 where they are not)."""
    count = 1
    for key in ("devices", "num_nodes"):
        value = kwargs.get(key)
        if isinstance(value, str) and value.isdigit():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            count *= value
    return count


class PPOTrainer(Trainer):
    """A ``Trainer`` whose epoch is one RL iteration (``max_epochs`` = iterations).

    Differences from a plain ``Trainer``: the fit loop is :class:`lppo.loop.PPOFitLoop`;
    lppo's built-in callbacks (:func:`lppo.callbacks.defaults`: lifecycle, monitoring and
    checkpoint) are added when no callback of their type is given (the per-iteration
    checkpoint not with ``enable_checkpointing=False``), and Lightning saves their state;
    the default logger writes ``<default_root_dir>/version_N/metrics.csv`` (one folder per
    launch, so a resumed run keeps the earlier metrics), also beside a ``WandbLogger`` given
    alone (a list of loggers is taken as given), and checkpoints go to
    ``<default_root_dir>/checkpoints``; Lightning's batch progress bar, model summary, sanity
    check and validation are off. ``global_step`` counts actor optimizer steps (on every
    rank).

    Data parallelism: ``strategy="ppo_ddp"`` (:class:`lppo.runtime.strategy.PPODDPStrategy`) with
    ``devices > 1`` (or ``num_nodes > 1``), which is also what ``strategy="auto"`` (the
    default) becomes when ``devices`` or ``num_nodes`` is a number above 1 (logged); Lightning's
    own multi-process strategies are rejected with a ``ValueError`` because their model wrapper
    syncs gradients per backward.

    Args:
        *args: passed to :class:`lightning.pytorch.Trainer`.
        ray: how lppo gets Ray, for every component that uses it (the TransferQueue replay
            store, Ray rollout workers): a local Ray on loopback started and stopped by lppo
            (``address: null``) or a running cluster to attach to. Applied at setup, before
            any component needs Ray (:func:`lppo.runtime.ray_runtime.configure_ray`).
        overwrite: start a fresh run in a ``default_root_dir`` that holds an earlier run's
            checkpoints by deleting them (and its metrics, summary and curve) first; without
            it such a run is refused (:mod:`lppo.run.directory`).
        **kwargs: passed to :class:`lightning.pytorch.Trainer`.
    """

    def __init__(
        self,
        *args: Any,
        ray: RaySettings = RaySettings(),
        overwrite: bool = False,
        **kwargs: Any,
    ) -> None:
        self.ray = ray
        self.overwrite = overwrite
        root = kwargs.get("default_root_dir") or DEFAULT_ROOT_DIR
        kwargs["default_root_dir"] = root
        # No default in this .get(): jsonargparse resolves `logger` through it, and a default
        # would hide Trainer's type (`--trainer.logger <class_path>` then stayed a string).
        logger = kwargs.get("logger")
        if logger is True or logger is None:
            # One version folder per launch: a resumed run never overwrites earlier metrics.
            kwargs["logger"] = CSVLogger(root, name="")
        elif isinstance(logger, WandbLogger):
            # metrics.csv stays beside wandb (offline analysis, plots, run summary); a list of
            # loggers is taken as given.
            kwargs["logger"] = [logger, CSVLogger(root, name="")]
        callbacks = list(kwargs.get("callbacks") or [])
        # enable_checkpointing=False: no per-iteration checkpoint (Lightning's own switch).
        checkpoints = kwargs.get("enable_checkpointing") is not False
        callbacks += defaults(callbacks, checkpoints=checkpoints)
        for cb in callbacks:
            if isinstance(cb, IterationCheckpoint) and cb.dirpath is None:
                # Fixed folder (not per logger version) so `--ckpt_path last` finds it.
                cb.dirpath = os.path.realpath(os.path.join(root, "checkpoints"))
        kwargs["callbacks"] = callbacks
        plugins = list(kwargs.get("plugins") or [])
        if not any(isinstance(p, CheckpointIO) for p in plugins):
            plugins.append(AtomicCheckpointIO())  # never a half-written last.ckpt
        kwargs["plugins"] = plugins
        for key, value in _DEFAULTS.items():
            if kwargs.get(key) is None:
                kwargs[key] = value
        # No default in .get() (see `logger` above): None is Lightning's "auto" too.
        if kwargs.get("strategy") in (None, "auto") and _processes(kwargs) > 1:
            kwargs["strategy"] = STRATEGY_NAME
            rank_zero_info(f"trainer.strategy=auto with {_processes(kwargs)} processes: ppo_ddp")
        super().__init__(*args, **kwargs)
        # Fail before any process is launched (PPOSystem.configure_model checks again).
        check_strategy(self.strategy, self.num_devices * self.num_nodes)
        install(self)

    def fit(
        self,
        *args: Any,
        ckpt_path: str | None = None,
        weights_only: bool | None = None,
        **kwargs: Any,
    ) -> None:
        """``Trainer.fit`` in a run directory of its own; a checkpoint is checked first.

        The process owning the run directory (the launch's rank zero) locks it for the run
        and applies its rule (:mod:`lppo.run.directory`): ``ckpt_path="last"`` is the
        folder's ``last.ckpt`` (an error when there is none), ``"auto"`` is ``last.ckpt``
        when it exists and a fresh run otherwise, and a fresh run into a folder holding
        checkpoints is refused unless ``overwrite``. Temporary files of an interrupted
        checkpoint write whose writer is gone are settled
        (:func:`lppo.run.digests.remove_stale_temporaries`). Checkpoints are checked against
        their digest, then loaded weights-only (:func:`lppo.run.checkpointing.load_checkpoint`):
        one changed after lppo wrote it, or holding any other pickled object, is refused before
        anything of it is built.

        Args:
            *args: passed to ``Trainer.fit``.
            ckpt_path: the checkpoint to resume from: a file, ``last`` or ``auto``.
            weights_only: ``null`` / ``true``: checkpoints are loaded weights-only (tensors and
                plain values; unpickling anything else could run code from the file);
                ``false`` is refused.
            **kwargs: passed to ``Trainer.fit``.

        Raises:
            CheckpointError: ``ckpt_path`` is missing, empty, has no digest or changed after
                lppo wrote it, is corrupt, holds non-weights content or is not lppo's.
            RunDirectoryError: the run directory is in use, or holds another run.
            SettingError: ``weights_only=False``.
        """
        if weights_only is False:
            raise SettingError(
                "fit(weights_only=False): lppo loads checkpoints weights-only, since unpickling "
                "anything else can run code; leave weights_only unset (lppo's checkpoints hold "
                "only tensors and plain values)."
            )
        folders = [cb.dirpath for cb in self.callbacks if isinstance(cb, IterationCheckpoint)]
        directory = RunDirectory(self.default_root_dir, folders[0] if folders else None)
        owner = is_launching_rank_zero()
        if owner:
            directory.lock()
        try:
            lightnings = ckpt_path in ("best", "hpc", "registry")  # Lightning's own words
            if not lightnings and (owner or ckpt_path in (LAST, AUTO)):
                ckpt_path = directory.resolve(ckpt_path, self.overwrite and owner)
            for folder in folders:
                remove_stale_temporaries(folder)
            if ckpt_path is not None and not lightnings:
                self._say_if_finished(check_checkpoint(os.fspath(ckpt_path)), ckpt_path)
            self._fit(args, ckpt_path, kwargs)
        finally:
            directory.unlock()

    def _say_if_finished(self, checkpoint: dict[str, Any], ckpt_path: str) -> None:
        """Say so when the checkpoint already holds every iteration ``max_epochs`` asks for.

        Lightning then trains nothing and says only "max_epochs reached"; a person resuming a
        finished run wants to know it was finished and how to train on.
        """
        done = int(checkpoint.get("epoch", -1)) + 1
        if self.max_epochs is not None and 0 <= self.max_epochs <= done:
            rank_zero_info(
                f"lppo: {ckpt_path} already holds all {done} iterations of this run "
                f"(trainer.max_epochs={self.max_epochs}): nothing to train. To train further, "
                f"resume with a larger --trainer.max_epochs (e.g. {done + 10})."
            )

    def _fit(self, args: tuple[Any, ...], ckpt_path: str | None, kwargs: dict[str, Any]) -> None:
        try:
            super().fit(*args, ckpt_path=ckpt_path, weights_only=True, **kwargs)
        except BaseException:
            # Lightning calls no teardown hook after a failed fit; the system's stops what it
            # started (Ray rollout workers), as after a successful one.
            model = kwargs.get("model", args[0] if args else None)
            if isinstance(model, LightningModule):
                model.teardown("fit")
            raise
