"""The runners' own checks (the runs themselves are in ``test_pipeline*.py``)."""

from __future__ import annotations

import os

import pytest
from _async_helpers import fit

from lppo.rollout import ProcessRunner
from lppo.rollout.runners import oversubscription


def test_oversubscription_names_both_knobs_and_the_cores() -> None:
    assert oversubscription(1, 1, 2) == ""
    assert oversubscription(3, 5, 8) == ""
    message = oversubscription(2, 2, 2)
    assert "trainer's 2 torch threads (model.num_threads)" in message
    assert "rollout process's 2 (model.runner.init_args.num_threads" in message
    assert "exceed the 2 cores" in message


@pytest.mark.slow
def test_a_process_that_crowds_the_trainer_is_warned_about(tmp_path) -> None:
    cores = len(os.sched_getaffinity(0))
    runner = ProcessRunner(num_threads=cores)  # + the trainer's one thread
    with pytest.warns(RuntimeWarning, match=rf"exceed the {cores} cores"):
        fit(tmp_path, 1, 1, runner=runner)
