"""The step lifecycle over megatron-core: its gradient buffer, its DDP reduce, its optimizer.

Chunks accumulate into the DDP wrapper's contiguous gradient buffer (``param.main_grad``)
under ``no_sync``; at ``finish`` the run's layout (:class:`~lppo.layouts.MegatronLayout`,
``trainer.strategy=ppo_megatron``) runs megatron's ``finalize_model_grads`` exactly once (the
only data-parallel reduce of the step, a sum since lppo's chunk losses are exact shares of the
step loss), takes the global grad norm (tensor-parallel shards counted once) and clips; then
one optimizer step.

Optimizer: with CUDA, megatron's distributed optimizer (``get_megatron_optimizer``, state
sharded over data-parallel ranks, float32 main weights for bf16 / fp16). megatron-core's
optimizers allocate on CUDA unconditionally, so on CPU the step is torch's AdamW over the same
parameters, reading the gradient buffer (``param.grad`` is pointed at ``param.main_grad``).
"""

from __future__ import annotations

from typing import Any

import torch

from lppo.layouts.base import ParallelContext
from lppo.modules.lifecycle import ChunkResult
from lppo.modules.megatron.full_state import install_optimizer_hooks
from lppo.types import Chunk
from lppo.validation import SettingError


class MegatronOptimizerAdapter(torch.optim.Optimizer):
    """megatron's optimizer seen as a ``torch.optim.Optimizer`` (Lightning accepts only those).

    It owns no parameters or state of its own: ``step``, ``zero_grad``, ``param_groups``,
    ``state`` and the state dicts are the wrapped optimizer's (``super().__init__`` is not
    called, so torch's step hooks do not exist).

    Args:
        inner: the result of ``megatron.core.optimizer.get_megatron_optimizer``.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.defaults: dict[str, Any] = {}

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups (``lr`` read and set there)."""
        return self.inner.param_groups

    @property  # type: ignore[override]
    def state(self) -> Any:
        """The wrapped optimizer's state."""
        return self.inner.state

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """One megatron optimizer step (gradients already in the grad buffer, clipped)."""
        return self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the wrapped optimizer's gradients."""
        self.inner.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped optimizer's state dict."""
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load into the wrapped optimizer."""
        self.inner.load_state_dict(state_dict)


#: Why megatron modules cannot share prompts (``data.share_prompts``).
MEGATRON_UNSHAREABLE = (
    "megatron's GPTModel runs its own forward (no Hugging Face key-value cache input)"
)


def untrimmed(kwargs: dict[str, Any], key: str, name: str) -> dict[str, Any]:
    """``kwargs`` with ``trim_prompt`` off: megatron runs its own forward, not HF's blocks.

    Raises:
        SettingError: an explicit ``trim_prompt: true`` (``key``: the module's init-args key).
    """
    if kwargs.get("trim_prompt") is True:
        raise SettingError(
            f"{key}.trim_prompt=true is for Hugging Face Llama-family models; {name} runs "
            "megatron's own forward. Set it to false (or auto)."
        )
    return {**kwargs, "trim_prompt": False}


def causal_inputs(chunk: Chunk) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTModel inputs of a right-padded chunk: ``(input_ids, position_ids, attention_mask)``.

    Rows are right-padded, so a causal mask alone keeps padding out of every real position;
    the mask is explicit (``bool[1, 1, T, T]``, ``True`` = masked) because megatron's default
    causal mask is allocated on CUDA.
    """
    ids = chunk.input_ids
    t = ids.shape[1]
    positions = torch.arange(t, device=ids.device).expand_as(ids)
    mask = torch.ones(t, t, dtype=torch.bool, device=ids.device).triu(1)[None, None]
    return ids, positions, mask


class MegatronLifecycle:
    """Mixin over :class:`~lppo.modules.PPOModule` for modules whose model is megatron's DDP.

    Subclasses hold the wrapped model in :attr:`ddp` and the :class:`MegatronGPT` spec in
    ``spec``; the spec's ``distributed_optimizer`` picks megatron's optimizer, which runs at
    the default constant learning rate only (no warmup, factories or schedulers).
    """

    spec: Any

    @property
    def ddp(self) -> Any:
        """The megatron ``DistributedDataParallel`` model (``None`` until ``configure_model``)."""
        raise NotImplementedError

    # --------------------------------------------------------- parallel groups
    @property
    def parallel(self) -> ParallelContext:
        """The groups a controller handed over, or the spec's (``ppo_megatron``'s, megatron's).

        Raises:
            RuntimeError: read before the model was built (the spec holds no groups yet).
        """
        ctx: ParallelContext | None = self.__dict__["_lppo_parallel"]
        return self._own_groups() if ctx is None else ctx

    @parallel.setter
    def parallel(self, ctx: ParallelContext) -> None:
        """Take the controller's groups (at setup): ``ppo_megatron``'s, of megatron's sizes.

        The first assignment is :class:`~lppo.modules.PPOModule`'s placeholder, made before
        the model exists; so is the run's, handed over by the system before the model is
        built (for what other modules decide while built; a megatron module decides nothing
        from it). Until a controller hands groups over, the module uses its spec's.

        Raises:
            SettingError: another layout (megatron's DDP reduces this module's gradients), or
                groups of other sizes than megatron-core's, naming the keys.
        """
        if "_lppo_parallel" not in self.__dict__ or self.spec.context is None:
            self.__dict__["_lppo_parallel"] = None
            return
        own = self._own_groups()
        if not isinstance(ctx.layout, type(own.layout)):
            raise SettingError(
                f"model.{self.role} is a megatron-core module ({type(self).__name__}) but "
                f"trainer.strategy lays the run out with {type(ctx.layout).__name__}; set "
                "trainer.strategy=ppo_megatron (megatron's data x tensor-parallel groups and "
                "its gradient reduce), with any trainer.devices."
            )
        if (ctx.data.size, ctx.tensor.size) != (own.data.size, own.tensor.size):
            raise SettingError(
                f"{self.spec.key}={self.spec.tensor_parallel_size}: lppo trains over "
                f"{ctx.data.size} data- x {ctx.tensor.size} tensor-parallel rank(s) but "
                f"megatron-core's groups are {own.data.size} x {own.tensor.size} "
                "(trainer.devices x trainer.num_nodes / tensor_parallel_size). Take the "
                "groups from lppo.runtime.strategy.parallel_context (as lppo fit does)."
            )
        self.__dict__["_lppo_parallel"] = ctx

    def _own_groups(self) -> ParallelContext:
        """The groups the spec built the model over (megatron's, with ``ppo_megatron``'s layout)."""
        ctx: ParallelContext | None = self.spec.context
        if ctx is None:
            raise RuntimeError(f"{self.role}: megatron model not built: call configure_model().")
        return ctx

    def _use_megatron_optimizer(self) -> bool:
        return bool(self.spec.distributed_optimizer)

    # --------------------------------------------------------------- optimizer
    def configure_optimizer(self) -> Any:
        """Megatron's distributed optimizer on CUDA; torch AdamW over the buffer elsewhere."""
        if self.optimizer is not None or not self._use_megatron_optimizer():
            built = self.optimizer is not None
            optimizer = super().configure_optimizer()  # type: ignore[misc]
            if not built:
                optimizer.register_step_pre_hook(_grads_from_buffer)
                if self.parallel.tensor.size > 1:  # checkpoints hold whole moments
                    install_optimizer_hooks(optimizer, self.ddp.module, self.parallel.tensor)
            return optimizer
        if self._optimizer_factory or self._scheduler_factory or self.warmup_steps:
            raise ValueError(
                f"{self.role}: megatron's distributed optimizer runs at a constant lr; drop "
                "optimizer / lr_scheduler / warmup_steps, or set the model's "
                "distributed_optimizer: false."
            )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        dtype = self.spec.hf.torch_dtype
        config = OptimizerConfig(
            optimizer="adam",
            lr=self.lr,
            weight_decay=self.weight_decay,
            adam_beta1=self.betas[0],
            adam_beta2=self.betas[1],
            adam_eps=self.eps,
            clip_grad=0.0,  # lppo clips with the norm it checked for finiteness
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            params_dtype=dtype,
            use_distributed_optimizer=True,
        )
        self.optimizer = MegatronOptimizerAdapter(get_megatron_optimizer(config, [self.ddp]))
        return self.optimizer

    # --------------------------------------------------------------- lifecycle
    def train_chunk(self, chunk: Chunk) -> ChunkResult:
        """Accumulate one chunk into megatron's grad buffer, with no data-parallel sync."""
        with self.ddp.no_sync():
            return super().train_chunk(chunk)  # type: ignore[misc]

    def _zero_grad(self) -> None:
        if self.ddp is not None:
            self.ddp.zero_grad_buffer()
        for p in self.parameters():  # type: ignore[attr-defined]
            p.grad = None


def _grads_from_buffer(optimizer: torch.optim.Optimizer, *args: Any) -> None:
    """Step pre-hook of torch's optimizer: ``param.grad`` := megatron's reduced, clipped buffer."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            main = getattr(p, "main_grad", None)
            if main is not None:
                p.grad = main if main.dtype == p.dtype else main.to(p)
