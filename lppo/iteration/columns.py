"""The iteration's columns: who writes π_old, and what each phase reads for it.

The rows of an iteration gain columns phase by phase (:mod:`lppo.types` names them). Modules
declare the columns a training chunk reads (:meth:`ActorModule.reads
<lppo.modules.ActorModule.reads>`, :meth:`CriticModule.reads <lppo.modules.CriticModule.reads>`);
π_old (``old_logprobs``) has several producers, each declared here once as a
:class:`PiOldProducer`: the stage that writes it (the rollout, the score phase or the actor's
first epoch), the columns the score phase streams for it and how a score chunk gets its value.
The run plan picks one (``model.ppo.old_logprobs``), the score phase and the controller ask it
what to stream and run, and a new producer is one class registered with
:func:`register_pi_old` (the plan's ``auto`` considers the built-in ones only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from lppo.types import (
    GEN_LOGPROBS,
    INPUT_IDS,
    OLD_LOGPROBS,
    PROMPT_INDEX,
    REF_LOGPROBS,
    RESPONSE_MASK,
    REWARD,
    TEACHER_LOGPROBS,
    VALUES,
    Chunk,
)
from lppo.validation import SettingError

__all__ = [
    "OLD_VALUES",
    "PI_OLD",
    "ROLLOUT_COLUMNS",
    "ColumnReader",
    "OldValuesProducer",
    "OwnColumns",
    "PiOldProducer",
    "Scorer",
    "check_read",
    "check_reads",
    "old_values",
    "pi_old",
    "register_pi_old",
    "writers",
]

#: Where a producer writes π_old: with the rows (the engine), in the score phase, or during the
#: actor's first epoch.
Stage = Literal["rollout", "score", "first_epoch"]


class AdvantageEstimatorLike(Protocol):
    """The part of :class:`~lppo.estimators.AdvantageEstimator` the column check reads."""

    def writes(self) -> list[str]:
        """The columns the estimator writes."""
        ...


class Scorer(Protocol):
    """What a producer may ask of the actor: π's log-probabilities of a chunk."""

    def score(self, chunk: Chunk) -> torch.Tensor:
        """``float[B, T]`` log-probabilities of the chunk's tokens, 0 off the response mask."""
        ...


class PiOldProducer(Protocol):
    """One way the iteration gets π_old (``model.ppo.old_logprobs: <name>``).

    Attributes:
        name: the setting's value.
        stage: where π_old is written (``first_epoch``: the controller opens the actor's
            first-epoch steps with :class:`~lppo.iteration.old_logprobs.FirstEpochLogprobs`,
            the :class:`OwnColumns` that completes each chunk).
        reads: the columns a score chunk needs for it, besides ``gen_logprobs`` (the score
            phase always measures the engine/trainer mismatch against those).
        runs_actor: the score phase runs the actor's forward pass for it.
    """

    name: str
    stage: Stage
    reads: tuple[str, ...]
    runs_actor: bool

    def from_chunk(self, chunk: Chunk, actor: Scorer) -> torch.Tensor:
        """π_old ``float[B, T]`` of a score chunk, 0 off the response mask (as ``actor.score``)."""
        ...


def _masked(chunk: Chunk, given: torch.Tensor) -> torch.Tensor:
    return torch.where(chunk.response_mask, given, torch.zeros_like(given))


@dataclass(frozen=True)
class Recompute:
    """π_old from a separate actor forward pass in the score phase (``recompute``)."""

    name: str = "recompute"
    stage: Stage = "score"
    reads: tuple[str, ...] = ()
    runs_actor: bool = True

    def from_chunk(self, chunk: Chunk, actor: Scorer) -> torch.Tensor:
        """The actor's own log-probabilities of the chunk."""
        return actor.score(chunk)


