"""Where admitted rollout jobs are generated: in the trainer, or in a background process.

A :class:`RolloutRunner` is chosen by ``model.runner.class_path`` (``null``:
:func:`~lppo.rollout.pipeline.default_runner`). This module holds the protocol, the trainer's
own runner and the thread that drives Ray rollout workers; the background process is
:mod:`lppo.rollout.process_runner`. The
fixed-lag scheduler (:class:`~lppo.rollout.pipeline.RolloutPipeline`) submits jobs in
iteration order and asks for their results in the same order; a runner never decides which
weights a job uses (the job carries them), so where it runs changes timing, never rows.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import ClassVar, Protocol, runtime_checkable

from lppo.init_args import RecordsInitArgs
from lppo.rollout.base import RolloutEngine
from lppo.rollout.jobs import GeneratedRollout, GenerationWorker, RolloutJob
from lppo.rollout.source import RolloutSource
from lppo.validation import check_number

#: The settings group of every runner (named in error messages).
RUNNER_KEY = "model.runner.init_args"


class RolloutProcessError(RuntimeError):
    """The background rollout process died, failed to start, or a wait for it ran out."""


@runtime_checkable
class RolloutRunner(Protocol):
    """Generates admitted :class:`~lppo.rollout.jobs.RolloutJob` s (``model.runner``).

    Attributes:
        live_weights: jobs without weights run on the actor's live weights (only a runner in
            the trainer's own process can; the scheduler then snapshots weights only for
            stale jobs).
    """

    live_weights: ClassVar[bool]

    def start(self, source: RolloutSource, engine: RolloutEngine) -> None:
        """Get ready to run jobs of ``source`` with copies of ``engine`` (not yet set up)."""
        ...

    def submit(self, job: RolloutJob) -> None:
        """Queue ``job`` (jobs are submitted in iteration order)."""
        ...

    def result(self, job: RolloutJob) -> GeneratedRollout:
        """``job``'s samples, waiting for them (a bounded wait; the oldest job first).

        Raises:
            RolloutProcessError: the generator died or the wait ran out (named in the message).
        """
        ...

    def close(self) -> None:
        """Stop whatever the runner started; idempotent."""
        ...


class InlineRunner(RecordsInitArgs):
    """Generates each job in the trainer when its iteration asks for it (no overlap).

    With ``max_staleness: 0`` this is the synchronous run. With ``s > 0`` it is the oracle of
    the asynchronous run: the same rows, generated without concurrency (from the job's
    weights, on a second copy of the policy).
    """

    live_weights: ClassVar[bool] = True

    def __init__(self) -> None:
        self.source: RolloutSource | None = None
        self.engine: RolloutEngine | None = None
        self.worker: GenerationWorker | None = None

    def start(self, source: RolloutSource, engine: RolloutEngine) -> None:
        """Keep the source (live weights) and the engine template (stale jobs)."""
        self.source, self.engine = source, engine

    def submit(self, job: RolloutJob) -> None:
        """Nothing to do before the job's iteration asks for it."""

    def result(self, job: RolloutJob) -> GeneratedRollout:
        """Generate ``job`` now: with the source on the live weights, or on the job's own."""
        assert self.source is not None and self.engine is not None
        if job.weights is None:
            started = time.monotonic()
            rows = self.source.run(job)
            return GeneratedRollout(job.iteration, rows, "", started, time.monotonic())
        if self.worker is None:
            s = self.source
            self.worker = GenerationWorker.copying(
                self.engine, s.actor.policy(), s.tokenizer, settings=s.settings, task=s.task
            )
        return self.worker.run(job)

    def close(self) -> None:
        """Drop the second copy of the policy."""
        self.worker = None


class ThreadRunner(RecordsInitArgs):
    """Generates jobs in a thread of the trainer, with a second copy of the engine.

    For engines whose work runs in processes of their own (``RayWorkersEngine``): the thread
    mostly waits for them, so it costs the trainer little. Its engine copy (its own workers)
    is set up on a second copy of the policy, into which each job's weights are loaded.

    Args:
        timeout_s: longest wait for one rollout.
    """

    live_weights: ClassVar[bool] = False

    def __init__(self, timeout_s: float = 600.0) -> None:
        check_number(f"{RUNNER_KEY}.timeout_s", timeout_s, low=0, low_open=True)
        self.timeout_s = timeout_s
        self.worker: GenerationWorker | None = None
        self.thread: threading.Thread | None = None
        self._jobs: queue.Queue[RolloutJob | None] = queue.Queue()
        self._results: queue.Queue[GeneratedRollout] = queue.Queue()

    def start(self, source: RolloutSource, engine: RolloutEngine) -> None:
        """Set the engine copy up (its workers start now) and start the thread."""
        self.worker = GenerationWorker.copying(
            engine,
            source.actor.policy(),
            source.tokenizer,
            settings=source.settings,
            task=source.task,
        )
        self.thread = threading.Thread(target=self._serve, name="lppo-rollout", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        assert self.worker is not None
        while True:
            clock = time.monotonic()
            job = self._jobs.get()
            if job is None:
                return
            idle = time.monotonic() - clock
            try:
                generated = self.worker.run(job)
                generated.idle_seconds = idle
            except Exception as error:
                cause = f"{type(error).__name__}: {error}"
                generated = GeneratedRollout(job.iteration, None, cause)
            self._results.put(generated)

    def submit(self, job: RolloutJob) -> None:
        """Queue ``job`` for the thread."""
        self._jobs.put(job)

    def result(self, job: RolloutJob) -> GeneratedRollout:
        """Wait (at most ``timeout_s``) for ``job``'s samples."""
        try:
            generated = self._results.get(timeout=self.timeout_s)
        except queue.Empty:
            raise RolloutProcessError(
                f"waited {self.timeout_s:g} s for the rollout of iteration {job.iteration + 1} "
                f"from the rollout thread; raise {RUNNER_KEY}.timeout_s, or lower the rollout size."
            ) from None
        if generated.iteration != job.iteration:
            raise RolloutProcessError(
                f"the rollout thread returned iteration {generated.iteration + 1}, not "
                f"{job.iteration + 1}."
            )
        return generated

    def close(self) -> None:
        """Stop the thread and what the engine copy started; idempotent."""
        thread, self.thread = self.thread, None
        if thread is not None:
            self._jobs.put(None)
            thread.join(timeout=self.timeout_s)
        if self.worker is not None:
            self.worker.engine.close()
            self.worker = None
