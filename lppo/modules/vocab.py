"""Log-probabilities and entropy slice by slice over the vocabulary: no ``[tokens, V]`` tensor.

The materialized path builds the logits ``z = h·Wᵀ / τ`` of every position (``float[N, V]``),
their log-softmax and, for the entropy, ``p`` and ``p·log p``: at 151,936 entries a 2,048-token
chunk holds several 1.2 GB tensors for backward. Here the output projection's rows are taken
``size`` at a time (a slice ``float[N, size]``); an online log-sum-exp carries, per token,

* ``m``: the running maximum logit, ``s = Σ exp(z − m)`` and ``t = Σ exp(z − m)·(z − m)``,
* the taken token's logit, read in whichever slice holds it,

so that ``log Z = m + log s``, ``log p(y) = z_y − log Z`` and the entropy
``H = log Z − E_p[z] = log s − t / s`` (``t`` is kept relative to ``m``: no cancellation when
the distribution is peaked). Backward recomputes each slice's logits and applies

* ``∂ log p(y) / ∂z_v = 1[v = y] − p_v``,
* ``∂H / ∂z_v = −p_v·(z_v − E_p[z])``,

then the projection's own backward (``∂h = g·W / τ``, ``∂W = gᵀ·h / τ``, ``∂b = Σ g / τ``, and
for a LoRA head ``∂u = g·B / τ``, ``∂B = gᵀ·u / τ``). Nothing of size ``[N, V]`` is ever held:
at most one slice, in backward four (``z``, ``p``, the gradient and its cast).

Only the positions that predict a response token are computed (the others are 0). The result
equals the materialized path's to the dtype's round-off (``tests/modules/test_vocab.py``).

The head runs *inside* the model's own forward (:func:`sliced_head` swaps the output
projection for a :class:`SlicedHead` for one call, as :mod:`lppo.modules.tail` swaps a block):
so FSDP2 gathers the projection exactly as it would for the plain head, and the packed result
is the model's ``logits`` output, with FSDP's backward hooks on it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch import nn

from lppo.decisions import note
from lppo.validation import SettingError

#: A module's ``vocab_chunk`` setting: vocabulary entries per slice, ``0`` (the materialized
#: path), or ``auto`` (on wherever it applies; slices sized by :func:`slice_size`).
VocabChunk = int | Literal["auto"]

#: ``config.model_type`` values whose causal-LM forward ends in ``logits = lm_head(hidden)``.
SLICEABLE = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gpt2")

#: Elements of one ``[tokens, slice]`` block under ``auto`` (4 MiB in float32; forward and
#: backward hold about five such blocks): small enough to stay in cache, which on a CPU makes
#: the sliced forward and backward faster than the materialized one despite the recomputed
#: logits (``bench/real_vocab.py --head``: 2,048 tokens × 151,936 entries on 2 CPU threads,
#: 3.6–4.0 s at 1 M elements, 7.7 s at 8 M, 5.8–6.1 s materialized).
AUTO_ELEMENTS = 1 << 20
#: The fewest entries ``auto`` puts in a slice (the matrix products' efficiency).
AUTO_MIN_ENTRIES = 128


def check_vocab_chunk(setting: Any, key: str) -> None:
    """Raise ``SettingError`` naming ``key`` unless ``setting`` is ``auto`` or an int ≥ 0."""
    if setting == "auto" and isinstance(setting, str):
        return
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 0:
        raise SettingError(
            f"{key}={setting!r}; use auto (the default), 0 for the materialized log-softmax, "
            "or a number of vocabulary entries per slice such as 8192."
        )


def _lora_parts(head: nn.Module) -> str | None:
    """Why a PEFT LoRA output projection cannot be sliced (``None``: it can)."""
    if not isinstance(getattr(head, "base_layer", None), nn.Linear):
        return f"its output projection is a {type(head).__name__}"
    if any(getattr(head, "use_dora", {}).values()):
        return "its output projection carries DoRA adapters"
    return None


def unsliceable(model: nn.Module) -> str | None:
    """Why ``model`` (a Hugging Face causal LM, possibly PEFT-wrapped) cannot slice its head.

    ``None``: its forward ends in a linear output projection whose output is the logits.
    """
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(hf, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in SLICEABLE:
        return f"it needs a {'/'.join(SLICEABLE)} causal LM, got model_type={kind!r}"
    if getattr(config, "final_logit_softcapping", None) is not None:
        return "the model soft-caps its logits after the output projection"
    head = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
    if isinstance(head, nn.Linear):
        return None
    return _lora_parts(head) if head is not None else "it has no output projection"


def resolve_vocab_chunk(
    setting: VocabChunk, model: nn.Module | None, key: str, unfit: str | None = None
) -> VocabChunk:
    """A module's ``vocab_chunk`` decided once for its model: ``0`` (off), a size, or ``auto``.

    Args:
        setting: the module's ``vocab_chunk`` argument (checked by :func:`check_vocab_chunk`).
        model: the Hugging Face causal LM (``None`` only with ``unfit``).
        key: the setting's configuration key (for the messages).
        unfit: why this module cannot slice, whatever its model (``None``: nothing).

    Raises:
        SettingError: an explicit size where the module or its model cannot slice.
    """
    if setting == 0:
        note(key, "off", setting="0")
        return 0
    reason = unfit or (unsliceable(model) if model is not None else "no Hugging Face model")
    if reason is None:
        note(key, "on", setting=str(setting))
        return setting
    if setting != "auto":
        raise SettingError(f"{key}={setting}: {reason}; set {key}: 0 (or auto).")
    note(key, "off", reason)
    return 0


def slice_size(setting: VocabChunk, tokens: int, vocab: int) -> int:
    """Vocabulary entries per slice: the setting, or under ``auto`` ``AUTO_ELEMENTS / tokens``.

    ``auto`` never goes below ``AUTO_MIN_ENTRIES`` nor above the vocabulary.
    """
    if setting != "auto":
        return min(int(setting), vocab)
    return max(min(AUTO_ELEMENTS // max(tokens, 1), vocab), min(AUTO_MIN_ENTRIES, vocab))


def _slice_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    low_rank: tuple[torch.Tensor, torch.Tensor] | None,
    span: slice,
    temperature: float,
    compute: torch.dtype,
) -> torch.Tensor:
    """``(h·W[span]ᵀ + b[span] + u·B[span]ᵀ) / τ`` as ``compute[N, len(span)]``."""
    z = torch.nn.functional.linear(hidden, weight[span], None if bias is None else bias[span])
    if low_rank is not None:
        u, b = low_rank
        z = z + u @ b[span].T
    # x / 1.0 == x exactly: skip a pass at the default temperature (as the plain path does).
    z = z if temperature == 1.0 else z / temperature
    return z.to(compute)


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """float32 for half-precision models (as the plain path upcasts), else the model's dtype."""
    return torch.float32 if hidden.dtype in (torch.float16, torch.bfloat16) else hidden.dtype


