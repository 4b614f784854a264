"""``lppo`` console script: ``lppo fit --config configs/tiny.yaml`` (LightningCLI)."""

from __future__ import annotations

import os
import sys
from typing import Any

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from lppo.errors import explain
from lppo.iteration.data import ReplayDataModule
from lppo.run import settings_list
from lppo.run.checkpointing import check_checkpoint
from lppo.run.cli_loggers import RecordConfig, place_logger_files
from lppo.run.cli_parser import (
    DESCRIPTION,
    FIT_DESCRIPTION,
    FIT_HELP,
    FIT_USAGE,
    PPOArgumentParser,
    check_trainer_options,
    tailor_trainer_options,
)
from lppo.run.system import PPOSystem
from lppo.run.trainer import PPOTrainer


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
        self._lppo_parser_kwargs(kwargs)
        super().__init__(PPOSystem, ReplayDataModule, *args, trainer_class=PPOTrainer, **kwargs)

    # ------------------------------------------ lppo's parser, help and checks (cli_parser)
    @staticmethod
    def _lppo_parser_kwargs(kwargs: dict[str, Any]) -> None:
        """Put lppo's parser class, description, usage and config recorder into ``kwargs``."""
        kwargs.setdefault("parser_class", PPOArgumentParser)
        kwargs.setdefault("save_config_callback", RecordConfig)
        parser_kwargs = kwargs.setdefault("parser_kwargs", {})
        parser_kwargs.setdefault("prog", "lppo")
        parser_kwargs.setdefault("description", DESCRIPTION)
        fit = parser_kwargs.setdefault("fit", {})
        fit.setdefault("usage", FIT_USAGE)
        fit.setdefault("description", FIT_DESCRIPTION)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """Only ``fit``: lppo implements no ``validate``, ``test`` or ``predict``."""
        return {"fit": LightningCLI.subcommands()["fit"]}

    def setup_parser(
        self, add_subcommands: bool, main_kwargs: dict[str, Any], subparser_kwargs: dict[str, Any]
    ) -> None:
        """LightningCLI's parser; ``lppo --help`` describes ``fit`` in lppo's words."""
        super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
        subcommands = self.parser._subcommands_action
        for choice in getattr(subcommands, "_choices_actions", []):
            if choice.dest == "fit":
                choice.help = FIT_HELP

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Hide the Trainer options that cannot apply to lppo; keep the parser for checks."""
        tailor_trainer_options(parser)
        self.fit_parser = parser

    def before_instantiate_classes(self) -> None:
        """Check the Trainer options, place logger files, give back the ``--ckpt_path`` file.

        Inapplicable Trainer options are refused; logger files go to the run directory; the
        file :meth:`parse_arguments` hid goes back to the ``fit`` call.
        """
        config = self.config.get(str(self.subcommand), self.config)
        check_trainer_options(self.fit_parser, config)
        place_logger_files(config)
        if self._ckpt_file is not None:
            self.config[self.config["subcommand"]]["ckpt_path"] = self._ckpt_file

    # ------------------------------------------ a --ckpt_path file: lppo's resume rules
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


def run(args: list[str] | None = None) -> PPOCLI:
    """Run the CLI in-process and return it (``args`` defaults to ``sys.argv[1:]``)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return PPOCLI(args=args)


def main() -> None:
    """Console-script entry point ``lppo``: ``lppo fit ...``, ``lppo settings ...``.

    ``lppo settings <fit's arguments>`` lists every setting of that configuration, one line
    each (:mod:`lppo.run.settings_list`).

    lppo's own setup errors (:func:`lppo.errors.explain`) print as one short block and exit
    with status 1; ``--debug`` (anywhere on the line) or ``LPPO_DEBUG=1`` shows the traceback
    (and jsonargparse's, for parse errors) instead.
    """
    debug = "--debug" in sys.argv[1:] or os.environ.get("LPPO_DEBUG", "") not in ("", "0")
    sys.argv = [arg for arg in sys.argv if arg != "--debug"]
    if debug:
        os.environ["JSONARGPARSE_DEBUG"] = "true"  # jsonargparse raises, not exits
    try:
        if sys.argv[1:2] == ["settings"]:
            settings_list.main(PPOCLI, sys.argv[2:])
        else:
            run()
    except Exception as exc:
        block = None if debug else explain(exc)
        if block is None:
            raise
        sys.stderr.write(block + "\n")
        sys.exit(1)


if __name__ == "__main__":
    main()
