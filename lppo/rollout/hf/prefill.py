"""A KV cache for ``generate``, prefilled in length-sorted pieces (``HFGenerateEngine`` knobs).

``generate`` prefills a left-padded batch in one forward pass, so with prompt lengths of 8-128
tokens about half of the prefill is padding. :func:`prefilled_cache` runs the prefill over
pieces of rows of similar length instead (each piece is only as wide as its longest prompt),
writes every piece's keys and values into one cache laid out like the left-padded batch, and
hands that cache to ``generate``, which then decodes all rows together. Keys and values at a
real position depend only on that row's earlier real tokens, so the cache holds what the
one-pass prefill computes, up to float round-off.

The cache is either Hugging Face's ``DynamicCache`` (grown by concatenation at every new
token) or its ``StaticCache`` (allocated once for prompt + ``max_new_tokens`` and written in
place, which avoids re-copying the whole cache at every step of a large batch).
"""

from __future__ import annotations

from typing import Literal

import torch
import transformers
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import DynamicLayer

from lppo.decisions import note
from lppo.modules.models import cache_keyword

#: ``prefill_tokens: auto``'s piece budget: a few thousand padded tokens keep each piece one
#: efficient forward pass while rows of very different lengths go to different pieces.
AUTO_PREFILL_TOKENS = 2048


def prefill_pieces(lengths: list[int], max_tokens: int | None) -> list[list[int]]:
    """Rows grouped for the prefill: sorted by length, each piece at most ``max_tokens`` wide.

    A piece's cost is its row count times its longest prompt (the left-padded slots), so rows
    are taken shortest first and a piece closes when one more row would pass ``max_tokens``
    (a row longer than the budget gets a piece of its own). ``None``: one piece of all rows.

    Args:
        lengths: prompt tokens of each row, ``int[B]``.
        max_tokens: padded-token budget of one piece.

    Returns:
        Row indices of each piece (every row exactly once).
    """
    order = sorted(range(len(lengths)), key=lambda r: lengths[r])
    if max_tokens is None:
        return [order] if order else []
    pieces: list[list[int]] = []
    for r in order:
        if pieces and (len(pieces[-1]) + 1) * lengths[r] <= max_tokens:
            pieces[-1].append(r)
        else:
            pieces.append([r])
    return pieces


def shared_prefill_pieces(
    prompts: list[list[int]], max_tokens: int | None
) -> tuple[list[list[int]], list[int]]:
    """:func:`prefill_pieces` over distinct prompts; rows repeating a prompt copy its prefix.

    Several samples of one prompt (``samples_per_prompt``, GRPO's group) have the same keys
    and values over the prompt, so each distinct prompt is prefilled once.

    Args:
        prompts: each row's prompt ids.
        max_tokens: padded-token budget of one piece.

    Returns:
        ``(pieces, sources)``: the pieces, over the first row of each distinct prompt, and for
        every row the row whose prefix it takes (itself for those first rows).
    """
    first: dict[tuple[int, ...], int] = {}
    sources = [first.setdefault(tuple(ids), r) for r, ids in enumerate(prompts)]
    distinct = [r for r, source in enumerate(sources) if source == r]
    pieces = prefill_pieces([len(prompts[r]) for r in distinct], max_tokens)
    return [[distinct[i] for i in piece] for piece in pieces], sources


def _prefix_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids as ``generate`` derives them from a left-padding mask (``int64[B, T]``)."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 1)


@torch.no_grad()
def prefilled_cache(
    model: transformers.PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    pieces: list[list[int]],
    static_length: int | None,
    sources: list[int] | None = None,
) -> transformers.Cache:
    """A KV cache of every prompt position but the last, filled piece by piece.

    ``generate(input_ids, attention_mask, cache=...)`` then runs only the last prompt column
    through the model before sampling, exactly as after its own prefill.

    Args:
        model: the causal LM (every layer full attention: :func:`check_full_attention`).
        input_ids: the left-padded prompts, ``int64[B, W]``.
        attention_mask: ``int64[B, W]``; 1 on prompt tokens.
        pieces: row indices of each prefill forward (:func:`prefill_pieces`).
        static_length: ``None`` for a ``DynamicCache``; otherwise the ``StaticCache`` length
            (at least ``W`` + the tokens to generate).
        sources: for every row, the row of ``pieces`` holding the same prompt, whose prefix
            it copies (:func:`shared_prefill_pieces`); ``None``: every row is in ``pieces``.
    """
    width = input_ids.shape[1]
    keyword = cache_keyword(model)
    static = (
        None
        if static_length is None
        else StaticCache(config=model.config, max_cache_len=static_length)
    )
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for rows in pieces:
        lb = int(attention_mask[rows].sum(dim=1).max())
        if lb < 2:
            continue  # one-token prompts: nothing before the last token to cache
        cols = slice(width - lb, width - 1)
        mask = attention_mask[rows, cols]
        piece = DynamicCache(config=model.config)
        model(
            input_ids=input_ids[rows, cols],
            attention_mask=mask,
            position_ids=_prefix_positions(mask),
            use_cache=True,
            logits_to_keep=1,
            **{keyword: piece},
        )
        if not keys:
            keys, values = _prefix_tensors(piece, static, input_ids.shape[0], width)
        for i, layer in enumerate(piece.layers):
            keys[i][rows, :, cols] = layer.keys
            values[i][rows, :, cols] = layer.values
    _copy_shared_prefixes(keys, values, sources)
    return _as_cache(model, static, keys, values, width)


