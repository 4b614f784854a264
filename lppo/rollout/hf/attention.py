"""Decode attention over the filled part of a static KV cache (``HFGenerateEngine``).

A ``StaticCache`` holds prompt + ``max_new_tokens`` positions from the start, and Hugging Face's
``sdpa`` attention reads all of them at every decode step, the positions not yet written
masked out. Reading the keys and values is most of a decode step's attention on a CPU (it is
bound by memory bandwidth), so on average about half of it reads masked zeros.
:func:`filled_part_decode` swaps in an attention function that cuts keys, values and mask to
the last column any row may attend to, then calls the same ``sdpa`` function. The cut columns
are masked for every row, so they add exactly zero to every softmax: the samples are those of
the full read (checked in ``tests/rollout/test_hf_attention.py``).

Only one-token queries of models whose attention implementation is ``sdpa`` are cut; everything
else (the prefill, training forwards, other implementations) goes to ``sdpa`` unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

#: The attention implementation name :func:`filled_part_decode` sets while ``generate`` runs.
IMPLEMENTATION = "lppo_filled_sdpa"


def filled_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``sdpa`` attention; a one-token query reads keys and values only up to its last open column.

    Args:
        module: the attention layer.
        query: ``[B, heads, Q, head_dim]``.
        key: ``[B, kv_heads, K, head_dim]`` (the whole static cache in a decode step).
        value: like ``key``.
        attention_mask: boolean ``[B, 1, Q, K]`` (``True``: may attend) or ``None``.
        **kwargs: passed on to Hugging Face's ``sdpa_attention_forward``.

    Returns:
        What ``sdpa_attention_forward`` returns: the attention output and ``None``.
    """
    if query.shape[-2] == 1 and attention_mask is not None and attention_mask.dtype == torch.bool:
        open_columns = attention_mask.reshape(-1, attention_mask.shape[-1]).any(dim=0)
        filled = open_columns.nonzero()  # ascending
        end = int(filled[-1]) + 1 if filled.numel() else key.shape[-2]
        if end < key.shape[-2]:
            key, value = key[:, :, :end], value[:, :, :end]
            attention_mask = attention_mask[..., :end]
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(IMPLEMENTATION, filled_sdpa)
AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)


def reads_filled_part(model: torch.nn.Module) -> bool:
    """Whether :func:`filled_part_decode` applies to ``model`` (its attention is ``sdpa``)."""
    config = getattr(model, "config", None)
    return (
        getattr(config, "_attn_implementation", None) == "sdpa"
        and hasattr(model, "set_attn_implementation")
        and bool(getattr(model, "_can_set_attn_implementation", lambda: False)())
    )


@contextmanager
def filled_part_decode(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, ``model`` decodes with :func:`filled_sdpa` (``sdpa`` again after it).

    The engine shares the actor's model, so the implementation is switched only around
    ``generate``; a model :func:`reads_filled_part` refuses is left as it is.
    """
    if not reads_filled_part(model):
        yield
        return
    model.set_attn_implementation(IMPLEMENTATION)  # type: ignore[operator]
    try:
        yield
    finally:
        model.set_attn_implementation("sdpa")  # type: ignore[operator]
