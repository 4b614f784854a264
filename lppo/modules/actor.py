"""The actor: a causal LM trained with the clipped PPO objective, one step per ``finish``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lppo.algorithms.losses import entropy_from_logprobs, policy_loss
from lppo.algorithms.off_policy import OffPolicyCorrection, importance_weights
from lppo.modules.lifecycle import PPOModule
from lppo.stats import SumStats
from lppo.tail import check_trimmable, response_start, trimmed
from lppo.types import Chunk
from lppo.validation import check_number

if TYPE_CHECKING:
    from lppo.models import HFCausalLM


def shifted_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of each token and the log-softmax that produced them.

    Args:
        logits: ``float[B, T, V]``; position ``t`` predicts token ``t + 1``.
        input_ids: ``int64[B, T]``.

    Returns:
        ``(logprobs, logp)``: ``float[B, T]`` aligned with ``input_ids`` (0 at position 0), and
        the ``float[B, T - 1, V]`` log-softmax of positions ``0 … T - 2``.
    """
    shifted = logits[:, :-1]
    if shifted.dtype in (torch.float16, torch.bfloat16):
        shifted = shifted.float()
    logp = torch.log_softmax(shifted, dim=-1)
    picked = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.nn.functional.pad(picked, (1, 0)), logp


class ActorModule(PPOModule):
    """Policy model with the step lifecycle; subclass it to change the loss or the forward.

    Attributes:
        temperature: sampling temperature; logits are divided by it before log-softmax, so
            training scores tokens under the distribution the rollout sampled from. Not an init
            argument: :class:`~lppo.system.PPOSystem` sets it from ``model.rollout.temperature``
            (the one source of sampling settings), so the two can never disagree.

    Args:
        model: a Hugging Face causal LM, or an :class:`~lppo.models.HFCausalLM` spec built at
            setup once the tokenizer is known.
        clip_low: ε_low of the ratio clip.
        clip_high: ε_high of the ratio clip (``> clip_low`` is "clip-higher").
        dual_clip: dual-clip constant ``c > 1`` for negative advantages, or ``None``.
        entropy_coef: weight of the entropy bonus (subtracted from the loss).
        off_policy: correction of the engine/trainer mismatch (opt-in truncated or masked
            importance sampling against the engine's sampling log-probabilities; see
            :mod:`lppo.algorithms.off_policy`); its bounds are also those of the
            ``rollout/mismatch_outside_fraction`` metric.
        trim_prompt: run the model's last block and LM head only from the position before
            the chunk's first response token on (:mod:`lppo.tail`; Llama / Mistral / Qwen2
            models): the same log-probabilities to round-off, less work per chunk. Also used
            by the reference, a copy of the actor.
        **kwargs: optimizer settings of :class:`~lppo.modules.PPOModule` (``lr``,
            ``weight_decay``, ``betas``, ``eps``, ``max_grad_norm``, ``loss_aggregation``,
            ``warmup_steps``, ``optimizer``, ``lr_scheduler``).
    """

    role = "actor"

    def __init__(
        self,
        model: HFCausalLM | nn.Module,
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        dual_clip: float | None = None,
        entropy_coef: float = 0.0,
        off_policy: OffPolicyCorrection = OffPolicyCorrection(),
        trim_prompt: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        key = self.config_key
        check_number(
            f"{key}.clip_low",
            clip_low,
            low=0,
            high=1,
            high_open=True,
            fix="The ratio is clipped to [1 - clip_low, 1 + clip_high]; typical: 0.2.",
        )
        check_number(f"{key}.clip_high", clip_high, low=0, fix="Typical: 0.2 to 0.28.")
        check_number(
            f"{key}.dual_clip",
            dual_clip,
            low=1,
            low_open=True,
            optional=True,
            fix="Dual clip bounds negative-advantage ratios; typical: 3.",
        )
        check_number(f"{key}.entropy_coef", entropy_coef, low=0)
        if not isinstance(model, nn.Module):  # a spec, built in configure_model
            model.validate(f"{key}.model.init_args")
        self.clip_low = clip_low
        self.clip_high = clip_high
        self.dual_clip = dual_clip
        self.entropy_coef = entropy_coef
        self.off_policy = off_policy
        self.trim_prompt = trim_prompt
        self.temperature = 1.0
        self.spec: HFCausalLM | None = None
        self.model: nn.Module | None = None
        if isinstance(model, nn.Module):
            self.model = model
        else:
            self.spec = model

    def configure_model(
        self,
        vocab_size: int | None = None,
        pad_token_id: int | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
    ) -> None:
        """Build the model from its spec (no-op when a model object was given)."""
        if self.model is None:
            if self.spec is None or vocab_size is None:
                raise RuntimeError("actor model spec needs the vocabulary to be built.")
            self.model = self.spec.build(vocab_size, pad_token_id, bos_token_id, eos_token_id)
        if self.trim_prompt:
            check_trimmable(self.model.base_model, f"{self.config_key}.trim_prompt")

    # ---------------------------------------------------------------- forward
    def logits(self, chunk: Chunk, start: int = 0) -> torch.Tensor:
        """Temperature-scaled logits ``float[B, T - start, V]`` of positions ``start …``.

        ``start > 0`` (only with ``trim_prompt``) runs the trimmed forward of :mod:`lppo.tail`.
        """
        if self.model is None:
            raise RuntimeError("actor model not built: call configure_model() first.")
        with trimmed(self.model.base_model, start):
            out = self.model(input_ids=chunk.input_ids, attention_mask=chunk.attention_mask.long())
        # x / 1.0 == x exactly: skip a pass over [B, T, V] at the default temperature.
        return out.logits if self.temperature == 1.0 else out.logits / self.temperature

    def token_logprobs(
        self, chunk: Chunk, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probabilities of the chunk's tokens and, optionally, the policy's entropy.

        Returns:
            ``(logprobs, entropy)``, both ``float[B, T]`` with 0 at position 0: ``logprobs[t] =
            log p(input_ids[t] | input_ids[:t])`` and ``entropy[t]`` that of the distribution
            predicting token ``t`` (``None`` unless ``with_entropy``). With ``trim_prompt``
            both are 0 before the chunk's first response token too.
        """
        start = response_start(chunk.response_mask) if self.trim_prompt else 0
        # A subclass's ``logits(chunk)`` without ``start`` keeps working untrimmed.
        logits = self.logits(chunk, start) if start else self.logits(chunk)
        logprobs, logp = shifted_logprobs(logits, chunk.input_ids[:, start:])
        logprobs = torch.nn.functional.pad(logprobs, (start, 0))
        if not with_entropy:
            return logprobs, None
        return logprobs, torch.nn.functional.pad(entropy_from_logprobs(logp), (start + 1, 0))

    def policy(self) -> nn.Module:
        """The Hugging Face causal LM holding the current weights, for the rollout engine."""
        if self.model is None:
            raise RuntimeError("actor model not built: call configure_model() first.")
        return self.model

    @torch.no_grad()
    def score(self, chunk: Chunk) -> torch.Tensor:
        """Log-probabilities of the chunk's tokens, ``float32[B, T]`` (0 off-response)."""
        was_training = self.training
        self.eval()
        try:
            chunk = chunk.to(self.device)
            logprobs, _ = self.token_logprobs(chunk)
        finally:
            self.train(was_training)
        return torch.where(chunk.response_mask, logprobs, torch.zeros_like(logprobs))

    def chunk_loss(self, chunk: Chunk, sums: SumStats) -> torch.Tensor:
        """Clipped policy loss minus the entropy bonus, per token; records diagnostics."""
        if chunk.old_logprobs is None or chunk.advantages is None:
            raise ValueError("actor chunks need old_logprobs and advantages columns.")
        logprobs, entropy = self.token_logprobs(chunk, with_entropy=True)
        assert entropy is not None
        terms = policy_loss(
            logprobs,
            chunk.old_logprobs.to(logprobs.dtype),
            chunk.advantages.to(logprobs.dtype),
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            dual_clip=self.dual_clip,
        )
        mask = chunk.response_mask
        loss = terms.loss
        if self.off_policy.enabled:
            loss = loss * self._importance_weights(chunk, logprobs, sums)
        policy = loss
        if self.entropy_coef != 0.0:
            loss = loss - self.entropy_coef * entropy
        sums.add("policy_loss_sum", (policy.detach() * mask).sum())
        sums.add("clipped", (terms.clipped & mask).sum())
        sums.add("approx_kl_sum", (terms.approx_kl * mask).sum())
        sums.add("entropy_sum", (entropy.detach() * mask).sum())
        sums.add("ratio_sum", (terms.ratio.detach() * mask).sum())
        sums.update_max("ratio_max", terms.ratio.detach()[mask])
        sums.update_min("ratio_min", terms.ratio.detach()[mask])
        return loss

    def _importance_weights(
        self, chunk: Chunk, logprobs: torch.Tensor, sums: SumStats
    ) -> torch.Tensor:
        """Detached per-token weights ``π_old / μ`` of the chunk (see ``off_policy``)."""
        if chunk.gen_logprobs is None or chunk.old_logprobs is None:
            raise ValueError(
                "model.actor.init_args.off_policy is on but the chunk has no gen_logprobs "
                "column; the controller reads it when actor.off_policy.enabled."
            )
        iw = importance_weights(
            chunk.old_logprobs.to(logprobs.dtype),
            chunk.gen_logprobs.to(logprobs.dtype),
            self.off_policy,
        )
        mask = chunk.response_mask
        sums.add("is_weight_sum", (iw.weight * mask).sum())
        sums.add("is_outside", (iw.outside & mask).sum())
        return iw.weight

    def metrics(self, sums: SumStats) -> dict[str, float]:
        """Token means of the policy loss, clip fraction, approx KL, entropy and ratio."""
        n = max(sums.get("valid_tokens"), 1.0)
        extra = {}
        if self.off_policy.enabled:
            extra = {
                "is_weight_mean": sums.get("is_weight_sum") / n,
                "is_outside_fraction": sums.get("is_outside") / n,
            }
        return {
            **extra,
            "policy_loss": sums.get("policy_loss_sum") / n,
            "clip_fraction": sums.get("clipped") / n,
            "approx_kl": sums.get("approx_kl_sum") / n,
            "entropy": sums.get("entropy_sum") / n,
            "ratio_mean": sums.get("ratio_sum") / n,
            "ratio_min": float(sums.mins["ratio_min"]) if "ratio_min" in sums.mins else 0.0,
            "ratio_max": float(sums.maxs["ratio_max"]) if "ratio_max" in sums.maxs else 0.0,
        }
