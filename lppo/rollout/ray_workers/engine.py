"""``RayWorkersEngine``: N rollout workers as Ray actors, each with its own engine.

Each worker is a Ray actor process holding its own copy of the policy inside its own engine
(:class:`~lppo.rollout.HFGenerateEngine` on CPU by default, configured by ``engine``). Every
block of prompts is cut into ``num_workers`` contiguous parts; part ``p`` samples from a seed
derived from ``(block seed, p)`` (part 0 keeps it), so a part's samples do not depend on which
worker runs it: a replaced worker retrying a part samples exactly what the dead one would have.
Results depend on ``num_workers`` as they do on the seed.

Rows: with a shared store (TransferQueue) the engine is a
:class:`~lppo.rollout.StoreWritingEngine`: each worker rewards its part and puts the rows into
the store from its own process (:meth:`generate_into`), and the trainer gets row ids and
per-row scalars back, never the tensors. With a local store the workers return their samples
(:meth:`generate`) and the trainer rewards and puts them.

Weights: :meth:`sync_from` puts the policy's state dict into Ray's object store once and every
worker loads it and reports the version; every part's result carries the version the worker
sampled from, and a part sampled from another version than :attr:`weights_version` is refused.

Failures: every wait is bounded by ``timeout_s`` (:class:`RolloutWorkerError` names the worker
and the knob). A dead worker is replaced by a fresh actor with the current weights, up to
``max_restarts`` times per call (a replacement that dies while loading counts too): during a
rollout its part is retried, and a part that still fails is dropped (counted against
``data.drop_budget``); during a weight sync a worker that cannot be replaced fails the call.
Each replacement logs a warning and is counted (``rollout/worker_restarts``). A raylet that
dies takes the whole process with it (:mod:`lppo.runtime.ray_runtime` reports it).

Ray comes from :mod:`lppo.runtime.ray_runtime`, as ``trainer.ray`` says (a local Ray on loopback,
or a cluster address); :meth:`close` kills the workers and releases Ray. Needs the ``[ray]`` extra.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lppo.init_args import RecordsInitArgs
from lppo.replay.base import ReplayStore
from lppo.replay.rollout_rows import StoredRollout, concat_stored
from lppo.rollout.base import (
    GenerationOutput,
    PromptBlock,
    RolloutEngine,
    RolloutSettings,
    RowJob,
    concat_outputs,
)
from lppo.rollout.capabilities import EngineCapabilities, capabilities_of
from lppo.rollout.hf.engine import HFGenerateEngine
from lppo.rollout.ray_workers.placement import acquire_for_workers
from lppo.rollout.ray_workers.worker import RolloutWorker, RolloutWorkerError
from lppo.rollout.source import derive_seed
from lppo.runtime.ray_runtime import ray_module, release_ray
from lppo.tasks.base import Prompt
from lppo.validation import check_number

__all__ = ["RayWorkersEngine", "RolloutWorker", "RolloutWorkerError"]

_log = logging.getLogger(__name__)
_KEY = "model.engine.init_args"


class _Budget:
    """The worker replacements one call may still make (``max_restarts`` per call)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0

    def take(self) -> bool:
        """Spend one replacement; ``False`` when none is left."""
        if self.used >= self.limit:
            return False
        self.used += 1
        return True


@dataclass
class _Part:
    """One worker's share of a block: prompts sampled together from one seed.

    Attributes:
        index: position among the call's parts (it runs on worker ``index % num_workers``).
        prompts: the part's prompts.
        seed: its generation seed.
        start: ``prompt_index`` of its first prompt.
        ids: row ids its samples are put under (only when the worker puts them).
    """

    index: int
    prompts: list[Prompt]
    seed: int
    start: int
    ids: tuple[int, ...] = ()


