"""Factories of Hugging Face causal language models (actor / reference) and backbones (critic).

:class:`HFCausalLM` is addressed by ``class_path`` from LightningCLI YAML. It either loads a local
checkpoint (offline) or builds a small randomly initialised model deterministically from a seed,
without touching the global RNG. Every built model exposes ``model.config.hidden_size`` (also via
:func:`hidden_size_of`), including GPT-2 whose native name is ``n_embd``.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import transformers

from lppo.validation import SettingError, check_number

ARCHITECTURES = ("llama", "gpt2")

#: Files of a tokenizer saved next to a checkpoint (any of them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def resolve_dtype(name: str) -> torch.dtype:
    """Map a dtype name (``"float32"``, ``"bfloat16"``, ...) to a ``torch.dtype``.

    Args:
        name: one of the keys of :data:`DTYPES`.

    Returns:
        The torch dtype.

    Raises:
        ValueError: for an unknown name.
    """
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {sorted(DTYPES)}") from None


def _own_vocabulary(path: str) -> dict[str, int] | None:
    """The vocabulary of the tokenizer saved with a checkpoint (``None``: it has none)."""
    if not any((Path(path) / f).exists() for f in TOKENIZER_FILES):
        return None
    return dict(transformers.AutoTokenizer.from_pretrained(path, local_files_only=True).get_vocab())


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword this transformers version passes a KV cache under (``cache`` from 5.20)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def attention_obstacle(config: Any, kinds: Sequence[str], fits: bool = True) -> str | None:
    """Why a model of ``config`` is not one of ``kinds`` with full ``sdpa``/``eager`` attention.

    ``None``: it is. Sliding-window models and other attention implementations (flash, flex)
    build other masks; ``fits``: the caller's own check of the model's layout passed.
    """
    kind = getattr(config, "model_type", None)
    windowed = getattr(config, "sliding_window", None) and getattr(
        config, "use_sliding_window", kind == "mistral"
    )
    attention = getattr(config, "_attn_implementation", None) or "sdpa"
    if kind not in kinds or not fits or windowed or attention not in ("sdpa", "eager"):
        return (
            f"it needs a {'/'.join(kinds)} model without sliding-window attention, with "
            f"attn_implementation sdpa or eager, got model_type={kind!r}, "
            f"attn_implementation={attention!r}"
        )
    return None


def hidden_size_of(model: transformers.PreTrainedModel) -> int:
    """Return the width of the hidden states of ``model`` (causal LM or backbone)."""
    return int(model.config.hidden_size)


class HFCausalLM:
    """Factory of a Hugging Face causal LM, from a local checkpoint or randomly initialised.

    Args:
        pretrained_path: local directory of a checkpoint to load with ``from_pretrained``
            (offline; ``local_files_only``). When ``None`` a random model is built from the
            remaining arguments.
        architecture: ``"llama"`` or ``"gpt2"`` (random models only).
        hidden_size: width of the hidden states (random models only).
        num_layers: number of transformer blocks (random models only).
        num_heads: number of attention heads (random models only).
        intermediate_size: width of the MLP (random models only).
        max_position_embeddings: longest supported sequence (random models only).
        dtype: parameter dtype: ``"float32"``, ``"float64"``, ``"bfloat16"`` or ``"float16"``.
        seed: seed of the random initialisation; the global RNG is left untouched.
        attn_implementation: Hugging Face attention backend. ``"sdpa"`` (default) handles
            the fully masked rows of left padding in every dtype; ``"eager"`` turns them into
            NaN in float64 (softmax over all ``-inf``), which breaks float64 generation.
    """

    def __init__(
        self,
        pretrained_path: str | None = None,
        architecture: str = "llama",
        hidden_size: int = 64,
        num_layers: int = 2,
        num_heads: int = 4,
        intermediate_size: int = 128,
        max_position_embeddings: int = 256,
        dtype: str = "float32",
        seed: int = 0,
        attn_implementation: str = "sdpa",
    ) -> None:
        if pretrained_path is None and architecture not in ARCHITECTURES:
            raise ValueError(f"unknown architecture {architecture!r}; known: {ARCHITECTURES}")
        self.pretrained_path = pretrained_path
        self.architecture = architecture
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.intermediate_size = intermediate_size
        self.max_position_embeddings = max_position_embeddings
        self.dtype = dtype
        self.torch_dtype = resolve_dtype(dtype)
        self.seed = seed
        self.attn_implementation = attn_implementation

    def validate(self, key: str) -> None:
        """Check the numeric settings; ``key`` is where the owner holds this spec (messages).

        The owner (actor, critic or reward model) calls it, since only the owner knows the
        spec's place in the configuration.

        Raises:
            SettingError: naming ``<key>.<setting>``, the value and the allowed range.
        """
        for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size"):
            check_number(f"{key}.{name}", getattr(self, name), integer=True, low=1)
        check_number(
            f"{key}.max_position_embeddings", self.max_position_embeddings, integer=True, low=1
        )
        check_number(f"{key}.seed", self.seed, integer=True, low=0)
        if self.hidden_size % self.num_heads:
            raise SettingError(
                f"{key}.hidden_size={self.hidden_size} is not divisible by "
                f"{key}.num_heads={self.num_heads}; choose sizes with hidden_size % num_heads == 0."
            )

    def make_config(
        self, vocab_size: int, pad_token_id: int, bos_token_id: int, eos_token_id: int
    ) -> transformers.PretrainedConfig:
        """Return the config of the random model ``build`` would create.

        Args:
            vocab_size: number of token ids.
            pad_token_id: padding id.
            bos_token_id: beginning-of-sequence id.
            eos_token_id: end-of-sequence id.

        Returns:
            A ``LlamaConfig`` or ``GPT2Config`` (dropout disabled).
        """
        ids = {
            "pad_token_id": pad_token_id,
            "bos_token_id": bos_token_id,
            "eos_token_id": eos_token_id,
        }
        if self.architecture == "llama":
            return transformers.LlamaConfig(
                vocab_size=vocab_size,
                hidden_size=self.hidden_size,
                intermediate_size=self.intermediate_size,
                num_hidden_layers=self.num_layers,
                num_attention_heads=self.num_heads,
                num_key_value_heads=self.num_heads,
                max_position_embeddings=self.max_position_embeddings,
                attention_dropout=0.0,
                **ids,
            )
        return transformers.GPT2Config(
            vocab_size=vocab_size,
            n_embd=self.hidden_size,
            n_layer=self.num_layers,
            n_head=self.num_heads,
            n_inner=self.intermediate_size,
            n_positions=self.max_position_embeddings,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            summary_first_dropout=0.0,
            **ids,
        )

    def check_vocabulary(
        self, key: str, tokenizer: Any, resize: bool, fix: str | None = None
    ) -> None:
        """Refuse a checkpoint whose vocabulary is not the run's tokenizer's, unless ``resize``.

        A checkpoint with fewer token embeddings than the tokenizer has tokens, or one that
        ships a tokenizer other than the run's, would read the run's ids as other tokens.

        Args:
            key: where the spec sits in the configuration (``model.actor.init_args.model``).
            tokenizer: the run's tokenizer.
            resize: ``model.resize_embeddings``: resize the embeddings to the tokenizer instead.
            fix: what the message proposes (``None``: the run's tokenizer, or resizing).

        Raises:
            SettingError: naming the checkpoint, both vocabularies and the fixes.
        """
        if self.pretrained_path is None:
            return
        if not os.path.isdir(self.pretrained_path):
            raise SettingError(
                f"{key}.init_args.pretrained_path={self.pretrained_path!r} is not a directory "
                f"(from {os.getcwd()!r}): give a local Hugging Face checkpoint directory (lppo "
                "loads offline), e.g. an HFExport's <run dir>/hf/policy."
            )
        if resize:
            return
        path, size = self.pretrained_path, len(tokenizer)
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        rows = getattr(config, "vocab_size", None)
        own = _own_vocabulary(path)
        if rows is not None and rows < size:
            problem = f"has {rows} token embeddings but the run's tokenizer has {size} tokens"
        elif own is not None and own != tokenizer.get_vocab():
            theirs = tokenizer.get_vocab()
            differ = sorted(k for k in own.keys() | theirs.keys() if own.get(k) != theirs.get(k))
            problem = (
                f"ships a tokenizer of {len(own)} tokens that is not the run's ({size} tokens; "
                f"{len(differ)} tokens differ, e.g. {differ[:5]})"
            )
        else:
            return
        fix = fix or (
            f"Use its own tokenizer (model.tokenizer_path={path!r}) or a checkpoint trained with "
            "the run's; or set model.resize_embeddings: true to resize its embeddings to the "
            "run's tokenizer (rows it adds start untrained)."
        )
        raise SettingError(
            f"{key}.init_args.pretrained_path={path!r} {problem}: the run's token ids would "
            f"not mean its tokens. {fix}"
        )

    def _random_causal_lm(
        self, vocab_size: int, pad_token_id: int, bos_token_id: int, eos_token_id: int
    ) -> transformers.PreTrainedModel:
        cfg = self.make_config(vocab_size, pad_token_id, bos_token_id, eos_token_id)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model = transformers.AutoModelForCausalLM.from_config(
                cfg, attn_implementation=self.attn_implementation
            )
        return model.to(self.torch_dtype)

    def _load(self, auto_class: type, **kwargs: object) -> transformers.PreTrainedModel:
        """``auto_class.from_pretrained`` of the local checkpoint (offline), in ``dtype``."""
        return auto_class.from_pretrained(
            self.pretrained_path,
            dtype=self.torch_dtype,
            local_files_only=True,
            attn_implementation=self.attn_implementation,
            **kwargs,
        )

    def _finish(
        self,
        model: transformers.PreTrainedModel,
        vocab_size: int,
        pad_token_id: int,
        bos_token_id: int,
        eos_token_id: int,
    ) -> transformers.PreTrainedModel:
        """Make a loaded checkpoint agree with the tokenizer's size and special ids."""
        if model.get_input_embeddings().num_embeddings < vocab_size:
            model.resize_token_embeddings(vocab_size)
        for name, value in (("pad", pad_token_id), ("bos", bos_token_id), ("eos", eos_token_id)):
            if getattr(model.config, f"{name}_token_id", None) is None:
                setattr(model.config, f"{name}_token_id", value)
        return model

    def build(
        self, vocab_size: int, pad_token_id: int, bos_token_id: int, eos_token_id: int
    ) -> transformers.PreTrainedModel:
        """Build the causal LM (with its LM head).

        Args:
            vocab_size: number of token ids of the tokenizer.
            pad_token_id: padding id.
            bos_token_id: beginning-of-sequence id.
            eos_token_id: end-of-sequence id.

        Returns:
            The model on CPU, in ``self.dtype``. Two calls with the same arguments return
            models with identical weights.
        """
        if self.pretrained_path is None:
            return self._random_causal_lm(vocab_size, pad_token_id, bos_token_id, eos_token_id)
        model = self._load(transformers.AutoModelForCausalLM)
        return self._finish(model, vocab_size, pad_token_id, bos_token_id, eos_token_id)

    def build_classifier(
        self, vocab_size: int, pad_token_id: int, bos_token_id: int, eos_token_id: int
    ) -> transformers.PreTrainedModel:
        """Build a sequence classifier with one output (a reward model).

        A checkpoint is loaded with ``AutoModelForSequenceClassification`` (``num_labels`` 1); a
        random model gets a random ``score`` head from the same seed.

        Args:
            vocab_size: number of token ids of the tokenizer.
            pad_token_id: padding id.
            bos_token_id: beginning-of-sequence id.
            eos_token_id: end-of-sequence id.

        Returns:
            A ``*ForSequenceClassification`` model with ``base_model`` and ``score``.
        """
        if self.pretrained_path is None:
            cfg = self.make_config(vocab_size, pad_token_id, bos_token_id, eos_token_id)
            cfg.num_labels = 1
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed)
                model = transformers.AutoModelForSequenceClassification.from_config(
                    cfg, attn_implementation=self.attn_implementation
                )
            return model.to(self.torch_dtype)
        model = self._load(transformers.AutoModelForSequenceClassification, num_labels=1)
        return self._finish(model, vocab_size, pad_token_id, bos_token_id, eos_token_id)

    def build_backbone(
        self, vocab_size: int, pad_token_id: int, bos_token_id: int, eos_token_id: int
    ) -> transformers.PreTrainedModel:
        """Build the base model (no LM head), e.g. for a critic.

        Its weights are identical to the body of the model :meth:`build` returns (for a random
        model: the same seed; for a checkpoint: the same file).

        Args:
            vocab_size: number of token ids of the tokenizer.
            pad_token_id: padding id.
            bos_token_id: beginning-of-sequence id.
            eos_token_id: end-of-sequence id.

        Returns:
            A ``LlamaModel`` / ``GPT2Model`` (or the checkpoint's ``AutoModel`` class) whose
            output ``last_hidden_state`` has width ``model.config.hidden_size``.
        """
        if self.pretrained_path is None:
            lm = self._random_causal_lm(vocab_size, pad_token_id, bos_token_id, eos_token_id)
            return lm.base_model
        model = self._load(transformers.AutoModel)
        return self._finish(model, vocab_size, pad_token_id, bos_token_id, eos_token_id)
