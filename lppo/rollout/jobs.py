"""One admitted iteration's generation work, and the worker that samples it on its own weights.

A :class:`RolloutJob` is what the fixed-lag scheduler (:mod:`lppo.rollout.pipeline`) admits:
the iteration the rows are for, the policy version they are drawn from, this rank's prompt
blocks (each with its own seed) and that version's weights. A job samples the same rows
wherever it runs (in the trainer, in a thread, in the background rollout process), because
its samples depend only on the weights and the blocks' seeds.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
import time
from dataclasses import dataclass, fields
from typing import Any

import torch

from lppo.replay.rollout_rows import StoredRollout
from lppo.rollout.base import (
    GenerationOutput,
    PromptBlock,
    RolloutEngine,
    RolloutSettings,
    concat_outputs,
    to_rollout,
)
from lppo.rollout.dynamic_sampling import generate_dynamic
from lppo.rollout.reward_call import score
from lppo.tasks.base import Prompt, Task
from lppo.types import Rollout

Weights = dict[str, torch.Tensor]


@dataclass
class RolloutJob:
    """The generation work of one iteration on this rank, admitted before it is generated.

    Attributes:
        iteration: the iteration the rows are for.
        version: the policy version the samples are drawn from (actor phases published before
            the job was admitted).
        blocks: this rank's prompt blocks, in order (prompts and per-block seeds).
        weights: the policy's state dict at ``version`` (CPU tensors, shared between jobs of
            one version); ``None``: the actor's live weights (no actor phase can run between
            admission and generation: ``max_staleness = 0`` with an in-process runner).
    """

    iteration: int
    version: int
    blocks: list[PromptBlock]
    weights: Weights | None = None

    @property
    def provenance(self) -> tuple[int, int]:
        """``(iteration, version)``, stored with every row of the job."""
        return (self.iteration, self.version)

    def state_dict(self, current: Weights | None) -> dict[str, Any]:
        """The job as plain data (``torch.load(weights_only=True)`` reads it).

        Weights equal to ``current`` (the checkpoint's own actor weights) are not stored twice.
        """
        weights = self.weights
        same = weights is None or (current is not None and _same(weights, current))
        return {
            "iteration": self.iteration,
            "version": self.version,
            "blocks": [_block_state(b) for b in self.blocks],
            "weights": None if same else weights,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> RolloutJob:
        """The job :meth:`state_dict` saved (``weights`` ``None``: the restored actor's)."""
        blocks = [_block_from_state(b) for b in state["blocks"]]
        return cls(state["iteration"], state["version"], blocks, state["weights"])


def _block_state(block: PromptBlock) -> dict[str, Any]:
    """A prompt block (and its refills) as plain data."""
    return {
        "start": block.start,
        "seed": block.seed,
        "prompts": [dataclasses.asdict(p) for p in block.prompts],
        "refills": [_block_state(r) for r in block.refills],
    }


def _block_from_state(state: dict[str, Any]) -> PromptBlock:
    """The block :func:`_block_state` saved (checkpoints without refills too)."""
    refills = tuple(_block_from_state(r) for r in state.get("refills", ()))
    return PromptBlock(
        state["start"], [Prompt(**p) for p in state["prompts"]], state["seed"], refills
    )


@dataclass
class GeneratedRollout:
    """A job's samples (or its failure), with when it ran.

    Attributes:
        iteration: the job's iteration.
        rollout: the rewarded samples, or their rows when the runner put them already
            (``None`` when the job failed).
        error: why the job failed (``""``: it did not).
        started: ``time.monotonic()`` when generation began (comparable across processes).
        finished: ``time.monotonic()`` when it ended.
        idle_seconds: how long the generator waited for this job (admission or weights).
    """

    iteration: int
    rollout: Rollout | StoredRollout | None
    error: str = ""
    started: float = 0.0
    finished: float = 0.0
    idle_seconds: float = 0.0

    def dumps(self) -> bytes:
        """Pickled, each per-row column of the samples packed into one tensor.

        Pickling a tensor pickles its storage on its own (``torch.save`` of each), so a
        rollout of many short rows (one tensor per row and column) took tenths of a second
        each way; packed, a column is one storage.
        """
        rollout = self.rollout
        if not isinstance(rollout, Rollout):
            return pickle.dumps((self, None))
        columns: dict[str, Any] = {f.name: getattr(rollout, f.name) for f in fields(rollout)}
        for name in _ROW_COLUMNS:
            columns[name] = _pack_rows(columns[name])
        columns["extras"] = {k: _pack_rows(v) for k, v in rollout.extras.items()}
        return pickle.dumps((dataclasses.replace(self, rollout=None), columns))

    @staticmethod
    def loads(message: bytes) -> GeneratedRollout:
        """The :class:`GeneratedRollout` :meth:`dumps` pickled (rows are views of a column)."""
        generated, columns = pickle.loads(message)
        if columns is not None:
            for name in _ROW_COLUMNS:
                columns[name] = _unpack_rows(columns[name])
            columns["extras"] = {k: _unpack_rows(v) for k, v in columns["extras"].items()}
            generated.rollout = Rollout(**columns)
        return generated


_ROW_COLUMNS = ("input_ids", "response_mask", "gen_logprobs")


def _pack_rows(rows: list[torch.Tensor]) -> tuple[str, Any, list[int]]:
    """A column of per-row tensors as one tensor: 0-dim rows stacked, 1-dim rows concatenated."""
    if rows and len({t.dtype for t in rows}) == 1:
        if all(t.dim() == 0 for t in rows):
            return ("stack", torch.stack(rows), [])
        if all(t.dim() == 1 for t in rows):
            return ("cat", torch.cat(rows), [len(t) for t in rows])
    return ("list", rows, [])


def _unpack_rows(packed: tuple[str, Any, list[int]]) -> list[torch.Tensor]:
    """The rows :func:`_pack_rows` packed."""
    kind, data, lengths = packed
    if kind == "stack":
        return list(data.unbind(0))
    if kind == "cat":
        return list(data.split(lengths))
    return data


def snapshot(policy: torch.nn.Module) -> Weights:
    """A detached CPU copy of ``policy``'s state dict (the weights of one published version)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in policy.state_dict().items()}


def _same(a: Weights, b: Weights) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def generate_blocks(
    engine: RolloutEngine,
    task: Task,
    blocks: list[PromptBlock],
    samples_per_prompt: int,
    provenance: tuple[int, int],
) -> Rollout:
    """Generate every block with its seed and reward all samples with one ``rewards`` call.

    Args:
        engine: the engine (on the weights the samples must come from).
        task: rewards the samples.
        blocks: the prompt blocks, in order.
        samples_per_prompt: responses per prompt.
        provenance: ``(iteration, policy version)`` stored with every row.

    Returns:
        The rewarded samples; ``prompt_index`` counts over the iteration's prompts. Blocks with
        refills are generated with dynamic sampling
        (:func:`~lppo.rollout.dynamic_sampling.generate_dynamic`).
    """
    if any(block.refills for block in blocks):
        return generate_dynamic(engine, task, blocks, samples_per_prompt, provenance)
    outputs: list[GenerationOutput] = []
    prompts: list[Prompt] = []
    for block in blocks:
        output = engine.generate(block.prompts, samples_per_prompt, seed=block.seed)
        output.prompt_index = output.prompt_index + len(prompts)
        prompts += block.prompts
        outputs.append(output)
    output = concat_outputs(outputs)
    rewards = score(task, prompts, output)
    local = torch.tensor([i for b in blocks for i in range(b.start, b.start + len(b.prompts))])
    output.prompt_index = local[output.prompt_index] if len(output) else output.prompt_index
    return to_rollout(output, rewards, provenance=provenance)


class GenerationWorker:
    """An engine over its own copy of the policy: loads a job's weights, samples, rewards.

    Args:
        engine: an engine that was not set up (a copy of the run's; set up here on ``policy``).
        policy: the worker's own copy of the causal LM.
        tokenizer: the policy's tokenizer.
        settings: the sampling settings.
        task: rewards the samples.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        policy: torch.nn.Module,
        tokenizer: Any,
        settings: RolloutSettings,
        task: Task,
    ) -> None:
        self.engine = engine
        self.policy = policy
        self.settings = settings
        self.task = task
        self.version: int | None = None
        engine.setup(policy, tokenizer, settings)

    @classmethod
    def copying(
        cls, engine: RolloutEngine, policy: torch.nn.Module, tokenizer: Any, **kwargs: Any
    ) -> GenerationWorker:
        """A worker on deep copies of a not-yet-set-up ``engine`` and of ``policy``."""
        return cls(copy.deepcopy(engine), copy.deepcopy(policy), tokenizer, **kwargs)

    def run(self, job: RolloutJob) -> GeneratedRollout:
        """Load ``job``'s weights (unless held already), then sample and reward its blocks.

        Raises:
            ValueError: the job carries no weights and the worker holds another version.
        """
        if job.version != self.version:
            if job.weights is None:
                raise ValueError(
                    f"rollout job of iteration {job.iteration} carries no weights and the "
                    f"worker holds version {self.version}, not {job.version}."
                )
            self.policy.load_state_dict(job.weights)
            self.engine.sync_from(self.policy, job.version)
            self.version = job.version
        started = time.monotonic()
        spp = self.settings.samples_per_prompt
        rollout = generate_blocks(self.engine, self.task, job.blocks, spp, job.provenance)
        return GeneratedRollout(job.iteration, rollout, "", started, time.monotonic())
