"""lppo's command-line parser: its help, its parse errors, and the Trainer options it refuses.

:class:`PPOArgumentParser` is the parser :class:`lppo.run.cli.PPOCLI` builds (LightningCLI's
``parser_class``): parse errors print the error first (then a one-line usage and where to start),
``lppo fit --help`` lists lppo's groups before the Trainer's, Lightning's own Trainer options keep
their first sentence only, and the Trainer options that cannot apply to lppo's loop are hidden
(:data:`NOT_APPLICABLE`) and refused at parse time by :func:`check_trainer_options`, naming
lppo's replacement. A ``class_path`` given later gives the new class its own defaults
(:mod:`lppo.run.class_switch`); a ``class_path`` that cannot be used is reported as lppo's short
block (:mod:`lppo.run.class_errors`).
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from typing import Any, NoReturn

from jsonargparse import Namespace
from lightning.pytorch.cli import LightningArgumentParser

from lppo.errors import missing_extra
from lppo.run import class_switch
from lppo.run.class_errors import class_path_block
from lppo.run.rst import rst_to_text

class_switch.install()  # a later class_path gives the new class its own defaults

#: What ``lppo --help`` says lppo is.
DESCRIPTION = (
    "lppo: streamed PPO post-training for language models on Lightning. Start from a config: "
    "`lppo fit --config configs/tiny.yaml`; `lppo fit --help` lists the settings with their "
    "defaults, and `lppo settings --config FILE` every setting of that configuration (the "
    "actor's, critic's, task's and engine's included), one line each. Errors in settings "
    "print as one short block; add --debug (or set LPPO_DEBUG=1) for the traceback."
)
#: The one line ``lppo --help`` shows for ``fit``.
FIT_HELP = "train a PPO run (or resume one with --ckpt_path); see `lppo fit --help`"
#: What ``lppo fit --help`` says first.
FIT_DESCRIPTION = (
    "Train a PPO run, or resume one with --ckpt_path. lppo's settings (model.*, data.*, "
    "--ckpt_path) come first, Lightning's Trainer options last; Trainer options that cannot "
    "apply to lppo are not listed and are refused, naming lppo's replacement. The settings "
    "of the classes chosen by class_path (the actor's lr and objective, the task's, the "
    "engine's): `lppo settings --config FILE`, one line each, or `--model.actor.help CLASS`."
)
#: ``lppo fit``'s usage line (jsonargparse's lists every option: 90 lines).
FIT_USAGE = (
    "lppo fit [--config FILE] [--KEY VALUE ...] [--ckpt_path FILE|last|auto] [--print_config]"
)
#: Where a person starts, printed under every parse error.
TIP = (
    "tip: start from a config (`lppo fit --config configs/tiny.yaml`) and override keys "
    "(`--model.ppo.kl_coef 0.05`); `lppo settings --config FILE` lists every key of a config."
)

_VALIDATION = (
    "Lightning's validation loop does not run in lppo; evaluate held-out prompts with "
    "--trainer.callbacks+=lppo.callbacks.Evaluation"
)
_NO_LOADER = "lppo has no Lightning dataloader: model.task gives each iteration's prompts"
_EPOCH = (
    "an lppo epoch is one RL iteration of model.rollout.prompts_per_iteration prompts; set its "
    "size there and the number of iterations with trainer.max_epochs"
)
_CLIP = (
    "lppo clips in the actor's and critic's own optimizer step: set "
    "model.actor.init_args.max_grad_norm (and model.critic.init_args.max_grad_norm; default 1.0)"
)

#: Trainer options that cannot apply to lppo's loop -> (values also accepted besides the
#: parser's default, the replacement). They are hidden from ``lppo fit --help``; any other value
#: is refused at parse time.
NOT_APPLICABLE: dict[str, tuple[tuple[Any, ...], str]] = {
    "gradient_clip_val": ((), _CLIP),
    "gradient_clip_algorithm": ((), _CLIP),
    "accumulate_grad_batches": (
        (),
        "each minibatch's gradients are already accumulated over its chunks "
        "(data.max_tokens_per_chunk bounds the memory of one chunk); for fewer, larger optimizer "
        "steps lower model.ppo.actor_minibatches (and model.ppo.critic_minibatches)",
    ),
    "limit_val_batches": ((0, 0.0), _VALIDATION),
    "val_check_interval": ((), _VALIDATION),
    "check_val_every_n_epoch": ((), _VALIDATION),
    "num_sanity_val_steps": ((0,), _VALIDATION),
    "limit_train_batches": ((), _EPOCH),
    "overfit_batches": ((), _EPOCH),
    "reload_dataloaders_every_n_epochs": ((), _NO_LOADER),
    "use_distributed_sampler": ((True, False), _NO_LOADER),
    "limit_test_batches": ((), "lppo has no `test` subcommand"),
    "limit_predict_batches": ((), "lppo has no `predict` subcommand"),
    "inference_mode": ((True, False), "it applies to validate / test / predict, not to fit"),
    "fast_dev_run": (
        (False, 0),
        "a quick check run: --trainer.max_epochs 1 --model.rollout.prompts_per_iteration 4 "
        "--trainer.enable_checkpointing false",
    ),
    "log_every_n_steps": (
        (),
        "lppo logs every iteration and every optimizer step (PPOMetricsLogger; its log_steps "
        "turns the per-step rows off)",
    ),
    "sync_batchnorm": ((False,), "lppo does not wrap its modules; no batch-norm layer is synced"),
}

#: Descriptions of ``fit`` arguments whose Lightning docstring has none.
METHOD_HELP = {
    "ckpt_path": (
        "checkpoint to resume from: `last` (<default_root_dir>/checkpoints/last.ckpt; an error "
        "when there is none), `auto` (last.ckpt when it exists, else a new run) or a .ckpt file "
        "written by `lppo fit`; null: a new run."
    ),
}

#: Order of the option groups in ``lppo fit --help``: lppo's first, Lightning's Trainer last.
_GROUP_ORDER = ("model", "data", "trainer.ray", "trainer")


def _first_sentence(text: str) -> str:
    """``text`` up to its first full stop (Lightning's docstrings run to many lines)."""
    flat = " ".join(text.split())
    match = re.search(r"(?<!e\.g)(?<!i\.e)\.(\s|$)", flat)
    return flat[: match.end()].strip() if match else flat


def _closest_key(parser: argparse.ArgumentParser, message: str) -> str | None:
    """The known key closest to the unknown one ``message`` names (a typo), if any is close."""
    unknown = re.search(
        r"unrecognized arguments: --([\w.]+)|does not accept option '([\w.]+)'", message
    )
    if unknown is None:
        return None
    key = unknown.group(1) or unknown.group(2)
    known = [o[2:] for a in parser._actions for o in a.option_strings if o.startswith("--")]
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.8)
    return close[0] if close else None


