"""Every rollout engine implements the whole ``RolloutEngine`` protocol (a class-level check).

Runs everywhere: it needs neither vLLM nor Ray, only the engine classes.
"""

from __future__ import annotations

import inspect

import pytest

from lppo.rollout import HFGenerateEngine, RayWorkersEngine, RolloutEngine, VLLMEngine

ENGINES = [HFGenerateEngine, VLLMEngine, RayWorkersEngine]

#: The protocol's methods, read from the protocol itself (so a new member is checked too).
METHODS = sorted(
    name
    for name, member in vars(RolloutEngine).items()
    if not name.startswith("_") and inspect.isfunction(member)
)


def test_the_protocol_is_what_the_engines_are_checked_against() -> None:
    assert METHODS == ["close", "generate", "setup", "sync_from"]
    assert "weights_version" in RolloutEngine.__annotations__
    greedy = inspect.signature(RolloutEngine.generate).parameters["greedy"]
    assert greedy.default is False


@pytest.mark.parametrize("engine", ENGINES, ids=lambda cls: cls.__name__)
def test_engine_defines_every_protocol_member(engine: type) -> None:
    for name in METHODS:
        method = inspect.getattr_static(engine, name, None)
        assert inspect.isfunction(method), f"{engine.__name__}.{name} is missing"
        want = inspect.signature(getattr(RolloutEngine, name)).parameters
        got = inspect.signature(method).parameters
        # The protocol's parameters, by name and in order, callable as the protocol calls them.
        assert list(got)[: len(want)] == list(want), f"{engine.__name__}.{name}{tuple(got)}"
        extra = [p for p in list(got.values())[len(want) :] if p.default is inspect.Parameter.empty]
        assert not extra, f"{engine.__name__}.{name} needs more than the protocol passes"
    assert inspect.signature(engine.generate).parameters["greedy"].default is False
    # weights_version is an instance attribute, set by the constructor (no process started).
    instance = engine()
    assert instance.weights_version == 0
    assert isinstance(instance, RolloutEngine)
    instance.close()  # nothing was started: closing is harmless, and so is closing again
    instance.close()
