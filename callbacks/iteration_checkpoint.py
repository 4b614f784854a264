"""Checkpoints at every RL-iteration boundary (``last.ckpt`` for ``--ckpt_path last``)."""

from __future__ import annotations

import warnings
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint

from lppo.loop import allow_checkpoint_without_new_step
from lppo.validation import callback_key, check_number


class IterationCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` saving after every iteration, even one without an actor step.

    Checkpoints are only taken between iterations (the replay is empty and no step is open),
    so a resumed run restarts the interrupted iteration from its beginning.

    Args:
        dirpath: directory of the checkpoints (default ``<run dir>/checkpoints``).
        filename: checkpoint name pattern (``{epoch}`` is the iteration index).
        save_top_k: how many iteration checkpoints to keep besides ``last.ckpt`` (-1: all).
        every_n_iterations: save every N iterations.
        save_last: also write ``last.ckpt``.
    """

    def __init__(
        self,
        dirpath: str | None = None,
        filename: str = "iteration-{epoch:04d}",
        save_top_k: int = 1,
        every_n_iterations: int = 1,
        save_last: bool = True,
    ) -> None:
        check_number(
            callback_key(self, "save_top_k"),
            save_top_k,
            integer=True,
            low=-1,
            fix="-1 keeps every iteration's checkpoint, 0 none besides last.ckpt.",
        )
        check_number(
            callback_key(self, "every_n_iterations"), every_n_iterations, integer=True, low=1
        )
        super().__init__(
            dirpath=dirpath,
            filename=filename,
            save_top_k=save_top_k,
            every_n_epochs=every_n_iterations,
            save_last=save_last,
            save_on_train_epoch_end=True,
            auto_insert_metric_name=False,
            # last.ckpt is always this run's latest (never a last-v1.ckpt beside another's).
            enable_version_counter=False,
        )

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """``ModelCheckpoint.setup``, without its "directory exists and is not empty" warning.

        lppo's run-directory rule (:mod:`lppo.run.directory`) already refuses a fresh run into
        a folder holding checkpoints, so a non-empty folder here is a resume: warning about it
        at every resume would only teach users to ignore warnings.
        """
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Checkpoint directory .* is not empty")
            super().setup(trainer, pl_module, stage)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """Save at the iteration boundary whether or not ``global_step`` moved."""
        allow_checkpoint_without_new_step(self)
        super().on_train_epoch_end(trainer, pl_module)
