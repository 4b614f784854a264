"""Loggers under ``lppo fit``: their files inside the run directory, the parsed config recorded.

* :func:`place_logger_files`: a ``WandbLogger`` given without ``save_dir`` writes under
  ``trainer.default_root_dir`` (Lightning's default is the current directory, where every run
  would also overwrite one ``config.yaml``).
* :class:`RecordConfig`: the full parsed config (the one ``config.yaml`` holds) becomes each
  logger's hyperparameters, e.g. the wandb run's config, so runs can be compared by setting.

The CSV metrics beside wandb are :class:`lppo.run.trainer.PPOTrainer`'s (it adds its ``CSVLogger``
to a ``WandbLogger``).
"""

from __future__ import annotations

from typing import Any

import yaml
from jsonargparse import Namespace
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import CSVLogger

from lppo.run.trainer import DEFAULT_ROOT_DIR

#: Loggers whose files default to the current directory; lppo points them at the run directory.
_IN_RUN_DIR = ("WandbLogger",)


def place_logger_files(config: Namespace) -> None:
    """Give the loggers in ``config.trainer.logger`` that have no directory the run's.

    Args:
        config: the ``fit`` config (``trainer``, ``model``, ``data``), changed in place before
            the classes are instantiated, so ``config.yaml`` shows the directory used.
    """
    entries = config.get("trainer.logger")
    if not isinstance(entries, list):
        entries = [entries]
    root = config.get("trainer.default_root_dir") or DEFAULT_ROOT_DIR
    for entry in entries:
        if not isinstance(entry, Namespace) or not entry.get("class_path"):
            continue
        if entry.class_path.rpartition(".")[2] not in _IN_RUN_DIR:
            continue
        init = entry.get("init_args")
        if init is None:
            entry.init_args = init = Namespace()
        if init.get("save_dir") in (None, ".") and init.get("dir") is None:
            init.save_dir = root


class RecordConfig(SaveConfigCallback):
    """Save ``config.yaml`` (Lightning's) and record the parsed config in the loggers.

    The ``CSVLogger`` is skipped: ``config.yaml`` already sits beside its ``metrics.csv``.
    """

    def save_config(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Log the parsed config as hyperparameters (rank zero only, as Lightning calls it)."""
        config: dict[str, Any] = yaml.safe_load(self.parser.dump(self.config, skip_none=False))
        for logger in trainer.loggers:
            if not isinstance(logger, CSVLogger):
                logger.log_hyperparams(config)
