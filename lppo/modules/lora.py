"""LoRA adapters (Hugging Face PEFT) on the actor's or the critic's model: only adapters train.

With ``model.actor.init_args.lora`` the actor's causal LM is wrapped by PEFT: its weights are
frozen and low-rank adapters ``W + (α/r)·B·A`` on the target linear layers are the only
parameters the optimizer sees (and holds state for). The reference policy is the same model
with its adapters disabled (:class:`AdapterFreeReference`), not a second copy of the weights;
rollout engines and export get a plain Hugging Face model holding the merged weights
(:class:`MergedPolicy`). Needs the ``[lora]`` extra (``pip install -c constraints.txt -e
'.[lora]'``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lppo.layouts.base import ParallelLayout
from lppo.validation import SettingError, check_number

EXTRA = "pip install -c constraints.txt -e '.[lora]'"


def _peft() -> Any:
    try:
        import peft
    except ImportError as error:  # pragma: no cover - the dev install has it
        raise ImportError(f"LoRA needs Hugging Face PEFT, the [lora] extra: {EXTRA}") from error
    return peft


@dataclass(frozen=True)
class LoRA:
    """LoRA settings of one module (``model.actor.init_args.lora``, the critic's likewise).

    Attributes:
        r: rank of the adapters.
        alpha: scale numerator: the update is ``(alpha / r)·B·A``.
        dropout: dropout on the adapters' input (0: none; disabled with
            ``model.ppo.disable_dropout`` like every dropout).
        target_modules: names (or name suffixes) of the linear layers to adapt;
            ``null``: every linear layer of the transformer blocks (PEFT's ``all-linear``:
            not the LM head).
        seed: seed of the adapters' initialization (``A``; ``B`` starts at 0, so the adapted
            model starts as the base model); the global RNG is left untouched, so every process
            and every rank builds the same adapters.
    """

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] | None = None
    seed: int = 0

    def validate(self, key: str) -> None:
        """Raise ``SettingError`` naming ``key`` for a bad setting."""
        check_number(f"{key}.r", self.r, integer=True, low=1, fix="Typical: 8 to 64.")
        check_number(f"{key}.alpha", self.alpha, low=0, low_open=True, fix="Typical: 2 x r.")
        check_number(f"{key}.dropout", self.dropout, low=0, high=1, high_open=True)
        check_number(f"{key}.seed", self.seed, integer=True, low=0)
        if self.target_modules is not None and not self.target_modules:
            raise SettingError(
                f"{key}.target_modules=[] adapts nothing; name layers (e.g. [q_proj, v_proj]) "
                "or set null for every linear layer."
            )

    def wrap(self, model: nn.Module) -> nn.Module:
        """``model`` with frozen weights and trainable adapters (a PEFT ``PeftModel``)."""
        peft = _peft()
        config = peft.LoraConfig(
            r=self.r,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=list(self.target_modules) if self.target_modules else "all-linear",
            init_lora_weights=True,  # B = 0: the wrapped model starts as the base model
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            return peft.get_peft_model(model, config)


def check_lora(lora: LoRA | None, trim_prompt: bool | str, key: str) -> None:
    """Validate a module's ``lora`` setting (``key``: the module's init-args key)."""
    if lora is None:
        return
    lora.validate(f"{key}.lora")
    if trim_prompt is True:
        raise SettingError(
            f"{key}.trim_prompt=true with {key}.lora: the trimmed forward swaps a block of the "
            "plain model, which PEFT has wrapped; set trim_prompt: false."
        )


def is_adapted(model: nn.Module | None) -> bool:
    """Whether ``model`` is a PEFT-wrapped model."""
    return model is not None and hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


def merged_state(model: nn.Module, layout: ParallelLayout) -> dict[str, torch.Tensor]:
    """The base model's state dict with every adapter folded into its weight.

    Keys are the plain Hugging Face names (``…q_proj.weight``); each adapted weight is
    ``W + ΔW`` (PEFT's own ``get_delta_weight``, so GPT-2's transposed layers are handled).
    Tensors are taken whole through ``layout`` (the module's): under ``ppo_fsdp`` the shards
    are gathered, so every rank must call it.
    """
    from peft.tuners.lora import LoraLayer

    deltas = {}
    base = model.get_base_model()
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            for adapter in module.active_adapters:
                delta = layout.full(module.get_delta_weight(adapter).detach())
                deltas[f"{name}.weight"] = deltas.get(f"{name}.weight", 0) + delta
    state = {}
    for key, value in base.state_dict().items():
        if ".lora_" in key:
            continue
        plain = key.replace(".base_layer.", ".")
        tensor = layout.full(value.detach())  # shards gathered (every rank calls this)
        state[plain] = tensor + deltas[plain].to(tensor.dtype) if plain in deltas else tensor
    return state


class MergedPolicy:
    """A plain Hugging Face model holding an adapted model's merged weights, kept current.

    Built once (a copy of the base model, taken before it was wrapped), refreshed from
    :func:`merged_state` whenever the adapters changed; it is never a submodule, so it is
    neither trained nor checkpointed.

    Args:
        plain: the base model before wrapping (copied here).
    """

    def __init__(self, plain: nn.Module) -> None:
        self._model = [copy.deepcopy(plain).requires_grad_(False)]
        self._version = 0  # the copy holds the base weights: the adapters start at 0

    def current(self, adapted: nn.Module, version: int, layout: ParallelLayout) -> nn.Module:
        """The merged model for the adapted model's weights at ``version``.

        ``layout``: how the adapted model's tensors are held (the actor's).
        """
        model = self._model[0]
        if version != self._version:
            with torch.no_grad():
                model.load_state_dict(merged_state(adapted, layout))
            self._version = version
        return model


class AdapterFreeReference(nn.Module):
    """The reference policy of a LoRA actor: the actor's own model, adapters disabled.

    It holds no weights (the actor is kept outside the module tree), so it adds nothing to
    memory or checkpoints; its log-probabilities are the base model's exactly.

    Args:
        actor: the LoRA actor.
    """

    def __init__(self, actor: nn.Module) -> None:
        super().__init__()
        self._actor = [actor]

    def score(self, chunk: Any) -> torch.Tensor:
        """The base model's log-probabilities of the chunk's tokens (see ``ActorModule.score``)."""
        actor = self._actor[0]
        with actor.model.disable_adapter():
            return actor.score(chunk)
