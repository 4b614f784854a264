"""Where π_old comes from: the score phase's forward pass, the actor's first epoch, or the engine.

With one optimizer step per actor epoch, the actor's weights through its first epoch are the
weights the score phase would score π_old with, so that epoch's forward pass already computes
π_old: :class:`FirstEpochLogprobs` stores it, chunk by chunk, as the rows' ``old_logprobs``
(what later epochs read) and measures the engine/trainer mismatch there instead of in the score
phase. The ratio of that epoch is then exactly 1 and its gradient the on-policy one, the same
numbers as with a separate score pass up to round-off, at one actor forward pass fewer per
iteration. Where something reads π_old before that epoch (a KL penalty in the reward, several
actor minibatches, ...), the engine can give it instead: an engine that samples from the
actor's own module computes π's logits for every sampled token anyway, and those at the
sampling temperature, before any top-p / top-k processing, are π_old up to round-off
(``engine``, :func:`engine_obstacles`). ``model.ppo.old_logprobs: auto`` (the default) picks
the first of those that is exact here, else a separate pass (:func:`resolve_old_logprobs`).
"""

from __future__ import annotations

import dataclasses

import torch

from lppo.algorithms.off_policy import OffPolicyCorrection
from lppo.config import PPOConfig
from lppo.decisions import note
from lppo.estimators.base import AdvantageEstimator
from lppo.iteration.chunks import unpad
from lppo.iteration.mismatch import Mismatch
from lppo.modules import ActorModule
from lppo.parallel import ProcessGroup
from lppo.replay.base import ReplayStore
from lppo.rollout.capabilities import capabilities_of
from lppo.types import GEN_LOGPROBS, OLD_LOGPROBS, Chunk, StepPlan

__all__ = [
    "FirstEpochLogprobs",
    "actor_epoch_obstacles",
    "engine_obstacles",
    "resolve_old_logprobs",
]


@dataclasses.dataclass(frozen=True)
class RowSource:
    """How a run's rows are generated, as far as π_old from the engine depends on it.

    Attributes:
        staleness: ``model.rollout.max_staleness`` (a runner in another thread or process
            generates each row from a copy of the weights it is for, which at staleness 0 are
            the weights π_old is of).
        precision: ``trainer.precision`` (``"32-true"`` without a trainer).
        shards_weights: the layout shards the weights (FSDP, megatron).
    """

    staleness: int
    precision: str
    shards_weights: bool


def precision_dtype(precision: str) -> torch.dtype | None:
    """The dtype ``trainer.precision`` converts the models to (``None``: they keep theirs).

    Lightning converts them after ``configure_model``; the run plan decides before that, on
    the dtype the models will have.
    """
    return {"64": torch.float64, "64-true": torch.float64, "double": torch.float64}.get(
        str(precision)
    )


#: What ``engine_obstacles`` says when nothing told the controller about the engine.
NO_ENGINE = "no rollout engine known (a PPOController built without PPOSystem)"


def engine_obstacles(
    engine: object,
    actor: ActorModule,
    config: PPOConfig,
    rows: RowSource,
) -> list[str]:
    """Why the engine's log-probs of π would not be the actor's π_old here (empty: they are).

    They are when the engine says its forward pass is the actor's (the
    ``policy_logprob_obstacles`` capability of :class:`~lppo.rollout.HFGenerateEngine`, asked
    at the run's final dtype: it samples from the module ``actor.policy()``
    returns), that module is the one the actor trains (not a LoRA merge or a converted copy),
    the actor keeps :class:`~lppo.modules.ActorModule`'s forward (``logits``,
    ``token_logprobs``) and ``policy``, the rows come from the current weights, dropout is off
    and the trainer runs without autocast (``generate`` does) on whole weights.
    """
    reasons = []
    if rows.staleness > 0:
        reasons.append(f"model.rollout.max_staleness={rows.staleness} (rows of older weights)")
    if "mixed" in rows.precision:
        reasons.append(f"trainer.precision={rows.precision} (generate runs without autocast)")
    if rows.shards_weights:
        reasons.append("trainer.strategy shards the weights")
    overrides = [m for m in ("logits", "token_logprobs", "policy") if _overrides(actor, m)]
    reasons += [f"{type(actor).__name__} overrides {m}" for m in overrides]
    ask = capabilities_of(engine).policy_logprob_obstacles
    if ask is None:
        reasons.append(f"{type(engine).__name__} does not give π's own log-probs")
    elif actor.lora is not None:
        reasons.append("the engine samples from a copy of the actor's model (LoRA merge)")
    elif not overrides:  # ActorModule.policy() is then the module the actor trains
        reasons += ask(actor.model, precision_dtype(rows.precision))
    if not config.disable_dropout:
        reasons.append("model.ppo.disable_dropout=false")
    return reasons


def _overrides(actor: ActorModule, method: str) -> bool:
    """Whether ``actor``'s class replaces :class:`~lppo.modules.ActorModule`'s ``method``."""
    return getattr(type(actor), method) is not getattr(ActorModule, method)


