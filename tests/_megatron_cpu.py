"""CPU shims for megatron-core 0.16 (tests only; the package never patches megatron).

megatron-core allocates on ``torch.cuda.current_device()`` in many places (RoPE tables, the
DDP gradient buffer, the global memory buffer) and its RNG tracker needs CUDA unless built
as an inference tracker. On a CPU-only torch those calls raise; these shims point them at the
CPU so the real megatron layers, DDP wrapper and collectives (gloo) run here.
"""

from __future__ import annotations

import torch

_ORIGINAL = torch.cuda.current_device


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def install() -> None:
    """Patch ``torch.cuda.current_device`` to the CPU and reset megatron's RNG tracker."""
    if torch.cuda.is_available():  # a real GPU: nothing to shim
        return
    torch.cuda.current_device = _cpu_device
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def uninstall() -> None:
    """Undo :func:`install` and tear megatron's and torch's process groups down."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    torch.cuda.current_device = _ORIGINAL