class _SlicedLogprobs(torch.autograd.Function):
    """The online log-sum-exp of the module docstring, with its recomputing backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        u: torch.Tensor | None,
        b: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: float,
        size: int,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        compute = _compute_dtype(hidden)
        n, vocab = hidden.shape[0], weight.shape[0]
        low_rank = None if u is None or b is None else (u, b)
        m = s = t = picked = hidden.new_zeros(n, dtype=compute)
        floor = torch.finfo(compute).min
        for lo in range(0, vocab if n else 0, size):
            hi = min(lo + size, vocab)
            z = _slice_logits(hidden, weight, bias, low_rank, slice(lo, hi), temperature, compute)
            top = z.max(dim=-1).values
            new_m = top if lo == 0 else torch.maximum(m, top)
            d = z - new_m[:, None]
            e = d.exp()
            # ≤ 0; exp(shift) rescales the sums kept relative to the old m. The first slice has
            # no old m (exp(0 - top) could overflow and turn 0 · inf into NaN).
            shift = m - new_m if lo else torch.zeros_like(top)
            rescale = shift.exp()
            if with_entropy:
                t = rescale * (t + s * shift) + (e * d.clamp_min(floor)).sum(dim=-1)
            s = rescale * s + e.sum(dim=-1)
            m = new_m
            here = (targets >= lo) & (targets < hi)
            index = (targets - lo).clamp(0, hi - lo - 1)[:, None]
            picked = torch.where(here, z.gather(1, index).squeeze(1), picked)
        log_s = s.log() if n else s
        logz = m + log_s
        entropy = log_s - t / s if n and with_entropy else torch.zeros_like(s)
        ctx.save_for_backward(hidden, weight, bias, u, b, targets, logz, logz - entropy)
        ctx.temperature, ctx.size = temperature, size
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None
        return picked - logz, entropy

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, g_logprob: torch.Tensor | None, g_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, u, b, targets, logz, mean_z = ctx.saved_tensors
        need = ctx.needs_input_grad
        compute = _compute_dtype(hidden)
        low_rank = None if u is None or b is None else (u, b)
        g_h = torch.zeros_like(hidden, dtype=compute) if need[0] else None
        g_w = torch.zeros_like(weight) if need[1] else None
        g_b = torch.zeros_like(bias) if bias is not None and need[2] else None
        g_u = torch.zeros_like(u, dtype=compute) if u is not None and need[3] else None
        g_lr = torch.zeros_like(b) if b is not None and need[4] else None
        floor = torch.finfo(compute).min
        n, vocab = hidden.shape[0], weight.shape[0]
        rows = torch.arange(n, device=hidden.device)
        for lo in range(0, vocab if n else 0, ctx.size):
            hi = min(lo + ctx.size, vocab)
            span = slice(lo, hi)
            z = _slice_logits(hidden, weight, bias, low_rank, span, ctx.temperature, compute)
            p = (z - logz[:, None]).exp()
            g = (
                torch.zeros_like(z)
                if g_entropy is None
                else -(g_entropy[:, None] * p * (z.clamp_min(floor) - mean_z[:, None]))
            )
            if g_logprob is not None:
                g = g - g_logprob[:, None] * p
                here = (targets >= lo) & (targets < hi)
                g[rows[here], targets[here] - lo] += g_logprob[here]
            g = (g if ctx.temperature == 1.0 else g / ctx.temperature).to(weight.dtype)
            if g_h is not None:
                g_h += g @ weight[span]
            if g_w is not None:
                g_w[span] = g.T @ hidden
            if g_b is not None:
                g_b[span] = g.sum(dim=0)
            if g_u is not None:
                g_u += g @ b[span]
            if g_lr is not None:
                g_lr[span] = g.T @ u
        g_h = None if g_h is None else g_h.to(hidden.dtype)
        g_u = None if g_u is None else g_u.to(u.dtype)
        return g_h, g_w, g_b, g_u, g_lr, None, None, None, None


def sliced_logprobs(
    hidden: torch.Tensor,
    head: nn.Module,
    targets: torch.Tensor,
    temperature: float,
    setting: VocabChunk,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``log softmax(head(h) / τ)[y]`` and the entropy, slice by slice over the vocabulary.

    Args:
        hidden: ``float[N, H]``, the final hidden states of the positions to score.
        head: the output projection, an ``nn.Linear`` or a PEFT LoRA ``Linear`` around one
            (its active adapters, dropout and scaling applied as PEFT does; none when its
            adapters are disabled or merged).
        targets: ``int64[N]``, the token each position predicts.
        temperature: ``τ``, the sampling temperature.
        setting: a ``vocab_chunk`` value other than 0 (see :func:`slice_size`).
        with_entropy: compute the entropy (else it is returned as zeros).

    Returns:
        ``(logprobs, entropy)``, both ``float[N]`` (float32 for half-precision models),
        differentiable in ``hidden`` and the projection's trainable weights.
    """
    base = head.base_layer if hasattr(head, "base_layer") else head
    u = b = None
    if base is not head and not head.disable_adapters and not head.merged:
        us, bs = [], []
        for name in head.active_adapters:
            if name in head.lora_A:
                x = head.lora_dropout[name](hidden)
                us.append(head.lora_A[name](x) * head.scaling[name])
                bs.append(head.lora_B[name].weight)
        if us:
            u, b = torch.cat(us, dim=-1), torch.cat(bs, dim=-1)
    size = slice_size(setting, hidden.shape[0], base.weight.shape[0])
    return _SlicedLogprobs.apply(
        hidden, base.weight, base.bias, u, b, targets, temperature, size, with_entropy
    )


