"""Typed containers passed between lppo's components.

Token alignment convention (every token-level tensor in lppo follows it): position ``t`` of
a row is aligned with ``input_ids[t]``. ``logprobs[t]`` is ``log p(input_ids[t] | input_ids[:t])``
and ``values[t]`` is the critic's estimate of the state *before* token ``t`` is emitted (computed
from the hidden state at ``t - 1``). Position 0 has no prediction, so ``response_mask[0]`` is
always ``False`` and every token-level field holds 0 there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

import torch

from lppo.reports import EpisodeReport, SamplingReport

# Names of the columns lppo itself reads and writes in a replay store.
INPUT_IDS = "input_ids"
RESPONSE_MASK = "response_mask"
GEN_LOGPROBS = "gen_logprobs"
REWARD = "reward"
OLD_LOGPROBS = "old_logprobs"
REF_LOGPROBS = "ref_logprobs"
VALUES = "values"
ADVANTAGES = "advantages"
RETURNS = "returns"
TASK_REWARD = "task_reward"
RM_SCORE = "rm_score"
# Row-level (bool, 0-dim) extra of a rollout: the sample hit max_new_tokens (read when put).
TRUNCATED = "truncated"
# Row-level (int64, 0-dim) provenance: the policy version the row was sampled from, and the
# iteration it was generated for (stored with every row).
POLICY_VERSION = "policy_version"
FOR_ITERATION = "for_iteration"
# Token-level (float64) extra of a multi-turn row: each turn's own reward on its last token.
TURN_REWARDS = "turn_rewards"
# Token-level: a teacher's log-probabilities of the sampled tokens (on-policy distillation).
TEACHER_LOGPROBS = "teacher_logprobs"
# Row-level (int64, 0-dim): which prompt of its batch a row answers (group baselines read it).
PROMPT_INDEX = "prompt_index"


@dataclass
class Rollout:
    """Rows produced by one rollout, packed: one variable-length entry per sample.

    Attributes:
        input_ids: ``len == n_rows``; row ``i`` is ``int64[L_i]`` (prompt followed by response).
        response_mask: ``bool[L_i]`` per row; ``True`` on response tokens that are trained on.
        gen_logprobs: ``float32[L_i]`` per row; the sampler's log-probabilities (0 off-response).
        reward: ``float64[n_rows]``; the sequence-level score of each row (float64 whatever the
            run's dtype: one number per row, and a float64 run's advantages stay float64).
        prompt_index: ``int64[n_rows]``; which prompt of the batch each row answers.
        extras: any further per-row fields (``[L_i]`` token-level or 0-dim row-level tensors).
        dropped: samples lost while producing the rollout (not in it; they count against the
            drop budget).
        sampling: what dynamic sampling did (``None``: it is off). Groups it dropped are not
            "lost": they never count against the drop budget.
        episodes: what multi-turn rollouts did (``None``: single-turn rows).
        worker_restarts: rollout workers the engine replaced since the previous rollout
            (``None``: an engine without workers).
    """

    input_ids: list[torch.Tensor]
    response_mask: list[torch.Tensor]
    gen_logprobs: list[torch.Tensor]
    reward: torch.Tensor
    prompt_index: torch.Tensor
    extras: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    dropped: int = 0
    sampling: SamplingReport | None = None
    episodes: EpisodeReport | None = None
    worker_restarts: int | None = None

    def __len__(self) -> int:
        return len(self.input_ids)

    def columns(self, rows: slice = slice(None)) -> dict[str, list[torch.Tensor]]:
        """Return rows ``rows`` as replay-store columns (``name -> one tensor per row``)."""
        cols: dict[str, list[torch.Tensor]] = {
            INPUT_IDS: self.input_ids[rows],
            RESPONSE_MASK: self.response_mask[rows],
            GEN_LOGPROBS: self.gen_logprobs[rows],
            REWARD: list(self.reward[rows].unbind(0)),
            PROMPT_INDEX: list(self.prompt_index[rows].unbind(0)),
        }
        cols.update({k: list(v[rows]) for k, v in self.extras.items()})
        return cols


@dataclass(frozen=True)
class RowMeta:
    """What a replay store knows about rows without reading their tensors.

    Attributes:
        ids: row ids, in the order asked for.
        lengths: total tokens of each row (prompt + response).
        valid_tokens: number of ``True`` entries of each row's ``response_mask``.
    """

    ids: tuple[int, ...]
    lengths: tuple[int, ...]
    valid_tokens: tuple[int, ...]


@dataclass(frozen=True)
class Normalizers:
    """Global denominators of one optimizer step, known before its first chunk.

    Attributes:
        valid_tokens: valid (masked-in) tokens over every chunk of the step, on every rank.
        valid_rows: rows with at least one valid token over every chunk of the step, every rank.
    """

    valid_tokens: int
    valid_rows: int


@dataclass(frozen=True)
class StepPlan:
    """The chunks one rank trains for one optimizer step.

    Attributes:
        chunks: row ids of each chunk for this rank; an empty tuple is a zero-weight padding
            chunk that keeps every data-parallel rank at the same number of chunks.
        normalizers: global denominators of the step (all chunks, all ranks).
        epoch: the phase epoch this step belongs to.
        minibatch: index of the step inside its epoch.
        padding_fraction: padded-but-empty token slots over all slots of the step's chunks.
    """

    chunks: tuple[tuple[int, ...], ...]
    normalizers: Normalizers
    epoch: int = 0
    minibatch: int = 0
    padding_fraction: float = 0.0

    @property
    def num_chunks(self) -> int:
        """Number of chunks this rank trains (padding chunks included)."""
        return len(self.chunks)


@dataclass
class Chunk:
    """A right-padded slice of replay rows, ready for a forward pass.

    ``B`` rows, ``T`` = longest row of the chunk. Padding positions have ``attention_mask``
    and ``response_mask`` ``False`` and hold 0 in every other field.

    Attributes:
        row_ids: replay ids of the ``B`` rows.
        input_ids: ``int64[B, T]``.
        attention_mask: ``bool[B, T]``; ``True`` on real tokens.
        response_mask: ``bool[B, T]``; ``True`` on trained tokens.
        old_logprobs: ``float[B, T]`` π_old log-probabilities, when scored.
        gen_logprobs: ``float[B, T]`` the engine's sampling log-probabilities, when read.
        ref_logprobs: ``float[B, T]`` reference log-probabilities, when scored.
        values: ``float[B, T]`` critic values at scoring time (the "old" values), when scored.
        advantages: ``float[B, T]`` whitened advantages, when computed.
        returns: ``float[B, T]`` value targets, when computed.
        reward: ``float[B]`` sequence scores, when read.
        extras: any other column read, ``[B, T]`` or ``[B]``.
        is_padding: ``True`` for a zero-weight chunk that exists only to keep ranks in step.
    """

    row_ids: tuple[int, ...]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    gen_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    reward: torch.Tensor | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    is_padding: bool = False

    @property
    def num_valid_tokens(self) -> int:
        """Number of trained tokens in the chunk."""
        return int(self.response_mask.sum())

    @property
    def num_tokens(self) -> int:
        """Number of real (unpadded) tokens in the chunk."""
        return int(self.attention_mask.sum())

    def to(self, device: torch.device | str) -> Chunk:
        """Return a copy with every tensor moved to ``device``."""
        moved = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                v = v.to(device)
            elif isinstance(v, dict):
                v = {k: t.to(device) for k, t in v.items()}
            moved[f.name] = v
        return Chunk(**moved)


@dataclass
class ChunkResult:
    """What one chunk contributed to the open step.

    Attributes:
        trained: the chunk ran forward and backward.
        skipped: the chunk had no valid token and was skipped without a forward pass.
        loss: the chunk's share of the step loss (0.0 when not trained).
        tokens: real tokens in the chunk.
    """

    trained: bool
    skipped: bool
    loss: float
    tokens: int


@dataclass
class StepStats:
    """Statistics of one finished (or skipped) optimizer step.

    Attributes:
        role: ``"actor"`` or ``"critic"``.
        epoch: phase epoch of the step.
        minibatch: index of the step inside its epoch.
        stepped: ``True`` when the optimizer stepped; ``False`` when the grad norm was not finite.
        grad_norm: total gradient norm before clipping (may be ``inf`` / ``nan`` when skipped).
        lr: learning rate used by the step.
        chunks_trained: chunks that ran forward and backward (padding chunks included).
        chunks_skipped: invalid chunks (no valid token) skipped without a forward pass.
        valid_tokens: global valid-token normalizer of the step.
        valid_rows: global valid-row normalizer of the step.
        tokens: real tokens processed on this rank (for throughput).
        metrics: diagnostics, ``name -> float`` (e.g. ``loss``, ``clip_fraction``).
        skip_reason: why the step was not taken (``""`` when ``stepped``).
    """

    role: str
    epoch: int
    minibatch: int
    stepped: bool
    grad_norm: float
    lr: float
    chunks_trained: int
    chunks_skipped: int
    valid_tokens: int
    valid_rows: int
    tokens: int
    metrics: dict[str, float] = field(default_factory=dict)
    skip_reason: str = ""


@dataclass
class RolloutStats:
    """An iteration's rollout statistics, over every rank's rows (logged as ``rollout/<name>``).

    Every field is a float; NaN when the iteration did not measure it (a failed iteration
    measures nothing).

    Attributes:
        reward_mean: mean reward of the samples (finite rewards, as the task gave them).
        reward_std: their population standard deviation.
        response_length_mean: mean response tokens per sample (as generated).
        invalid_rows: rows with no valid response token (never trained on).
        dropped_rows: samples lost before reaching the store.
        bad_rewards: rows whose reward was non-finite or out of bounds.
        kl_mean: mean per-token KL to the reference (estimators that report it).
        mismatch_kl: engine/trainer mismatch ``KL(μ‖π_old)`` per sampled token.
        mismatch_max_abs_log_ratio: ``max |log π_old − log μ|``.
        mismatch_outside_fraction: sampled tokens whose importance weight lies outside the
            off-policy correction's bounds.
        staleness: policy versions between the rows' sampling policy and π_old
            (:class:`GenerationReport`).
        extra: what the estimator and the reward model report besides (e.g.
            ``advantage_abs_mean``, ``rm_score_mean``), and with dynamic sampling the counts of
            :class:`SamplingReport` over every rank (``uniform_groups``, ``surplus_groups``,
            ``short_groups``, ``refills``); with multi-turn rollouts the
            :meth:`EpisodeReport.metrics` (``turns_per_episode``, ``tool_calls_per_episode``,
            ...).
    """

    reward_mean: float = math.nan
    reward_std: float = math.nan
    response_length_mean: float = math.nan
    invalid_rows: float = math.nan
    dropped_rows: float = math.nan
    bad_rewards: float = math.nan
    kl_mean: float = math.nan
    mismatch_kl: float = math.nan
    mismatch_max_abs_log_ratio: float = math.nan
    mismatch_outside_fraction: float = math.nan
    staleness: float = math.nan
    extra: dict[str, float] = field(default_factory=dict)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The typed statistics, in order (always logged, NaN when not measured)."""
        return tuple(f.name for f in fields(cls) if f.name != "extra")

    def update(self, metrics: Mapping[str, float]) -> None:
        """Take ``metrics``: a typed statistic by its name, anything else into :attr:`extra`."""
        typed = self.names()
        for name, value in metrics.items():
            if name in typed:
                setattr(self, name, float(value))
            else:
                self.extra[name] = float(value)

    def as_dict(self) -> dict[str, float]:
        """Every typed statistic, then the extras: ``name -> value``."""
        return {**{name: getattr(self, name) for name in self.names()}, **self.extra}