@dataclass(frozen=True)
class FromEngine:
    """π's log-probs the engine computed while sampling, put with the rows (``engine``)."""

    name: str = "engine"
    stage: Stage = "rollout"
    reads: tuple[str, ...] = (OLD_LOGPROBS,)
    runs_actor: bool = False

    def from_chunk(self, chunk: Chunk, actor: Scorer) -> torch.Tensor:
        """The column the engine wrote, masked.

        Raises:
            RuntimeError: a row came without it (the engine was not asked for them).
        """
        if chunk.old_logprobs is None:
            raise RuntimeError(
                "model.ppo.old_logprobs=engine: a row came without the engine's π_old "
                "(GenerationOutput.policy_logprobs); the engine was not asked for them."
            )
        return _masked(chunk, chunk.old_logprobs)


@dataclass(frozen=True)
class Behaviour:
    """π_old taken to be the behaviour policy μ, the engine's sampling log-probs (``rollout``)."""

    name: str = "rollout"
    stage: Stage = "rollout"
    reads: tuple[str, ...] = ()
    runs_actor: bool = False

    def from_chunk(self, chunk: Chunk, actor: Scorer) -> torch.Tensor:
        """The sampling log-probabilities, masked (every importance weight is then 1)."""
        assert chunk.gen_logprobs is not None
        return _masked(chunk, chunk.gen_logprobs)


@dataclass(frozen=True)
class FirstEpoch:
    """π_old from the actor's first epoch, before its first step changes it (``actor``)."""

    name: str = "actor"
    stage: Stage = "first_epoch"
    reads: tuple[str, ...] = ()
    runs_actor: bool = False

    def from_chunk(self, chunk: Chunk, actor: Scorer) -> torch.Tensor:
        """Never called: the score phase writes nothing for this producer."""
        raise RuntimeError("old_logprobs=actor: π_old is written in the actor's first epoch")


#: Every π_old producer, by ``model.ppo.old_logprobs`` value.
PI_OLD: dict[str, PiOldProducer] = {
    p.name: p for p in (Recompute(), FromEngine(), Behaviour(), FirstEpoch())
}


def register_pi_old(producer: PiOldProducer) -> None:
    """Make ``producer`` selectable as ``model.ppo.old_logprobs: <producer.name>``.

    Raises:
        ValueError: the name is taken (or is ``auto``).
    """
    if producer.name in PI_OLD or producer.name == "auto":
        raise ValueError(f"a π_old producer named {producer.name!r} exists already")
    PI_OLD[producer.name] = producer


def pi_old(name: str) -> PiOldProducer:
    """The producer of ``model.ppo.old_logprobs: name`` (resolved: not ``auto``).

    Raises:
        ValueError: naming the registered producers.
    """
    if name not in PI_OLD:
        raise ValueError(
            f"model.ppo.old_logprobs={name!r} is not resolved to a producer; one of "
            f"{', '.join(sorted(PI_OLD))} (lppo.iteration.columns)."
        )
    return PI_OLD[name]


class OwnColumns(Protocol):
    """Columns a first training epoch takes from the module's own forward pass.

    Handed to ``begin`` of a step in that epoch (``model.ppo.old_logprobs: actor``,
    ``model.ppo.old_values: critic``): the chunks then lack those columns, and the module
    completes each from what it just computed. The store is written after the chunk's
    backward pass, by whoever opened the step (:meth:`commit`), not from inside the loss.
    """

    def complete(self, chunk: Chunk, output: torch.Tensor) -> Chunk:
        """``chunk`` with its missing columns computed from ``output``.

        Args:
            chunk: a chunk of the step, without the columns this epoch produces.
            output: ``float[B, T]`` the module's detached output of the chunk (the actor's
                log-probabilities, the critic's values).
        """
        ...

    def commit(self) -> None:
        """Write the columns completed since the last call into the replay store."""
        ...


@dataclass(frozen=True)
class OldValuesProducer:
    """One way the iteration gets the critic's old values (``model.ppo.old_values: <name>``).

    Attributes:
        name: the setting's value.
        stage: ``score``: the score phase runs the critic over every row; ``first_epoch``: the
            critic's first epoch values each chunk, and the advantages are estimated from
            those chunk by chunk (:class:`~lppo.iteration.critic_targets.FirstEpochTargets`).
    """

    name: str
    stage: Stage


