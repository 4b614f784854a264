"""The actor: a causal LM trained with the clipped PPO objective, one step per ``finish``."""

from __future__ import annotations

import copy
import functools
import inspect
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lppo.algorithms.kl import KLKind, kl_loss
from lppo.algorithms.losses import PolicyTerms, entropy_from_logprobs
from lppo.algorithms.objectives import ClippedPPO, PolicyObjective
from lppo.algorithms.off_policy import OffPolicyCorrection, importance_weights
from lppo.modules.lifecycle import PPOModule
from lppo.modules.lora import AdapterFreeReference, LoRA, MergedPolicy, check_lora, is_adapted
from lppo.modules.shared import pack_or_none, unshareable
from lppo.modules.tail import TrimSetting, resolve_trim, response_start, trimmed
from lppo.modules.vocab import VocabChunk, check_vocab_chunk, resolve_vocab_chunk, sliced_head
from lppo.stats import SumStats
from lppo.types import ADVANTAGES, GEN_LOGPROBS, OLD_LOGPROBS, REF_LOGPROBS, Chunk
from lppo.validation import SettingError, check_number

if TYPE_CHECKING:
    from lppo.modules.models import HFCausalLM


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
            argument: :class:`~lppo.run.system.PPOSystem` sets it from ``model.rollout.temperature``
            (the one source of sampling settings), so the two can never disagree.

    Args:
        model: a Hugging Face causal LM, or an :class:`~lppo.modules.models.HFCausalLM` spec built
            at setup once the tokenizer is known.
        objective: the per-token policy loss (:mod:`lppo.algorithms.objectives`):
            ``lppo.algorithms.ClippedPPO`` (``null``: the default, PPO's clipped surrogate with
            clip-higher and dual clip), ``lppo.algorithms.GSPO`` (sequence-level ratio) or
            ``lppo.algorithms.CISPO`` (clipped importance weight); each carries its own clip
            range.
        entropy_coef: weight of the entropy bonus (subtracted from the loss).
        kl_loss_coef: β of the KL penalty *in the loss*, ``β·KL(π_θ ‖ π_ref)`` per token (GRPO's
            form; 0: none). Independent of ``model.ppo.kl_coef`` (KL folded into the reward);
            either one builds the reference policy.
        kl_loss_kind: estimator of that KL, ``k1``, ``k2`` or ``k3`` (GRPO's; the gradient
            each gives is in :func:`~lppo.algorithms.kl.kl_loss`).
        off_policy: correction of the engine/trainer mismatch (opt-in truncated or masked
            importance sampling against the engine's sampling log-probabilities; see
            :mod:`lppo.algorithms.off_policy`); its bounds are also those of the
            ``rollout/mismatch_outside_fraction`` metric.
        trim_prompt: run the model's last block and LM head only from the position before
            the chunk's first response token on (:mod:`lppo.modules.tail`; Llama / Mistral / Qwen2
            models): the same log-probabilities to round-off, less work per chunk. Also used
            by the reference, a copy of the actor. ``auto`` (the default): on wherever it
            applies, off with a log line for other models, LoRA and layouts that shard the
            weights (:func:`~lppo.modules.tail.resolve_trim`).
        lora: train LoRA adapters instead of the model (:mod:`lppo.modules.lora`, the
            ``[lora]`` extra): only adapters train and hold optimizer state; the reference is
            the model with adapters disabled; engines and export get the merged weights.
        vocab_chunk: compute log-probabilities and entropy from the final hidden states and
            the output projection this many vocabulary entries at a time, forward and backward
            (:mod:`lppo.modules.vocab`): no ``[tokens, vocabulary]`` tensor is ever built, and
            only positions predicting a response token are computed (0 elsewhere). Equal to
            the materialized log-softmax to round-off. ``auto`` (the default): on wherever it
            applies, slices sized to the chunk; off with a log line for models whose logits
            are not a plain projection and for subclasses that override :meth:`logits`.
            ``0``: the materialized log-softmax of every position (the reference path).
            Also used by the reference, a copy of the actor.
        **kwargs: optimizer settings of :class:`~lppo.modules.PPOModule` (``lr``,
            ``weight_decay``, ``betas``, ``eps``, ``max_grad_norm``, ``loss_aggregation``,
            ``warmup_steps``, ``optimizer``, ``lr_scheduler``).
    """

    role = "actor"

    def __init__(
        self,
        model: HFCausalLM | nn.Module,
        objective: PolicyObjective | None = None,
        entropy_coef: float = 0.0,
        kl_loss_coef: float = 0.0,
        kl_loss_kind: KLKind = "k3",
        off_policy: OffPolicyCorrection = OffPolicyCorrection(),
        trim_prompt: TrimSetting = "auto",
        lora: LoRA | None = None,
        vocab_chunk: VocabChunk = "auto",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        key = self.config_key
        check_lora(lora, trim_prompt, key)
        check_number(f"{key}.entropy_coef", entropy_coef, low=0)
        check_vocab_chunk(vocab_chunk, f"{key}.vocab_chunk")
        check_number(f"{key}.kl_loss_coef", kl_loss_coef, low=0, fix="0: no KL in the loss.")
        if kl_loss_kind not in ("k1", "k2", "k3"):
            raise SettingError(f"{key}.kl_loss_kind={kl_loss_kind!r}; use 'k1', 'k2' or 'k3'.")
        objective = objective if objective is not None else ClippedPPO()
        if not callable(objective):
            raise SettingError(
                f"{key}.objective={objective!r} is not a policy objective; use a class_path "
                "such as lppo.algorithms.ClippedPPO, lppo.algorithms.GSPO or lppo.algorithms.CISPO."
            )
        if not isinstance(model, nn.Module):  # a spec, built in configure_model
            model.validate(f"{key}.model.init_args")
        self.objective = objective
        self.entropy_coef = entropy_coef
        self.kl_loss_coef = kl_loss_coef
        self.kl_loss_kind: KLKind = kl_loss_kind
        self.off_policy = off_policy
        #: The ``trim_prompt`` argument; :attr:`trim_prompt` is what it resolved to at setup.
        self.trim_prompt_setting: TrimSetting = trim_prompt
        self.trim_prompt = False
        #: The ``vocab_chunk`` argument; :attr:`vocab_chunk` is what it resolved to at setup.
        self.vocab_chunk_setting: VocabChunk = vocab_chunk
        self.vocab_chunk: VocabChunk = 0
        self.lora = lora
        #: Whether forwards compute each prompt once per chunk (``data.share_prompts``, set by
        #: the run plan: :func:`~lppo.modules.shared.resolve_share_prompts`).
        self.share_prompts = False
        self._merged: MergedPolicy | None = None
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
        if self.lora is not None and not is_adapted(self.model):
            self._merged = MergedPolicy(self.model)  # before wrapping: the plain base model
            self.model = self.lora.wrap(self.model)
        unfit = None
        if is_adapted(self.model):
            unfit = "LoRA: PEFT wraps the model's blocks"
        elif "start" not in inspect.signature(self.logits).parameters:
            unfit = f"{type(self).__name__}.logits(chunk) takes no start"
        body = getattr(self.model, "base_model", None)
        key = f"{self.config_key}.trim_prompt"
        shards = self.parallel.layout
        shards_name = type(shards).__name__ if shards.shards_weights() else None
        self.trim_prompt = resolve_trim(self.trim_prompt_setting, body, key, unfit, shards_name)
        key = f"{self.config_key}.vocab_chunk"
        self.vocab_chunk = resolve_vocab_chunk(
            self.vocab_chunk_setting, self.model, key, self.unsliceable()
        )

    def unsliceable(self) -> str | None:
        """Why this actor cannot use ``vocab_chunk`` whatever its model (``None``: it can)."""
        overridden = type(self).logits is not ActorModule.logits
        return f"{type(self).__name__} overrides logits(chunk)" if overridden else None

    def unshareable(self) -> str | None:
        """Why this actor's forwards cannot share prompts (``None``: they can)."""
        if (why := ActorModule.unsliceable(self)) or self.model is None:
            return why or "the model is not built"
        return unshareable(self.model)

    # ---------------------------------------------------------------- forward
    def logits(self, chunk: Chunk, start: int = 0) -> torch.Tensor:
        """Temperature-scaled logits ``float[B, T - start, V]`` of positions ``start …``.

        ``start > 0`` (only with ``trim_prompt``) runs the trimmed forward of
        :mod:`lppo.modules.tail`.
        """
        pack = pack_or_none(self.share_prompts, chunk)
        if pack is None:
            out = self._output(chunk, start)
        else:  # computed whole (no trimming), read back from position ``start``
            out = pack.take(*(o.logits for o in pack.forward(self._model())))[:, start:]
        # x / 1.0 == x exactly: skip a pass over [B, T, V] at the default temperature.
        return out if self.temperature == 1.0 else out / self.temperature

    def _model(self) -> nn.Module:
        if self.model is None:
            raise RuntimeError("actor model not built: call configure_model() first.")
        return self.model

    def _output(self, chunk: Chunk, start: int) -> torch.Tensor:
        """The model's ``logits`` output for the chunk (trimmed from ``start``), unscaled."""
        model = self._model()
        with trimmed(model.base_model, start):
            out = model(input_ids=chunk.input_ids, attention_mask=chunk.attention_mask.long())
        return out.logits

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
        if self.vocab_chunk:
            return self._sliced_logprobs(chunk, start, with_entropy)
        # A subclass's ``logits(chunk)`` without ``start`` is never trimmed (configure_model).
        logits = self.logits(chunk, start) if start else self.logits(chunk)
        logprobs, logp = shifted_logprobs(logits, chunk.input_ids[:, start:])
        logprobs = torch.nn.functional.pad(logprobs, (start, 0))
        if not with_entropy:
            return logprobs, None
        return logprobs, torch.nn.functional.pad(entropy_from_logprobs(logp), (start + 1, 0))

    def _sliced_logprobs(
        self, chunk: Chunk, start: int, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`token_logprobs` through :func:`~lppo.modules.vocab.sliced_head`."""
        if (pack := pack_or_none(self.share_prompts, chunk)) is not None:
            head = functools.partial(self._head, with_entropy=with_entropy)
            logprobs, entropy = pack.scores(
                self._model(), chunk.input_ids, chunk.response_mask, head
            )
            return logprobs, entropy if with_entropy else None
        mask = chunk.response_mask[:, start + 1 :]
        b, t = mask.shape  # position j of row b of the body's [B, T - start] output
        index = torch.arange(b * (t + 1), device=mask.device).view(b, t + 1)[:, :-1]
        targets = chunk.input_ids[:, start + 1 :][mask]
        with self._head(index[mask], targets, with_entropy):  # float[N, 2]: log-prob, entropy
            packed = self._output(chunk, start)
        placed = packed.new_zeros(*mask.shape, 2).masked_scatter(mask[..., None], packed)
        logprobs, entropy = (torch.nn.functional.pad(x, (start + 1, 0)) for x in placed.unbind(-1))
        return logprobs, entropy if with_entropy else None

    def _head(
        self, index: torch.Tensor, targets: torch.Tensor, with_entropy: bool
    ) -> AbstractContextManager[None]:
        """The vocabulary-sliced head scoring ``targets`` at the body's outputs ``index``."""
        model = self._model()
        return sliced_head(model, index, targets, self.temperature, self.vocab_chunk, with_entropy)

    def policy(self) -> nn.Module:
        """The Hugging Face causal LM holding the current weights, for the rollout engine."""
        model = self._model()
        if self._merged is not None:  # LoRA: the base model with the adapters merged in
            return self._merged.current(model, self.weights_version, self.parallel.layout)
        return model

    def reference_policy(self) -> nn.Module:
        """The frozen reference (KL): a copy of this actor, or with LoRA the base model itself.

        With LoRA the reference is this actor's own model with its adapters disabled
        (:class:`~lppo.modules.lora.AdapterFreeReference`): no second copy of the weights.
        """
        if self.lora is not None:
            return AdapterFreeReference(self)
        reference = copy.deepcopy(self)
        reference.requires_grad_(False)
        reference.eval()
        return reference

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

    def reads(self) -> list[str]:
        """π_old, advantages; μ's log-probs (off-policy correction), the reference's (KL loss)."""
        names = [OLD_LOGPROBS, ADVANTAGES]
        names += [GEN_LOGPROBS] if self.off_policy.enabled else []
        return names + ([REF_LOGPROBS] if self.needs_reference else [])

    def chunk_loss(self, chunk: Chunk, sums: SumStats) -> torch.Tensor:
        """Policy loss (``objective``), minus the entropy bonus, plus ``β·KL``, per token.

        Records the diagnostics :meth:`metrics` reports.
        """
        if (chunk.old_logprobs is None and not self.produces_columns) or chunk.advantages is None:
            raise ValueError("actor chunks need old_logprobs and advantages columns.")
        logprobs, entropy = self.token_logprobs(chunk, with_entropy=True)
        assert entropy is not None
        mask = chunk.response_mask
        if chunk.old_logprobs is None:  # model.ppo.old_logprobs: actor; π_θ is π_old here
            chunk = self.complete(chunk, logprobs.detach())
        assert chunk.old_logprobs is not None and chunk.advantages is not None
        old = chunk.old_logprobs.to(logprobs.dtype)
        terms = self.objective(logprobs, old, chunk.advantages.to(logprobs.dtype), mask)
        loss = terms.loss
        if self.off_policy.enabled:
            loss = loss * self._importance_weights(chunk, old, logprobs, sums)
        policy = loss
        if self.entropy_coef != 0.0:
            loss = loss - self.entropy_coef * entropy
        if self.kl_loss_coef != 0.0:
            loss = loss + self.kl_loss_coef * self._kl_term(chunk, logprobs, sums)
        sums.add("policy_loss_sum", (policy.detach() * mask).sum())
        sums.add("entropy_sum", (entropy.detach() * mask).sum())
        self._record_ratio(terms, mask, sums)
        return loss

    @staticmethod
    def _record_ratio(terms: PolicyTerms, mask: torch.Tensor, sums: SumStats) -> None:
        """Clip counts (per token, and per row for a sequence-level objective) and the ratio."""
        sums.add("clipped", (terms.clipped & mask).sum())
        if terms.sequence_level:
            rows = mask.any(dim=-1)
            sums.add("clipped_rows", ((terms.clipped & mask).any(dim=-1) & rows).sum())
            sums.add("valid_rows", rows.sum())
        sums.add("approx_kl_sum", (terms.approx_kl * mask).sum())
        ratio = terms.ratio.detach()
        sums.add("ratio_sum", (ratio * mask).sum())
        sums.update_max("ratio_max", ratio[mask])
        sums.update_min("ratio_min", ratio[mask])

    def _kl_term(self, chunk: Chunk, logprobs: torch.Tensor, sums: SumStats) -> torch.Tensor:
        """Per-token ``KL(π_θ ‖ π_ref)`` estimate of the chunk (with grad; see ``kl_loss_kind``)."""
        if chunk.ref_logprobs is None:
            raise ValueError(
                f"{self.config_key}.kl_loss_coef={self.kl_loss_coef} but the chunk has no "
                "ref_logprobs column; the controller reads it when kl_loss_coef > 0."
            )
        kl = kl_loss(logprobs, chunk.ref_logprobs.to(logprobs.dtype), self.kl_loss_kind)
        sums.add("kl_loss_sum", (kl.detach() * chunk.response_mask).sum())
        return kl

    @property
    def needs_reference(self) -> bool:
        """Whether the loss reads reference log-probabilities (``kl_loss_coef > 0``)."""
        return self.kl_loss_coef > 0

    def _importance_weights(
        self, chunk: Chunk, old: torch.Tensor, logprobs: torch.Tensor, sums: SumStats
    ) -> torch.Tensor:
        """Detached per-token weights ``π_old / μ`` of the chunk (see ``off_policy``)."""
        if chunk.gen_logprobs is None:
            raise ValueError(
                "model.actor.init_args.off_policy is on but the chunk has no gen_logprobs "
                "column; the controller reads it when actor.off_policy.enabled."
            )
        iw = importance_weights(
            old,
            chunk.gen_logprobs.to(logprobs.dtype),
            self.off_policy,
        )
        mask = chunk.response_mask
        sums.add("is_weight_sum", (iw.weight * mask).sum())
        sums.add("is_outside", (iw.outside & mask).sum())
        return iw.weight

    def metrics(self, sums: SumStats) -> dict[str, float]:
        """Token means of the policy loss, clip fraction, approx KL, entropy and ratio.

        Also, when they apply: ``seq_clip_fraction`` (rows with a clipped token over valid rows,
        for a sequence-level objective), ``kl_loss`` (the token mean of the KL in the loss),
        ``is_weight_mean`` and ``is_outside_fraction`` (the off-policy correction).
        """
        n = max(sums.get("valid_tokens"), 1.0)
        extra = {}
        if self.off_policy.enabled:
            extra = {
                "is_weight_mean": sums.get("is_weight_sum") / n,
                "is_outside_fraction": sums.get("is_outside") / n,
            }
        if "clipped_rows" in sums.sums:
            extra["seq_clip_fraction"] = sums.get("clipped_rows") / max(sums.get("valid_rows"), 1)
        if "kl_loss_sum" in sums.sums:
            extra["kl_loss"] = sums.get("kl_loss_sum") / n
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