class PPOArgumentParser(LightningArgumentParser):
    """LightningCLI's parser with lppo's errors and help (see the module docstring)."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        """Print the error first, then the usage line and a tip; exit with status 2.

        A ``class_path`` that cannot be used prints as lppo's short block instead, with the
        classes lppo ships for the key (:func:`lppo.run.class_errors.class_path_block`).
        """
        if not self.exit_on_error or os.environ.get("JSONARGPARSE_DEBUG", "").lower() == "true":
            super().error(message, ex)
        class_switch.flush()  # a dropped argument may be why the parse failed
        text = message.strip()
        if self._config_path:  # YAML names the file it read from a string "<unicode string>"
            text = text.replace('"<unicode string>"', f'"{self._config_path}"')
        extra = missing_extra(ex) if ex is not None else None
        extra = extra or missing_extra(ImportError(text))
        parser = getattr(ex, "subcommand_parser", None) or self
        block = class_path_block(parser, ex) if ex is not None and extra is None else None
        if block is not None:
            sys.stderr.write(block + "\n")
            self.exit(2)
        lines = [f"lppo: error: {text}"]
        if extra is not None:
            package, name = extra
            lines[0] = f"lppo: error: the Python package {package!r} is not installed"
            lines.append(f"  fix: pip install -c constraints.txt -e '.[{name}]' (in the clone)")
            lines.append(f"  (the parser said: {' '.join(text.split())[:300]})")
        guess = _closest_key(parser, text)
        if guess:
            lines.append(f"  did you mean {guess}?")
        lines += [f"usage: {parser.format_usage().removeprefix('usage: ').strip()}", TIP]
        sys.stderr.write("\n".join(lines) + "\n")
        self.exit(2)

    _config_path: str = ""

    def parse_args(self, *args: Any, **kwargs: Any) -> Namespace:
        """Parse, giving a class set later its own defaults (:mod:`lppo.run.class_switch`)."""
        with class_switch.recording():
            return super().parse_args(*args, **kwargs)

    def parse_path(self, cfg_path: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
        """Parse a config file, remembering its path for :meth:`error`."""
        self._config_path = os.fspath(cfg_path)
        return super().parse_path(cfg_path, *args, **kwargs)

    def format_help(self, formatter: argparse.HelpFormatter | None = None) -> str:
        """The help with lppo's groups first (argparse prints groups in insertion order)."""

        def rank(group: argparse._ArgumentGroup) -> int:
            key = next((k for k, g in (self.groups or {}).items() if g is group), None)
            if key is None:
                return -1  # the positional / top-level options come first
            for i, prefix in enumerate(_GROUP_ORDER):
                if key == prefix or key.startswith(f"{prefix}."):
                    return i
            return _GROUP_ORDER.index("trainer.ray")  # fit's arguments (--ckpt_path) with lppo's

        self._action_groups.sort(key=rank)
        # Docstrings are written for the documentation site: their roles are noise here.
        return rst_to_text(super().format_help(formatter))

    def add_method_arguments(self, *args: Any, **kwargs: Any) -> list[str]:
        """Add a method's arguments, describing those its docstring leaves bare."""
        added = super().add_method_arguments(*args, **kwargs)
        for action in self._actions:
            if action.dest in METHOD_HELP and not action.help:
                action.help = METHOD_HELP[action.dest]
        return added


def tailor_trainer_options(parser: LightningArgumentParser) -> None:
    """Hide the Trainer options of :data:`NOT_APPLICABLE`; shorten Lightning's descriptions."""
    for action in parser._actions:
        key = action.dest.removeprefix("trainer.")
        if not action.dest.startswith("trainer.") or key.startswith("ray"):
            continue
        if key.removesuffix(".help") in NOT_APPLICABLE:
            action.help = argparse.SUPPRESS
        elif action.help and action.help is not argparse.SUPPRESS:
            action.help = _first_sentence(action.help)


def check_trainer_options(parser: LightningArgumentParser, config: Namespace) -> None:
    """Refuse (``parser.error``) a Trainer option of :data:`NOT_APPLICABLE` set to act."""
    for key, (accepted, replacement) in NOT_APPLICABLE.items():
        value = config.get(f"trainer.{key}")
        if value == parser.get_default(f"trainer.{key}") or value in accepted:
            continue
        parser.error(
            f"trainer.{key}={value!r} does not apply to lppo: {replacement}.",
        )


__all__ = [
    "DESCRIPTION",
    "FIT_DESCRIPTION",
    "FIT_HELP",
    "FIT_USAGE",
    "NOT_APPLICABLE",
    "PPOArgumentParser",
    "check_trainer_options",
    "tailor_trainer_options",
]
