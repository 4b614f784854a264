"""Step 3 of an iteration, the advantages: now, or during the critic's first epoch.

:func:`resolve_old_values` checks that the estimator, the critic and
``model.ppo.old_values`` fit together and decides when the advantage estimator runs;
:class:`AdvantagePhase` runs it then. With ``old_values: score`` it runs the estimator on the
scored rows.

With ``old_values: critic`` and one optimizer step per critic epoch, the critic's weights
through its first epoch are the weights the score phase would have run it with, so that
epoch's forward pass already computes the old values. :class:`FirstEpochTargets` turns them,
chunk by chunk, into the advantages and returns that the estimator would have written after a
score pass: one forward pass of the critic over every row fewer per iteration, and the same
numbers up to round-off. ``old_values: auto`` (the default) picks ``critic`` wherever it
applies (:func:`resolve_old_values`).
"""

from __future__ import annotations

import dataclasses
from typing import cast

import torch

from lppo.config import PPOConfig
from lppo.decisions import note
from lppo.estimators.base import (
    AdvantageEstimator,
    EstimatorInputs,
    TargetMoments,
    ValueTargets,
)
from lppo.iteration.columns import old_values
from lppo.modules import CriticModule
from lppo.types import ADVANTAGES, RETURNS, VALUES, Chunk, RolloutStats
from lppo.validation import SettingError

__all__ = [
    "AdvantagePhase",
    "FirstEpochTargets",
    "check_critic",
    "critic_epoch_obstacles",
    "resolve_old_values",
]


class AdvantagePhase:
    """Runs the advantage estimator after the score phase, or hands it to the critic's epoch.

    Args:
        estimator: the advantage estimator.
        config: the algorithm settings, ``old_values`` resolved (:func:`resolve_old_values`).
    """

    def __init__(self, estimator: AdvantageEstimator, config: PPOConfig) -> None:
        self.estimator = estimator
        self.deferred = old_values(config.old_values).stage == "first_epoch"

    def start(self, inputs: EstimatorInputs, stats: RolloutStats) -> FirstEpochTargets | None:
        """Write the advantages now, or return the critic's first-epoch targets.

        With ``old_values: score`` the estimator runs now and its metrics go into ``stats``;
        with ``old_values: critic`` the returned targets write them during that epoch.
        """
        if self.deferred:
            return FirstEpochTargets(cast(ValueTargets, self.estimator), inputs)
        stats.update(self.estimator.estimate(inputs))
        return None


class FirstEpochTargets:
    """Old values, advantages and returns of one iteration's first critic epoch.

    The critic completes each chunk with them (:class:`~lppo.iteration.columns.OwnColumns`).

    Args:
        estimator: the iteration's estimator (its per-chunk targets and final whitening).
        inputs: the iteration's rows, as the estimator reads and writes them.
    """

    def __init__(self, estimator: ValueTargets, inputs: EstimatorInputs) -> None:
        self.estimator = estimator
        self.inputs = inputs
        self.moments = TargetMoments()
        self.rows: set[int] = set()
        self._pending: list[tuple[Chunk, dict[str, torch.Tensor]]] = []

    def columns(self, names: list[str]) -> list[str]:
        """The first epoch's columns: the estimator's reward columns instead of ``names``."""
        return self.inputs.reward_columns

    def complete(self, chunk: Chunk, output: torch.Tensor) -> Chunk:
        """``chunk`` with its old values and returns, from the critic's ``output``.

        Args:
            chunk: a first-epoch critic chunk (with :attr:`columns`).
            output: ``float[B, T]`` the critic's detached values of the chunk.
        """
        # Zero off-response, as CriticModule.score writes them.
        old = torch.where(chunk.response_mask, output, torch.zeros_like(output))
        adv, ret = self.estimator.chunk_targets(self.inputs, chunk, old, self.moments)
        self._pending.append((chunk, {VALUES: old, ADVANTAGES: adv, RETURNS: ret}))
        self.rows.update(chunk.row_ids)
        return dataclasses.replace(chunk, values=old, returns=ret)

    def commit(self) -> None:
        """Store the old values, advantages and returns of the chunks completed since."""
        for chunk, columns in self._pending:
            self.inputs.write(chunk, columns)
        self._pending.clear()

    def finish(self) -> dict[str, float]:
        """After the epoch: the estimator's final pass (whitening); returns its metrics.

        Raises:
            RuntimeError: a row of the iteration got no targets in the epoch.
        """
        wanted = {i for ids in self.inputs.step.chunks for i in ids}
        if missing := wanted - self.rows:
            raise RuntimeError(
                f"model.ppo.old_values=critic: {len(missing)} rows got no values in the "
                "critic's first epoch (each row must be in one of its chunks)."
            )
        return self.estimator.finish_targets(self.inputs, self.moments)


