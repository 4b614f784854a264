"""The background rollout process: generates admitted jobs concurrently with training.

The trainer side (:class:`ProcessRunner`) spawns one process, sends it each job (its weights
move to shared memory in the queue's feeder thread) and waits, bounded, for the answers in
job order; the process side (:func:`_serve`) sets up its own copy of the engine and policy
once, then generates the jobs in order and dies with the trainer.
"""

from __future__ import annotations

import copy
import multiprocessing
import multiprocessing.connection
import os
import queue
import threading
import time
import traceback
import warnings
from typing import Any

import torch

from lppo.rollout.base import RolloutEngine
from lppo.rollout.jobs import GeneratedRollout, GenerationWorker, RolloutJob
from lppo.rollout.runners import CLOSE_TIMEOUT_S, RUNNER_KEY, BackgroundRunner, RolloutProcessError
from lppo.rollout.source import RolloutSource
from lppo.validation import check_number


class ProcessRunner(BackgroundRunner):
    """Generates jobs in one background process that lppo starts and stops itself.

    The process holds its own copy of the policy and of the engine; each job's weights reach
    it through shared memory (torch's multiprocessing), its samples come back pickled (each
    column packed into one tensor: :meth:`~lppo.rollout.jobs.GeneratedRollout.dumps`). It
    generates the admitted jobs in order, concurrently with training.

    Args:
        num_threads: torch threads of the process (``null``: the trainer's count, so its
            samples equal the trainer's own bit for bit).
        timeout_s: longest wait for one rollout.
        start_timeout_s: longest wait for the process to start (import torch, unpickle the
            policy, set the engine up).
        max_restarts: times a dead process is replaced over the run (its unfinished jobs are
            generated again, from the same weights and seeds) before the run fails.
        close_timeout_s: longest wait, at close, for the running job (and then for the killed
            process to be reaped; :class:`~lppo.rollout.runners.BackgroundRunner`).
    """

    def __init__(
        self,
        num_threads: int | None = None,
        timeout_s: float = 600.0,
        start_timeout_s: float = 300.0,
        max_restarts: int = 1,
        close_timeout_s: float = CLOSE_TIMEOUT_S,
    ) -> None:
        check_number(f"{RUNNER_KEY}.num_threads", num_threads, integer=True, low=1, optional=True)
        check_number(f"{RUNNER_KEY}.timeout_s", timeout_s, low=0, low_open=True)
        check_number(f"{RUNNER_KEY}.start_timeout_s", start_timeout_s, low=0, low_open=True)
        check_number(f"{RUNNER_KEY}.max_restarts", max_restarts, integer=True, low=0)
        super().__init__(close_timeout_s)
        self.num_threads = num_threads
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self.max_restarts = max_restarts
        self.restarts = 0
        self.process: Any = None
        self._source: RolloutSource | None = None
        self._engine: RolloutEngine | None = None
        self._inbox: Any = None
        self._outbox: Any = None
        self._stopping: Any = None  # the process's stop flag (a multiprocessing Event)
        self._inflight: list[RolloutJob] = []
        #: Jobs the queue could not send (by iteration): their waits fail at once.
        self._unsent: dict[int, str] = {}
        #: Answers that came while a job that was never sent was awaited (in order).
        self._early: list[tuple[str, Any]] = []

    def start(self, source: RolloutSource, engine: RolloutEngine) -> None:
        """Start the process with copies of the engine, the policy, the task and the settings."""
        self._source, self._engine = source, engine
        trainer = torch.get_num_threads()
        crowded = oversubscription(trainer, self.num_threads or trainer, _cores())
        if crowded:
            warnings.warn(crowded, RuntimeWarning, stacklevel=2)
        self._admitting = True
        self._spawn()

    def _spawn(self) -> None:
        assert self._source is not None
        s = self._source
        # The policy's architecture travels (its storages through shared memory, not copied
        # again); each job brings its weights.
        policy = copy.deepcopy(s.actor.policy()).cpu()
        threads = self.num_threads or torch.get_num_threads()
        spec = (self._engine, policy, s.tokenizer, s.settings, s.task, threads)
        # spawn, not fork: forking a trainer that runs threads (Ray, gloo, torch's pool) is
        # not safe.
        ctx = torch.multiprocessing.get_context("spawn")
        self._inbox, self._outbox, self._stopping = ctx.Queue(), ctx.Queue(), ctx.Event()
        self._early = []  # the old process's answers: its unfinished jobs are sent again
        # A job is pickled (its weights moved to shared memory) in the queue's feeder thread,
        # which by default prints a failure and drops the job: record it, so the wait for
        # that job fails at once, naming the cause (the stdlib's hook for this, which
        # concurrent.futures overrides too).
        self._inbox._on_queue_feeder_error = self._send_failed
        self.process = ctx.Process(
            target=_serve,
            args=(spec, self._inbox, self._outbox, self._stopping),
            name="lppo-rollout",
            daemon=True,
        )
        self.process.start()
        del policy, spec
        what = "the background rollout process to start"
        try:
            kind, message = self._receive(what, self.start_timeout_s, "start_timeout_s")
        except RolloutProcessError as error:
            self.close()
            raise RolloutProcessError(
                f"{error} Its stderr says why; the engine, policy, tokenizer and task are "
                "unpickled there, so their classes must be importable by name."
            ) from None
        if kind != "ready":
            self.close()
            raise RolloutProcessError(f"the background rollout process failed to start:\n{message}")
        for job in self._inflight:  # a replacement generates the unfinished jobs again
            self._inbox.put(job)

    def _send_failed(self, error: BaseException, job: Any) -> None:
        if not isinstance(job, RolloutJob):  # the stop message: nothing waits for it
            return
        self._unsent[job.iteration] = (
            f"iteration {job.iteration + 1}'s job could not be sent to the background rollout "
            f"process ({type(error).__name__}: {error}). Its weights travel through shared memory "
            "(/dev/shm): give it room for max_staleness + 1 copies of the policy (docker: "
            "--shm-size), or use model.runner: lppo.rollout.InlineRunner."
        )

    def _send(self, job: RolloutJob) -> None:
        """Send ``job`` to the process (its weights travel through shared memory)."""
        self._inflight.append(job)
        self._inbox.put(job)

    def result(self, job: RolloutJob) -> GeneratedRollout:
        """Wait (at most ``timeout_s``) for ``job``'s samples; replace a dead process."""
        if not self._inflight or self._inflight[0].iteration != job.iteration:
            raise RolloutProcessError(
                f"asked for iteration {job.iteration + 1}'s rollout, but the oldest job in the "
                f"background rollout process is {[j.iteration + 1 for j in self._inflight]}."
            )
        what = f"the rollout of iteration {job.iteration + 1} from the background rollout process"
        while True:
            try:
                kind, message = self._receive(what, self.timeout_s, "timeout_s", job)
                break
            except RolloutProcessError:
                if self.process is not None and self.process.is_alive():
                    raise  # a timeout: the process lives but is too slow
                if self.restarts >= self.max_restarts:
                    raise
                self.restarts += 1
                self._spawn()
        self._inflight.pop(0)
        if kind == "error":
            return GeneratedRollout(job.iteration, None, message)
        generated = GeneratedRollout.loads(message)
        if generated.iteration != job.iteration:
            raise RolloutProcessError(
                f"the background rollout process answered iteration {generated.iteration + 1} "
                f"when iteration {job.iteration + 1}'s rollout was due."
            )
        return generated

    def _receive(
        self, what: str, bound: float, key: str, job: RolloutJob | None = None
    ) -> tuple[str, Any]:
        deadline = time.monotonic() + bound
        while True:
            if job is not None and job.iteration in self._unsent:
                # never sent, so never answered: the next iteration waits for the next job
                self._inflight = [j for j in self._inflight if j.iteration != job.iteration]
                raise RolloutProcessError(self._unsent.pop(job.iteration))
            if self._early:
                return self._early.pop(0)
            try:
                message = self._outbox.get(timeout=min(1.0, max(deadline - time.monotonic(), 0.01)))
            except queue.Empty:
                message = None
            if message is not None and job is not None and job.iteration in self._unsent:
                self._early.append(message)  # a later job's answer: its own wait takes it
                continue
            if message is not None:
                return message
            if not self.process.is_alive():
                code = self.process.exitcode
                raise RolloutProcessError(
                    f"the background rollout process (pid {self.process.pid}) exited with code "
                    f"{code} while lppo waited for {what}."
                )
            if time.monotonic() > deadline:
                raise RolloutProcessError(
                    f"waited {bound:g} s for {what} (pid {self.process.pid}); it is alive but "
                    f"too slow: raise {RUNNER_KEY}.{key}, or lower the rollout size."
                )

    def _running(self) -> bool:
        return self.process is not None

    def _stop(self) -> None:
        self._stopping.set()
        if self.process.is_alive():
            self._inbox.put(None)  # wakes a process that waits for a job

    def _join(self, timeout: float) -> None:
        self.process.join(timeout=timeout)

    def _kill(self) -> None:
        process, self.process = self.process, None
        if process.is_alive():
            process.kill()
            process.join(timeout=self.close_timeout_s)  # SIGKILL: only the reaping is waited
        for q in (self._inbox, self._outbox):
            q.cancel_join_thread()  # jobs not yet sent are dropped, not flushed
            q.close()


