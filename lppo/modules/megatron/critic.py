"""``MegatronCritic``: the PPO critic over a megatron-core GPTModel with a value head."""

from __future__ import annotations

from typing import Any

import torch

from lppo.modules.critic import CriticModule
from lppo.modules.megatron.lifecycle import (
    MEGATRON_UNSHAREABLE,
    MegatronLifecycle,
    causal_inputs,
    untrimmed,
)
from lppo.modules.megatron.model import MegatronGPT
from lppo.types import Chunk


class MegatronCritic(MegatronLifecycle, CriticModule):
    """The critic of :class:`~lppo.modules.CriticModule` (same loss, same lifecycle) on megatron.

    GPTModel's output layer is replaced by :meth:`make_value_head` (``Linear(h, 1)``,
    replicated on every tensor-parallel rank), so the backbone returns ``[B, T, 1]`` values.

    Args:
        backbone: the megatron model spec (its LM head is not built).
        **kwargs: the :class:`~lppo.modules.CriticModule` arguments (``value_clip``,
            ``head_init_std``, ``head_seed``, ``lr``, ``weight_decay``, ``betas``, ``eps``,
            ``max_grad_norm``, ``loss_aggregation``, ``warmup_steps``, ``optimizer``,
            ``lr_scheduler``).
    """

    def __init__(self, backbone: MegatronGPT, **kwargs: Any) -> None:
        if not isinstance(backbone, MegatronGPT):
            raise TypeError(
                f"MegatronCritic.backbone must be a lppo.modules.megatron.MegatronGPT, got "
                f"{type(backbone).__name__}."
            )
        kwargs = untrimmed(kwargs, "model.critic.init_args", "MegatronCritic")
        super().__init__(backbone, **kwargs)  # type: ignore[arg-type]

    @property
    def ddp(self) -> Any:
        """The megatron DDP model (``None`` until ``configure_model``)."""
        return self.backbone

    def configure_model(
        self,
        vocab_size: int | None = None,
        pad_token_id: int | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
    ) -> None:
        """Build the megatron backbone with the value head in place of its LM head."""
        if self.backbone is not None:
            return
        if self.spec is None or vocab_size is None:
            raise RuntimeError("critic backbone spec needs the vocabulary to be built.")
        spec: MegatronGPT = self.spec  # type: ignore[assignment]
        self.backbone = spec.build(
            vocab_size, pad_token_id, bos_token_id, eos_token_id, value_head=self.make_value_head
        )

    def unshareable(self) -> str:
        """``data.share_prompts`` does not apply: megatron's GPTModel runs its own forward."""
        return MEGATRON_UNSHAREABLE

    def values(self, chunk: Chunk) -> torch.Tensor:
        """Value predictions ``float[B, T]`` (0 at position 0), with grad."""
        if self.backbone is None:
            raise RuntimeError("critic backbone not built: call configure_model() first.")
        v = self.backbone(*causal_inputs(chunk))[:, :-1, 0]
        return torch.nn.functional.pad(v, (1, 0))
