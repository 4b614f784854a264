"""``lppo`` console script: ``lppo fit --config configs/tiny.yaml`` (LightningCLI)."""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from lppo.checkpointing import check_checkpoint
from lppo.data import ReplayDataModule
from lppo.system import PPOSystem
from lppo.trainer import PPOTrainer


class PPOCLI(LightningCLI):
    """LightningCLI for PPO: ``PPOSystem`` (or a subclass) + ``ReplayDataModule`` + ``PPOTrainer``.

    Every knob is documented in ``lppo fit --help``; user subclasses of the system, actor,
    critic, task or callbacks are addressed by ``class_path``.
    """

    #: A ``--ckpt_path`` file, hidden from LightningCLI until the classes are instantiated.
    _ckpt_file: str | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        # PPOSystem's own knobs (actor, critic, task, rollout, ppo) show in `lppo fit --help`;
        # the pieces users subclass are addressed by class_path inside it.
        kwargs.setdefault("subclass_mode_model", False)
        # Actor and critic own their optimizers; Lightning's --optimizer would be ignored.
        kwargs.setdefault("auto_configure_optimizers", False)
        super().__init__(PPOSystem, ReplayDataModule, *args, trainer_class=PPOTrainer, **kwargs)

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """Parse, then check a ``--ckpt_path`` file (weights-only) and keep the given settings.

        LightningCLI would next replace every ``model.*`` setting by the file's hyperparameters,
        so the file is hidden from it until :meth:`before_instantiate_classes`: resuming from a
        named file follows the rules of ``--ckpt_path last`` (``PPOSystem.on_load_checkpoint``
        applies the resume-safe changes and refuses the others).
        """
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if ckpt_path and os.path.isfile(ckpt_path):
            check_checkpoint(os.fspath(ckpt_path))  # one clear error, nothing unpickled
            self._ckpt_file = ckpt_path
            self.config[subcommand]["ckpt_path"] = None

    def before_instantiate_classes(self) -> None:
        """Give the ``--ckpt_path`` file back to the ``fit`` call."""
        if self._ckpt_file is not None:
            self.config[self.config["subcommand"]]["ckpt_path"] = self._ckpt_file


def run(args: list[str] | None = None) -> PPOCLI:
    """Run the CLI in-process and return it (``args`` defaults to ``sys.argv[1:]``)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return PPOCLI(args=args)


def main() -> None:
    """Console-script entry point ``lppo``."""
    run()


if __name__ == "__main__":
    main()
