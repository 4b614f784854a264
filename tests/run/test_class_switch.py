"""A ``class_path`` given later gives the new class its own defaults (``lppo.run.class_switch``).

jsonargparse alone carries the old class's ``init_args`` over to the new one: GSPO inherited
ClippedPPO's clip range 0.2 / 0.28 instead of its own 3e-4 / 4e-4, without a word. Most checks
parse with lppo's parser in-process (built once); one builds the system and one runs ``lppo fit
--print_config`` as a person does.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
from _cli import ROOT, TINY, lppo_cli
from jsonargparse import ArgumentParser, Namespace

from lppo.algorithms import CISPO, GSPO, PolicyObjective
from lppo.estimators import ReinforcePP
from lppo.rollout import VLLMEngine
from lppo.run.cli import PPOCLI

GRPO_CONFIG = ROOT / "configs" / "grpo.yaml"
OBJECTIVE = "model.actor.init_args.objective"

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter:UserWarning")


def defaults(cls: type) -> dict[str, Any]:
    """A class's own defaults, from its signature."""
    return {n: p.default for n, p in inspect.signature(cls).parameters.items()}


@pytest.fixture(scope="module")
def parser(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """lppo's parser (the one ``lppo fit`` builds), without a subcommand."""
    root = tmp_path_factory.mktemp("run")
    args = ["--config", str(TINY), "--trainer.max_epochs", "0", "--trainer.default_root_dir"]
    return PPOCLI(args=[*args, str(root)], run=False).parser


def parse(parser: Any, *args: str, config: Path = TINY) -> Namespace:
    return parser.parse_args(["--config", str(config), *args])


@pytest.mark.parametrize("config", [TINY, GRPO_CONFIG], ids=["tiny", "grpo"])
@pytest.mark.parametrize("cls", [GSPO, CISPO])
def test_switched_objective_gets_its_own_defaults(
    parser: Any, config: Path, cls: type, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = parse(parser, "--" + OBJECTIVE, f"lppo.algorithms.{cls.__name__}", config=config)
    objective = cfg.model.actor.init_args.objective
    assert objective.class_path == f"lppo.algorithms.{cls.__name__}"
    assert objective.init_args.as_dict() == defaults(cls)
    line = (
        f"lppo: {OBJECTIVE}: class changed ClippedPPO -> {cls.__name__}; dropped clip_low=0.2, "
        f"clip_high=0.28 ({cls.__name__}'s own defaults apply)"
    )
    assert capsys.readouterr().err.splitlines() == [line]


def test_the_built_objective_has_gspo_clip_range(tmp_path: Path) -> None:
    args = ["--config", str(TINY), "--trainer.max_epochs", "0"]
    args += ["--trainer.default_root_dir", str(tmp_path), "--" + OBJECTIVE, "lppo.algorithms.GSPO"]
    objective = PPOCLI(args=args, run=False).model.actor.objective
    assert isinstance(objective, GSPO)
    assert (objective.clip_low, objective.clip_high) == (3e-4, 4e-4)


@pytest.mark.parametrize(
    ("key", "old", "new", "arg", "value"),
    [
        ("model.estimator", "GAE", (ReinforcePP, "lppo.estimators"), "whiten", "false"),
        ("model.engine", "HFGenerateEngine", (VLLMEngine, "lppo.rollout"), "chat_template", "true"),
    ],
    ids=["estimator", "engine"],
)
def test_switched_estimator_and_engine_get_their_own_defaults(
    parser: Any,
    key: str,
    old: str,
    new: tuple[type, str],
    arg: str,
    value: str,
    capsys: pytest.CaptureFixture,
) -> None:
    # an argument both classes take: the one jsonargparse would carry over
    cls, package = new
    path = f"{package}.{cls.__name__}"
    cfg = parse(parser, f"--{key}.init_args.{arg}", value, f"--{key}", path)
    assert cfg[key].class_path == path
    assert cfg[key].init_args[arg] == defaults(cls)[arg] != (value == "true")
    err = capsys.readouterr().err
    assert err.startswith(f"lppo: {key}: class changed {old} -> {cls.__name__}; dropped ")
    assert f"{arg}={value.title()}" in err


def test_arguments_given_after_the_switch_are_kept(
    parser: Any, capsys: pytest.CaptureFixture
) -> None:
    after = ["--" + OBJECTIVE, "lppo.algorithms.GSPO", f"--{OBJECTIVE}.init_args.clip_high", "0.01"]
    cfg = parse(parser, f"--{OBJECTIVE}.init_args.clip_low", "0.1", *after)
    assert cfg.model.actor.init_args.objective.init_args.as_dict() == {
        "clip_low": 3e-4,  # given before the switch: ClippedPPO's
        "clip_high": 0.01,
    }
    assert "dropped clip_low=0.1, clip_high=0.28" in capsys.readouterr().err


def test_a_later_config_keeps_what_it_gives_with_the_new_class(
    parser: Any, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    later = tmp_path / "gspo.yaml"
    later.write_text(
        "model:\n  actor:\n    init_args:\n      objective:\n"
        "        class_path: lppo.algorithms.GSPO\n        init_args: {clip_high: 0.001}\n"
    )
    cfg = parse(parser, "--config", str(later))
    assert cfg.model.actor.init_args.objective.init_args.as_dict() == {
        "clip_low": 3e-4,
        "clip_high": 0.001,
    }
    assert capsys.readouterr().err.splitlines() == [
        f"lppo: {OBJECTIVE}: class changed ClippedPPO -> GSPO; dropped clip_low=0.2 "
        "(GSPO's own defaults apply)"
    ]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--" + OBJECTIVE, "lppo.algorithms.ClippedPPO"], (0.2, 0.28)),  # the same class again
        (["--" + OBJECTIVE, "lppo.algorithms.objectives.ClippedPPO"], (0.2, 0.28)),  # other path
        ([f"--{OBJECTIVE}.init_args.clip_low", "0.1"], (0.1, 0.28)),  # no class given
    ],
    ids=["same-class", "same-class-other-path", "init-arg-only"],
)
def test_no_switch_keeps_everything(
    parser: Any, args: list[str], expected: tuple[float, float], capsys: pytest.CaptureFixture
) -> None:
    cfg = parse(parser, *args)
    given = cfg.model.actor.init_args.objective.init_args
    assert (given.clip_low, given.clip_high) == expected
    assert capsys.readouterr().err == ""


def test_a_subclass_keeps_what_it_inherits_and_says_so(
    parser: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "own_objective.py").write_text(
        "from lppo.algorithms import ClippedPPO\n\n\nclass Wider(ClippedPPO):\n"
        '    """ClippedPPO by another name."""\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = parse(parser, "--" + OBJECTIVE, "own_objective.Wider")
    given = cfg.model.actor.init_args.objective.init_args
    assert (given.clip_low, given.clip_high) == (0.2, 0.28)
    assert capsys.readouterr().err.splitlines() == [
        f"lppo: {OBJECTIVE}: class changed ClippedPPO -> Wider; kept clip_low, clip_high "
        "(Wider is a subclass of ClippedPPO)"
    ]


def test_other_parsers_keep_jsonargparse_behaviour() -> None:
    """The rule is lppo's parser's: a plain jsonargparse parser still carries arguments over."""
    plain = ArgumentParser(exit_on_error=False)
    plain.add_argument("--objective", type=PolicyObjective | None)
    first = '{"class_path": "lppo.algorithms.ClippedPPO", "init_args": {"clip_low": 0.1}}'
    cfg = plain.parse_args(["--objective", first, "--objective", "lppo.algorithms.GSPO"])
    assert cfg.objective.init_args.clip_low == 0.1


def test_print_config_shows_the_new_defaults_and_the_change(tmp_path: Path) -> None:
    root = ["--trainer.default_root_dir", str(tmp_path / "run")]
    args = ["fit", "--config", str(TINY), *root, "--" + OBJECTIVE, "lppo.algorithms.GSPO"]
    proc = lppo_cli(*args, "--print_config")
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = " ".join(proc.stdout.split())
    assert "class_path: lppo.algorithms.GSPO init_args: clip_low: 0.0003 clip_high: 0.0004" in text
    assert f"{OBJECTIVE}: class changed ClippedPPO -> GSPO; dropped clip_low=0.2" in proc.stderr
