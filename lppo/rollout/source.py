"""``RolloutSource``: where each iteration's rollout comes from.

Prompts from the task → the engine's samples → one batch call of ``Task.rewards`` → a packed
:class:`~lppo.types.Rollout`, which the source puts into the store (when it has one) and
returns as row ids and per-row scalars (a :class:`~lppo.replay.rollout_rows.StoredRollout`),
so the samples' per-row tensors are freed before scoring starts instead of living through the
whole iteration. With a shared store (``store.shared``) and an engine that writes rows itself
(:class:`~lppo.rollout.StoreWritingEngine`, e.g. Ray rollout workers), the engine's processes
reward and put the rows: the trainer never holds the samples.

The iteration's prompts are cut into *blocks* (``model.rollout.prompts_per_block``); each
block is one ``generate`` call from a seed derived from ``(seed, iteration, block)``, so a
block's samples are the same whoever generates it. Under data parallelism every rank draws the
same prompts and generates its own contiguous run of blocks (rank 0 the first ones), so no
rank repeats another's work, every prompt's samples stay on one rank, and the ranks' rows in
rank order are the single-process rows in order.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from lppo.errors import IterationError
from lppo.modules import ActorModule
from lppo.parallel import SINGLE, ProcessGroup
from lppo.replay.base import ReplayStore
from lppo.replay.rollout_rows import RowRules, StoredRollout, put_rollout
from lppo.rollout.base import (
    PromptBlock,
    RolloutEngine,
    RolloutSettings,
    RowJob,
    StoreWritingEngine,
)
from lppo.rollout.capabilities import capabilities_of
from lppo.rollout.evaluation import EvalSamples, undisturbed
from lppo.rollout.jobs import RolloutJob, generate_blocks
from lppo.rollout.reward_call import RewardError, score
from lppo.tasks import Task
from lppo.tasks.base import Prompt
from lppo.types import Rollout, iteration_label
from lppo.validation import SettingError


class StaleWeightsError(RuntimeError):
    """A rollout engine would sample from weights older than the policy's."""