def _parts(blocks: list[PromptBlock], num_workers: int) -> list[_Part]:
    """Each block cut into ``num_workers`` contiguous parts, in order.

    Part ``p`` of a block samples from a seed derived from ``(block seed, p)`` (part 0 keeps
    the block's), so a part's samples do not depend on the worker that runs it.
    """
    parts: list[_Part] = []
    for block in blocks:
        size = -(-len(block.prompts) // num_workers)
        for p, at in enumerate(range(0, len(block.prompts), size)):
            seed = derive_seed(block.seed, "part", p) if p else block.seed
            parts.append(_Part(len(parts), block.prompts[at : at + size], seed, block.start + at))
    return parts


class RayWorkersEngine(RecordsInitArgs):
    """A :class:`~lppo.rollout.RolloutEngine` whose samples come from N Ray actor workers.

    Asynchronous rollouts drive a second copy of it from a thread (its capabilities say it
    ``generates_elsewhere``): the thread only waits for the workers.

    Args:
        num_workers: rollout worker actors (one logical Ray CPU each).
        engine: the engine each worker runs (``null``: ``HFGenerateEngine()``). The Ray
            cluster the workers run on is ``trainer.ray``'s (on several nodes they spread).
        timeout_s: longest wait for any worker call (start, weight load, one part).
        max_restarts: worker replacements per ``generate`` call before a part is dropped.
    """

    def __init__(
        self,
        num_workers: int = 2,
        engine: RolloutEngine | None = None,
        timeout_s: float = 300.0,
        max_restarts: int = 2,
    ) -> None:
        key = _KEY
        check_number(f"{key}.num_workers", num_workers, integer=True, low=1)
        check_number(
            f"{key}.timeout_s",
            timeout_s,
            low=0,
            low_open=True,
            fix="Seconds a worker may take for its share of a rollout.",
        )
        check_number(f"{key}.max_restarts", max_restarts, integer=True, low=0)
        self.num_workers = num_workers
        self.engine: RolloutEngine = engine if engine is not None else HFGenerateEngine()
        self.timeout_s = timeout_s
        self.max_restarts = max_restarts
        self.weights_version = 0
        self.workers: list[Any] = []
        self.restarts = 0  # workers replaced so far (tested)
        self._unreported = 0  # replacements not yet taken by take_restarts
        self.placement: list[tuple[int, str]] = []  # (pid, Ray node id) of each started worker
        self._spawn: Any = None
        self._weights: Any = None  # object ref of the latest state dict

    # ------------------------------------------------------------------ lifecycle
    def setup(self, policy: torch.nn.Module, tokenizer: Any, sampling: RolloutSettings) -> None:
        """Start Ray (or attach) and the workers, each with a copy of ``policy``."""
        ray = ray_module()
        acquire_for_workers(self.num_workers, sampling.max_staleness)  # refused if unplaceable
        # SPREAD: on a cluster of several nodes the workers land on different nodes.
        actor_class = ray.remote(num_cpus=1, max_restarts=0)(RolloutWorker).options(
            scheduling_strategy="SPREAD"
        )
        policy_ref = ray.put(copy.deepcopy(policy).cpu())  # a copy: the trainer's stays put
        args = (self.engine, policy_ref, tokenizer, sampling)
        self._spawn = lambda: actor_class.remote(*args)
        self.workers = [self._spawn() for _ in range(self.num_workers)]
        self.placement = self._wait([w.where.remote() for w in self.workers], "start")
        self._weights = ray.put(_state(policy))
        self._load_all()

    def close(self) -> None:
        """Kill the workers and release Ray (stopping it if lppo started it here); idempotent."""
        if not self.workers and self._spawn is None:
            return
        ray = ray_module()
        for worker in self.workers:
            ray.kill(worker, no_restart=True)
        self.workers, self._spawn, self._weights = [], None, None
        release_ray()

    def sync_from(self, policy: torch.nn.Module, version: int) -> None:
        """Publish ``policy``'s weights as ``version`` to every worker (waits for all)."""
        self._weights = ray_module().put(_state(policy))
        self.weights_version = version
        self._load_all()

    def capabilities(self) -> EngineCapabilities:
        """Generation in the workers; restarts counted; the inner engine bounds and checks rows."""
        inner = capabilities_of(self.engine)
        return EngineCapabilities(
            generates_elsewhere=True,
            take_restarts=self.take_restarts,
            max_row_tokens=inner.max_row_tokens,
            multi_turn=inner.multi_turn,
            check_setup=inner.check_setup,
            encode_prompt=inner.encode_prompt,
            ray_cpus=self.num_workers,  # one logical CPU per worker actor
        )

    def take_restarts(self) -> int:
        """Workers replaced since the last call (the rollout source logs them per iteration)."""
        taken, self._unreported = self._unreported, 0
        return taken

    def _load_all(self) -> None:
        """Every worker loads the current weights; a dead one is replaced within the budget."""
        ray = ray_module()
        refs = [w.load.remote(self._weights, self.weights_version) for w in self.workers]
        budget, versions = _Budget(self.max_restarts), []
        for index, ref in enumerate(refs):
            try:
                versions.append(self._wait([ref], f"weight load (worker {index})")[0])
            except ray.exceptions.RayActorError:
                if not self._replace(index, budget, "died before its weight load"):
                    raise self._out_of_restarts(index, budget, "weight load") from None
                versions.append(self.weights_version)  # _replace checked the load
        if any(v != self.weights_version for v in versions):
            raise RolloutWorkerError(
                f"workers report weights versions {versions} after loading version "
                f"{self.weights_version}."
            )

    # ------------------------------------------------------------------ generation
    def generate(
        self, prompts: list[Prompt], samples_per_prompt: int, seed: int, greedy: bool = False
    ) -> GenerationOutput:
        """Samples of every part, in prompt order (parts lost for good are left out).

        ``greedy`` travels to every worker's engine (each part is then its argmax decoding).
        """
        parts = _parts([PromptBlock(0, prompts, seed)], self.num_workers)

        def submit(part: _Part) -> Any:
            worker = self.workers[part.index % self.num_workers]
            return worker.generate.remote(part.prompts, samples_per_prompt, part.seed, greedy)

        done, dropped = self._run(parts, samples_per_prompt, submit)
        outputs = []
        for i in sorted(done):
            output, version = done[i]
            if version != self.weights_version:
                raise RolloutWorkerError(
                    f"worker {i % self.num_workers} sampled from weights version {version}, "
                    f"not {self.weights_version}."
                )
            output.prompt_index = output.prompt_index + parts[i].start
            outputs.append(output)
        out = concat_outputs(outputs)
        out.dropped = dropped
        return out

    def generate_into(self, store: ReplayStore, job: RowJob) -> StoredRollout:
        """Every worker rewards and puts its parts' rows into ``store`` (a shared store) itself.

        Row ids come from ``store.allocate``, one contiguous run per call cut into the parts
        in order, so the rows are the ones :meth:`generate` would give, in the same order and
        under the same ids as the trainer's own put. A part whose worker died is discarded
        (whatever it had put) and retried under the same ids; a call that fails leaves
        nothing in the store (workers still busy with it are replaced first, so none can put
        after it).
        """
        ray = ray_module()
        k = job.samples_per_prompt
        parts = _parts(job.blocks, self.num_workers)
        ids = store.allocate(sum(len(p.prompts) for p in parts) * k)
        at = 0
        for part in parts:
            part.ids, at = ids[at : at + len(part.prompts) * k], at + len(part.prompts) * k
        task, version = ray.put(job.task), self.weights_version

        def submit(part: _Part) -> Any:
            worker = self.workers[part.index % self.num_workers]
            args = (part.ids, part.prompts, k, part.seed, part.start, task, job.rules)
            return worker.generate_into.remote(store, *args, version, job.provenance)

        try:
            done, dropped = self._run(
                parts, k, submit, lost=lambda p: store.discard(p.ids), abandon=self._abandon
            )
        except BaseException:
            store.discard(ids)
            raise
        return concat_stored([done[i] for i in sorted(done)], dropped)

    def _run(
        self,
        parts: list[_Part],
        k: int,
        submit: Callable[[_Part], Any],
        lost: Callable[[_Part], None] | None = None,
        abandon: Callable[[list[_Part]], None] | None = None,
    ) -> tuple[dict[int, Any], int]:
        """Run every part on its worker; replace dead workers and retry, or drop the part.

        Args:
            parts: the parts (part ``i`` runs on worker ``i % num_workers``).
            k: samples per prompt (a dropped part loses ``k`` per prompt).
            submit: starts a part on its worker; returns the Ray object ref.
            lost: called for a part whose worker died, before it is retried or dropped.
            abandon: called with the parts still running when the call fails.

        Returns:
            Each finished part's result by part index, and the samples dropped.
        """
        ray = ray_module()
        n = self.num_workers
        # part index -> (part, its object ref, the worker it was submitted to)
        pending = {p.index: (p, submit(p), self.workers[p.index % n]) for p in parts}
        done: dict[int, Any] = {}
        dropped, budget = 0, _Budget(self.max_restarts)
        try:
            while pending:
                i, (part, ref, worker) = next(iter(pending.items()))
                try:
                    done[i] = self._wait([ref], f"generate (part {i})")[0]
                except ray.exceptions.RayActorError:
                    if lost is not None:
                        lost(part)
                    replaced = self.workers[i % n] is not worker  # by another part of it
                    if not replaced and not self._replace(i % n, budget, f"died in part {i}"):
                        dropped += len(part.prompts) * k
                        del pending[i]
                        continue
                    pending[i] = (part, submit(part), self.workers[i % n])
                    continue
                del pending[i]
        except BaseException:
            if abandon is not None:
                abandon([part for part, _, _ in pending.values()])
            raise
        if not done:
            raise RolloutWorkerError(
                f"every part of the rollout was lost ({dropped} samples) after {budget.used} "
                f"worker restarts; see the workers' logs, or raise {_KEY}.max_restarts."
            )
        return done, dropped

    def _abandon(self, parts: list[_Part]) -> None:
        """Replace the workers still running ``parts`` (so that none puts rows afterwards)."""
        for index in sorted({part.index % self.num_workers for part in parts}):
            try:
                self._replace(index, _Budget(1), "abandoned by a failed call")
            except Exception:  # the original failure is raised; a next call replaces again
                pass

    def _replace(self, index: int, budget: _Budget, why: str) -> bool:
        """A fresh worker in slot ``index``, loaded with the current weights, within ``budget``.

        A replacement that dies while loading is replaced in turn (each one spends budget).

        Returns:
            ``False`` when the budget ran out first (the slot then holds a dead worker, which
            the next call replaces).
        """
        ray = ray_module()
        while budget.take():
            ray.kill(self.workers[index], no_restart=True)
            self.workers[index] = self._spawn()
            self.restarts += 1
            self._unreported += 1
            _log.warning(
                "rollout worker %d %s: replaced (%d of %s.max_restarts=%d in this call)",
                index, why, budget.used, _KEY, self.max_restarts,
            )  # fmt: skip
            load = self.workers[index].load.remote(self._weights, self.weights_version)
            try:
                self._wait([load], f"weight load (replacement worker {index})")
                return True
            except ray.exceptions.RayActorError:
                why = "died during its weight load"
        return False

    def _out_of_restarts(self, index: int, budget: _Budget, what: str) -> RolloutWorkerError:
        return RolloutWorkerError(
            f"rollout worker {index} died during the {what} and could not be replaced: "
            f"{budget.used} replacements made, {_KEY}.max_restarts={self.max_restarts}. See "
            "the worker's log in the Ray session directory, or raise max_restarts."
        )

    def _wait(self, refs: list[Any], what: str) -> list[Any]:
        """``ray.get`` bounded by ``timeout_s``; a timeout names the call and the knob."""
        ray = ray_module()
        start = time.monotonic()
        try:
            return ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError as error:
            raise RolloutWorkerError(
                f"rollout workers did not finish {what} within "
                f"model.engine.init_args.timeout_s={self.timeout_s} s "
                f"(waited {time.monotonic() - start:.1f} s); a worker may be hung or the "
                "cluster out of CPUs. Raise timeout_s or check the Ray cluster."
            ) from error


def _state(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``policy``'s state dict, detached on CPU (what workers load)."""
    return {k: v.detach().cpu().clone() for k, v in policy.state_dict().items()}
