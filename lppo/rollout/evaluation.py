"""What an evaluation generation returns, and the guard that keeps training undisturbed by it.

:meth:`lppo.rollout.RolloutSource.evaluate` samples (or decodes greedily) a fixed prompt set
between iterations; it runs under :func:`undisturbed`, so that training after it is bitwise
what it would have been without it.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from lppo.rollout.base import GenerationOutput


@dataclass(frozen=True)
class EvalSamples:
    """The samples of one evaluation and their rewards.

    Attributes:
        output: the generated samples, grouped by prompt (``samples_per_prompt`` each).
        rewards: one reward per sample, in the order of ``output``.
    """

    output: GenerationOutput
    rewards: list[float]


@contextlib.contextmanager
def undisturbed(module: torch.nn.Module) -> Iterator[None]:
    """Run a block without gradients, then restore RNGs and every submodule's train/eval mode.

    Forks torch's CPU RNG and that of every initialized CUDA device, and saves Python's
    ``random`` state (and NumPy's, when installed), so whatever the block draws leaves the
    training trajectory untouched.

    Args:
        module: the module whose (and whose submodules') ``training`` flags are restored.
    """
    modes = [(m, m.training) for m in module.modules()]
    python_state = random.getstate()
    numpy_state = _numpy_state()
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    devices = list(range(torch.cuda.device_count())) if cuda else []
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            yield
    finally:
        random.setstate(python_state)
        if numpy_state is not None:
            import numpy

            numpy.random.set_state(numpy_state)
        for m, training in modes:
            m.training = training


def _numpy_state() -> Any:
    """NumPy's global RNG state, or ``None`` without NumPy."""
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy comes with torch / transformers
        return None
    return numpy.random.get_state()
