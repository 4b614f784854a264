"""The fixed-lag rollout scheduler (``model.rollout.max_staleness``).

With lag ``s``, iteration ``t`` trains on samples drawn from exactly the policy published
after iteration ``t - s - 1``'s actor phase. The scheduler makes that a matter of order, never
of timing:

1. at the run's first iteration ``t0``, iterations ``t0 .. t0 + s`` are admitted with the
   current policy;
2. when iteration ``t`` ends (``publish``), the policy version advances (unless ``t`` was a
   critic warm-up iteration, where the actor does not move), an engine that follows the
   actor's live weights is synced, and with ``s > 0`` iteration ``t + s + 1`` is admitted
   with the new version: its prompts are drawn and the version's weights are attached;
3. iteration ``t`` takes its rollout (``take``), waiting for the runner if it is not done.
   With ``s = 0`` it is admitted here, at the start of its own iteration, as in a
   synchronous run: a checkpoint between iterations holds no job and the task's position
   counts only the iterations that ran.

Admission happens before generation, so nothing is generated and then thrown away, and which
weights produced which rows is fixed by the iteration index alone. A checkpoint holds the
admitted jobs (prompts, seeds and, for a stale version, its weights): a resumed run generates
them again and samples exactly what the uninterrupted run did.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from lppo.algorithms.off_policy import OffPolicyCorrection
from lppo.errors import IterationError, SetupError
from lppo.replay.rollout_rows import StoredRollout
from lppo.rollout.base import RolloutEngine, RolloutSettings
from lppo.rollout.capabilities import capabilities_of
from lppo.rollout.jobs import GeneratedRollout, RolloutJob, Weights, snapshot
from lppo.rollout.process_runner import ProcessRunner
from lppo.rollout.runners import InlineRunner, RolloutProcessError, RolloutRunner, ThreadRunner
from lppo.rollout.source import RolloutSource, StaleWeightsError
from lppo.types import POLICY_VERSION, GenerationReport, Rollout, iteration_label
from lppo.validation import SettingError


def stale_correction(
    settings: RolloutSettings, old_logprobs: str, correction: OffPolicyCorrection
) -> OffPolicyCorrection:
    """The actor's off-policy correction for rows ``settings.max_staleness`` versions old.

    Decoupled PPO: the ratio is taken against π_old recomputed by the trainer (the proximal
    policy) and each token's loss is weighted by the truncated ``π_old / π_behaviour``.

    Raises:
        SettingError: stale rows with π_old taken from the rollout (the ratio would be against
            the behaviour policy), or with the correction off and no explicit opt-in.
    """
    s = settings.max_staleness
    if s == 0:
        return correction.resolved(stale=False)
    if old_logprobs == "rollout":
        raise SettingError(
            f"model.ppo.old_logprobs={old_logprobs!r} with model.rollout.max_staleness={s}: "
            "π_old must be recomputed by the trainer when rows are sampled from an older "
            "policy; set old_logprobs: auto (or recompute)."
        )
    if correction.mode == "none" and not settings.allow_uncorrected_staleness:
        raise SettingError(
            f"model.actor.init_args.off_policy.mode=none with model.rollout.max_staleness={s}: "
            f"rows sampled {s} policy version(s) back would be trained as on-policy, a biased "
            "gradient. Use mode auto (truncated importance sampling), truncate or mask, or "
            "accept the bias with model.rollout.allow_uncorrected_staleness: true."
        )
    return correction.resolved(stale=True)


class RolloutPipeline:
    """Admits rollouts a fixed ``staleness`` ahead of training and hands them out in order.

    Args:
        source: draws prompts, puts rows, and (inline) generates.
        runner: where the jobs are generated.
        engine: a copy of the run's engine that was not set up (runners set it up on their
            own copy of the policy).
        staleness: the fixed lag ``s`` (``model.rollout.max_staleness``).
        warmup_iterations: the first iterations train only the critic (no new version).
        stop_at: iterations from this one on are admitted (and checkpointed) but not
            generated: the run ends before them (``None``: no end).
    """

    def __init__(
        self,
        source: RolloutSource,
        runner: RolloutRunner,
        engine: RolloutEngine,
        staleness: int = 0,
        warmup_iterations: int = 0,
        stop_at: int | None = None,
    ) -> None:
        self.source = source
        self.runner = runner
        self.engine = engine
        self.staleness = staleness
        self.warmup_iterations = warmup_iterations
        self.stop_at = stop_at
        #: Policy versions published so far (actor phases that ran).
        self.version = 0
        #: Admitted jobs not yet taken, by iteration.
        self.pending: dict[int, RolloutJob] = {}
        self._started = False
        self._restored: dict[str, Any] | None = None
        self._snapshot: tuple[int, Weights] | None = None
        self.runner.start(source, engine)

    # ------------------------------------------------------------------ the schedule
    def take(self, iteration: int) -> tuple[Rollout | StoredRollout, GenerationReport]:
        """``iteration``'s rows, in the store (waiting for the runner when they are not ready).

        Raises:
            IterationError: the generator failed on this iteration, died, or a wait ran out;
                the message names the iteration and the cause.
        """
        label = f"{iteration_label(iteration)}, phase rollout"
        try:
            job = self._job(iteration)
        except RolloutProcessError as error:
            raise IterationError(f"{label}: {error}") from error
        clock = time.monotonic()
        try:
            generated = self.runner.result(job)
        except RolloutProcessError as error:
            raise IterationError(f"{label}: {error}") from error
        except (IterationError, SetupError, StaleWeightsError):  # the source's; mistakes to fix
            raise
        except Exception as error:
            # The engine failed in this process (the inline runner): a failed iteration,
            # counted by model.ppo.max_failed_iterations like one whose generator failed.
            raise IterationError(f"{label}: {type(error).__name__}: {error}") from error
        if generated.rollout is None:
            raise IterationError(f"{label}: the generator failed: {generated.error}")
        rows = generated.rollout
        if isinstance(rows, Rollout):
            rows = self.source.put(rows, iteration)
        waited = time.monotonic() - clock
        return rows, self._report(rows, job, generated, clock, waited)

    def _job(self, iteration: int) -> RolloutJob:
        """``iteration``'s admitted job (admitting it first when its turn has come).

        Raises:
            RolloutProcessError: it was never admitted.
        """
        if not self._started:
            self._start(iteration)
        elif self.staleness == 0:
            self._admit(iteration)
        job = self.pending.pop(iteration, None)
        if job is None:
            raise RolloutProcessError(f"it was never admitted (admitted: {self._admitted()})")
        return job

    def publish(self, iteration: int) -> None:
        """``iteration`` ended: advance the version (after an actor phase), admit the next."""
        if iteration >= self.warmup_iterations:
            self.version += 1
        if self.runner.live_weights:
            self.source.sync()  # evaluation and export see the published weights
        if self.staleness > 0:
            self._admit(iteration + self.staleness + 1)

    def close(self) -> None:
        """Stop the runner (admitted jobs stay in :meth:`state_dict` for a resume)."""
        self.runner.close()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The version and the admitted jobs (weights of stale versions included)."""
        if not self._started and self._restored is not None:
            return self._restored
        policy = self.source.actor.policy()
        current = {k: v.detach().cpu() for k, v in policy.state_dict().items()}
        jobs = [job.state_dict(current) for _, job in sorted(self.pending.items())]
        return {"version": self.version, "staleness": self.staleness, "jobs": jobs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the admitted jobs are submitted again when the first iteration asks."""
        self._restored = state

    # ------------------------------------------------------------------ internals
    def _start(self, iteration: int) -> None:
        self._started = True
        state, self._restored = self._restored, None
        if state is not None:
            self.version = int(state["version"])
            for saved in state["jobs"]:
                job = RolloutJob.from_state(saved)
                if job.weights is None and self._needs_weights():
                    job.weights = self._weights()
                self.pending[job.iteration] = job
                self._submit(job)
        for j in range(iteration, iteration + self.staleness + 1):
            if j not in self.pending:  # a fresh run, or a checkpoint written before admission
                self._admit(j)

    def _admit(self, iteration: int) -> None:
        blocks = self.source.admit(iteration)
        weights = self._weights() if self._needs_weights() else None
        job = RolloutJob(iteration, self.version, blocks, weights)
        self.pending[iteration] = job
        self._submit(job)

    def _submit(self, job: RolloutJob) -> None:
        if self.stop_at is None or job.iteration < self.stop_at:
            self.runner.submit(job)

    def _needs_weights(self) -> bool:
        return self.staleness > 0 or not self.runner.live_weights

    def _weights(self) -> Weights:
        """The current version's weights (one snapshot shared by the jobs of a version)."""
        if self._snapshot is None or self._snapshot[0] != self.version:
            self._snapshot = (self.version, snapshot(self.source.actor.policy()))
        return self._snapshot[1]

    def _admitted(self) -> list[int]:
        return [i + 1 for i in sorted(self.pending)]

    def _row_staleness(self, rows: Rollout | StoredRollout, job: RolloutJob) -> int:
        """Versions published since the oldest of the rows was sampled (their own column)."""
        versions: list[torch.Tensor] = []
        if isinstance(rows, Rollout):
            versions = rows.extras.get(POLICY_VERSION, [])
        elif self.source.store is not None and len(rows):
            try:
                versions = self.source.store.read(list(rows.row_ids), [POLICY_VERSION])[
                    POLICY_VERSION
                ]
            except KeyError:  # an engine that writes its own rows without provenance
                versions = []
        if not versions:
            return self.version - job.version
        return self.version - min(int(v) for v in versions)

    def _report(
        self,
        rows: Rollout | StoredRollout,
        job: RolloutJob,
        generated: GeneratedRollout,
        waited_from: float,
        waited: float,
    ) -> GenerationReport:
        busy = generated.finished - generated.started
        during_wait = max(
            0.0, min(generated.finished, waited_from + waited) - max(generated.started, waited_from)
        )
        return GenerationReport(
            staleness=self._row_staleness(rows, job),
            wait_seconds=waited,
            generation_seconds=busy,
            overlap_seconds=max(0.0, busy - during_wait),
            generator_idle_seconds=generated.idle_seconds,
        )


def default_runner(staleness: int, engine: RolloutEngine) -> RolloutRunner:
    """The runner of ``model.runner: null``.

    The trainer at ``s = 0``; else a thread when the engine generates in processes of its own
    (its capabilities' ``generates_elsewhere``: Ray rollout workers), a background process
    otherwise.
    """
    if staleness == 0:
        return InlineRunner()
    if capabilities_of(engine).generates_elsewhere:
        return ThreadRunner()
    return ProcessRunner()
