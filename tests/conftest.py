"""Test configuration: hypothesis profiles and float64 determinism."""

import os

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


@pytest.fixture(scope="session", autouse=True)
def _transfer_queue_session():
    """Stop the session's Ray + TransferQueue (started by the first test that needs them)."""
    yield
    import _tq

    _tq.shutdown()
