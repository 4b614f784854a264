"""``lppo`` console script: ``lppo fit --config configs/tiny.yaml`` (LightningCLI)."""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch.cli import LightningCLI

from lppo.data import ReplayDataModule
from lppo.system import PPOSystem
from lppo.trainer import PPOTrainer


class PPOCLI(LightningCLI):
    """LightningCLI for PPO: ``PPOSystem`` (or a subclass) + ``ReplayDataModule`` + ``PPOTrainer``.

    Every knob is documented in ``lppo fit --help``; user subclasses of the system, actor,
    critic, task or callbacks are addressed by ``class_path``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        # PPOSystem's own knobs (actor, critic, task, rollout, ppo) show in `lppo fit --help`;
        # the pieces users subclass are addressed by class_path inside it.
        kwargs.setdefault("subclass_mode_model", False)
        # Actor and critic own their optimizers; Lightning's --optimizer would be ignored.
        kwargs.setdefault("auto_configure_optimizers", False)
        super().__init__(PPOSystem, ReplayDataModule, *args, trainer_class=PPOTrainer, **kwargs)


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
