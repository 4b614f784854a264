"""Guards the Lightning private names lppo.loop relies on (Lightning is pinned to 2.6.x)."""

import importlib

import lightning
import pytest

from lppo.loop import PRIVATE_NAMES


def test_lightning_minor_is_pinned():
    major, minor = (int(x) for x in lightning.__version__.split(".")[:2])
    assert (major, minor) == (2, 6), "lppo.loop is written against Lightning 2.6.x"


@pytest.mark.parametrize(("owner", "name"), PRIVATE_NAMES)
def test_private_name_exists(owner, name):
    module_name, _, attr_path = owner, "", ""
    obj = None
    parts = owner.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            module_name, attr_path = ".".join(parts[:i]), parts[i:]
            break
        except ImportError:
            continue
    assert obj is not None, owner
    for part in attr_path:
        obj = getattr(obj, part)
    if isinstance(obj, type) and not hasattr(obj, name):
        # Instance attributes are set in __init__: check the source assigns them.
        import inspect

        source = inspect.getsource(obj)
        assert f"self.{name}" in source, f"{module_name}.{'.'.join(attr_path)}.{name} is gone"
    else:
        assert hasattr(obj, name), f"{owner}.{name} is gone"


def test_loop_is_the_only_module_using_private_lightning_api():
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1]
    pattern = re.compile(
        r"lightning\.pytorch\.loops|_FitLoop|_TrainingEpochLoop|trainer\.call\b|\._trainer\b"
        r"|_given_hyperparameters|_last_global_step_saved"
    )
    offenders = [
        str(p.relative_to(root))
        for folder in ("lppo", "callbacks")
        for p in (root / folder).rglob("*.py")
        if p.name != "loop.py" and pattern.search(p.read_text())
    ]
    assert offenders == []