class SlicedHead(nn.Module):
    """Stands in for the output projection during one forward; see :func:`sliced_head`.

    Its output (the model's ``logits``) is ``float[N, 2]``: per scored position, the log-prob
    of its target and the entropy.
    """

    def __init__(
        self,
        head: nn.Module,
        index: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        setting: VocabChunk,
        with_entropy: bool,
    ) -> None:
        super().__init__()
        self._head = [head]  # a list: not a submodule (no second name for its weights)
        self.index, self.targets = index, targets
        self.temperature, self.setting, self.with_entropy = temperature, setting, with_entropy

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden``: ``float[..., H]``; its position ``index[n]`` predicts ``targets[n]``."""
        rows = hidden.reshape(-1, hidden.shape[-1])[self.index.to(hidden.device)]
        logprobs, entropy = sliced_logprobs(
            rows,
            self._head[0],
            self.targets.to(hidden.device),
            self.temperature,
            self.setting,
            self.with_entropy,
        )
        return torch.stack((logprobs, entropy), dim=-1)


@contextmanager
def sliced_head(
    model: nn.Module,
    index: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    setting: VocabChunk,
    with_entropy: bool = True,
) -> Iterator[None]:
    """Within the block, ``model``'s ``logits`` are :class:`SlicedHead`'s ``float[N, 2]``.

    The output projection is swapped back on exit, so parameter names, checkpoints and
    exports never see the stand-in.

    Args:
        model: a causal LM that passed :func:`unsliceable` (PEFT-wrapped or not).
        index: ``int64[N]``, the positions to score, in the body's output flattened over
            every dimension but the last.
        targets: ``int64[N]``, the token each of them predicts.
        temperature: the sampling temperature.
        setting: the resolved ``vocab_chunk`` (not 0).
        with_entropy: compute the entropy (else its column is zeros).
    """
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = hf.get_output_embeddings()
    hf.set_output_embeddings(SlicedHead(head, index, targets, temperature, setting, with_entropy))
    try:
        yield
    finally:
        hf.set_output_embeddings(head)
