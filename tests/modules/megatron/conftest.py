"""megatron-core tests run on CPU through the shims of ``tests/_megatron_cpu.py``."""

from __future__ import annotations

import pytest
from _megatron_cpu import install, uninstall


@pytest.fixture(autouse=True, scope="module")
def megatron_cpu():
    """Shims installed for the module; process groups torn down after it."""
    install()
    yield
    uninstall()
