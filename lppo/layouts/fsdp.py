"""``ppo_fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard``) for Hugging Face models.

Every Hugging Face model of the run (actor, critic backbone, reference, reward model) is
sharded per decoder block and then as a whole over the data-parallel ranks: each rank holds
``1/N`` of the parameters, of the gradients and of the optimizer state. Parameters outside
those models (a critic's value head) stay whole on every rank and are summed like
``ppo_ddp``'s. The step lifecycle is unchanged:

* chunks accumulate gradients with gradient sync off (FSDP keeps the unsharded partial sums);
  a rank with no chunk to train runs a one-token zero-weight forward and backward, because
  FSDP's all-gathers are collectives and every rank must issue the same ones;
* :meth:`FSDPLayout.reduce_gradients` runs one more zero-weight forward and backward with
  sync on: its reduce-scatter is the step's one gradient reduction, a sum (gradient divide
  factor 1, so chunk losses stay exact shares of the step's loss);
  with ``reduce_every_chunk`` each chunk's backward reduce-scatters its own gradients instead
  (gradients stay sharded: 1/N per rank, not a full unsharded sum; no extra pass per step);
* the global grad norm sums every rank's shard once, and clipping scales the local shards;
* :meth:`FSDPLayout.abort` drops FSDP's pending unsharded gradients (no collective).

Forwards whose count differs between ranks (scoring, generation, evaluation) run inside
:meth:`FSDPLayout.gathered`: one all-gather per model, then rank-local forwards on full
weights, resharded at exit. Checkpoints hold full tensors (bitwise resumable; any world size
can read them), and export gets full weights.

Every trained model runs one forward per chunk (as lppo's actor and critic do); a subclass
running more forwards of a sharded model per chunk must run as many in ``idle_chunk``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lppo.layouts.base import LAYOUT_ATTRIBUTE, ParallelContext, data_parallel_context
from lppo.parallel import ProcessGroup, sum_gradients
from lppo.validation import SettingError

#: Marks the models :meth:`FSDPLayout.prepare` sharded as a whole (the FSDP roots).
ROOT_MARK = "_lppo_fsdp_root"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class FSDPLayout:
    """FSDP2 over the data-parallel ranks (see the module docstring).

    Args:
        param_dtype: compute dtype of the gathered parameters (``bfloat16``: mixed precision;
            ``None``: the model's own dtype). The sharded parameters, their gradients and the
            optimizer state stay in the model's own dtype, and so do each model's outputs
            (cast back at the model's root, for the unsharded value head and the losses).
        reduce_dtype: dtype of the gradient reduce-scatter (``None``: ``param_dtype``).
        reshard_after_forward: free each block's gathered parameters after its forward (less
            memory, one more all-gather in backward).
        cpu_offload: keep the sharded parameters, gradients and optimizer state in CPU memory
            (for GPU runs short of memory; nothing to gain on a CPU-only machine).
        reduce_every_chunk: reduce-scatter every chunk's gradients in its own backward: each
            rank holds only its shard of the gradients (not the full unsharded sum of the
            step's chunks) and the step needs no zero-weight pass, at one reduce-scatter per
            chunk instead of one per step; the sums are taken in another order (round-off).
    """

    param_dtype: str | None = None
    reduce_dtype: str | None = None
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    reduce_every_chunk: bool = False

    def __post_init__(self) -> None:
        for key in ("param_dtype", "reduce_dtype"):
            value = getattr(self, key)
            if value is not None and value not in _DTYPES:
                raise SettingError(
                    f"trainer.strategy.layout.init_args.{key}={value!r}; use one of "
                    f"{', '.join(_DTYPES)}, or null for the model's own dtype."
                )

    # ------------------------------------------------------------------- setup
    def shards_weights(self) -> bool:
        """Yes: each rank holds ``1/N`` of every Hugging Face model."""
        return True

    def context(self, world_size: int, rank: int) -> ParallelContext:
        """Sharding over every launched process (the data-parallel group)."""
        return data_parallel_context(self, world_size, rank)

    def build_context(self, root: nn.Module, world_size: int, rank: int) -> ParallelContext:
        """:meth:`context`: the models are built whole and sharded later, in :meth:`prepare`."""
        return self.context(world_size, rank)

    def prepare(self, root: nn.Module, parallel: ParallelContext) -> None:
        """Rank 0's states everywhere, then shard every Hugging Face model under ``root``."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, fully_shard

        parallel.data.broadcast_module(root)
        device = parallel.data.device
        mesh = init_device_mesh(device.type, (parallel.data.size,))
        options: dict[str, Any] = {"mesh": mesh, "mp_policy": self._precision()}
        if self.cpu_offload:
            from torch.distributed.fsdp import CPUOffloadPolicy

            options["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
        for model in hf_models(root):
            hf = model.get_base_model() if hasattr(model, "get_base_model") else model
            blocks = set(getattr(hf, "_no_split_modules", None) or ())
            for module in model.modules():
                if type(module).__name__ in blocks:
                    fully_shard(module, reshard_after_forward=self.reshard_after_forward, **options)
            # The model's outputs in its own dtype: what lppo does with them (a critic's value
            # head, which stays unsharded in that dtype; log-softmax) never sees param_dtype.
            own = next(model.parameters()).dtype
            fully_shard(model, **{**options, "mp_policy": self._precision(output=own)})
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    # A sum (not FSDP's mean): chunk losses are shares of the step's loss.
                    module.set_gradient_divide_factor(1.0)
                    module.set_force_sum_reduction_for_comms(True)
            # Reduced once per step, in reduce_gradients, unless every chunk reduces its own.
            model.set_requires_gradient_sync(self.reduce_every_chunk)
            setattr(model, ROOT_MARK, True)
            setattr(model, LAYOUT_ATTRIBUTE, self)  # for code handed only the model (layout_of)

    def _precision(self, output: torch.dtype | None = None) -> Any:
        """FSDP's mixed-precision policy; ``output``: the dtype outputs are cast to (or not)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        param = _DTYPES[self.param_dtype] if self.param_dtype else None
        reduce = _DTYPES[self.reduce_dtype] if self.reduce_dtype else None
        cast = output if param is not None and param != output else None
        return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce, output_dtype=cast)

    # --------------------------------------------------------------- the step
    def reduce_gradients(
        self, module: nn.Module, params: Sequence[nn.Parameter], group: ProcessGroup
    ) -> float:
        """Reduce-scatter the step's gradients (one synced zero-weight pass); the global norm."""
        for model in trained_roots(module) if not self.reduce_every_chunk else ():
            model.set_requires_gradient_sync(True)
            try:
                _zero_pass(model)
            finally:
                model.set_requires_gradient_sync(False)
        plain = [p for p in params if not is_sharded(p)]
        sum_gradients(plain, group)
        sharded = torch.zeros((), dtype=torch.float64)
        whole = torch.zeros((), dtype=torch.float64)
        for p in params:
            if p.grad is None:
                continue
            if is_sharded(p.grad):
                sharded += p.grad.to_local().detach().to(torch.float64).square().sum().cpu()
            else:
                whole += p.grad.detach().to(torch.float64).square().sum().cpu()
        return float((group.all_reduce(sharded) + whole).sqrt())

    def clip_gradients(self, params: Sequence[nn.Parameter], max_norm: float, norm: float) -> None:
        """Scale every local shard (and whole gradient) by torch's clipping coefficient."""
        coefficient = min(max_norm / (norm + 1e-6), 1.0)
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    local_part(p.grad).mul_(coefficient)

    def idle_chunk(self, module: nn.Module) -> None:
        """A zero-weight forward and backward, so every rank issues the same all-gathers."""
        for model in trained_roots(module):
            _zero_pass(model)

    def abort(self, module: nn.Module) -> None:
        """Drop FSDP's pending unsharded gradients of the open step (local, no collective).

        FSDP2 has no public call for this: ``reset_iter_state`` keeps them, and the only
        public way (a synced backward) is a collective a failing rank cannot run.
        """
        for model in trained_roots(module):
            for param_group in _param_groups(model):
                for fsdp_param in param_group.fsdp_params:
                    if hasattr(fsdp_param, "_unsharded_param"):
                        fsdp_param._unsharded_param.grad = None
                    fsdp_param.unsharded_accumulated_grad = None

    # ------------------------------------------------------------ full weights
    def gathered(self, modules: Sequence[nn.Module | None]) -> AbstractContextManager[None]:
        """Full weights inside: one all-gather per model, then rank-local forwards."""
        return self._gathered(modules)

    @contextlib.contextmanager
    def _gathered(self, modules: Sequence[nn.Module | None]) -> Iterator[None]:
        from torch.distributed.fsdp import FSDPModule

        roots = _unique(r for m in modules if m is not None for r in roots_of(m))
        units = _unique(u for r in roots for u in r.modules() if isinstance(u, FSDPModule))
        for root in roots:
            root.set_reshard_after_forward(False)
        try:
            for unit in units:
                unit.unshard()
            yield
        finally:
            for unit in units:
                unit.reshard()
            for root in roots:
                root.set_reshard_after_forward(self.reshard_after_forward)
                root.set_reshard_after_forward(False, recurse=False)

    def full_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """``module.state_dict()`` with every shard gathered (a collective, same on every rank)."""
        return whole_state_dict(module)

    def full(self, tensor: torch.Tensor) -> torch.Tensor:
        """The whole tensor of a shard (a collective: every rank must call it); else itself."""
        return whole(tensor)

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a sharded tensor; a whole tensor itself."""
        return local_part(tensor)

    def is_sharded(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a shard (a ``DTensor``) of an FSDP-sharded model."""
        return is_sharded(tensor)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state dict with every sharded state tensor gathered."""
        state = optimizer.state_dict()
        per_param = {
            key: {name: whole(value) for name, value in entry.items()}
            for key, entry in state["state"].items()
        }
        return {**state, "state": per_param}

    def local_optimizer_state(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> dict[str, Any]:
        """Full state tensors cut into this rank's shards of the parameters they belong to."""
        from torch.distributed.tensor import distribute_tensor

        params = [p for group in optimizer.param_groups for p in group["params"]]
        per_param: dict[Any, dict[str, Any]] = {}
        for key, entry in state["state"].items():
            p = params[int(key)]
            per_param[key] = {
                name: distribute_tensor(
                    value.to(p.device), p.device_mesh, p.placements, src_data_rank=None
                )
                if is_sharded(p) and isinstance(value, torch.Tensor) and value.shape == p.shape
                else value
                for name, value in entry.items()
            }
        return {**state, "state": per_param}


def hf_models(root: nn.Module) -> list[nn.Module]:
    """The outermost Hugging Face (or PEFT) models under ``root`` (each once), in module order.

    A LoRA model is sharded at its PEFT wrapper: PEFT calls the inner model's ``forward``
    directly, past the hooks FSDP puts on the module it shards.
    """
    from transformers import PreTrainedModel

    found: list[tuple[str, nn.Module]] = []
    for name, module in root.named_modules():
        # ``root`` itself may be the model (name ""): then everything is inside it.
        inside = any(not outer or name.startswith(f"{outer}.") for outer, _ in found)
        model = isinstance(module, PreTrainedModel) or hasattr(module, "peft_config")
        if model and not inside:
            found.append((name, module))
    return [m for _, m in found]


def roots_of(module: nn.Module) -> list[nn.Module]:
    """The models under ``module`` that :meth:`FSDPLayout.prepare` sharded."""
    return _unique(m for m in module.modules() if getattr(m, ROOT_MARK, False))


def trained_roots(module: nn.Module) -> list[nn.Module]:
    """The sharded models of ``module`` with a parameter that trains."""
    return [r for r in roots_of(module) if any(p.requires_grad for p in r.parameters())]


def _zero_pass(model: nn.Module) -> None:
    """Forward one token through ``model`` and backward a zero loss (every parameter takes part)."""
    device = next(model.parameters()).device
    out = model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device))
    first = out[0] if not isinstance(out, torch.Tensor) else out
    (first.sum() * 0.0).backward()


def _param_groups(model: nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    groups = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            groups.extend(module._get_fsdp_state()._fsdp_param_groups)
    return groups


def is_sharded(value: Any) -> bool:
    """Whether ``value`` is a sharded tensor (a ``DTensor``) of an FSDP-sharded model."""
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded tensor; a whole tensor itself."""
    return tensor.to_local() if is_sharded(tensor) else tensor


def whole(value: Any) -> Any:
    """The whole tensor of a sharded one (a collective: every rank must call it); else itself."""
    return value.full_tensor() if is_sharded(value) else value


def whole_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with every shard gathered whole (a collective if any is sharded).

    A module without shards gives its own tensors (``whole`` returns them as they are). Read
    the state dict, not the parameters of a module unsharded by ``gathered()``: FSDP's
    state-dict hook reshards it first, so gathered weights cannot be read in place.
    """
    return {k: whole(v) for k, v in module.state_dict().items()}


def _unique(items: Any) -> list[Any]:
    seen: set[int] = set()
    out = []
    for item in items:
        if id(item) not in seen:
            seen.add(id(item))
            out.append(item)
    return out
