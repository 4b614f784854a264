"""Exports the policy (and critic) as Hugging Face directories at the end of fit."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lppo.callbacks.reward_plot import run_dir

from lppo.validation import SettingError, callback_key, check_number


class HFExport(Callback):
    """At ``on_train_end`` (global rank zero) writes ``<directory>/policy`` (and ``critic``).

    The layout is that of :func:`lppo.run.export.export_system`: ``<directory>/policy`` loads with
    ``transformers.AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``;
    ``<directory>/critic`` with :func:`lppo.run.export.load_critic`. With ``every_n_iterations``
    the same is written to ``<directory>/iteration-NNNN`` after every N-th iteration
    (``NNNN`` is the 0-based iteration index, as in the ``IterationCheckpoint`` names).

    From YAML / the command line: ``--trainer.callbacks+=lppo.callbacks.HFExport``.

    Args:
        directory: export root; ``None`` means ``<trainer.default_root_dir>/hf``.
        critic: also export the critic (backbone + value head).
        every_n_iterations: also export every N iterations (``None``: only at the end).
        adapter: a LoRA actor's adapters alone in ``policy`` (PEFT's layout) instead of the
            model with the adapters merged in.
    """

    def __init__(
        self,
        directory: str | None = None,
        critic: bool = False,
        every_n_iterations: int | None = None,
        adapter: bool = False,
    ) -> None:
        super().__init__()
        check_number(
            callback_key(self, "every_n_iterations"),
            every_n_iterations,
            integer=True,
            low=1,
            optional=True,
            fix="null exports once, at the end of the run.",
        )
        self.directory = directory
        self.critic = critic
        self.every_n_iterations = every_n_iterations
        self.adapter = adapter
        self.exported: list[Path] = []

    def setup(self, trainer: pl.Trainer, pl_module: Any, stage: str) -> None:
        """Refuse ``adapter`` without a LoRA actor now, not when the run ends."""
        if self.adapter and getattr(getattr(pl_module, "actor", None), "lora", None) is None:
            raise SettingError(
                f"{callback_key(self, 'adapter')}=true but model.actor.init_args.lora is null: "
                "there is no adapter to export; set adapter: false (the merged model) or train "
                "LoRA adapters."
            )

    def root(self, trainer: pl.Trainer) -> Path:
        """The export root: ``directory``, or ``<run dir>/hf``."""
        if self.directory is not None:
            return Path(self.directory)
        return Path(os.path.join(run_dir(trainer), "hf"))

    def export(self, trainer: pl.Trainer, pl_module: Any, directory: Path) -> None:
        """Export ``pl_module`` to ``directory``: every rank takes part, global rank zero writes.

        Every rank gathers the weights with the others (a collective under a sharding layout;
        free with full replicas), so every rank must call this at the same point.
        """
        # Imported here: `python -m lppo.run.export` must not find lppo.run.export already imported
        # (lppo -> lppo.run.trainer -> lppo.callbacks).
        from lppo.run.export import export_system

        write = trainer.is_global_zero
        export_system(pl_module, directory, self.critic, self.adapter, write=write)
        if write:
            self.exported.append(directory)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        """After every ``every_n_iterations``-th iteration, export to ``iteration-NNNN``."""
        n = self.every_n_iterations
        if n is None or (trainer.current_epoch + 1) % n != 0:
            return
        self.export(
            trainer, pl_module, self.root(trainer) / f"iteration-{trainer.current_epoch:04d}"
        )

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        """Export the final policy (and critic) to the export root."""
        self.export(trainer, pl_module, self.root(trainer))
