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

#: Default ``close_timeout_s`` of the runners that generate outside the trainer's call.
CLOSE_TIMEOUT_S = 10.0


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
        """Stop whatever the runner started, in bounded time; idempotent.

        Jobs queued but not started are dropped, not generated (the scheduler's checkpoint
        keeps them for a resume); :class:`BackgroundRunner` is the shape of it.
        """
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


class BackgroundRunner(RecordsInitArgs):
    """A runner whose jobs are generated outside the trainer's call: its close, shared.

    :class:`ThreadRunner` and :class:`~lppo.rollout.process_runner.ProcessRunner` close the
    same way, in three steps: 1. stop admitting: :meth:`submit` refuses new jobs and the
    generator starts none of the queued ones (they are dropped, not generated; the
    scheduler's checkpoint keeps them for a resume); 2. wait at most ``close_timeout_s`` for
    the job it is running; 3. kill what still runs (a process) or abandon it (a thread, whose
    engine copy is closed under it), and let go of the queues.

    Args:
        close_timeout_s: longest wait, at close, for the job being generated (and for a
            killed process to be reaped); 0 kills at once.
    """

    live_weights: ClassVar[bool] = False
    #: Closing does not shape the rows, so a resumed run may change it.
    resume_safe: ClassVar[tuple[str, ...]] = ("close_timeout_s",)

    def __init__(self, close_timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        check_number(
            f"{RUNNER_KEY}.close_timeout_s",
            close_timeout_s,
            low=0,
            fix=f"It bounds the wait for the running job at close ({CLOSE_TIMEOUT_S:g} s by "
            "default; 0 kills it at once).",
        )
        self.close_timeout_s = close_timeout_s
        self._admitting = False

    def submit(self, job: RolloutJob) -> None:
        """Queue ``job`` for the generator.

        Raises:
            RolloutProcessError: the runner was closed (or never started).
        """
        if not self._admitting:
            raise RolloutProcessError(
                f"iteration {job.iteration + 1}'s job was submitted to a {type(self).__name__} "
                "that is closed or not started; start it (RolloutPipeline does) before submit."
            )
        self._send(job)

    def close(self) -> None:
        """Stop admitting, wait (``close_timeout_s``) for the running job, kill; idempotent."""
        self._admitting = False
        if not self._running():
            return
        self._stop()
        self._join(self.close_timeout_s)
        self._kill()

    def _send(self, job: RolloutJob) -> None:
        """Hand ``job`` to the generator."""
        raise NotImplementedError

    def _running(self) -> bool:
        """Whether a generator was started and not yet killed."""
        raise NotImplementedError

    def _stop(self) -> None:
        """Tell the generator to start no further job, and wake it if it waits for one."""
        raise NotImplementedError

    def _join(self, timeout: float) -> None:
        """Wait at most ``timeout`` seconds for the generator to end."""
        raise NotImplementedError

    def _kill(self) -> None:
        """Kill or abandon what still runs; let go of the queues and the engine copy."""
        raise NotImplementedError


class ThreadRunner(BackgroundRunner):
    """Generates jobs in a thread of the trainer, with a second copy of the engine.

    For engines whose work runs in processes of their own (``RayWorkersEngine``): the thread
    mostly waits for them, so it costs the trainer little. Its engine copy (its own workers)
    is set up on a second copy of the policy, into which each job's weights are loaded.

    Args:
        timeout_s: longest wait for one rollout.
        close_timeout_s: longest wait, at close, for the running job; then the engine copy is
            closed (its workers killed) and the thread abandoned (:class:`BackgroundRunner`).
    """

    def __init__(self, timeout_s: float = 600.0, close_timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        check_number(f"{RUNNER_KEY}.timeout_s", timeout_s, low=0, low_open=True)
        super().__init__(close_timeout_s)
        self.timeout_s = timeout_s
        self.worker: GenerationWorker | None = None
        self.thread: threading.Thread | None = None
        self._stopping = threading.Event()
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
        # Fresh ones per start: a thread abandoned by an earlier close keeps its own.
        self._stopping, self._jobs, self._results = threading.Event(), queue.Queue(), queue.Queue()
        args = (self.worker, self._stopping, self._jobs, self._results)
        self.thread = threading.Thread(target=_serve, args=args, name="lppo-rollout", daemon=True)
        self.thread.start()
        self._admitting = True

    def _send(self, job: RolloutJob) -> None:
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

    def _running(self) -> bool:
        return self.thread is not None

    def _stop(self) -> None:
        self._stopping.set()
        self._jobs.put(None)  # wakes a thread that waits for a job

    def _join(self, timeout: float) -> None:
        assert self.thread is not None
        self.thread.join(timeout=timeout)

    def _kill(self) -> None:
        # A thread cannot be killed: closing the engine copy (its Ray workers) fails the job
        # it still runs, after which it sees the stop and ends; until then it is abandoned.
        self.thread = None
        worker, self.worker = self.worker, None
        if worker is not None:
            worker.engine.close()


def _serve(
    worker: GenerationWorker,
    stopping: threading.Event,
    jobs: queue.Queue[RolloutJob | None],
    results: queue.Queue[GeneratedRollout],
) -> None:
    """The rollout thread: generate the queued jobs in order until told to stop."""
    while True:
        clock = time.monotonic()
        job = jobs.get()
        if job is None or stopping.is_set():  # queued jobs are dropped at close
            return
        idle = time.monotonic() - clock
        try:
            generated = worker.run(job)
            generated.idle_seconds = idle
        except Exception as error:
            cause = f"{type(error).__name__}: {error}"
            generated = GeneratedRollout(job.iteration, None, cause)
        results.put(generated)