def oversubscription(trainer_threads: int, process_threads: int, cores: int) -> str:
    """Why the trainer and the rollout process would crowd the cores (``""``: they fit).

    Both run torch's intra-op pool; more threads than cores makes each side wait for the
    other's (measured here, 2 cores: 2 + 2 threads ran 8.1x slower than 1 + 1).
    """
    if trainer_threads + process_threads <= cores:
        return ""
    return (
        f"the trainer's {trainer_threads} torch threads (model.num_threads) and the rollout "
        f"process's {process_threads} ({RUNNER_KEY}.num_threads; null: the trainer's) exceed the "
        f"{cores} cores this process may use: training and generation will slow each other "
        "down. Set both so that they sum to at most the cores."
    )


def _cores() -> int:
    """Cores this process may run on (its affinity, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _exit_with_parent() -> None:
    """End this process as soon as the trainer that started it is gone, even by SIGKILL.

    A killed trainer runs no cleanup, and the process would wait for jobs forever (it holds
    its queues' write ends too, so it never reads an end of file): a thread waits on the
    parent's sentinel (readable once the parent's end of the start-up pipe is closed).
    """
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="lppo-rollout-parent", daemon=True).start()


def _serve(spec: tuple[Any, ...], inbox: Any, outbox: Any, stopping: Any) -> None:
    """The background rollout process: set up once, then generate the jobs in order.

    Once ``stopping`` is set it starts no further job (those queued are dropped) and exits.
    """
    _exit_with_parent()
    try:
        engine, policy, tokenizer, settings, task, threads = spec
        torch.set_num_threads(threads)
        worker = GenerationWorker(engine, policy, tokenizer, settings, task)
    except BaseException:
        outbox.put(("error", traceback.format_exc()))
        return
    outbox.put(("ready", os.getpid()))
    while True:
        clock = time.monotonic()
        job = inbox.get()
        if job is None or stopping.is_set():
            # Nobody reads an answer after close: exit without flushing one into the pipe.
            outbox.cancel_join_thread()
            return
        idle = time.monotonic() - clock
        try:
            generated = worker.run(job)
            generated.idle_seconds = idle
            outbox.put(("done", generated.dumps()))
        except Exception as error:
            outbox.put(("error", f"{type(error).__name__}: {error}"))
        del job
