"""The parallel-layout seam: every layout implements it, every method of it is called."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
from lightning.pytorch.strategies import StrategyRegistry

import lppo.run.trainer  # noqa: F401  (registers the layouts' strategy names)
from lppo.layouts import LAYOUTS, FSDPLayout
from lppo.layouts.base import DataParallelLayout, ParallelLayout
from lppo.run.cli import run
from lppo.runtime.strategy import PPOStrategy
from lppo.validation import SettingError

ROOT = Path(__file__).resolve().parents[2]
#: Where layouts are implemented (their own calls to the protocol do not count as uses).
IMPLEMENTATIONS = {ROOT / "lppo" / "parallel.py", *(ROOT / "lppo" / "layouts").glob("*.py")}


def protocol_methods() -> list[str]:
    return [n for n, v in vars(ParallelLayout).items() if inspect.isfunction(v) and n[0] != "_"]


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_registered_name_builds_the_strategy_with_its_layout(name):
    cls, _ = LAYOUTS[name]
    strategy = StrategyRegistry.get(name)
    assert type(strategy) is PPOStrategy and type(strategy.layout) is cls
    assert isinstance(strategy.layout, ParallelLayout)
    # Its own file (the data-parallel default lives beside the context in lppo/parallel.py).
    assert Path(inspect.getfile(cls)) in IMPLEMENTATIONS


def test_every_protocol_method_is_called_outside_the_layouts():
    """A protocol method the code does not call would be a lie."""
    calls: set[str] = set()
    for path in [*(ROOT / "lppo").rglob("*.py"), *(ROOT / "callbacks").rglob("*.py")]:
        if path in IMPLEMENTATIONS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                calls.add(node.func.attr)
    methods = protocol_methods()
    assert len(methods) >= 10
    assert [m for m in methods if m not in calls] == []


def test_a_layout_is_chosen_by_class_path_with_its_settings(capsys):
    args = [
        "fit",
        "--config",
        str(ROOT / "configs" / "tiny.yaml"),
        "--trainer.strategy",
        "lppo.runtime.strategy.PPOStrategy",
        "--trainer.strategy.layout",
        "lppo.layouts.FSDPLayout",
        "--trainer.strategy.layout.param_dtype",
        "bfloat16",
        "--print_config",
    ]
    with pytest.raises(SystemExit) as exc:
        run(args)
    assert exc.value.code == 0
    printed = capsys.readouterr().out
    assert "class_path: lppo.layouts.FSDPLayout" in printed
    assert "param_dtype: bfloat16" in printed


def test_layout_settings_are_checked():
    with pytest.raises(SettingError, match=r"layout\.init_args\.param_dtype='fp8'.*bfloat16"):
        FSDPLayout(param_dtype="fp8")


def test_only_sharding_layouts_gather():
    assert not DataParallelLayout().shards_weights()
    assert FSDPLayout().shards_weights()