def actor_epoch_obstacles(
    config: PPOConfig, estimator: AdvantageEstimator, actor: ActorModule
) -> list[str]:
    """Why the actor's first epoch cannot compute π_old exactly here (empty: it can).

    It can when nothing reads π_old before that epoch and no step changes the actor inside
    it: no KL penalty in the reward (the advantages read π_old), an estimator that does not
    declare π_old among its reads (:class:`~lppo.estimators.Distill` does), an estimator whose
    ``estimate`` is lppo's own (a custom one may read it), ``actor_minibatches: 1``,
    ``disable_dropout: true``, no critic warmup (an iteration without actor epochs still
    reports the mismatch) and an actor that keeps :class:`~lppo.modules.ActorModule`'s
    ``chunk_loss`` (a subclass's own may read ``chunk.old_logprobs``).
    """
    reasons = []
    if config.kl_coef > 0:
        reasons.append(f"model.ppo.kl_coef={config.kl_coef} (the KL reward reads π_old)")
    if OLD_LOGPROBS in estimator.reads():
        reasons.append(f"model.estimator={type(estimator).__name__} reads π_old")
    estimate = next(c for c in type(estimator).__mro__ if "estimate" in vars(c))
    if not estimate.__module__.startswith("lppo.estimators"):
        reasons.append(f"{type(estimator).__name__} has its own estimate (it may read π_old)")
    if config.actor_minibatches != 1:
        reasons.append(f"model.ppo.actor_minibatches={config.actor_minibatches}")
    if not config.disable_dropout:
        reasons.append("model.ppo.disable_dropout=false")
    if config.critic_warmup_iterations > 0:
        reasons.append(f"model.ppo.critic_warmup_iterations={config.critic_warmup_iterations}")
    if _overrides(actor, "chunk_loss"):
        reasons.append(f"{type(actor).__name__} overrides chunk_loss")
    return reasons


def resolve_old_logprobs(
    config: PPOConfig,
    estimator: AdvantageEstimator,
    actor: ActorModule,
    engine: list[str] | None = None,
) -> PPOConfig:
    """``config`` with ``old_logprobs: auto`` made ``actor``, ``engine`` or ``recompute``.

    ``actor`` wherever :func:`actor_epoch_obstacles` finds none, else ``engine`` wherever
    ``engine`` (:func:`engine_obstacles`) is empty, else ``recompute``, with a log line naming
    the obstacles. ``recompute`` and ``rollout`` are returned unchanged, and so is ``engine``
    when ``engine`` is ``None`` (PPOSystem resolved it).

    Raises:
        SettingError: an explicit ``actor`` or ``engine`` where it would not be exact (the
            message names each obstacle).
    """
    mode = config.old_logprobs
    # recompute, rollout and registered producers are taken as given; actor and engine checked
    if mode not in ("auto", "actor", "engine") or (mode == "engine" and engine is None):
        note("model.ppo.old_logprobs", mode, setting=mode)
        return config
    engine = [NO_ENGINE] if engine is None else engine
    if mode == "engine":
        return config.resolved("old_logprobs", "engine", "recompute", engine)
    first_epoch = actor_epoch_obstacles(config, estimator, actor)
    if mode == "actor" or not first_epoch:
        return config.resolved("old_logprobs", "actor", "recompute", first_epoch)
    if not engine:
        why = f"not the first epoch: {'; '.join(first_epoch)}"
        return config.resolved("old_logprobs", "engine", "recompute", engine, why)
    return config.resolved("old_logprobs", "engine", "recompute", first_epoch + engine)


class FirstEpochLogprobs:
    """π_old of one iteration's first actor epoch (:class:`~lppo.iteration.columns.OwnColumns`).

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
        self._pending: list[tuple[tuple[int, ...], list[torch.Tensor]]] = []

    def columns(self, names: list[str]) -> list[str]:
        """The first epoch's columns: ``names`` without π_old, with the engine's log-probs."""
        kept = [n for n in names if n != OLD_LOGPROBS]
        return kept if GEN_LOGPROBS in kept else [*kept, GEN_LOGPROBS]

    def complete(self, chunk: Chunk, output: torch.Tensor) -> Chunk:
        """``chunk`` with π_old, the actor's own log-probs; the mismatch folded in.

        Args:
            chunk: a first-epoch actor chunk (with ``gen_logprobs``, without ``old_logprobs``).
            output: ``float[B, T]`` the actor's detached log-probabilities of the chunk.
        """
        mask = chunk.response_mask
        old = torch.where(mask, output, torch.zeros_like(output))  # as actor.score masks
        assert chunk.gen_logprobs is not None
        self.mismatch.add(old.cpu(), chunk.gen_logprobs.cpu(), mask.cpu(), self.correction)
        self._pending.append((chunk.row_ids, unpad(chunk, old)))
        self.rows.update(chunk.row_ids)
        return dataclasses.replace(chunk, old_logprobs=old)

    def commit(self) -> None:
        """Store the π_old of the chunks completed since the last call."""
        for row_ids, old in self._pending:
            self.store.write(row_ids, {OLD_LOGPROBS: old})
        self._pending.clear()

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
