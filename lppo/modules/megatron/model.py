"""``MegatronGPT``: a megatron-core ``GPTModel`` built from a Hugging Face Llama, and back.

The model always starts from Hugging Face weights (a checkpoint, or the random Llama an
:class:`~lppo.modules.models.HFCausalLM` spec builds from its seed), converted with
:mod:`lppo.modules.megatron.convert` and sharded over the tensor-parallel group. So a random
megatron model equals the Hugging Face one of the same spec, and every tensor-parallel size
starts from the same weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import transformers
from torch import nn

from lppo.layouts.base import ParallelContext
from lppo.layouts.megatron import MegatronLayout
from lppo.modules.megatron.convert import (
    AttentionShape,
    hf_to_megatron,
    megatron_to_hf,
    shard,
    split_dim,
    unshard,
)
from lppo.modules.megatron.full_state import install_model_hooks
from lppo.modules.models import HFCausalLM
from lppo.parallel import ProcessGroup
from lppo.validation import check_number

_EXTRA = (
    "megatron-core is not installed; install lppo's extra from the clone: "
    "pip install -c constraints.txt -e '.[megatron]'"
)


def require_megatron() -> None:
    """Raise ``ImportError`` naming the ``[megatron]`` extra when megatron-core is missing."""
    try:
        import megatron.core  # noqa: F401
    except ImportError as error:
        raise ImportError(_EXTRA) from error


class ValueHead(nn.Module):
    """Stands in for GPTModel's ``output_layer``: ``[S, B, h] -> ([S, B, 1], None)``.

    Args:
        head: the scalar head (e.g. ``Linear(h, 1)``), replicated on every tensor-parallel rank
            (its input, the final hidden state, is the same on all of them).
    """

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.head = head

    def forward(self, hidden: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, None]:
        """Apply the head; megatron's output-layer keywords (``weight``, ...) are ignored."""
        return self.head(hidden), None


def _wrapped_keys(module: nn.Module, state: dict[str, Any], prefix: str, *args: Any) -> None:
    """Load hook of megatron's DDP: its state dict keys lack ``module.``; loading wants them.

    megatron's ``state_dict`` returns the wrapped model's keys, but torch's recursive load
    reaches the model through the wrapper's ``module`` child (``<prefix>module.<name>``).
    """
    for key in [k for k in state if k.startswith(prefix) and not k.startswith(prefix + "module.")]:
        state[prefix + "module." + key[len(prefix) :]] = state.pop(key)