#: Both producers of the old values, by ``model.ppo.old_values`` value.
OLD_VALUES: dict[str, OldValuesProducer] = {
    "score": OldValuesProducer("score", "score"),
    "critic": OldValuesProducer("critic", "first_epoch"),
}


def old_values(name: str) -> OldValuesProducer:
    """The producer of ``model.ppo.old_values: name`` (resolved: not ``auto``).

    Raises:
        ValueError: ``auto`` or an unknown name (the run plan resolves ``auto``).
    """
    if name not in OLD_VALUES:
        raise ValueError(
            f"model.ppo.old_values={name!r} is not resolved to a producer (score or critic); "
            "resolve it first (lppo.iteration.critic_targets.resolve_old_values)."
        )
    return OLD_VALUES[name]


def score_reads(producer: PiOldProducer) -> list[str]:
    """The columns the score phase streams for ``producer`` (the mismatch reads μ's too)."""
    return [GEN_LOGPROBS, *producer.reads]


#: Columns every rollout stores with its rows (:meth:`lppo.types.Rollout.columns`).
ROLLOUT_COLUMNS = (INPUT_IDS, RESPONSE_MASK, GEN_LOGPROBS, REWARD, PROMPT_INDEX)


@dataclass(frozen=True)
class ColumnReader:
    """A phase's declared reads: who reads (for messages) and the column names."""

    who: str
    reads: tuple[str, ...]


def writers(
    old_logprobs: str,
    old_values_name: str | None,
    reference: bool,
    estimator: AdvantageEstimatorLike,
    teacher: bool = False,
) -> dict[str, str]:
    """Each column of an iteration and what writes it (step 4 of the run plan).

    Args:
        old_logprobs: ``model.ppo.old_logprobs``, resolved.
        old_values_name: ``model.ppo.old_values``, resolved (``None``: no critic).
        reference: a reference policy is scored (the KL penalty or loss is on).
        estimator: the advantage estimator (its :meth:`writes`).
        teacher: a teacher is scored (on-policy distillation).
    """
    out = {c: "the rollout" for c in ROLLOUT_COLUMNS}
    out[OLD_LOGPROBS] = f"model.ppo.old_logprobs={old_logprobs}"
    if old_values_name is not None:
        out[VALUES] = f"model.ppo.old_values={old_values_name}"
    if reference:
        out[REF_LOGPROBS] = "the reference policy (score phase)"
    if teacher:
        out[TEACHER_LOGPROBS] = "model.teacher (score phase)"
    for name in estimator.writes():
        out[name] = f"model.estimator={type(estimator).__name__}"
    return out


def check_reads(readers: list[ColumnReader], written: dict[str, str]) -> None:
    """Refuse a run in which a phase reads a column that nothing writes.

    Raises:
        SettingError: naming the reader, the column and what writes the others.
    """
    for reader in readers:
        for name in reader.reads:
            if name not in written:
                known = ", ".join(f"{c} ({w})" for c, w in written.items())
                raise SettingError(
                    f"{reader.who} reads the column {name!r}, which nothing in this run writes "
                    f"(written: {known}); change {reader.who} or give the part that writes it "
                    "(model.critic for values, a KL coefficient for ref_logprobs, model.teacher "
                    "for teacher_logprobs)."
                )


def check_read(name: str, writer: str, readers: list[ColumnReader]) -> None:
    """Refuse a part whose only job is to write the column ``name`` when no phase reads it.

    Raises:
        SettingError: naming the part, the column and the readers.
    """
    if any(name in reader.reads for reader in readers):
        return
    who = ", ".join(reader.who for reader in readers)
    raise SettingError(
        f"{writer} is set, but nothing in this run reads its column {name!r} (read by: {who}); "
        "it would be computed for nothing. Use an estimator that reads it "
        "(lppo.estimators.Distill for model.teacher) or remove it."
    )
