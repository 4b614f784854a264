"""``DataSettings``: the ``data:`` group's settings, validated when built, and its run checks.

One owner validates the data group: :class:`DataSettings` checks every setting on its own when
it is built (so a bad value stops the run before any model exists), and
:meth:`DataSettings.check_run` checks what only setup knows (data-parallel size and rank, the
longest possible row, rows per iteration, minibatches) against those settings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from lppo.validation import SettingError, check_number

#: ``max_tokens_per_score_chunk: auto`` is this many training budgets. A training chunk keeps
#: every layer's activations (and the logits' gradient) for its backward pass, a no-grad pass
#: only the layer it is in and the logits, so four times the tokens stays within about the
#: training chunk's memory for a language model, and runs in fewer, larger matrix products.
SCORE_CHUNK_FACTOR = 4


@dataclass(frozen=True)
class DataSettings:
    """Settings of the replay-backed data module and its chunk planner.

    Attributes:
        max_tokens_per_chunk: padded-token budget of one chunk (``rows × longest row``); the
            knob that bounds activation memory.
        max_tokens_per_score_chunk: padded-token budget of one chunk of the no-grad (score)
            passes, which keep no activations, so larger chunks are cheap in memory and faster;
            ``None``: ``max_tokens_per_chunk``; ``"auto"`` (the default):
            :data:`SCORE_CHUNK_FACTOR` × ``max_tokens_per_chunk``.
        drop_budget: samples that may be lost per iteration (invalid rows, rollout failures)
            before the iteration fails.
        fixed_rows_per_rank: every data-parallel rank trains the same number of rows per step
            (engines with fixed micro-batch shapes); requires ``drop_budget=0``.
        shuffle: shuffle rows every epoch (``False`` keeps the iteration's sample order).
        seed: base seed of the per-epoch shuffles.
        balance_ranks: after each rollout, move rows between data-parallel ranks so each
            holds about the same number of tokens (:mod:`lppo.iteration.balance`; exact: every step
            trains the same rows, some on another rank). Not applied with
            ``fixed_rows_per_rank``, which fixes each rank's row count.
        share_prompts: in every forward over a chunk (actor, reference, critic; scoring and
            training), rows that answer the same prompt compute it once
            (:mod:`lppo.modules.shared`), and chunks keep the iteration's sample order, so a
            prompt's samples share chunks. The same results to round-off, less work.
            ``auto`` (the default): on where every model of the run supports it and prompts
            are long enough for it to pay, off with a line in the run plan naming the reason.
    """

    #: The score phase's chunking is a speed knob (the planner is built at setup, so a resumed
    #: run uses the new budget; the scores are the same up to float round-off).
    resume_safe: ClassVar[tuple[str, ...]] = ("max_tokens_per_score_chunk", "share_prompts")

    max_tokens_per_chunk: int = 4096
    max_tokens_per_score_chunk: int | Literal["auto"] | None = "auto"
    drop_budget: int = 0
    fixed_rows_per_rank: bool = False
    shuffle: bool = True
    seed: int = 0
    balance_ranks: bool = True
    share_prompts: bool | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        """Raise ``SettingError`` naming the key, the value and the fix."""
        if not isinstance(self.share_prompts, bool) and self.share_prompts != "auto":
            raise SettingError(
                f"data.share_prompts={self.share_prompts!r}; use auto (the default), true or false."
            )
        if self.max_tokens_per_score_chunk != "auto":
            check_number(
                "data.max_tokens_per_score_chunk",
                self.max_tokens_per_score_chunk,
                integer=True,
                low=1,
                optional=True,
                fix="null: the training budget, data.max_tokens_per_chunk; auto: "
                f"{SCORE_CHUNK_FACTOR} x that.",
            )
        check_number(
            "data.max_tokens_per_chunk",
            self.max_tokens_per_chunk,
            integer=True,
            low=1,
            fix="Set it to at least the longest row (prompt + max_new_tokens).",
        )
        check_number("data.drop_budget", self.drop_budget, integer=True, low=0)
        check_number("data.seed", self.seed, integer=True, low=0)
        if self.fixed_rows_per_rank and self.drop_budget > 0:
            raise SettingError(
                f"data.drop_budget={self.drop_budget} with data.fixed_rows_per_rank=true: "
                "dropping any sample can leave a row count that no longer divides evenly over "
                "the data-parallel ranks and minibatches. Set data.drop_budget=0, or "
                "data.fixed_rows_per_rank=false (token-budget chunks with zero-weight "
                "padding keep normalization exact whatever is dropped)."
            )

    @property
    def score_budget(self) -> int:
        """Padded-token budget of a no-grad chunk (``max_tokens_per_score_chunk`` resolved)."""
        score = self.max_tokens_per_score_chunk
        if score == "auto":
            return SCORE_CHUNK_FACTOR * self.max_tokens_per_chunk
        return score or self.max_tokens_per_chunk

    def check_run(
        self,
        world_size: int = 1,
        rank: int = 0,
        max_row_length: int | None = None,
        rows_per_iteration: int | None = None,
        minibatches: int = 1,
    ) -> None:
        """Check these settings against the run's shape, known at setup.

        Args:
            world_size: data-parallel size.
            rank: this process's data-parallel rank.
            max_row_length: longest row the configuration can produce (prompt + new tokens);
                ``None``: unknown (each plan checks its rows instead).
            rows_per_iteration: rows each iteration puts into the store, when known.
            minibatches: the most optimizer steps per epoch any phase will ask for.

        Raises:
            SettingError: naming the keys, the values and the fix.
            ValueError: an inconsistent rank / world size or minibatch count (a caller's bug).
        """
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"data-parallel rank={rank} world_size={world_size} is inconsistent; "
                "need world_size >= 1 and 0 <= rank < world_size."
            )
        if minibatches < 1:
            raise ValueError(f"minibatches={minibatches} must be >= 1.")
        if max_row_length is not None:
            self._check_row_length(max_row_length)
        per_step = world_size * minibatches
        if (
            self.fixed_rows_per_rank
            and rows_per_iteration is not None
            and rows_per_iteration % per_step != 0
        ):
            raise SettingError(
                f"rows per iteration = model.rollout.prompts_per_iteration x "
                f"model.rollout.samples_per_prompt = {rows_per_iteration} is not divisible by "
                f"data-parallel ranks x minibatches (model.ppo.*_minibatches) = {world_size} x "
                f"{minibatches} = {per_step} while data.fixed_rows_per_rank=true; make the "
                f"rows per iteration a multiple of {per_step}, or set "
                "data.fixed_rows_per_rank=false."
            )

    def _check_row_length(self, max_row_length: int) -> None:
        """Both chunk budgets must hold the longest row the configuration can produce."""
        score = self.max_tokens_per_score_chunk
        if isinstance(score, int) and max_row_length > score:
            raise SettingError(
                f"data.max_tokens_per_score_chunk={score} is below the longest possible "
                f"row ({max_row_length} tokens); raise it to at least that, or set it to "
                "null (the training budget, data.max_tokens_per_chunk)."
            )
        if self.max_tokens_per_chunk < max_row_length:
            raise SettingError(
                f"data.max_tokens_per_chunk={self.max_tokens_per_chunk} is below the longest "
                f"possible row ({max_row_length} tokens = prompt + max_new_tokens); raise "
                f"data.max_tokens_per_chunk to at least {max_row_length}, or shorten prompts / "
                "max_new_tokens."
            )
