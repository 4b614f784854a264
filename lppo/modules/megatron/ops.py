"""Log-probabilities and entropy over a vocabulary split across tensor-parallel ranks.

No rank materializes the full-vocabulary softmax: each holds ``float[..., V / tp]`` logits of
its slice, and only three numbers per token cross the group (the max, the sum of
exponentials, the target's logit, plus ``Σ p z`` for the entropy). The same algorithm as
megatron-core's ``vocab_parallel_cross_entropy``, but in the logits' own dtype (megatron's
upcasts to float32, which would cap float64 parity at float32 round-off).
"""

from __future__ import annotations

import torch

from lppo.parallel import ProcessGroup


def vocab_parallel_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, group: ProcessGroup, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(z)[target]`` and the entropy ``log Z − Σ p z``, vocabulary split on ``group``.

    Args:
        logits: ``float[..., V / tp]``, this rank's slice ``[rank · V/tp, (rank + 1) · V/tp)``
            (bf16 / fp16 are computed in float32).
        targets: ``int64[...]`` token ids in the full vocabulary.
        group: the tensor-parallel group the vocabulary is split over.
        with_entropy: also return the entropy.

    Returns:
        ``(logprobs, entropy)``, both ``float[...]`` and differentiable (``entropy`` is
        ``None`` unless requested).
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    width = logits.shape[-1]
    # A constant shift per token (no gradient flows through it) keeps exp() in range.
    shift = group.all_reduce(logits.detach().amax(-1), op="max")
    z = logits - shift.unsqueeze(-1)
    exp = z.exp()
    local = targets - group.rank * width
    owned = (local >= 0) & (local < width)
    picked = z.gather(-1, local.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1)
    parts = [exp.sum(-1), torch.where(owned, picked, torch.zeros_like(picked))]
    if with_entropy:
        parts.append((exp * z).sum(-1))
    sums = group.sum_partials(torch.stack(parts, -1))
    log_z = sums[..., 0].log()
    logprobs = sums[..., 1] - log_z
    if not with_entropy:
        return logprobs, None
    return logprobs, log_z - sums[..., 2] / sums[..., 0]
