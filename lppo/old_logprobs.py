"""Where π_old comes from: the score phase's forward pass, or the actor's first epoch.

With one optimizer step per actor epoch, the actor's weights through its first epoch are the
weights the score phase would score π_old with, so that epoch's forward pass already computes
π_old: :class:`FirstEpochLogprobs` stores it, chunk by chunk, as the rows' ``old_logprobs``
(what later epochs read) and measures the engine/trainer mismatch there instead of in the score
phase. The ratio of that epoch is then exactly 1 and its gradient the on-policy one, the same
numbers as with a separate score pass up to round-off, at one actor forward pass fewer per
iteration. ``model.ppo.old_logprobs: auto`` (the default) picks it wherever that holds
(:func:`resolve_old_logprobs`).
"""

from __future__ import annotations

import dataclasses

import torch

from lppo.algorithms.off_policy import OffPolicyCorrection
from lppo.chunks import unpad
from lppo.config import PPOConfig
from lppo.estimators.base import AdvantageEstimator
from lppo.mismatch import Mismatch
from lppo.modules import ActorModule
from lppo.parallel import ProcessGroup
from lppo.replay.base import ReplayStore
from lppo.types import GEN_LOGPROBS, OLD_LOGPROBS, Chunk, StepPlan

__all__ = ["FirstEpochLogprobs", "actor_epoch_obstacles", "resolve_old_logprobs"]


def actor_epoch_obstacles(
    config: PPOConfig, estimator: AdvantageEstimator, actor: ActorModule
) -> list[str]:
    """Why the actor's first epoch cannot compute π_old exactly here (empty: it can).

    It can when nothing reads π_old before that epoch and no step changes the actor inside
    it: no KL penalty in the reward (the advantages read π_old), an estimator whose
    ``estimate`` is lppo's own (a custom one may read it), ``actor_minibatches: 1``,
    ``disable_dropout: true``, no critic warmup (an iteration without actor epochs still
    reports the mismatch) and an actor that keeps :class:`~lppo.modules.ActorModule`'s
    ``chunk_loss`` (a subclass's own may read ``chunk.old_logprobs``).
    """
    reasons = []
    if config.kl_coef > 0:
        reasons.append(f"model.ppo.kl_coef={config.kl_coef} (the KL reward reads π_old)")
    estimate = next(c for c in type(estimator).__mro__ if "estimate" in vars(c))
    if not estimate.__module__.startswith("lppo.estimators"):
        reasons.append(f"{type(estimator).__name__} has its own estimate (it may read π_old)")
    if config.actor_minibatches != 1:
        reasons.append(f"model.ppo.actor_minibatches={config.actor_minibatches}")
    if not config.disable_dropout:
        reasons.append("model.ppo.disable_dropout=false")
    if config.critic_warmup_iterations > 0:
        reasons.append(f"model.ppo.critic_warmup_iterations={config.critic_warmup_iterations}")
    if type(actor).chunk_loss is not ActorModule.chunk_loss:
        reasons.append(f"{type(actor).__name__} overrides chunk_loss")
    return reasons


def resolve_old_logprobs(
    config: PPOConfig, estimator: AdvantageEstimator, actor: ActorModule
) -> PPOConfig:
    """``config`` with ``old_logprobs: auto`` made ``actor`` or ``recompute``.

    ``actor`` wherever :func:`actor_epoch_obstacles` finds none, else ``recompute`` with a log
    line naming them. ``recompute`` and ``rollout`` are returned unchanged.

    Raises:
        SettingError: an explicit ``old_logprobs: actor`` where it would not be exact (the
            message names each obstacle).
    """
    if config.old_logprobs in ("recompute", "rollout"):
        return config
    obstacles = actor_epoch_obstacles(config, estimator, actor)
    return config.resolved("old_logprobs", "actor", "recompute", obstacles)


class FirstEpochLogprobs:
    """``Chunk.record_old_logprobs`` of one iteration's first actor epoch.

    Args:
        store: the replay store (π_old goes back into it, for the later epochs).
        step: the score phase's step: every row of the iteration the actor trains on.
        correction: the actor's off-policy correction (the mismatch's bounds).
        group: the data-parallel group (each rank trains its own share of the rows).
    """

    def __init__(
        self,
        store: ReplayStore,
        step: StepPlan,
        correction: OffPolicyCorrection,
        group: ProcessGroup,
    ) -> None:
        self.store = store
        self.step = step
        self.correction = correction
        self.group = group
        self.mismatch = Mismatch()
        self.rows: set[int] = set()

    def columns(self, names: list[str]) -> list[str]:
        """The first epoch's columns: ``names`` without π_old, with the engine's log-probs."""
        kept = [n for n in names if n != OLD_LOGPROBS]
        return kept if GEN_LOGPROBS in kept else [*kept, GEN_LOGPROBS]

    def attach(self, chunk: Chunk) -> Chunk:
        """``chunk`` with this recorder as its ``record_old_logprobs``."""
        return dataclasses.replace(chunk, record_old_logprobs=self)

    def __call__(self, chunk: Chunk, logprobs: torch.Tensor) -> torch.Tensor:
        """Store the chunk's π_old and fold its mismatch in; return π_old ``float[B, T]``.

        Args:
            chunk: a first-epoch actor chunk (with ``gen_logprobs``).
            logprobs: ``float[B, T]`` the actor's detached log-probabilities of the chunk.
        """
        mask = chunk.response_mask
        old = torch.where(mask, logprobs, torch.zeros_like(logprobs))  # as actor.score masks
        assert chunk.gen_logprobs is not None
        self.mismatch.add(old.cpu(), chunk.gen_logprobs.cpu(), mask.cpu(), self.correction)
        self.store.write(chunk.row_ids, {OLD_LOGPROBS: unpad(chunk, old)})
        self.rows.update(chunk.row_ids)
        return old

    def finish(self) -> dict[str, float]:
        """After the epoch: the mismatch over every rank's rows (collective over ``group``).

        Raises:
            RuntimeError: a row of the iteration got no π_old in the epoch.
        """
        wanted = {i for ids in self.step.chunks for i in ids}
        if missing := wanted - self.rows:
            raise RuntimeError(
                f"model.ppo.old_logprobs=actor: {len(missing)} rows got no π_old in the "
                "actor's first epoch (each row must be in one of its chunks)."
            )
        self.mismatch.all_reduce(self.group)
        return self.mismatch.metrics()
