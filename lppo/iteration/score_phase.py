"""Steps 1 and 2 of an iteration after the rows are in the store: their statistics, the scores.

:func:`rollout_stats` reduces the rollout's per-row scalars over the data-parallel ranks.
:class:`ScorePhase` streams the iteration's rows once without gradients and writes back, per
chunk, π_old log-probabilities (or the engine's: ``ppo.old_logprobs: rollout``; none with
``actor``, whose first epoch computes them), reference log-probabilities (KL on), a
teacher's (distillation), the critic's old values (``ppo.old_values: score``) and a reward
model's scores, which it then combines with the task's reward, row by row.
"""

from __future__ import annotations

import math

import torch

from lppo.config import PPOConfig
from lppo.iteration.chunks import unpad
from lppo.iteration.columns import old_values, pi_old, score_reads
from lppo.iteration.data import ReplayDataModule
from lppo.iteration.hooks import IterationContext
from lppo.iteration.mismatch import Mismatch
from lppo.modules import ActorModule, CriticModule
from lppo.modules.reward_model import RewardModel
from lppo.parallel import ProcessGroup
from lppo.replay.rollout_rows import StoredRollout
from lppo.stats import Moments
from lppo.types import (
    GEN_LOGPROBS,
    OLD_LOGPROBS,
    REF_LOGPROBS,
    REWARD,
    RM_SCORE,
    TASK_REWARD,
    TEACHER_LOGPROBS,
    VALUES,
    EpisodeReport,
    RolloutStats,
    SamplingReport,
    StepPlan,
)

__all__ = ["ScorePhase", "rollout_stats"]


def _reward_range(reward: torch.Tensor, group: ProcessGroup) -> dict[str, float]:
    """``reward_min`` / ``reward_max`` of every rank's finite rewards (none without any)."""
    finite = reward[torch.isfinite(reward)].to(torch.float64)
    low = finite.min() if finite.numel() else torch.tensor(math.inf, dtype=torch.float64)
    high = finite.max() if finite.numel() else torch.tensor(-math.inf, dtype=torch.float64)
    low, neg_high = group.all_reduce(torch.stack([low, -high]), "min").tolist()  # one collective
    if not math.isfinite(low):
        return {}
    return {"reward_min": low, "reward_max": -neg_high}


def rollout_stats(rows: StoredRollout, group: ProcessGroup) -> tuple[RolloutStats, int]:
    """Reward and length moments and loss counts of every rank's rows (as generated).

    Collective over ``group``.

    Returns:
        The statistics, and every rank's response tokens.
    """
    reward, length = Moments(), Moments()
    reward.update(rows.reward[torch.isfinite(rows.reward)])
    length.update(rows.response_tokens)
    reward.all_reduce(group)
    length.all_reduce(group)
    counts = torch.tensor(
        [rows.dropped, rows.bad_rewards, length.count * length.mu], dtype=torch.float64
    )
    dropped_all, bad_all, tokens = group.all_reduce(counts).tolist()
    stats = RolloutStats(
        reward_mean=reward.mu if reward.count else math.nan,
        reward_std=math.sqrt(reward.var) if reward.count else math.nan,
        response_length_mean=length.mu,
        dropped_rows=dropped_all,
        bad_rewards=bad_all,
    )
    stats.update(_reward_range(rows.reward, group))
    if rows.sampling is not None:  # dynamic sampling is on (on every rank)
        counts = torch.tensor(rows.sampling.counts(), dtype=torch.float64)
        total = SamplingReport(*group.all_reduce(counts).tolist())
        stats.update(total.metrics())
    if rows.episodes is not None:  # multi-turn rollouts (on every rank)
        counts = torch.tensor(rows.episodes.counts(), dtype=torch.float64)
        stats.update(EpisodeReport(*group.all_reduce(counts).tolist()).metrics())
    if rows.worker_restarts is not None:  # an engine with rollout workers (on every rank)
        counts = torch.tensor([rows.worker_restarts], dtype=torch.float64)
        stats.update({"worker_restarts": group.all_reduce(counts).item()})
    return stats, round(tokens)


