"""``MegatronActor``: the PPO actor over a megatron-core GPTModel (tensor parallel)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from lppo.modules.actor import ActorModule
from lppo.modules.megatron.lifecycle import (
    MEGATRON_UNSHAREABLE,
    MegatronLifecycle,
    causal_inputs,
    untrimmed,
)
from lppo.modules.megatron.model import MegatronGPT
from lppo.modules.megatron.ops import vocab_parallel_logprobs
from lppo.types import Chunk


class MegatronActor(MegatronLifecycle, ActorModule):
    """The actor of :class:`~lppo.modules.ActorModule` (same loss, same lifecycle) on megatron.

    Log-probabilities and entropy come from the vocabulary-split logits
    (:func:`~lppo.modules.megatron.ops.vocab_parallel_logprobs`). The rollout engine gets a
    Hugging Face ``LlamaForCausalLM`` (:meth:`policy`), refreshed from the megatron weights
    (gathered over the tensor-parallel group) whenever they changed since the last call.

    Args:
        model: the megatron model spec.
        **kwargs: the :class:`~lppo.modules.ActorModule` arguments (``objective``,
            ``entropy_coef``, ``lr``, ``weight_decay``, ``betas``, ``eps``, ``max_grad_norm``,
            ``loss_aggregation``, ``warmup_steps``, ``optimizer``, ``lr_scheduler``).
    """

    def __init__(self, model: MegatronGPT, **kwargs: Any) -> None:
        if not isinstance(model, MegatronGPT):
            raise TypeError(
                f"MegatronActor.model must be a lppo.modules.megatron.MegatronGPT, got "
                f"{type(model).__name__}."
            )
        kwargs = untrimmed(kwargs, "model.actor.init_args", "MegatronActor")
        super().__init__(model, **kwargs)  # type: ignore[arg-type]
        self._rollout: list[nn.Module] = []  # a list: not a submodule, not in state_dict
        self._rollout_version = -1

    def reference_policy(self) -> nn.Module:
        """The frozen KL reference: a second megatron model of this spec with the actor's weights.

        megatron's DDP wrapper and process groups do not copy, so the reference is a copy of
        this actor without them whose model is built anew from a fresh spec (sharded over the
        same tensor-parallel group), then loaded with the actor's current weights.
        """
        spec: MegatronGPT = self.spec  # type: ignore[assignment]
        if self.model is None or spec.hf_config is None:
            raise RuntimeError("actor model not built: call configure_model() first.")
        fresh = MegatronGPT(
            spec.hf, spec.tensor_parallel_size, spec.distributed_optimizer, spec.bucket_size
        )
        fresh.key = spec.key
        fresh.context = spec.context  # the same groups (the layout handed them to the actor's)
        held = (self.model, self.optimizer, self.scheduler, self.__dict__["_lppo_parallel"])
        memo: dict[int, Any] = {id(obj): None for obj in held if obj is not None}
        memo.update({id(spec): fresh, id(self._rollout): []})
        reference = copy.deepcopy(self, memo)
        cfg = spec.hf_config
        reference.configure_model(
            cfg.vocab_size, cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id
        )
        assert reference.model is not None
        reference.model.load_state_dict(self.model.state_dict())
        reference.requires_grad_(False)
        reference.eval()
        return reference

    def __deepcopy__(self, memo: dict[int, Any]) -> MegatronActor:
        # megatron's DDP and process groups do not copy: only reference_policy's copy, which
        # leaves the model out, may copy the rest; anything else is told so.
        if id(self.model) not in memo:
            raise TypeError(
                "MegatronActor cannot be deep-copied (megatron's DDP and process groups do "
                "not copy); use reference_policy() for a frozen copy."
            )
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        for key, value in self.__dict__.items():
            copied.__dict__[key] = copy.deepcopy(value, memo)
        return copied

    @property
    def ddp(self) -> Any:
        """The megatron DDP model (``None`` until ``configure_model``)."""
        return self.model

    def unsliceable(self) -> str:
        """``vocab_chunk`` does not apply: each tensor-parallel rank holds ``V / tp`` logits."""
        return (
            "MegatronActor splits the vocabulary across tensor-parallel ranks (each rank forms "
            "only its [tokens, V / tp] logits; vocab_parallel_logprobs combines them)"
        )

    def unshareable(self) -> str:
        """``data.share_prompts`` does not apply: megatron's GPTModel runs its own forward."""
        return MEGATRON_UNSHAREABLE

    def logits(self, chunk: Chunk) -> torch.Tensor:
        """Temperature-scaled logits of this rank's vocabulary slice, ``float[B, T, V / tp]``."""
        if self.model is None:
            raise RuntimeError("actor model not built: call configure_model() first.")
        return self.model(*causal_inputs(chunk)) / self.temperature

    def token_logprobs(
        self, chunk: Chunk, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """See :meth:`ActorModule.token_logprobs`; no rank forms the full-vocabulary softmax."""
        logits = self.logits(chunk)[:, :-1]
        lp, entropy = vocab_parallel_logprobs(
            logits, chunk.input_ids[:, 1:], self.parallel.tensor, with_entropy
        )
        pad = torch.nn.functional.pad
        return pad(lp, (1, 0)), None if entropy is None else pad(entropy, (1, 0))

    def policy(self) -> nn.Module:
        """A Hugging Face ``LlamaForCausalLM`` with the current weights (collective over TP).

        Every tensor-parallel rank must call it (each gathers the shards).
        """
        if self.model is None:
            raise RuntimeError("actor model not built: call configure_model() first.")
        spec: MegatronGPT = self.spec  # type: ignore[assignment]
        if not self._rollout:
            self._rollout.append(spec.export_hf(self.model, self.parallel.tensor))
        elif self._rollout_version != self.weights_version:
            self._rollout[0].load_state_dict(spec.export_state(self.model, self.parallel.tensor))
        self._rollout_version = self.weights_version
        return self._rollout[0]
