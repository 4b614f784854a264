"""Weight conversion between Hugging Face Llama-family checkpoints and megatron-core's GPTModel.

Pure tensor functions (no megatron import), so they are testable and reusable anywhere.
Names are those of ``LlamaForCausalLM.state_dict()`` and of megatron-core's local layer spec
(``get_gpt_layer_local_spec(normalization="RMSNorm")``), with untied embeddings.

Layouts (``h`` hidden, ``d`` head dim, ``nq`` query heads, ``ng`` key/value groups, ``f`` MLP
width, ``V`` vocabulary):

* ``linear_qkv.weight`` ``[(nq + 2 ng) d, h]``: per group ``g``, its ``nq / ng`` query heads,
  then its key head, then its value head (HF keeps ``q_proj``, ``k_proj``, ``v_proj`` apart).
  Both sides use the same rotate-half RoPE convention, so no permutation of rows is needed.
* ``linear_fc1.weight`` ``[2 f, h]``: ``gate_proj`` then ``up_proj`` (SwiGLU).

Tensor parallelism (:func:`shard` / :func:`unshard`) splits dim 0 of the embedding, the output
layer, ``linear_qkv`` (whole groups per rank) and ``linear_fc1`` (each rank holds its slice of
gate, then its slice of up); dim 1 of ``linear_proj`` and ``linear_fc2``; norms are replicated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_ROW_SPLIT = ("linear_qkv.weight", "word_embeddings.weight", "output_layer.weight")
_COL_SPLIT = ("linear_proj.weight", "linear_fc2.weight")

#: megatron per-layer name -> HF per-layer name, for the tensors that map one to one.
_SAME = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}


@dataclass(frozen=True)
class AttentionShape:
    """Head layout of a Llama attention block.

    Attributes:
        num_heads: query heads ``nq``.
        num_groups: key/value heads ``ng`` (``nq`` for multi-head attention).
        head_dim: width ``d`` of one head.
    """

    num_heads: int
    num_groups: int
    head_dim: int

    @property
    def heads_per_group(self) -> int:
        """Query heads sharing one key/value head."""
        return self.num_heads // self.num_groups


def hf_to_megatron(
    hf: dict[str, torch.Tensor], shape: AttentionShape, lm_head: bool = True
) -> dict[str, torch.Tensor]:
    """Map a ``LlamaForCausalLM`` (or ``LlamaModel``) state dict to GPTModel names (TP 1).

    Args:
        hf: the Hugging Face state dict (``model.``-prefixed names, or none for a base model).
        shape: the attention head layout.
        lm_head: include ``output_layer.weight`` (from ``lm_head.weight``, or the embedding
            when the checkpoint ties them).

    Returns:
        Full (unsharded) megatron tensors; the originals are not copied where not reshaped.
    """
    prefix = "model." if any(k.startswith("model.") for k in hf) else ""
    out = {
        "embedding.word_embeddings.weight": hf[f"{prefix}embed_tokens.weight"],
        "decoder.final_layernorm.weight": hf[f"{prefix}norm.weight"],
    }
    if lm_head:
        out["output_layer.weight"] = hf.get(
            "lm_head.weight", out["embedding.word_embeddings.weight"]
        )
    layers = sorted({int(k.split(".")[1 + bool(prefix)]) for k in hf if ".layers." in k})
    d, g, r = shape.head_dim, shape.num_groups, shape.heads_per_group
    for i in layers:
        src, dst = f"{prefix}layers.{i}.", f"decoder.layers.{i}."
        for mega, name in _SAME.items():
            out[dst + mega] = hf[src + name]
        q = hf[src + "self_attn.q_proj.weight"].reshape(g, r * d, -1)
        k = hf[src + "self_attn.k_proj.weight"].reshape(g, d, -1)
        v = hf[src + "self_attn.v_proj.weight"].reshape(g, d, -1)
        out[dst + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], 1).flatten(0, 1)
        gate, up = hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([gate, up], 0)
    return out


def megatron_to_hf(mega: dict[str, torch.Tensor], shape: AttentionShape) -> dict[str, torch.Tensor]:
    """Inverse of :func:`hf_to_megatron`: full GPTModel tensors to ``LlamaForCausalLM`` names.

    Tensors that are neither layers, embeddings, final norm nor output layer (e.g. a value
    head) are left out.
    """
    out = {
        "model.embed_tokens.weight": mega["embedding.word_embeddings.weight"],
        "model.norm.weight": mega["decoder.final_layernorm.weight"],
    }
    if "output_layer.weight" in mega:
        out["lm_head.weight"] = mega["output_layer.weight"]
    d, g, r = shape.head_dim, shape.num_groups, shape.heads_per_group
    for key, value in mega.items():
        m = _LAYER.match(key)
        if m is None:
            continue
        dst, name = f"model.layers.{m.group(1)}.", m.group(2)
        if name in _SAME:
            out[dst + _SAME[name]] = value
        elif name == "self_attention.linear_qkv.weight":
            qkv = value.reshape(g, (r + 2) * d, -1)
            q, k, v = qkv.split([r * d, d, d], dim=1)
            out[dst + "self_attn.q_proj.weight"] = q.flatten(0, 1)
            out[dst + "self_attn.k_proj.weight"] = k.flatten(0, 1)
            out[dst + "self_attn.v_proj.weight"] = v.flatten(0, 1)
        elif name == "mlp.linear_fc1.weight":
            gate, up = value.chunk(2, dim=0)
            out[dst + "mlp.gate_proj.weight"] = gate
            out[dst + "mlp.up_proj.weight"] = up
    return out


def split_dim(name: str) -> int | None:
    """The dimension tensor-parallel ranks split ``name`` along (``None``: replicated)."""
    if name.endswith(_ROW_SPLIT) or name.endswith("linear_fc1.weight"):
        return 0
    if name.endswith(_COL_SPLIT):
        return 1
    return None


def shard(name: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Tensor-parallel rank ``rank``'s part of the full megatron tensor ``name``.

    Raises:
        ValueError: the split dimension is not divisible by ``size``.
    """
    dim = split_dim(name)
    if dim is None or size == 1:
        return full
    if full.shape[dim] % (2 * size if name.endswith("linear_fc1.weight") else size):
        raise ValueError(
            f"{name} of shape {tuple(full.shape)} cannot be split over {size} tensor-parallel "
            "ranks; choose a tensor_parallel_size dividing the heads, MLP width and vocabulary."
        )
    if name.endswith("linear_fc1.weight"):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size)[rank], up.chunk(size)[rank]], 0)
    return full.chunk(size, dim=dim)[rank]


def unshard(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """The full megatron tensor ``name`` from every tensor-parallel rank's part, in rank order."""
    dim = split_dim(name)
    if dim is None or len(parts) == 1:
        return parts[0]
    if name.endswith("linear_fc1.weight"):
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
    return torch.cat(parts, dim=dim)