class MegatronGPT:
    """Factory of a megatron-core GPTModel (local layer spec) holding a Hugging Face Llama.

    Args:
        hf: the Hugging Face Llama to start from (``architecture: llama``; a checkpoint or a
            seeded random model). Its ``dtype`` is the megatron parameter dtype.
        tensor_parallel_size: ranks each layer is split over (heads, MLP width and
            vocabulary must divide by it).
        distributed_optimizer: megatron's distributed optimizer (state sharded over
            data-parallel ranks; reduce-scattered gradients). ``null``: when CUDA is
            available; it needs CUDA. Otherwise torch AdamW over megatron's gradient buffer.
        bucket_size: megatron DDP gradient-bucket size in elements (``null``: megatron's
            default).
    """

    def __init__(
        self,
        hf: HFCausalLM,
        tensor_parallel_size: int = 1,
        distributed_optimizer: bool | None = None,
        bucket_size: int | None = None,
    ) -> None:
        require_megatron()
        if hf.pretrained_path is None and hf.architecture != "llama":
            raise ValueError(
                f"megatron model.hf.architecture={hf.architecture!r}: only the Llama family "
                "converts; use architecture: llama."
            )
        self.hf = hf
        if distributed_optimizer and not torch.cuda.is_available():
            raise ValueError(
                "distributed_optimizer=true needs CUDA (megatron-core's optimizers allocate "
                "there); set it to false or null on CPU."
            )
        self.tensor_parallel_size = tensor_parallel_size
        self.distributed_optimizer = (
            torch.cuda.is_available() if distributed_optimizer is None else distributed_optimizer
        )
        self.bucket_size = bucket_size
        self.hf_config: transformers.PretrainedConfig | None = None
        #: The groups the model is built over: handed over by ``ppo_megatron``'s layout before
        #: the run builds its models, else megatron's own, taken at :meth:`build`.
        self.context: ParallelContext | None = None
        self.key = "tensor_parallel_size"  # its config key, named in messages (validate)

    # ------------------------------------------------------------------ build

    def validate(self, key: str) -> None:
        """Check the numeric settings; ``key`` is where the owner holds this spec (messages).

        Raises:
            SettingError: naming ``<key>.<setting>``, the value and the allowed range.
        """
        self.key = f"{key}.tensor_parallel_size"
        check_number(self.key, self.tensor_parallel_size, integer=True, low=1)
        check_number(
            f"{key}.bucket_size",
            self.bucket_size,
            integer=True,
            low=1,
            optional=True,
            fix="null: megatron's default bucket size.",
        )
        self.hf.validate(f"{key}.hf.init_args")

    def build(
        self,
        vocab_size: int,
        pad_token_id: int,
        bos_token_id: int,
        eos_token_id: int,
        value_head: Callable[[int], nn.Module] | None = None,
    ) -> nn.Module:
        """Build the Hugging Face model, convert it, and wrap megatron's GPTModel in its DDP.

        Args:
            vocab_size: tokenizer size.
            pad_token_id: padding id.
            bos_token_id: beginning-of-sequence id.
            eos_token_id: end-of-sequence id.
            value_head: ``hidden_size -> head`` replacing the output layer (a critic);
                ``None`` keeps the LM head.

        Returns:
            ``megatron.core.distributed.DistributedDataParallel`` around the GPTModel; its
            forward returns ``[B, T, V / tp]`` logits (or ``[B, T, 1]`` values).
        """
        if self.context is None:  # built outside lppo's strategy (a script, a test)
            self.context = MegatronLayout().groups(self.tensor_parallel_size, self.key)
        if torch.cuda.is_available():
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            # megatron's attention forks its CUDA RNG tracker even with zero dropout
            model_parallel_cuda_manual_seed(self.hf.seed)
        hf_model = self.hf.build(vocab_size, pad_token_id, bos_token_id, eos_token_id)
        self.hf_config = hf_model.config
        state = hf_to_megatron(hf_model.state_dict(), self.shape, lm_head=value_head is None)
        del hf_model
        gpt = self._gpt(self.hf_config, lm_head=value_head is None)
        if value_head is not None:
            param = next(gpt.parameters())
            head = value_head(int(self.hf_config.hidden_size))
            gpt.output_layer = ValueHead(head.to(dtype=param.dtype, device=param.device))
        tp = self.context.tensor
        with torch.no_grad():
            for name, param in gpt.named_parameters():
                if name.startswith("output_layer.head."):
                    continue
                param.copy_(shard(name, state[name], tp.rank, tp.size))
                dim = split_dim(name)
                if dim is not None:
                    # megatron sets these only in the initialization skipped above; its
                    # optimizer and checkpointing read them
                    param.tensor_model_parallel = True
                    param.partition_dim = dim
                    param.partition_stride = 1
        if tp.size > 1:  # state dicts (checkpoints) hold whole tensors
            install_model_hooks(gpt, tp)
        return self._wrap(gpt)

    @property
    def shape(self) -> AttentionShape:
        """Head layout of the built model's attention."""
        cfg = self._config()
        heads = int(cfg.num_attention_heads)
        groups = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return AttentionShape(heads, groups, int(head_dim))

    def _config(self) -> transformers.PretrainedConfig:
        if self.hf_config is None:
            raise RuntimeError("MegatronGPT used before build().")
        return self.hf_config

    def transformer_config(self, cfg: transformers.PretrainedConfig) -> Any:
        """The megatron ``TransformerConfig`` equal to the Hugging Face Llama config."""
        from megatron.core.transformer import TransformerConfig

        shape = AttentionShape(
            cfg.num_attention_heads,
            getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        )
        dtype = self.hf.torch_dtype
        return TransformerConfig(
            num_layers=cfg.num_hidden_layers,
            hidden_size=cfg.hidden_size,
            num_attention_heads=shape.num_heads,
            num_query_groups=shape.num_groups,
            kv_channels=shape.head_dim,
            ffn_hidden_size=cfg.intermediate_size,
            tensor_model_parallel_size=self.tensor_parallel_size,
            normalization="RMSNorm",
            layernorm_epsilon=cfg.rms_norm_eps,
            gated_linear_unit=True,
            activation_func=torch.nn.functional.silu,
            add_bias_linear=False,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            params_dtype=dtype,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            use_cpu_initialization=not torch.cuda.is_available(),
            perform_initialization=False,  # weights are copied in from Hugging Face
            # lppo's chunk losses are exact shares of the step loss: sum, never average, grads
            calculate_per_token_loss=True,
            masked_softmax_fusion=False,
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            apply_rope_fusion=False,
            gradient_accumulation_fusion=False,
        )

    def _gpt(self, cfg: transformers.PretrainedConfig, lm_head: bool) -> nn.Module:
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type {rope['rope_type']!r} is not converted; only 'default'.")
        if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
            raise ValueError("Llama checkpoints with attention or MLP biases are not converted.")
        vocab = int(cfg.vocab_size)
        if vocab % self.tensor_parallel_size:
            raise ValueError(
                f"vocabulary size {vocab} is not divisible by tensor_parallel_size="
                f"{self.tensor_parallel_size}; choose a divisor or pad the tokenizer."
            )
        model = GPTModel(
            self.transformer_config(cfg),
            get_gpt_layer_local_spec(normalization="RMSNorm"),
            vocab_size=vocab,
            max_sequence_length=int(cfg.max_position_embeddings),
            position_embedding_type="rope",
            rotary_base=int(theta),
            share_embeddings_and_output_weights=False,
            parallel_output=True,
        )
        # torch's RMSNorm is built in float32 whatever params_dtype says: one dtype throughout
        return model.to(self.hf.torch_dtype)

    def _wrap(self, gpt: nn.Module) -> nn.Module:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
        )

        ddp = DistributedDataParallelConfig(
            # bf16 / fp16 grads accumulate over chunks in float32; float32 / float64 in place
            grad_reduce_in_fp32=self.hf.torch_dtype in (torch.bfloat16, torch.float16),
            overlap_grad_reduce=False,  # one synchronous reduce per optimizer step, in finish
            use_distributed_optimizer=self.distributed_optimizer,
            bucket_size=self.bucket_size,
        )
        wrapped = DistributedDataParallel(gpt.config, ddp, gpt)
        wrapped.register_load_state_dict_pre_hook(_wrapped_keys)
        return wrapped

    # ----------------------------------------------------------------- export
    def export_state(self, model: nn.Module, group: ProcessGroup) -> dict[str, torch.Tensor]:
        """Hugging Face-named full weights of ``model`` (gathered over ``group``; collective).

        Every tensor-parallel rank must call this; each receives the whole state dict.
        """
        gpt = getattr(model, "module", model)
        full = {}
        for name, param in gpt.named_parameters():
            if name.startswith("output_layer.head."):
                continue
            full[name] = unshard(name, group.all_gather(param.detach()))
        return megatron_to_hf(full, self.shape)

    def export_hf(self, model: nn.Module, group: ProcessGroup) -> transformers.PreTrainedModel:
        """A new ``LlamaForCausalLM`` holding ``model``'s current weights (collective)."""
        cfg = self._config()
        with torch.random.fork_rng(devices=[]):
            hf = transformers.AutoModelForCausalLM.from_config(
                cfg, attn_implementation=self.hf.attn_implementation
            )
        # beside the megatron weights (the rollout engine samples where training runs)
        hf = hf.to(device=next(model.parameters()).device, dtype=self.hf.torch_dtype)
        hf.load_state_dict(self.export_state(model, group))
        return hf
