"""Hugging Face Llama <-> megatron GPTModel: equal logits, exact round trips, TP shards."""

from __future__ import annotations

import pytest
import torch
import transformers
from _mbuilders import IDS, VOCAB, hf_spec
from hypothesis import given
from hypothesis import strategies as st

from lppo.modules.megatron import MegatronGPT
from lppo.modules.megatron.convert import (
    AttentionShape,
    hf_to_megatron,
    megatron_to_hf,
    shard,
    unshard,
)
from lppo.modules.megatron.lifecycle import causal_inputs
from lppo.modules.models import HFCausalLM
from lppo.parallel import SINGLE
from lppo.types import Chunk

#: Relative logits tolerance. Hugging Face's Llama computes RMSNorm in float32 whatever the
#: model's dtype (``hidden_states.to(torch.float32)``), so a float64 HF model carries float32
#: round-off (~1e-7 relative per norm) that megatron's float64 torch RMSNorm does not; RoPE
#: tables are float32 on both sides. float32 agrees to its own round-off.
LOGITS_RTOL = {"float32": 2e-5, "float64": 2e-6}


def chunk_of(ids: torch.Tensor) -> Chunk:
    mask = torch.ones_like(ids, dtype=torch.bool)
    return Chunk(
        row_ids=tuple(range(len(ids))), input_ids=ids, attention_mask=mask, response_mask=mask
    )


def assert_logits_close(got, want, dtype):
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= LOGITS_RTOL[dtype] * scale, f"max err {err:.3e} vs scale {scale:.3e}"


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_random_llama_converts_with_equal_logits(dtype):
    spec = MegatronGPT(hf_spec(dtype))
    model = spec.build(*IDS)
    hf = hf_spec(dtype).build(*IDS)
    ids = torch.randint(0, VOCAB, (3, 17), generator=torch.Generator().manual_seed(0))
    got = model(*causal_inputs(chunk_of(ids)))
    assert got.dtype == hf.dtype == getattr(torch, dtype)
    assert_logits_close(got, hf(input_ids=ids).logits, dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_checkpoint_with_grouped_query_attention_converts_both_ways(tmp_path, dtype):
    """A saved HF checkpoint (GQA: 4 query heads, 2 key/value heads) loads into megatron with
    equal logits, and exports back to the same tensors, bit for bit."""
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=5000.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(3)
    transformers.LlamaForCausalLM(cfg).to(getattr(torch, dtype)).save_pretrained(tmp_path)
    spec = MegatronGPT(HFCausalLM(pretrained_path=str(tmp_path), dtype=dtype))
    model = spec.build(*IDS)
    hf = HFCausalLM(pretrained_path=str(tmp_path), dtype=dtype).build(*IDS)
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    assert_logits_close(model(*causal_inputs(chunk_of(ids))), hf(input_ids=ids).logits, dtype)
    back = spec.export_hf(model, SINGLE).state_dict()
    want = hf.state_dict()
    assert back.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(back[name], tensor), name


@given(
    groups=st.sampled_from([1, 2, 4]),
    per_group=st.integers(1, 3),
    head_dim=st.sampled_from([2, 4]),
    tp=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_shard_then_unshard_and_convert_round_trip_exactly(groups, per_group, head_dim, tp, seed):
    shape = AttentionShape(groups * per_group, groups, head_dim)
    g = torch.Generator().manual_seed(seed)
    h, f, v = 8, 6, 10
    q = shape.num_heads * head_dim
    hf = {
        "model.embed_tokens.weight": torch.randn(v, h, generator=g),
        "model.norm.weight": torch.randn(h, generator=g),
        "lm_head.weight": torch.randn(v, h, generator=g),
        "model.layers.0.input_layernorm.weight": torch.randn(h, generator=g),
        "model.layers.0.post_attention_layernorm.weight": torch.randn(h, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(q, h, generator=g),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(groups * head_dim, h, generator=g),
        "model.layers.0.self_attn.v_proj.weight": torch.randn(groups * head_dim, h, generator=g),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(h, q, generator=g),
        "model.layers.0.mlp.gate_proj.weight": torch.randn(f, h, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(f, h, generator=g),
        "model.layers.0.mlp.down_proj.weight": torch.randn(h, f, generator=g),
    }
    mega = hf_to_megatron(hf, shape)
    if tp > 1 and (groups % tp or v % tp or f % tp):
        return
    parts = {k: [shard(k, t, r, tp) for r in range(tp)] for k, t in mega.items()}
    full = {k: unshard(k, p) for k, p in parts.items()}
    back = megatron_to_hf(full, shape)
    assert back.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name
    # each rank's query-group slice holds whole groups: q, k and v of the same heads
    if tp == 2:
        qkv0 = parts["decoder.layers.0.self_attention.linear_qkv.weight"][0]
        assert qkv0.shape[0] == (groups // 2) * (per_group + 2) * head_dim