def critic_epoch_obstacles(
    config: PPOConfig, estimator: AdvantageEstimator, critic: CriticModule | None
) -> list[str]:
    """Why the critic's first epoch cannot compute the old values exactly here (empty: it can).

    It can with a critic, an estimator with per-row value targets (``GAE``),
    ``critic_minibatches: 1`` (no step changes the critic before every row is valued),
    ``disable_dropout: true``, a critic whose ``chunk_loss`` is
    :class:`~lppo.modules.CriticModule`'s (a subclass's own may not call ``self.complete``) and
    an estimator whose ``estimate`` comes from the class of its ``chunk_targets`` (a subclass
    that overrides only ``estimate`` would not be called).
    """
    reasons = []
    if critic is None or not isinstance(estimator, ValueTargets) or not estimator.uses_critic:
        reasons.append(f"model.estimator={type(estimator).__name__} has no per-row value targets")
    elif type(critic).chunk_loss is not CriticModule.chunk_loss:
        reasons.append(f"{type(critic).__name__} overrides chunk_loss")
    elif _defines(type(estimator), "estimate") is not _defines(type(estimator), "chunk_targets"):
        reasons.append(f"{type(estimator).__name__} overrides estimate but not chunk_targets")
    if config.critic_minibatches != 1:
        reasons.append(f"model.ppo.critic_minibatches={config.critic_minibatches}")
    if not config.disable_dropout:
        reasons.append("model.ppo.disable_dropout=false")
    return reasons


def resolve_old_values(
    config: PPOConfig, estimator: AdvantageEstimator, critic: CriticModule | None
) -> PPOConfig:
    """``config`` with ``old_values: auto`` made ``critic`` or ``score``, the critic checked.

    ``critic`` (one critic forward pass fewer per iteration, the same numbers to round-off)
    wherever :func:`critic_epoch_obstacles` finds none, else ``score`` with a log line that
    names them. An explicit ``score`` is returned unchanged.

    Raises:
        SettingError: a critic the estimator ignores, or a missing one it needs
            (:func:`check_critic`).
        SettingError: an explicit ``old_values: critic`` where it would not be exact (the
            message names each obstacle).
    """
    check_critic(critic, estimator)
    if critic is None and config.old_values == "auto":
        note("model.ppo.old_values", "score")  # nothing to say: no critic
        return dataclasses.replace(config, old_values="score")
    obstacles = critic_epoch_obstacles(config, estimator, critic)
    return config.resolved("old_values", "critic", "score", obstacles)


def _defines(cls: type, name: str) -> type:
    """The class of ``cls``'s MRO whose own namespace defines ``name``."""
    return next(c for c in cls.__mro__ if name in vars(c))


def check_critic(critic: CriticModule | None, estimator: AdvantageEstimator) -> None:
    """Reject a critic the estimator ignores, or a missing critic it needs.

    Raises:
        SettingError: naming ``model.critic``, ``model.estimator`` and the fix (lppo's short
            block on the command line, not a traceback).
    """
    name = type(estimator).__name__
    uses = bool(getattr(estimator, "uses_critic", True))
    if uses and critic is None:
        raise SettingError(
            f"model.critic is null but model.estimator={name} needs a critic (its values and "
            "returns); give model.critic, or pick a critic-free estimator "
            "(lppo.estimators.GRPO, RLOO, ReinforcePP)."
        )
    if not uses and critic is not None:
        raise SettingError(
            f"model.estimator={name} is critic-free: the critic would train on targets nobody "
            "writes; set model.critic: null (or use lppo.estimators.GAE)."
        )