@dataclass
class GenerationReport:
    """How an iteration's rollout was generated: its lag, and the timing of the overlap.

    Attributes:
        staleness: policy versions published between the version the rows were sampled from
            and π_old (``model.rollout.max_staleness`` by construction, less during critic
            warm-up, where the version does not advance).
        wait_seconds: the trainer waited for the rollout (and put it into the store).
        generation_seconds: the generator sampled and rewarded it.
        overlap_seconds: of those, the seconds that ran while the trainer did other work.
        generator_idle_seconds: the generator waited for this job to be admitted.
    """

    staleness: int = 0
    wait_seconds: float = 0.0
    generation_seconds: float = 0.0
    overlap_seconds: float = 0.0
    generator_idle_seconds: float = 0.0

    def timing(self) -> dict[str, float]:
        """The seconds, by name (``wait``, ``generation``, ``overlap``, ``generator_idle``)."""
        return {
            "wait": self.wait_seconds,
            "generation": self.generation_seconds,
            "overlap": self.overlap_seconds,
            "generator_idle": self.generator_idle_seconds,
        }


@dataclass
class IterationResult:
    """What one RL iteration did; handed to ``on_iteration_end`` and returned by the controller.

    Attributes:
        iteration: RL iteration index.
        rollout: the rollout statistics (what the advantage estimator and the reward model
            report among its extras).
        steps: stats of every critic and actor step, in order.
        seconds: wall time per phase (``rollout``, ``collect``, ``score``, ``advantages``,
            ``critic``, ``actor``).
        tokens: real tokens processed per phase (``rollout``: response tokens generated).
        padding: padded-but-empty fraction of the token slots per chunked phase (``score``,
            ``critic``, ``actor``; the planner's ``padding_fraction``, mean over epochs).
        failed: the error of a failed iteration (``""``: it ran); a failed iteration still
            reaches ``on_iteration_end``, with no statistics and no steps.
        generation: seconds of the rollout's generation (logged as ``perf/generation/<k>``;
            see :meth:`GenerationReport.timing`).
    """

    iteration: int
    rollout: RolloutStats
    steps: list[StepStats]
    seconds: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    padding: dict[str, float] = field(default_factory=dict)
    failed: str = ""
    generation: dict[str, float] = field(default_factory=dict)

    def phase_steps(self, role: str) -> list[StepStats]:
        """Steps of ``role`` (``actor`` or ``critic``)."""
        return [s for s in self.steps if s.role == role]


def iteration_number(iteration: int) -> int:
    """The number of the iteration with 0-based index ``iteration``, as lppo shows it.

    Every message and every file (``metrics.csv``, wandb, ``summary.json``, the reward curve)
    counts iterations from 1; 0 is "before the first iteration" (an evaluation of the initial
    policy). Trainer epochs and ``IterationResult.iteration`` stay 0-based.
    """
    return iteration + 1


def iteration_label(iteration: int) -> str:
    """``iteration k`` for the 0-based index ``k - 1`` (:func:`iteration_number`).

    Errors, warnings and the progress output all name iterations through this function, so
    the iteration an error names is the one the progress line showed.
    """
    return f"iteration {iteration_number(iteration)}"
