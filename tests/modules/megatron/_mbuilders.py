"""Tiny megatron specs and their Hugging Face twins (same seed, same weights)."""

from __future__ import annotations

import torch

from lppo.modules import ActorModule, CriticModule
from lppo.modules.megatron import MegatronActor, MegatronCritic, MegatronGPT
from lppo.modules.models import HFCausalLM

VOCAB = 24  # even: splits over 2 tensor-parallel ranks
#: vocab, pad, bos, eos. The pad id never occurs in the rows (ids < 23): HF embeddings have
#: padding_idx (no gradient for that row), megatron's do not.
IDS = (VOCAB, 23, 1, 2)


def hf_spec(dtype: str = "float64", seed: int = 0) -> HFCausalLM:
    return HFCausalLM(
        architecture="llama",
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        dtype=dtype,
        seed=seed,
    )


def megatron_spec(dtype: str = "float64", seed: int = 0, tp: int = 1) -> MegatronGPT:
    return MegatronGPT(hf_spec(dtype, seed), tensor_parallel_size=tp)


def make(role: str, dtype: str = "float64", tp: int = 1, cls=None, **kwargs):
    """A built megatron actor or critic (``cls`` overrides the class, e.g. a capturing one)."""
    if role == "actor":
        module = (cls or MegatronActor)(megatron_spec(dtype, 0, tp), **kwargs)
    else:
        module = (cls or MegatronCritic)(megatron_spec(dtype, 1, tp), **kwargs)
    module.configure_model(*IDS)
    return module


def make_hf(role: str, dtype: str = "float64", **kwargs):
    """The Hugging Face module :func:`make` mirrors (same seeds)."""
    if role == "actor":
        module = ActorModule(hf_spec(dtype, 0), **kwargs)
    else:
        module = CriticModule(hf_spec(dtype, 1), **kwargs)
    module.configure_model(*IDS)
    return module


def main_grads(module) -> dict[str, torch.Tensor]:
    """Accumulated gradients (megatron's buffer) by parameter name."""
    return {
        n: p.main_grad.detach().clone()
        for n, p in module.named_parameters()
        if getattr(p, "main_grad", None) is not None
    }