class ScorePhase:
    """Writes the columns every later phase reads, in one no-grad pass over the rows.

    Also measures the engine/trainer mismatch on every sampled token (π_old against the
    engine's ``gen_logprobs``): ``mismatch_kl``, ``mismatch_max_abs_log_ratio`` and
    ``mismatch_outside_fraction`` (bounds of ``actor.off_policy``), always on (with
    ``old_logprobs: actor`` the actor's first epoch measures it).

    Args:
        actor: the policy (π_old).
        critic: the value model; scored here only when the old values' producer is this
            phase (``old_values: score``).
        reference: the frozen reference policy (KL on), else ``None``.
        reward_model: a learned reward, else ``None``.
        data: the store and the chunk streams.
        config: the algorithm settings (``old_logprobs``, ``old_values``).
        group: the data-parallel group (each rank scores its own rows).
        teacher: the frozen teacher of on-policy distillation, else ``None``.
    """

    def __init__(
        self,
        actor: ActorModule,
        critic: CriticModule | None,
        reference: ActorModule | None,
        reward_model: RewardModel | None,
        data: ReplayDataModule,
        config: PPOConfig,
        group: ProcessGroup,
        teacher: ActorModule | None = None,
    ) -> None:
        self.actor = actor
        self.critic = critic if old_values(config.old_values).stage == "score" else None
        self.reference = reference
        self.teacher = teacher
        self.reward_model = reward_model
        self.data = data
        #: π_old's producer (:mod:`lppo.iteration.columns`); ``None`` when the actor's first
        #: epoch writes it (this phase then writes no π_old).
        producer = pi_old(config.old_logprobs)
        self.pi_old = producer if producer.stage != "first_epoch" else None
        self.group = group

    @property
    def models(self) -> list[torch.nn.Module]:
        """The modules whose forwards this phase runs (each rank its own number of them)."""
        actor = self.actor if self.pi_old is not None and self.pi_old.runs_actor else None
        found = (actor, self.critic, self.reference, self.teacher, self.reward_model)
        return [m for m in found if m is not None]

    @torch.no_grad()
    def run(self, ctx: IterationContext, step: StepPlan) -> dict[str, float]:
        """Score this rank's rows (``step``: the whole phase as one step); return metrics."""
        if not self.models and self.pi_old is None:
            return {}  # old_logprobs: actor, and nothing else to score
        scores: dict[int, float] = {}
        mismatch = Mismatch()
        wanted = score_reads(self.pi_old) if self.pi_old is not None else [GEN_LOGPROBS]
        for c, chunk in enumerate(self.data.stream(step, wanted)):
            if chunk.is_padding:
                continue
            ctx.chunk = c
            columns = {}
            if self.pi_old is not None:
                gen = chunk.gen_logprobs
                assert gen is not None
                old = self.pi_old.from_chunk(chunk, self.actor)
                # old_logprobs=rollout: π_old is μ, the mismatch (every IS weight) is 0 (1).
                mismatch.add(old.cpu(), gen, chunk.response_mask, self.actor.off_policy)
                columns[OLD_LOGPROBS] = unpad(chunk, old)
            if self.critic is not None:
                columns[VALUES] = unpad(chunk, self.critic.score(chunk))
            if self.reference is not None:
                columns[REF_LOGPROBS] = unpad(chunk, self.reference.score(chunk))
            if self.teacher is not None:
                columns[TEACHER_LOGPROBS] = unpad(chunk, self.teacher.score(chunk))
            if self.reward_model is not None:
                rows = self.reward_model.score(chunk).tolist()
                scores.update(zip(chunk.row_ids, rows, strict=True))
            self.data.store.write(chunk.row_ids, columns)
        ctx.chunk = -1
        stats = {}
        if self.pi_old is not None:  # else the actor's first epoch measures it
            mismatch.all_reduce(self.group)  # each rank scored only its own rows
            stats = mismatch.metrics()
        if self.reward_model is not None:
            stats.update(self.combine_rewards(self.reward_model, scores))
        return stats

    def combine_rewards(self, model: RewardModel, scores: dict[int, float]) -> dict[str, float]:
        """Replace each scored row's reward by the reward model's combination (row scalars).

        The task's reward is kept as ``task_reward`` and the raw score as ``rm_score``.
        """
        store = self.data.store
        ids = list(scores)  # may be empty on a rank without valid rows: it still reduces
        read = store.read(ids, [REWARD])[REWARD] if ids else []
        task = torch.stack(read) if read else torch.zeros(0)
        raw = torch.tensor([scores[i] for i in ids], dtype=torch.float64)
        combined = model.combine(task, raw, self.group).to(task.dtype)
        if ids:
            columns = {
                REWARD: list(combined.unbind(0)),
                TASK_REWARD: list(task.unbind(0)),
                RM_SCORE: list(raw.unbind(0)),
            }
            store.write(ids, columns)
        moments = {"rm_score": Moments(), "reward_combined": Moments()}
        moments["rm_score"].update(raw)
        moments["reward_combined"].update(combined)
        for m in moments.values():
            m.all_reduce(self.group)
        return {
            "rm_score_mean": moments["rm_score"].mean,
            "rm_score_std": math.sqrt(moments["rm_score"].var),
            "reward_combined_mean": moments["reward_combined"].mean,
        }
