"""Prompt trimming: a Llama-family forward whose last block runs only where outputs are read.

A PPO chunk reads the model's output (log-probabilities, values, a reward score) only from the
position before its first response token on. Below the last transformer block every position
is needed (later positions attend to it), but in the last block a position before that start
contributes only its keys and values: its query, attention output, MLP, final norm and LM head
are computed and thrown away. :func:`trimmed` swaps the last block of a Hugging Face body for
:class:`TailBlock` during one forward, so the body returns hidden states of positions
``start … T - 1`` only (``float[B, T - start, H]``); the math of those positions is unchanged
(the same weights, keys and values of every position, the same mask), so results agree with the
full forward to round-off (the tail block runs SDPA in the model's dtype, so against HF's
eager attention, whose softmax is float32, they agree to float32 round-off). Saved at every
prompt position before ``start``: the last block's query and output projections and MLP, and
for a causal LM the LM head; with 4 blocks and prompts about half of each chunk (the TRL
benchmark's variable-length rows) that is about a tenth of a forward and backward.

Supported: bodies whose blocks have Llama's layout (``input_layernorm``, ``self_attn`` with
``q_proj`` / ``k_proj`` / ``v_proj`` / ``o_proj`` and rotary position embeddings,
``post_attention_layernorm``, ``mlp``): ``llama`` (SmolLM2), ``mistral`` and ``qwen2``
(:func:`check_trimmable` rejects the rest).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch import nn

from lppo.decisions import note
from lppo.modules.models import attention_obstacle
from lppo.validation import SettingError

#: ``config.model_type`` values whose blocks have the layout :class:`TailBlock` computes.
TRIMMABLE = ("llama", "mistral", "qwen2")


#: A module's ``trim_prompt`` setting: on, off, or ``auto`` (on wherever it applies).
TrimSetting = bool | Literal["auto"]


def untrimmable(body: nn.Module) -> str | None:
    """Why ``body`` (a Hugging Face base model) cannot run :func:`trimmed` (``None``: it can)."""
    layers = getattr(body, "layers", None)
    attn = getattr(layers[-1], "self_attn", None) if layers else None
    plain = attn is not None and not hasattr(attn, "q_norm") and hasattr(attn, "q_proj")
    # The tail reads HF's 4-D mask (sdpa / eager); flash and flex pass other mask types.
    return attention_obstacle(getattr(body, "config", None), TRIMMABLE, plain)


def check_trimmable(body: nn.Module, key: str) -> None:
    """Raise unless ``body`` (a Hugging Face base model) can run :func:`trimmed`.

    Args:
        body: the base model (``LlamaModel`` …), e.g. ``causal_lm.base_model``.
        key: the configuration key of the ``trim_prompt`` setting (for the message).

    Raises:
        SettingError: naming the key, the model type and the fix.
    """
    if (reason := untrimmable(body)) is not None:
        raise SettingError(f"{key}=true: {reason}; set {key}: false (or auto).")


def resolve_trim(
    setting: TrimSetting,
    body: nn.Module | None,
    key: str,
    unfit: str | None = None,
    shards: str | None = None,
) -> bool:
    """A module's ``trim_prompt`` setting made ``True`` or ``False`` for ``body``, decided once.

    ``auto`` is on wherever neither ``unfit`` (the module's own reason, e.g. LoRA),
    :func:`untrimmable` nor ``shards`` finds anything against it, else off with a log line
    naming the reason; ``true`` is checked.

    Args:
        setting: the module's ``trim_prompt`` argument.
        body: the Hugging Face base model (``None`` only with ``unfit``).
        key: the setting's configuration key (for the messages).
        unfit: why this module cannot trim, whatever its body (``None``: nothing).
        shards: the name of the run's layout when it shards the weights (``ppo_fsdp``): the
            trimmed last block calls the block's submodules directly, past the per-block hooks
            that gather a sharded block's weights.

    Raises:
        SettingError: ``true`` where the module, its body or the layout cannot run
            :func:`trimmed`.
    """
    if setting is False:
        note(key, "off", setting="false")
        return False
    reason = unfit or (untrimmable(body) if body is not None else "no Hugging Face body")
    if reason is None and shards is None:
        note(key, "on", setting=str(setting).lower())
        return True
    if setting is True and reason is None:
        raise SettingError(
            f"{key}=true under {shards}, which shards the weights: the trimmed last "
            f"block would bypass its per-block all-gather; set {key}: false (or auto)."
        )
    if setting is True:
        raise SettingError(f"{key}=true: {reason}; set {key}: false (or auto).")
    note(key, "off", reason or f"under {shards}, which shards the weights")
    return False


def response_start(response_mask: torch.Tensor) -> int:
    """The first position whose output a chunk reads: one before its earliest response token.

    Args:
        response_mask: ``bool[B, T]``.

    Returns:
        ``min_b(first response index of row b) - 1``, at least 0 (0 for a chunk without
        response tokens).
    """
    rows = response_mask.any(dim=1)
    if not bool(rows.any()):
        return 0
    first = response_mask.int().argmax(dim=1)[rows]
    return max(int(first.min()) - 1, 0)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[B, heads, T, d]`` with ``cos`` / ``sin`` ``[B|1, T, d]``."""
    return x * cos.unsqueeze(1) + _rotate_half(x) * sin.unsqueeze(1)


class TailBlock(nn.Module):
    """A Llama-layout block computing queries and everything after them from ``start`` on.

    Args:
        block: the body's last decoder block (its weights are used, not copied).
        start: first position whose output is returned.
    """

    def __init__(self, block: nn.Module, start: int) -> None:
        super().__init__()
        self.block = block
        self.start = start

    def _mask(self, mask: torch.Tensor | None, hidden: torch.Tensor) -> torch.Tensor:
        """The mask rows of the kept queries: HF's 4-D mask sliced, or a causal one."""
        if mask is not None:
            return mask[:, :, self.start :, : hidden.shape[1]]
        t = hidden.shape[1]
        keys = torch.arange(t, device=hidden.device)
        return keys[None, :] <= keys[self.start :, None]

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """``float[B, T - start, H]``: the block's output at positions ``start … T - 1``."""
        if position_embeddings is None:
            raise RuntimeError("trim_prompt needs a body that passes rotary position_embeddings")
        block, attn, s = self.block, self.block.self_attn, self.start
        b, t, _ = hidden_states.shape
        x = block.input_layernorm(hidden_states)
        cos, sin = position_embeddings
        d = attn.head_dim
        q = attn.q_proj(x[:, s:]).view(b, t - s, -1, d).transpose(1, 2)
        k = attn.k_proj(x).view(b, t, -1, d).transpose(1, 2)
        v = attn.v_proj(x).view(b, t, -1, d).transpose(1, 2)
        q, k = _rotary(q, cos[:, s:], sin[:, s:]), _rotary(k, cos, sin)
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=self._mask(attention_mask, hidden_states),
            dropout_p=attn.attention_dropout if self.training else 0.0,
            scale=attn.scaling,
        )
        h = hidden_states[:, s:] + attn.o_proj(out.transpose(1, 2).reshape(b, t - s, -1))
        return h + block.mlp(block.post_attention_layernorm(h))


@contextmanager
def trimmed(body: nn.Module, start: int) -> Iterator[None]:
    """Within the block, ``body``'s forward returns positions ``start …`` only (see module).

    The last block is swapped for a :class:`TailBlock` and put back on exit, so parameter
    names, checkpoints and exports never see the wrapper. ``start == 0`` changes nothing.

    Args:
        body: a base model that passed :func:`check_trimmable`.
        start: first position whose output is needed.
    """
    if start <= 0:
        yield
        return
    last = body.layers[-1]
    body.layers[-1] = TailBlock(last, start)
    try:
        yield
    finally:
        body.layers[-1] = last