def derive_seed(*parts: object) -> int:
    """A stable 63-bit seed from any parts (independent of Python's hash randomization)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def prompt_blocks(settings: RolloutSettings, world_size: int = 1) -> list[range]:
    """The prompt-index ranges of an iteration's blocks (the last one may be shorter).

    Raises:
        ValueError: fewer blocks than ranks (a rank would generate nothing), naming the keys.
    """
    n = settings.prompts_per_iteration
    size = settings.prompts_per_block or -(-n // world_size)
    blocks = [range(start, min(start + size, n)) for start in range(0, n, size)]
    if len(blocks) < world_size:
        raise ValueError(
            f"model.rollout.prompts_per_iteration={n} with model.rollout.prompts_per_block="
            f"{settings.prompts_per_block} gives {len(blocks)} block(s) for {world_size} "
            "data-parallel ranks: every rank needs at least one block. Lower "
            "model.rollout.prompts_per_block or raise model.rollout.prompts_per_iteration."
        )
    return blocks


def block_seed(seed: int, iteration: int, block: int) -> int:
    """Generation seed of ``block`` of ``iteration`` (block 0 keeps the iteration's own seed)."""
    return derive_seed(seed, "generate", iteration, *([block] if block else []))


def rank_share(blocks: int, world_size: int, rank: int) -> range:
    """The contiguous block indices ``rank`` generates (sizes differ by at most one)."""
    base, extra = divmod(blocks, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def put_samples(
    store: ReplayStore, rollout: Rollout, rules: RowRules, iteration: int
) -> StoredRollout:
    """Put the trainer's rewarded samples of ``iteration`` into ``store`` as rows.

    Raises:
        IterationError: allocating or putting failed (``put_rollout`` left none of the rows
            behind); the message names the iteration and the collect phase.
    """
    try:
        return put_rollout(store, store.allocate(len(rollout)), rollout, rules)
    except Exception as error:
        where = f"{iteration_label(iteration)}, phase collect"
        raise IterationError(f"{where}: {type(error).__name__}: {error}") from error


class RolloutSource:
    """Generates and rewards each iteration's samples, keeping the engine on fresh weights.

    Args:
        task: prompt source and reward.
        engine: the rollout engine (already :meth:`~lppo.rollout.RolloutEngine.setup`).
        actor: the policy whose weights the engine must sample from.
        settings: sampling settings.
        seed: base seed; iteration ``i`` samples prompts and responses from seeds derived from
            ``(seed, i)``, so a resumed run samples exactly what the uninterrupted run would.
        group: the data-parallel group (each rank generates its own share of the blocks).
        store: the replay store the rows are put into (``None``: :meth:`collect` returns
            the samples themselves); when it is shared and the engine is a
            :class:`~lppo.rollout.StoreWritingEngine`, the engine puts the rows itself.
        rules: which rows become invalid when put (``model.ppo``; ``None``: only rows with a
            non-finite reward).
        tokenizer: the policy's tokenizer (engines that run elsewhere are set up with it).
    """

    def __init__(
        self,
        task: Task,
        engine: RolloutEngine,
        actor: ActorModule,
        settings: RolloutSettings,
        seed: int = 0,
        group: ProcessGroup = SINGLE,
        store: ReplayStore | None = None,
        rules: RowRules | None = None,
        tokenizer: Any = None,
    ) -> None:
        self.task = task
        self.tokenizer = tokenizer
        self.engine = engine
        self.actor = actor
        self.settings = settings
        self.seed = seed
        self.group = group
        self.store = store
        self.rules = rules if rules is not None else RowRules()
        # The one place the path is chosen: rows put by the engine's own processes need a
        # store those processes see; otherwise the trainer puts the samples it is handed.
        self.writer: StoreWritingEngine | None = None
        if store is not None and store.shared and isinstance(engine, StoreWritingEngine):
            self.writer = engine
        if self.writer is not None and settings.dynamic_sampling_rounds:
            raise SettingError(
                f"model.rollout.dynamic_sampling_rounds={settings.dynamic_sampling_rounds} with "
                f"{type(engine).__name__}, which puts rows into the store itself: dynamic "
                "sampling must see every group's rewards before rows are kept. Set it to 0, or "
                "use an engine the trainer's rollout source puts rows for."
            )
        prompt_blocks(settings, group.size)  # reject too few blocks at setup

    def sync(self) -> None:
        """Bring the engine to the actor's current weights (lppo calls it after each actor phase).

        Raises:
            StaleWeightsError: the engine did not report the actor's weights version after
                :meth:`~lppo.rollout.RolloutEngine.sync_from`.
        """
        version = self.actor.weights_version
        if self.engine.weights_version == version:
            return
        self.engine.sync_from(self.actor.policy(), version)
        if self.engine.weights_version != version:
            raise StaleWeightsError(
                f"{type(self.engine).__name__}.sync_from(policy, version={version}) left "
                f"weights_version={self.engine.weights_version}: the engine would sample from "
                "stale weights. An engine must set weights_version to the version it loaded."
            )

    def admit(self, iteration: int) -> list[PromptBlock]:
        """This rank's blocks of ``iteration``'s prompts, each with its seed.

        Draws the prompts, so iterations must be admitted in order (a task may keep a position).
        """
        s = self.settings
        n = s.prompts_per_iteration
        # Round 0 draws as without dynamic sampling; each refill round draws its own prompts
        # now, so which prompts the iteration may use never depends on what was generated.
        draws = [
            self.task.sample_prompts(
                n, random.Random(derive_seed(self.seed, "prompts", iteration, *r))
            )
            for r in [()] + [("refill", k) for k in range(1, s.dynamic_sampling_rounds + 1)]
        ]
        blocks = prompt_blocks(s, self.group.size)

        def block(b: int, round_: int) -> PromptBlock:
            seed = block_seed(self.seed, iteration, b)
            if round_:
                seed = derive_seed(self.seed, "generate", iteration, b, "refill", round_)
            prompts = [draws[round_][i] for i in blocks[b]]
            refills = () if round_ else tuple(block(b, k) for k in range(1, len(draws)))
            return PromptBlock(round_ * n + blocks[b].start, prompts, seed, refills)

        return [block(b, 0) for b in rank_share(len(blocks), self.group.size, self.group.rank)]

    def collect(self, iteration: int, version: int = 0) -> Rollout | StoredRollout:
        """This rank's rewarded samples of ``iteration`` from the actor's current weights.

        Admits the iteration (:meth:`admit`) and runs it here (:meth:`run`).
        """
        return self.run(RolloutJob(iteration, version, self.admit(iteration)))

    def run(self, job: RolloutJob) -> Rollout | StoredRollout:
        """Generate ``job`` here, with the engine on the actor's current weights.

        Returns:
            The rows in the store (put here, or by an engine that writes rows itself), or the
            samples when the source has no store.

        Raises:
            IterationError: the task's reward or the put failed (nothing of it is left in the
                store).
        """
        self.sync()  # never sample from weights older than the actor's
        spp = self.settings.samples_per_prompt
        try:
            if self.writer is not None:
                assert self.store is not None
                row_job = RowJob(job.blocks, spp, self.task, self.rules, job.provenance)
                stored = self.writer.generate_into(self.store, row_job)
                stored.worker_restarts = self._worker_restarts()
                return stored
            rollout = generate_blocks(self.engine, self.task, job.blocks, spp, job.provenance)
        except RewardError as error:
            label = iteration_label(job.iteration)
            raise IterationError(f"{label}, phase rollout: {error}") from error
        rollout.worker_restarts = self._worker_restarts()
        return self.put(rollout, job.iteration)

    def _worker_restarts(self) -> int | None:
        """Workers the engine replaced since the last rollout (``None``: it has no workers)."""
        take = capabilities_of(self.engine).take_restarts  # engines with rollout workers
        return None if take is None else int(take())

    def put(self, rollout: Rollout, iteration: int) -> Rollout | StoredRollout:
        """Put ``iteration``'s samples into the store (returned as they are without one)."""
        if self.store is None:
            return rollout
        return put_samples(self.store, rollout, self.rules, iteration)

    def evaluate(
        self,
        prompts: list[Prompt],
        samples_per_prompt: int,
        seed: int,
        greedy: bool = False,
        task: Task | None = None,
    ) -> EvalSamples:
        """Samples of ``prompts`` from the actor's current weights, rewarded, training untouched.

        Syncs the engine first (never evaluate weights older than the actor's), then generates
        and rewards with :func:`~lppo.rollout.score`, all without gradients, under forked RNGs
        and with the actor's train/eval modes restored afterwards (:func:`undisturbed`).

        Args:
            prompts: the prompts to answer.
            samples_per_prompt: responses per prompt.
            seed: the generation seed.
            greedy: decode greedily (argmax) instead of sampling.
            task: rewards the samples; ``None``: the source's task.

        Returns:
            The samples, grouped by prompt, and one reward per sample.

        Raises:
            RuntimeError: the engine returned another number of samples.
            RewardError: the task's reward failed.
        """
        with undisturbed(self.actor):
            self.sync()
            output = self.engine.generate(prompts, samples_per_prompt, seed, greedy=greedy)
            if len(output) != len(prompts) * samples_per_prompt:
                raise RuntimeError(
                    f"{type(self.engine).__name__}.generate returned {len(output)} samples for "
                    f"{len(prompts)} prompts × {samples_per_prompt}."
                )
            scored = task if task is not None else self.task
            rewards = score(scored, prompts, output, self.task.reward_timeout_s).tolist()
        return EvalSamples(output, rewards)
