"""Test configuration: hypothesis profiles and float64 determinism."""

import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=int(os.environ.get("LPPO_HYPOTHESIS_EXAMPLES", "25")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
settings.load_profile("ci")

# The folders of tests/ mirror lppo/'s, and test modules import helpers of other test modules
# by name (``from test_ddp import WORKER``), as pytest's rootdir-relative "prepend" import does
# for a file's own folder: put every folder on the path now, so the order files are collected
# in does not decide what imports (folders with an __init__.py are packages, imported by it).
_TESTS = Path(__file__).resolve().parent
sys.path[:0] = [
    str(d)
    for d in sorted(_TESTS.iterdir())
    if d.is_dir() and d.name[0] not in "._" and not (d / "__init__.py").exists()
]


@pytest.fixture(autouse=True)
def _master_port(monkeypatch):
    """Each test's launched fits rendezvous on a port of their own (see ``tests/_ports.py``)."""
    from _ports import next_port

    monkeypatch.setenv("MASTER_PORT", str(next_port()))


@pytest.fixture(scope="session", autouse=True)
def _transfer_queue_session():
    """Stop the session's Ray + TransferQueue (started by the first test that needs them)."""
    yield
    import _tq

    _tq.shutdown()


@pytest.fixture(scope="session")
def straight_tiny_fit(tmp_path_factory):
    """The final state dict of one uninterrupted ``lppo fit`` of ``test_sigkill.ARGS``.

    The reference that every killed-and-resumed or signalled-and-resumed run of that same
    configuration (tests/run/test_sigkill.py, tests/run/test_interrupts.py) must equal
    bitwise; it is deterministic, so one run serves the whole session.
    """
    import subprocess

    from test_sigkill import env, final_state, lppo_fit

    root = tmp_path_factory.mktemp("straight")
    subprocess.run(lppo_fit(root), check=True, env=env(), capture_output=True, timeout=900)
    return final_state(root)


def _vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def pytest_collection_modifyitems(config, items):
    """Files with slow or multi-process tests first; ``vllm`` tests only where vLLM is.

    Under ``pytest -n 2 --dist loadfile`` (CI) each worker takes whole files in this order, so
    the long files start first and the run does not end waiting on one of them (a stable sort:
    within each group, files keep their order).

    ``vllm`` tests run in the vLLM environment (``bash .ci/vllm``, called by ``.ci/run``). In an
    environment without vLLM they are skipped; with ``LPPO_REQUIRE_VLLM=1`` (set by
    ``.ci/vllm``) a missing vLLM fails them instead, so CI can never skip them silently.
    """
    import pytest

    heavy = {
        item.path
        for item in items
        if item.get_closest_marker("slow") or item.get_closest_marker("distributed")
    }
    items.sort(key=lambda item: item.path not in heavy)
    if _vllm_available() or os.environ.get("LPPO_REQUIRE_VLLM") == "1":
        return
    skip = pytest.mark.skip(reason="needs vLLM: runs in the vLLM venv (bash .ci/vllm)")
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(skip)
