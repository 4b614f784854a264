"""The critic: a transformer backbone plus a scalar value head, trained on clipped value loss."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lppo.algorithms.losses import value_loss
from lppo.modules.lifecycle import PPOModule
from lppo.modules.lora import LoRA, check_lora, is_adapted
from lppo.modules.shared import pack_or_none, unshareable
from lppo.modules.tail import TrimSetting, resolve_trim, response_start, trimmed
from lppo.stats import SumStats
from lppo.types import RETURNS, VALUES, Chunk
from lppo.validation import check_number

if TYPE_CHECKING:
    from lppo.modules.models import HFCausalLM


class CriticModule(PPOModule):
    """Value model with the step lifecycle; subclass it to change the head or the loss.

    ``values[:, t]`` estimates the return from the state before token ``t`` (the backbone's
    hidden state at ``t - 1``), matching the token alignment of :mod:`lppo.types`.

    Args:
        backbone: a Hugging Face transformer (base model or causal LM; the last hidden state
            is used), or an :class:`~lppo.modules.models.HFCausalLM` spec built at setup.
        value_clip: ε of the clipped value loss (``None``: unclipped squared error).
        head_init_std: standard deviation of the value head's initial weights.
        head_seed: seed of the value head's initialization.
        trim_prompt: run the backbone's last block only from the position before the chunk's
            first response token on (:mod:`lppo.modules.tail`; Llama / Mistral / Qwen2 backbones):
            the same values on response tokens to round-off, less work per chunk. ``auto``
            (the default): on wherever it applies, off with a log line for other models, LoRA
            and layouts that shard the weights (:func:`~lppo.modules.tail.resolve_trim`).
        lora: train LoRA adapters on the backbone instead of its weights (the value head
            trains fully; :mod:`lppo.modules.lora`, the ``[lora]`` extra).
        **kwargs: optimizer settings of :class:`~lppo.modules.PPOModule` (``lr``,
            ``weight_decay``, ``betas``, ``eps``, ``max_grad_norm``, ``loss_aggregation``,
            ``warmup_steps``, ``optimizer``, ``lr_scheduler``).
    """

    role = "critic"

    def __init__(
        self,
        backbone: HFCausalLM | nn.Module,
        value_clip: float | None = 0.2,
        head_init_std: float = 0.02,
        head_seed: int = 0,
        trim_prompt: TrimSetting = "auto",
        lora: LoRA | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        key = self.config_key
        check_lora(lora, trim_prompt, key)
        check_number(f"{key}.value_clip", value_clip, low=0, low_open=True, optional=True)
        check_number(f"{key}.head_init_std", head_init_std, low=0)
        check_number(f"{key}.head_seed", head_seed, integer=True, low=0)
        if not isinstance(backbone, nn.Module):  # a spec, built in configure_model
            backbone.validate(f"{key}.backbone.init_args")
        self.value_clip = value_clip
        self.head_init_std = head_init_std
        self.head_seed = head_seed
        #: The ``trim_prompt`` argument; :attr:`trim_prompt` is what it resolved to at setup.
        self.trim_prompt_setting: TrimSetting = trim_prompt
        self.trim_prompt = False
        #: Whether forwards compute each prompt once per chunk (``data.share_prompts``, set by
        #: the run plan: :func:`~lppo.modules.shared.resolve_share_prompts`).
        self.share_prompts = False
        self.lora = lora
        given = isinstance(backbone, nn.Module)
        self.spec: HFCausalLM | None = None if given else backbone  # type: ignore[assignment]
        self.backbone: nn.Module | None = backbone if given else None  # type: ignore[assignment]
        self.value_head: nn.Module | None = None
        if given:
            self.configure_model()

    def configure_model(
        self,
        vocab_size: int | None = None,
        pad_token_id: int | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
    ) -> None:
        """Build the backbone from its spec (when given one) and the value head; idempotent.

        With a backbone *module* this runs inside ``__init__``: a subclass whose
        :meth:`make_value_head` reads its own attributes sets them before ``super().__init__``.
        """
        if self.backbone is None:
            if self.spec is None or vocab_size is None:
                raise RuntimeError("critic backbone spec needs the vocabulary to be built.")
            self.backbone = self.spec.build_backbone(
                vocab_size, pad_token_id, bos_token_id, eos_token_id
            )
        if self.lora is not None and not is_adapted(self.backbone):
            self.backbone = self.lora.wrap(self.backbone)  # the value head stays fully trained
        unfit = "LoRA: PEFT wraps the backbone's blocks" if is_adapted(self.backbone) else None
        body = getattr(self.backbone, "base_model", None)
        key = f"{self.config_key}.trim_prompt"
        shards = self.parallel.layout
        shards_name = type(shards).__name__ if shards.shards_weights() else None
        self.trim_prompt = resolve_trim(self.trim_prompt_setting, body, key, unfit, shards_name)
        if self.value_head is None:
            param = next(self.backbone.parameters())
            head = self.make_value_head(int(self.backbone.config.hidden_size))
            self.value_head = head.to(dtype=param.dtype, device=param.device)

    def unshareable(self) -> str | None:
        """Why this critic's forwards cannot share prompts (``None``: they can)."""
        if type(self).values is not CriticModule.values:
            return f"{type(self).__name__} overrides values(chunk)"
        return "the backbone is not built" if self.backbone is None else unshareable(self.backbone)

    def make_value_head(self, hidden_size: int) -> nn.Module:
        """The value head, mapping ``[..., hidden_size]`` to ``[..., 1]``; override to change it.

        Default: one ``Linear`` with weights ``N(0, head_init_std²)`` drawn from ``head_seed``
        and a zero bias.
        """
        head = nn.Linear(hidden_size, 1)
        gen = torch.Generator().manual_seed(self.head_seed)
        with torch.no_grad():
            head.weight.copy_(torch.randn(head.weight.shape, generator=gen) * self.head_init_std)
            head.bias.zero_()
        return head

    # ---------------------------------------------------------------- forward
    def values(self, chunk: Chunk) -> torch.Tensor:
        """Value predictions ``float[B, T]`` (0 at position 0), with grad."""
        if self.backbone is None or self.value_head is None:
            raise RuntimeError("critic backbone not built: call configure_model() first.")
        start = response_start(chunk.response_mask) if self.trim_prompt else 0
        pack = pack_or_none(self.share_prompts, chunk)
        if pack is not None:  # computed whole (no trimming)
            start = 0
            outs = pack.forward(self.backbone, output_hidden_states=True)
            hidden = pack.take(*(_last_hidden(out) for out in outs))
        elif start:
            body = self.backbone.base_model
            with trimmed(body, start):
                out = body(input_ids=chunk.input_ids, attention_mask=chunk.attention_mask.long())
            hidden = out.last_hidden_state  # positions start … T - 1
        else:
            out = self.backbone(
                input_ids=chunk.input_ids,
                attention_mask=chunk.attention_mask.long(),
                output_hidden_states=True,
            )
            hidden = _last_hidden(out)
        v = self.value_head(hidden[:, :-1]).squeeze(-1)
        return torch.nn.functional.pad(v, (start + 1, 0))

    @torch.no_grad()
    def score(self, chunk: Chunk) -> torch.Tensor:
        """Value predictions ``float32[B, T]`` for scoring (0 off-response)."""
        was_training = self.training
        self.eval()
        try:
            chunk = chunk.to(self.device)
            v = self.values(chunk)
        finally:
            self.train(was_training)
        return torch.where(chunk.response_mask, v, torch.zeros_like(v))

    def reads(self) -> list[str]:
        """The old values and the returns (the clipped value loss's inputs)."""
        return [VALUES, RETURNS]

    def chunk_loss(self, chunk: Chunk, sums: SumStats) -> torch.Tensor:
        """Clipped value loss per token; records the explained-variance and range sums.

        The old values and returns are the chunk's columns, or, in the first epoch under
        ``model.ppo.old_values: critic``, what :meth:`complete` makes of the values computed
        here (detached): the first epoch then regresses on targets of its own forward pass.
        """
        if (chunk.values is None or chunk.returns is None) and not self.produces_columns:
            raise ValueError("critic chunks need values (old values) and returns columns.")
        v = self.values(chunk)
        if chunk.values is None or chunk.returns is None:  # old_values: critic, first epoch
            chunk = self.complete(chunk, v.detach())
        assert chunk.values is not None and chunk.returns is not None
        old, ret = chunk.values.to(v.dtype), chunk.returns.to(v.dtype)
        terms = value_loss(v, old, ret, clip=self.value_clip)
        mask = chunk.response_mask
        vd, rd = v.detach().to(torch.float64)[mask], ret.to(torch.float64)[mask]
        sums.add("value_loss_sum", (terms.loss.detach() * mask).sum())
        sums.add("clipped", (terms.clipped & mask).sum())
        sums.add("value_sum", vd.sum())
        sums.update_moments("returns", rd)
        sums.update_moments("residuals", rd - vd)
        sums.update_min("value_min", vd)
        sums.update_max("value_max", vd)
        sums.update_min("return_min", rd)
        sums.update_max("return_max", rd)
        return terms.loss

    def metrics(self, sums: SumStats) -> dict[str, float]:
        """Value loss, clip fraction, explained variance, value and return mean / min / max."""
        n = max(sums.get("valid_tokens"), 1.0)
        returns = sums.moments.get("returns")
        residuals = sums.moments.get("residuals")
        explained = float("nan")
        if returns is not None and residuals is not None and returns.count > 0:
            ret_var = returns.var
            if ret_var > 1e-12:
                explained = 1.0 - residuals.var / ret_var
        ret_mean = returns.mean if returns is not None else 0.0
        return {
            "value_loss": sums.get("value_loss_sum") / n,
            "clip_fraction": sums.get("clipped") / n,
            "explained_variance": explained,
            "value_mean": sums.get("value_sum") / n,
            "value_min": float(sums.mins.get("value_min", torch.tensor(0.0))),
            "value_max": float(sums.maxs.get("value_max", torch.tensor(0.0))),
            "return_mean": ret_mean,
            "return_min": float(sums.mins.get("return_min", torch.tensor(0.0))),
            "return_max": float(sums.maxs.get("return_max", torch.tensor(0.0))),
        }


def _last_hidden(out: Any) -> torch.Tensor:
    """The last hidden state of a Hugging Face model output (a base model's or a causal LM's)."""
    hidden = getattr(out, "last_hidden_state", None)
    return out.hidden_states[-1] if hidden is None else hidden