def _copy_shared_prefixes(
    keys: list[torch.Tensor], values: list[torch.Tensor], sources: list[int] | None
) -> None:
    """Give every row that repeats a prompt its source row's prefix (in place).

    Args:
        keys: per-layer prefix keys, ``[B, heads, W - 1, head_dim]`` (empty: nothing cached).
        values: per-layer prefix values, shaped like ``keys``.
        sources: for every row, the row whose prefix it takes (:func:`shared_prefill_pieces`);
            ``None``: every row was prefilled itself.
    """
    if sources is None or not keys:
        return
    copies = [r for r, source in enumerate(sources) if source != r]
    if copies:
        origin = [sources[r] for r in copies]
        for tensors in (keys, values):
            for t in tensors:
                t[copies] = t[origin]


def _as_cache(
    model: transformers.PreTrainedModel,
    static: StaticCache | None,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    width: int,
) -> transformers.Cache:
    """The cache ``generate`` takes, holding the prefix ``keys`` / ``values`` of ``width - 1``.

    Args:
        model: the causal LM (its config shapes a ``DynamicCache``).
        static: the ``StaticCache`` the prefix was written into, or ``None`` for a
            ``DynamicCache`` built from ``keys`` and ``values``.
        keys: per-layer prefix keys (empty: every prompt is one token, nothing cached).
        values: per-layer prefix values.
        width: the padded prompt width ``W``.

    Returns:
        ``static`` with its length recorded, or a new ``DynamicCache``.
    """
    if static is not None:
        if keys:  # the prefix was written in place: record its length
            for layer in static.layers:
                layer.cumulative_length.fill_(width - 1)
        return static
    cache = DynamicCache(config=model.config)
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        cache.update(k, v, i)
    return cache


def other_cache_layer(model: torch.nn.Module) -> str | None:
    """The type name of a layer of ``model``'s KV cache that is not full attention, if any.

    A model without a Hugging Face config (whose cache layers cannot be known) gives
    ``"unknown"``.
    """
    config = getattr(model, "config", None)
    if config is None:
        return "unknown"
    for layer in DynamicCache(config=config).layers:
        if type(layer) is not DynamicLayer:
            return type(layer).__name__
    return None


def resolve_cache(
    model: torch.nn.Module,
    cache: Literal["auto", "dynamic", "static"],
    prefill_tokens: int | Literal["auto"] | None,
) -> tuple[Literal["dynamic", "static"], int | None]:
    """``HFGenerateEngine``'s ``cache`` and ``prefill_tokens`` for ``model``, ``auto`` resolved.

    ``auto`` is ``static`` / :data:`AUTO_PREFILL_TOKENS` for a full-attention model, else
    ``dynamic`` / ``None`` (one-pass prefill), with a log line naming the layer.

    Returns:
        The cache kind and the prefill piece budget.

    Raises:
        ValueError: an explicit static cache or piece budget for a model with a layer that is
            not full attention (:func:`check_full_attention`).
    """
    if prefill_tokens not in (None, "auto") or cache == "static":
        check_full_attention(model)
    layer = other_cache_layer(model)
    kind = ("dynamic" if layer else "static") if cache == "auto" else cache
    auto_budget = None if layer else AUTO_PREFILL_TOKENS
    budget = auto_budget if prefill_tokens == "auto" else prefill_tokens
    why = f"a {layer} layer" if layer else ""
    note("model.engine.init_args.cache", kind, why if cache == "auto" else "", str(cache))
    pieces = "one pass" if budget is None else str(budget)
    why = why if prefill_tokens == "auto" else ""
    note("model.engine.init_args.prefill_tokens", pieces, why, str(prefill_tokens))
    return kind, budget


def check_full_attention(model: torch.nn.Module) -> None:
    """Raise unless every layer of ``model``'s KV cache is a plain full-attention layer.

    Raises:
        ValueError: a sliding-window, linear-attention, ... layer, naming the knobs and the fix.
    """
    if (layer := other_cache_layer(model)) is not None:
        raise ValueError(
            f"model.engine.init_args.prefill_tokens / cache: {type(model).__name__} has a "
            f"{layer} layer; only full-attention layers can be prefilled in pieces or "
            "decoded with a static cache. Set prefill_tokens: null and cache: dynamic (or auto)."
        )


def _prefix_tensors(
    piece: DynamicCache, static: StaticCache | None, batch: int, width: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer key / value tensors the pieces are written into (``[B, heads, T, head_dim]``).

    For a static cache these are views of its own storage (its first ``width - 1``
    positions), so the prefix is never held twice; otherwise zeros of ``width - 1``.
    """
    first = piece.layers[0]
    if static is not None:
        heads, dims = first.keys.shape[1], first.keys.shape[-1]
        static.early_initialization(batch, heads, dims, first.keys.dtype, first.keys.device)
        return (
            [layer.keys[:, :, : width - 1] for layer in static.layers],
            [layer.values[:, :, : width - 1] for layer in static.layers],
        )

    def zeros(t: torch.Tensor) -> torch.Tensor:
        return t.new_zeros(batch, t.shape[1], width - 1, t.shape[-1])

    return [zeros(layer.keys) for layer in piece.layers], [
        zeros(layer.values) for layer in piece.layers
    ]
