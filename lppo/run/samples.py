"""A sample of an iteration's rows, read back from the replay store as typed records.

:class:`~lppo.callbacks.RolloutSamples` writes these records to ``<run dir>/samples/``. A
record is what the store holds for the row at the end of the iteration, before the rows are
released: the tokens, the rollout's columns (``gen_logprobs``, ``reward``, ``prompt_index``)
and what the iteration added (π_old, the reference's log-probs, the critic's old values,
advantages and targets, a multi-turn row's ``turn_rewards``). Nothing is recomputed: no forward
pass runs, so the per-token entropy of the policy (which no column holds) is not in a record.

Row layout (:mod:`lppo.types`): the prompt's tokens, then the rest; ``response_mask`` is true on
the tokens the policy generated and is trained on, so the prompt ends at the first of them, and
a multi-turn row's other tokens after it are the environment's observations. A row made invalid
when it was put (a rejected reward, a masked overlong row) has no response token: there the
engine's log-probabilities, non-zero exactly on sampled tokens, tell the policy's tokens apart.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lppo.replay.base import ReplayStore
from lppo.types import (
    ADVANTAGES,
    GEN_LOGPROBS,
    INPUT_IDS,
    OLD_LOGPROBS,
    POLICY_VERSION,
    PROMPT_INDEX,
    REF_LOGPROBS,
    RESPONSE_MASK,
    RETURNS,
    REWARD,
    RM_SCORE,
    TASK_REWARD,
    TEACHER_LOGPROBS,
    TURN_REWARDS,
    VALUES,
)

__all__ = ["SampleRow", "SampleToken", "SampleTurn", "choose_rows", "read_samples"]

#: Columns every row has (the rollout puts them).
_ROW_COLUMNS = (INPUT_IDS, RESPONSE_MASK, GEN_LOGPROBS, REWARD, PROMPT_INDEX)
#: Token-level columns a run may lack (no critic, no reference, not yet written, single turn).
_TOKEN_COLUMNS = (
    OLD_LOGPROBS, REF_LOGPROBS, TEACHER_LOGPROBS, VALUES, ADVANTAGES, RETURNS, TURN_REWARDS
)  # fmt: skip
#: Row-level columns a run may lack (no reward model, no provenance).
_SCALAR_COLUMNS = (TASK_REWARD, RM_SCORE, POLICY_VERSION)
#: Rows whose prompt index is read at a time while looking for distinct prompts.
_SCAN_BLOCK = 256


@dataclass(frozen=True)
class SampleToken:
    """One token of a sampled row, from the first token after the prompt on.

    Log-probabilities are natural logarithms at the sampling temperature, as stored. A field
    is ``None`` where the run has no such column or it means nothing for the token (no
    log-probability on an observation, no advantage on a token the loss does not weigh).

    Attributes:
        position: the token's index in the row (``input_ids[position]``).
        id: the token id.
        text: the token decoded after the token before it (so a leading space shows);
            special tokens kept.
        policy: the policy generated it (``False``: a multi-turn row's observation token).
        trained: on the response mask, so the loss weighs it (not on an invalid row).
        gen_logprob: the engine's log-probability when sampling it (μ; ``gen_logprobs``).
        old_logprob: π_old, the trainer's log-probability before the update (``old_logprobs``).
        ref_logprob: the reference policy's (``ref_logprobs``; runs with a KL term).
        teacher_logprob: the teacher's (``teacher_logprobs``; on-policy distillation).
        value: the critic's value before the token (``values``; runs with a critic).
        advantage: the advantage the actor trained on (``advantages``, whitened if so set).
        value_target: the critic's target (``returns``; runs with a critic).
        mismatch: ``old_logprob − gen_logprob``, the score phase's ``d = log π_old − log μ``
            (``rollout/mismatch_max_abs_log_ratio`` is its largest magnitude).
        turn_reward: a multi-turn row's turn reward, on the turn's last token (0 elsewhere);
            ``None`` on single-turn rows.
    """

    position: int
    id: int
    text: str
    policy: bool
    trained: bool
    gen_logprob: float | None = None
    old_logprob: float | None = None
    ref_logprob: float | None = None
    teacher_logprob: float | None = None
    value: float | None = None
    advantage: float | None = None
    value_target: float | None = None
    mismatch: float | None = None
    turn_reward: float | None = None


@dataclass(frozen=True)
class SampleTurn:
    """A stretch of a multi-turn row: one policy turn, or the observation that followed it.

    Attributes:
        kind: ``policy`` (the policy's turn, a tool call included) or ``observation`` (what the
            environment appended: a tool's output, the template's turn markers).
        start: position of its first token in the row.
        end: position after its last token.
        text: its tokens decoded, special tokens kept.
        reward: the sum of ``turn_rewards`` over its tokens (a turn's own reward).
    """

    kind: str
    start: int
    end: int
    text: str
    reward: float


@dataclass
class SampleRow:
    """One sampled row of an iteration: one line of ``samples/iteration-NNNN.jsonl``.

    Attributes:
        iteration: the iteration's number, counted from 1 (as the console and metrics count).
        row_id: the row's id in the replay store of global rank zero.
        prompt_index: which prompt of the iteration's batch it answers.
        prompt: the prompt's tokens decoded as the model saw them (special tokens kept).
        completion: every token after the prompt decoded as the task's verifier saw a
            single-turn answer (special tokens skipped); a multi-turn row's turns and
            observations together.
        reward: the row's reward as trained on (after penalties; 0 on an invalid row).
        valid: it has trained tokens (``False``: its reward was rejected or it was masked).
        response_tokens: tokens the policy generated.
        trained_tokens: tokens on the response mask.
        observation_tokens: tokens after the prompt the policy did not generate.
        advantage_mean: mean advantage over the trained tokens (``None``: none or no column).
        max_abs_mismatch: largest ``|mismatch|`` over the policy's tokens (``None``: unknown).
        task_reward: the task's own reward, with a learned reward model in the run.
        rm_score: the reward model's raw score, with one in the run.
        policy_version: the policy version that sampled it, when recorded.
        turns: a multi-turn row's policy turns and observations, in order; empty otherwise.
        tokens: one record per token after the prompt, at most ``max_tokens`` of them.
        tokens_omitted: tokens after the listed ones, cut by the size bound.
    """

    iteration: int
    row_id: int
    prompt_index: int
    prompt: str
    completion: str
    reward: float
    valid: bool
    response_tokens: int
    trained_tokens: int
    observation_tokens: int
    advantage_mean: float | None = None
    max_abs_mismatch: float | None = None
    task_reward: float | None = None
    rm_score: float | None = None
    policy_version: int | None = None
    turns: list[SampleTurn] = field(default_factory=list)
    tokens: list[SampleToken] = field(default_factory=list)
    tokens_omitted: int = 0

    def to_json(self) -> dict[str, Any]:
        """The record as JSON-ready values (nested records as objects).

        Field by field: ``dataclasses.asdict`` deep-copies every value, several times slower
        for a row of a few hundred tokens.
        """
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["turns"] = [dict(vars(turn)) for turn in self.turns]
        out["tokens"] = [dict(vars(token)) for token in self.tokens]
        return out


def choose_rows(store: ReplayStore, row_ids: Sequence[int], n: int) -> tuple[int, ...]:
    """The ``n`` rows to sample: the first row of each prompt, in sample order, then the rest.

    Deterministic (no clock, no random draw): the same rows of the same iteration are chosen
    on a rerun. Only the prompt index of the rows scanned is read, in blocks, until ``n``
    distinct prompts are found.

    Args:
        store: the replay store holding the rows.
        row_ids: the iteration's rows, in sample order.
        n: how many to choose.
    """
    if n <= 0 or not row_ids:
        return ()
    first: list[int] = []
    seen: set[int] = set()
    for start in range(0, len(row_ids), _SCAN_BLOCK):
        block = list(row_ids[start : start + _SCAN_BLOCK])
        for row, index in zip(block, store.read(block, [PROMPT_INDEX])[PROMPT_INDEX], strict=True):
            if int(index) not in seen:
                seen.add(int(index))
                first.append(row)
        if len(first) >= n:
            return tuple(first[:n])
    chosen = set(first)
    return tuple([*first, *(r for r in row_ids if r not in chosen)][:n])


def read_samples(
    store: ReplayStore,
    ids: Sequence[int],
    tokenizer: Any,
    iteration: int,
    max_tokens: int,
) -> list[SampleRow]:
    """The records of rows ``ids``, read from ``store``.

    Args:
        store: the replay store (the rows must still be live).
        ids: the rows, from :func:`choose_rows`.
        tokenizer: decodes the tokens (``None``: token ids as text).
        iteration: the iteration's number, counted from 1.
        max_tokens: most token records per row (0: none, the row's texts only).
    """
    if not ids:
        return []
    ids = list(ids)
    columns = store.read(ids, list(_ROW_COLUMNS))
    optional = {
        name: _read_optional(store, ids, name) for name in (*_TOKEN_COLUMNS, *_SCALAR_COLUMNS)
    }
    rows = []
    for k, row_id in enumerate(ids):
        own = {name: values[k] for name, values in columns.items()}
        own |= {name: values[k] for name, values in optional.items() if values[k] is not None}
        rows.append(_record(own, row_id, iteration, tokenizer, max_tokens))
    return rows


def _read_optional(store: ReplayStore, ids: list[int], name: str) -> list[torch.Tensor | None]:
    """Column ``name`` of each row of ``ids``; ``None`` for a row that lacks it."""
    try:
        return list(store.read(ids, [name])[name])
    except KeyError:
        pass
    out: list[torch.Tensor | None] = []
    for row in ids:  # some rows have it (a row another rank trained has no advantages here)
        try:
            out.append(store.read([row], [name])[name][0])
        except KeyError:
            out.append(None)
    return out


def _record(
    row: dict[str, torch.Tensor], row_id: int, iteration: int, tokenizer: Any, max_tokens: int
) -> SampleRow:
    """One row's record from its columns (``name -> tensor``, the row's own)."""
    ids = [int(i) for i in row[INPUT_IDS].tolist()]
    trained = row[RESPONSE_MASK].bool()
    # An invalid row's mask is empty: the engine's log-probs still mark the sampled tokens.
    policy = trained if bool(trained.any()) else row[GEN_LOGPROBS] != 0
    start = int(policy.nonzero()[0, 0]) if bool(policy.any()) else len(ids)
    multi_turn = TURN_REWARDS in row
    values = {name: row[name].double() for name in _TOKEN_COLUMNS if name in row}
    values[GEN_LOGPROBS] = row[GEN_LOGPROBS].double()
    shown = min(len(ids) - start, max_tokens)
    tokens = _tokens(ids, start, start + shown, policy, trained, values, tokenizer)
    advantages = values[ADVANTAGES][trained] if ADVANTAGES in values else None
    has_advantages = advantages is not None and advantages.numel() > 0
    return SampleRow(
        iteration=iteration,
        row_id=int(row_id),
        prompt_index=int(row[PROMPT_INDEX]),
        prompt=_decode(tokenizer, ids[:start], skip_special=False),
        completion=_decode(tokenizer, ids[start:], skip_special=True),
        reward=_num(row[REWARD]) or 0.0,
        valid=bool(trained.any()),
        response_tokens=int(policy.sum()),
        trained_tokens=int(trained.sum()),
        observation_tokens=len(ids) - start - int(policy.sum()),
        advantage_mean=_num(advantages.mean()) if has_advantages else None,
        max_abs_mismatch=_max_abs_mismatch(values, policy),
        task_reward=_num(row[TASK_REWARD]) if TASK_REWARD in row else None,
        rm_score=_num(row[RM_SCORE]) if RM_SCORE in row else None,
        policy_version=int(row[POLICY_VERSION]) if POLICY_VERSION in row else None,
        turns=_turns(ids, start, policy, values.get(TURN_REWARDS), tokenizer) if multi_turn else [],
        tokens=tokens,
        tokens_omitted=len(ids) - start - shown,
    )


def _tokens(
    ids: list[int],
    start: int,
    end: int,
    policy: torch.Tensor,
    trained: torch.Tensor,
    values: dict[str, torch.Tensor],
    tokenizer: Any,
) -> list[SampleToken]:
    """The token records of positions ``start..end`` of a row."""
    texts = _token_texts(tokenizer, ids, start, end)

    def at(name: str, t: int, keep: bool) -> float | None:
        column = values.get(name)
        return _num(column[t]) if keep and column is not None else None

    out = []
    for t, text in zip(range(start, end), texts, strict=True):
        sampled, weighed = bool(policy[t]), bool(trained[t])
        exact = sampled and OLD_LOGPROBS in values  # the difference of the stored values
        out.append(
            SampleToken(
                position=t,
                id=ids[t],
                text=text,
                policy=sampled,
                trained=weighed,
                gen_logprob=at(GEN_LOGPROBS, t, sampled),
                old_logprob=at(OLD_LOGPROBS, t, sampled),
                ref_logprob=at(REF_LOGPROBS, t, sampled),
                teacher_logprob=at(TEACHER_LOGPROBS, t, sampled),
                value=at(VALUES, t, weighed),
                advantage=at(ADVANTAGES, t, weighed),
                value_target=at(RETURNS, t, weighed),
                mismatch=_num(values[OLD_LOGPROBS][t] - values[GEN_LOGPROBS][t]) if exact else None,
                turn_reward=at(TURN_REWARDS, t, True),
            )
        )
    return out


def _max_abs_mismatch(values: dict[str, torch.Tensor], policy: torch.Tensor) -> float | None:
    """Largest ``|π_old − μ|`` over every policy token of the row (listed or not)."""
    if OLD_LOGPROBS not in values or not bool(policy.any()):
        return None
    d = (values[OLD_LOGPROBS] - values[GEN_LOGPROBS])[policy]
    return _num(d.abs().max())


def _turns(
    ids: list[int], start: int, policy: torch.Tensor, rewards: torch.Tensor | None, tokenizer: Any
) -> list[SampleTurn]:
    """The row's stretches after the prompt: policy turns and observations, in order."""
    turns = []
    t = start
    while t < len(ids):
        kind = bool(policy[t])
        end = t
        while end < len(ids) and bool(policy[end]) == kind:
            end += 1
        reward = float(rewards[t:end].sum()) if rewards is not None else 0.0
        turns.append(
            SampleTurn(
                kind="policy" if kind else "observation",
                start=t,
                end=end,
                text=_decode(tokenizer, ids[t:end], skip_special=False),
                reward=_num(reward) or 0.0,
            )
        )
        t = end
    return turns


def _token_texts(tokenizer: Any, ids: list[int], start: int, end: int) -> list[str]:
    """The text of each token of ``ids[start:end]``, decoded after the token before it.

    A token decoded alone loses what depends on its neighbour (SentencePiece drops a word's
    leading space at the start of a text): decoding it after the token before and removing
    that token's own text keeps it. Where the two texts do not line up, the lone decoding.
    """
    if tokenizer is None:
        return [str(i) for i in ids[start:end]]
    heads = [ids[t - 1 : t] for t in range(start, end)]
    pairs = [[*head, ids[t]] for head, t in zip(heads, range(start, end), strict=True)]
    kw = {"skip_special_tokens": False, "clean_up_tokenization_spaces": False}
    before = tokenizer.batch_decode(heads, **kw)
    both = tokenizer.batch_decode(pairs, **kw)
    out = []
    for t, head, full in zip(range(start, end), before, both, strict=True):
        out.append(full[len(head) :] if full.startswith(head) else tokenizer.decode([ids[t]], **kw))
    return out


def _decode(tokenizer: Any, ids: list[int], skip_special: bool) -> str:
    """``ids`` as text (token ids joined by spaces without a tokenizer)."""
    if tokenizer is None:
        return " ".join(str(i) for i in ids)
    return str(
        tokenizer.decode(ids, skip_special_tokens=skip_special, clean_up_tokenization_spaces=False)
    )


def _num(value: torch.Tensor | float) -> float | None:
    """A stored number for JSON: 6 significant digits, ``None`` when not finite."""
    number = float(value)
    return float(f"{number:.6g}") if math.isfinite(number) else None
