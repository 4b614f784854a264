"""Shared prompts: the rows of a chunk that answer one prompt compute that prompt once.

GRPO's ``G`` samples of a prompt repeat its tokens ``G`` times in every forward over the chunk
(the score passes and the actor's training pass). :func:`pack_shared` splits a chunk's rows:
each *group* (rows whose tokens before their first response token are equal: a prompt's
samples, a multi-turn row's first prompt) keeps its prompt once, and every row keeps its *rest*
(the response, and for multi-turn rows the later turns). :meth:`SharedPack.forward` runs the
model twice:

1. the prompts, ``[groups, P]``, keeping their keys and values (``use_cache``);
2. the rests, ``[rows, R]``, each against its group's keys and values (the cache's batch
   re-indexed by group) under a 2-D mask of the group's prompt and the row itself, with the
   row's own position ids (``P_b …``),

so every position sees the keys and values it sees in its own row (same tokens, same positions)
and its output is the same to round-off; in the actor's backward the gradients that reach a
prompt's keys and values from its rows add up there and flow back through the prompt's single
forward. :meth:`SharedPack.take` reads both outputs back into the chunk's ``[B, T]`` layout
(an index gather), so everything after the forward is unchanged. The prompt's last position
predicts each row's first response token.

Where nothing is shared, or the two passes would hold more tokens than the chunk's rows
(``groups × P + rows × R > rows × T``), the chunk runs as it is (:func:`pack_shared` returns
``None``): ``data.max_tokens_per_chunk`` still bounds memory.

Supported: Hugging Face ``llama``, ``mistral``, ``qwen2``, ``qwen3`` and ``gpt2`` models
without sliding-window attention, attention ``sdpa`` or ``eager``, no gradient checkpointing
(:func:`unshareable` checks). ``data.share_prompts`` decides for the run
(:func:`resolve_share_prompts`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from transformers import DynamicCache

from lppo.decisions import note
from lppo.modules.models import attention_obstacle, cache_keyword
from lppo.validation import SettingError

#: ``data.share_prompts``: on, off, or ``auto`` (on where every model supports it and it pays).
ShareSetting = bool | Literal["auto"]

#: ``config.model_type`` values whose forward takes a cache, a 2-D mask and position ids.
SHAREABLE = ("llama", "mistral", "qwen2", "qwen3", "gpt2")

KEY = "data.share_prompts"

#: ``auto`` shares only where prompts can be this long (the task's longest, in characters:
#: about 128 tokens). Below it the second pass and the packing cost more than the prompt tokens
#: save (``bench/real_vocab.py``, 2026-12-07: 1.03-1.04 x the per-row time with 32-token prompts,
#: 0.71-1.00 x with 256-token ones; the tiny default run 1.4 x).
AUTO_MIN_PROMPT_CHARS = 512


def unshareable(model: nn.Module) -> str | None:
    """Why ``model`` (a Hugging Face model, possibly PEFT-wrapped) cannot share prompts."""
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    if (reason := attention_obstacle(getattr(hf, "config", None), SHAREABLE)) is not None:
        return reason
    name = "is_activation_checkpointing"  # transformers >= 5.x; older: is_gradient_checkpointing
    if getattr(hf, name if hasattr(hf, name) else "is_gradient_checkpointing", False):
        return "gradient checkpointing drops the prompt's keys and values (no cache)"
    return None


def float32_inside(module: nn.Module) -> str | None:
    """Why sharing would not be exact to a float64 ``module``'s round-off (``None``: it would).

    Hugging Face's RMSNorms (Llama, Mistral, Qwen) compute in float32 whatever the model's
    dtype. Per row, each row's share of a prompt's gradient passes that float32 step and the
    shares are summed in float64 afterwards; shared, their sum passes it once, so a float64
    run would agree with the per-row one to float32 round-off only. In float32 and below that
    is the run's own round-off.
    """
    for sub in module.modules():
        kind = type(sub)
        if kind.__name__.endswith("RMSNorm") and kind.__module__.startswith("transformers."):
            weight = getattr(sub, "weight", None)
            if weight is not None and weight.dtype == torch.float64:
                return (
                    f"in float64, Hugging Face's {kind.__name__} computes in float32, so a "
                    "shared prompt's gradient would round at float32"
                )
    return None


def resolve_share_prompts(
    setting: ShareSetting,
    reasons: dict[str, str | None],
    inexact: dict[str, str | None] | None = None,
) -> bool:
    """``data.share_prompts`` decided once for the run's models.

    Args:
        setting: the data group's ``share_prompts``.
        reasons: per model that runs over chunks (``model.actor`` …), why it cannot share
            (``None``: it can).
        inexact: why sharing would not be exact to the run's round-off
            (:func:`float32_inside`) or would not pay: ``auto`` stays off, ``true`` is taken as
            asked.

    Raises:
        SettingError: ``true`` where a model cannot share, naming it and the fix.
    """
    if setting is False:
        note(KEY, "off", setting="false")
        return False
    against = [f"{who}: {why}" for who, why in reasons.items() if why is not None]
    if setting is True and against:
        raise SettingError(f"{KEY}=true: {'; '.join(against)}; set {KEY}: false (or auto).")
    if setting == "auto":
        against += [f"{who}: {why}" for who, why in (inexact or {}).items() if why is not None]
    if not against:
        note(KEY, "on", setting=str(setting).lower())
        return True
    note(KEY, "off", "; ".join(against))
    return False


def decide(
    setting: ShareSetting,
    modules: Sequence[Any],
    prompt_chars: int | None = None,
    samples_per_prompt: int = 2,
) -> bool:
    """Decide ``data.share_prompts`` for the run's modules and set it on each of them.

    Args:
        setting: the data group's ``share_prompts``.
        modules: the actor, critic and reference (``None`` or modules without an
            ``unshareable()`` are skipped: an adapter-free reference runs the actor's forward).
        prompt_chars: the task's longest prompt in characters (``None``: unknown); ``auto``
            stays off below :data:`AUTO_MIN_PROMPT_CHARS`.
        samples_per_prompt: ``model.rollout.samples_per_prompt``; ``auto`` stays off at 1.
    """
    present = [m for m in modules if m is not None and hasattr(m, "unshareable")]
    reasons = {m.config_key.removesuffix(".init_args"): m.unshareable() for m in present}
    sharded = {
        type(m.parallel.layout).__name__ for m in present if m.parallel.layout.shards_weights()
    }
    if sharded:  # every rank must issue the same all-gathers per chunk
        reasons["trainer.strategy"] = (
            f"under {', '.join(sorted(sharded))}, which shards the weights, a chunk that shares "
            "runs two forwards (two all-gathers per block) while another rank's may run one"
        )
    inexact = {m.config_key.removesuffix(".init_args"): float32_inside(m) for m in present}
    if samples_per_prompt < 2:
        inexact["model.rollout.samples_per_prompt"] = "1: no two rows share a prompt"
    elif prompt_chars is not None and prompt_chars < AUTO_MIN_PROMPT_CHARS:
        inexact["model.task"] = (
            f"prompts of at most {prompt_chars} characters; sharing pays from about "
            f"{AUTO_MIN_PROMPT_CHARS} (set data.share_prompts: true to share anyway)"
        )
    share = resolve_share_prompts(setting, reasons, inexact)
    for module in present:
        module.share_prompts = share
    return share


@dataclass(frozen=True)
class SharedPack:
    """A chunk's ``B`` rows (width ``T``) as ``G`` prompts and ``B`` rests.

    Attributes:
        prompts: ``int64[G, P]``, each group's prompt, right-padded (``P``: the longest).
        prompt_mask: ``bool[G, P]``.
        rests: ``int64[B, R]``, each row's tokens after its prompt, right-padded.
        rest_mask: ``bool[B, R]``.
        group: ``int64[B]``, each row's group.
        starts: ``int64[B]``, each row's prompt length (its first response position).
        index: ``int64[B, T]``, where each chunk position is in the two passes' outputs
            flattened and concatenated (``G·P`` prompt positions, then ``B·R``); a padding
            position points at its row's last token.
    """

    prompts: torch.Tensor
    prompt_mask: torch.Tensor
    rests: torch.Tensor
    rest_mask: torch.Tensor
    group: torch.Tensor
    starts: torch.Tensor
    index: torch.Tensor

    def forward(
        self,
        model: nn.Module,
        heads: tuple[AbstractContextManager[Any], AbstractContextManager[Any]] | None = None,
        **kwargs: Any,
    ) -> tuple[Any, Any]:
        """``model``'s outputs over the prompts, then over the rests against their keys and values.

        Args:
            model: a Hugging Face model (causal LM or base model; PEFT-wrapped or not).
            heads: context managers entered around the first and the second pass (the
                vocabulary-sliced head of each, :func:`~lppo.modules.vocab.sliced_head`).
            **kwargs: more keyword arguments of both calls (``output_hidden_states``).
        """
        first_head, rest_head = heads or (nullcontext(), nullcontext())
        device = next(model.parameters()).device
        move = {n: getattr(self, n).to(device) for n in ("prompts", "prompt_mask", "rests")}
        group = self.group.to(device)
        hf = model.get_base_model() if hasattr(model, "get_base_model") else model
        cache = DynamicCache(config=hf.config)
        keyword = cache_keyword(hf)
        with first_head:
            first = model(
                input_ids=move["prompts"],
                attention_mask=move["prompt_mask"].long(),
                use_cache=True,
                **{keyword: cache},
                **kwargs,
            )
        cache.reorder_cache(group)  # each row gets its group's keys and values (a gather)
        mask = torch.cat([move["prompt_mask"][group], self.rest_mask.to(device)], dim=1)
        positions = self.starts.to(device)[:, None] + torch.arange(
            self.rests.shape[1], device=device
        )
        with rest_head:
            rest = model(
                input_ids=move["rests"],
                attention_mask=mask.long(),
                position_ids=positions,
                use_cache=True,
                **{keyword: cache},
                **kwargs,
            )
        return first, rest

    def take(self, first: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
        """The chunk's ``[B, T, ...]`` outputs from the passes' ``[G, P, ...]``, ``[B, R, ...]``."""
        flat = torch.cat([first.reshape(-1, *first.shape[2:]), rest.reshape(-1, *rest.shape[2:])])
        index = self.index.to(flat.device)
        return flat[index.reshape(-1)].reshape(*index.shape, *first.shape[2:])

    def heads_index(
        self, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Which outputs of each pass predict the scored tokens, and the tokens' places.

        Args:
            mask: ``bool[B, T]``, the positions whose token is scored (a response mask).

        Returns:
            ``(first, rest, first_rows, rest_mask)``: flat positions in the prompt pass's
            output (each scored row's last prompt token, predicting its first response token)
            and in the rest pass's (every later scored token's predecessor), the rows of the
            first (``int64``), and ``bool[B, T]`` marking the tokens of the second, in order.
        """
        b, t = mask.shape
        starts = self.starts.to(mask.device)
        columns = torch.arange(t, device=mask.device)[None, :]
        at_start = mask & (columns == starts[:, None]) & (starts[:, None] > 0)
        later = mask & (columns > starts[:, None])
        rows = at_start.any(dim=1).nonzero().squeeze(1)
        width = self.prompts.shape[1]
        first = self.group.to(mask.device)[rows] * width + starts[rows] - 1
        rest_width = self.rests.shape[1]
        grid = torch.arange(b, device=mask.device)[:, None] * rest_width + columns - 1
        return first, (grid - starts[:, None])[later], rows, later

    def scores(
        self,
        model: nn.Module,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        head: Callable[[torch.Tensor, torch.Tensor], AbstractContextManager[Any]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token ``(log-prob, entropy)``, ``float[B, T]`` each, 0 off ``mask``.

        Each pass's output projection is ``head(index, targets)``, a ``float[N, 2]`` one
        (:func:`~lppo.modules.vocab.sliced_head`).
        """
        first, rest, rows, later = self.heads_index(mask)
        at = self.starts.to(rows.device)[rows]
        heads = (head(first, input_ids[rows, at]), head(rest, input_ids[later]))
        a, b = (out.logits for out in self.forward(model, heads))
        placed = b.new_zeros(*input_ids.shape, 2).index_put((rows, at), a)
        logprobs, entropy = placed.masked_scatter(later[..., None], b).unbind(-1)
        return logprobs, entropy


def _groups(ids: list[list[int]], starts: Sequence[int]) -> list[list[int]]:
    """Rows with equal prompts (tokens before the first response token), in first-seen order."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for b, row in enumerate(ids):
        groups.setdefault(tuple(row[: starts[b]]), []).append(b)
    return list(groups.values())


def pack_shared(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor
) -> SharedPack | None:
    """Split a chunk's rows into prompts (once per group) and rests (``None``: nothing to gain).

    Args:
        input_ids: ``int64[B, T]``, right-padded.
        attention_mask: ``bool[B, T]``.
        response_mask: ``bool[B, T]``; a row's prompt is everything before its first ``True``.

    Returns:
        The pack, or ``None`` when no two rows share a prompt, a row has no response token,
        or the two passes would hold more tokens than the chunk (``G·P + B·R > B·T``).
    """
    b, t = input_ids.shape
    if not bool(response_mask.any(dim=1).all()):
        return None
    lengths = attention_mask.sum(dim=1).tolist()
    starts = response_mask.int().argmax(dim=1).tolist()
    ids = [row[:n] for row, n in zip(input_ids.tolist(), lengths, strict=True)]
    groups = _groups(ids, starts)
    width = max(starts[g[0]] for g in groups)
    rest_width = max(n - s for n, s in zip(lengths, starts, strict=True))
    if len(groups) == b or len(groups) * width + b * rest_width > b * t:
        return None
    prompts = torch.zeros(len(groups), width, dtype=torch.long)
    prompt_mask = torch.zeros(prompts.shape, dtype=torch.bool)
    rests = torch.zeros(b, rest_width, dtype=torch.long)
    rest_mask = torch.zeros(rests.shape, dtype=torch.bool)
    group = torch.zeros(b, dtype=torch.long)
    index = torch.zeros(b, t, dtype=torch.long)
    offset = len(groups) * width
    for k, rows in enumerate(groups):
        p = starts[rows[0]]
        prompts[k, :p] = torch.tensor(ids[rows[0]][:p], dtype=torch.long)
        prompt_mask[k, :p] = True
        for i in rows:
            n = lengths[i]
            rests[i, : n - p] = torch.tensor(ids[i][p:], dtype=torch.long)
            rest_mask[i, : n - p] = True
            group[i] = k
            index[i, :p] = k * width + torch.arange(p)
            index[i, p:n] = offset + i * rest_width + torch.arange(n - p)
            index[i, n:] = index[i, n - 1]
    return SharedPack(prompts, prompt_mask, rests, rest_mask, group, torch.tensor(starts), index)


def pack_or_none(enabled: bool, chunk: Any) -> SharedPack | None:
    """:func:`pack_shared` of ``chunk`` (a :class:`~lppo.types.Chunk`) when ``enabled``."""
    if not enabled or chunk.input_ids.numel() == 0:
        return None
    return pack_shared(chunk.input_ids, chunk.attention_mask, chunk.response_mask)
