"""The runners' own checks (the runs themselves are in ``test_pipeline*.py``)."""

from __future__ import annotations

import dataclasses
import os
import threading

import pytest
from _async_helpers import fit

from lppo.errors import IterationError
from lppo.rollout import ProcessRunner
from lppo.rollout.process_runner import oversubscription


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


class Unsendable(ProcessRunner):
    """Gives iteration 3's job something that cannot be pickled, as a full /dev/shm fails the
    move of its weights: either way the queue's feeder thread cannot send it."""

    def submit(self, job):
        if job.iteration == 2:
            job = dataclasses.replace(job, weights={**job.weights, "lock": threading.Lock()})
        super().submit(job)


@pytest.mark.slow
def test_a_job_that_cannot_be_sent_fails_its_own_iteration_at_once(tmp_path) -> None:
    # without the hook the queue drops the job and the wait runs out after timeout_s
    unsent = r"iteration 3, phase rollout: iteration 3's job could not be sent .*TypeError"
    with pytest.raises(IterationError, match=unsent):
        fit(tmp_path / "fatal", 4, 1, runner=Unsendable(timeout_s=600.0))
    # under a failure budget only that iteration is lost: the next waits for its own job
    trainer, system = fit(
        tmp_path / "skip", 4, 1, runner=Unsendable(timeout_s=600.0), max_failed_iterations=1
    )
    assert system.run_log.failed == 1
    assert [r["iteration"] for r in system.run_log.history] == [1, 2, 4]
    assert len(trainer.datamodule.store) == 0
