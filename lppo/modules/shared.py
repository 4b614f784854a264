"""Shared prompts: the rows of a chunk that answer one prompt compute that prompt once.

GRPO's ``G`` samples of a prompt repeat its tokens ``G`` times in every forward over the chunk
(the score passes and the actor's training pass). :func:`pack_shared` lays a chunk's rows out
again: each *group* (rows whose tokens before their first response token are equal) becomes
one block, its prompt once followed by every row's remainder (response, and for multi-turn rows
the later turns), and blocks are packed into rows of width ``W``::

    block:   [ prompt (P) | rest of row 1 (R1) | rest of row 2 (R2) | … ]
    mask:    the prompt causal; rest i sees the whole prompt and itself causally, nothing else
    ids:     prompt 0 … P − 1; rest i again P … P + Ri − 1 (each row's own positions)

so every position sees exactly the keys and values (same tokens, same positions) it sees in its
own row, and its output is the same up to round-off. The model runs with that 4-D mask and the
position ids; :meth:`SharedPack.take` reads the outputs back into the chunk's ``[B, T]`` layout
(an index gather: in the actor's backward the gradients of a prompt's positions add up over
its rows, as they would over separate rows). Everything after the forward is unchanged.

Where nothing is shared, or packing would hold more padded tokens than the rows themselves, the
chunk runs as it is (:func:`pack_shared` returns ``None``). Packed tokens never exceed the
chunk's ``rows × longest row``, so ``data.max_tokens_per_chunk`` still bounds memory.

Supported: Hugging Face ``llama``, ``mistral``, ``qwen2``, ``qwen3`` and ``gpt2`` models
without sliding-window attention, attention ``sdpa`` or ``eager`` (they take a 4-D mask as
given, :func:`unshareable` checks). ``data.share_prompts`` decides for the run
(:func:`resolve_share_prompts`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from lppo.decisions import note
from lppo.validation import SettingError

#: ``data.share_prompts``: on, off, or ``auto`` (on wherever every model of the run supports it).
ShareSetting = bool | Literal["auto"]

#: ``config.model_type`` values whose forward takes a 4-D mask and position ids as given.
SHAREABLE = ("llama", "mistral", "qwen2", "qwen3", "gpt2")

KEY = "data.share_prompts"


def unshareable(model: nn.Module) -> str | None:
    """Why ``model`` (a Hugging Face model, possibly PEFT-wrapped) cannot share prompts."""
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(hf, "config", None)
    kind = getattr(config, "model_type", None)
    windowed = getattr(config, "sliding_window", None) and getattr(
        config, "use_sliding_window", kind == "mistral"
    )
    attention = getattr(config, "_attn_implementation", None) or "sdpa"
    if kind not in SHAREABLE or windowed or attention not in ("sdpa", "eager"):
        return (
            f"it needs a {'/'.join(SHAREABLE)} model without sliding-window attention, with "
            f"attn_implementation sdpa or eager, got model_type={kind!r}, "
            f"attn_implementation={attention!r}"
        )
    return None


def float32_inside(module: nn.Module) -> str | None:
    """Why sharing would not be exact to a float64 ``module``'s round-off (``None``: it would).

    Hugging Face's RMSNorms (Llama, Mistral, Qwen) compute in float32 whatever the model's
    dtype. Per row, each row's share of a prompt's gradient passes that float32 step and the
    shares are summed in float64 afterwards; shared, their sum passes it once, so a float64
    run would agree with the per-row one to float32 round-off only. In float32 and below that
    is the run's own round-off.
    """
    for sub in module.modules():
        kind = type(sub)
        if kind.__name__.endswith("RMSNorm") and kind.__module__.startswith("transformers."):
            weight = getattr(sub, "weight", None)
            if weight is not None and weight.dtype == torch.float64:
                return (
                    f"in float64, Hugging Face's {kind.__name__} computes in float32, so a "
                    "shared prompt's gradient would round at float32"
                )
    return None


def resolve_share_prompts(
    setting: ShareSetting,
    reasons: dict[str, str | None],
    inexact: dict[str, str | None] | None = None,
) -> bool:
    """``data.share_prompts`` decided once for the run's models.

    Args:
        setting: the data group's ``share_prompts``.
        reasons: per model that runs over chunks (``model.actor`` …), why it cannot share
            (``None``: it can).
        inexact: per model, why sharing would not be exact to the run's round-off
            (:func:`float32_inside`): ``auto`` stays off, ``true`` is taken as asked.

    Raises:
        SettingError: ``true`` where a model cannot share, naming it and the fix.
    """
    if setting is False:
        note(KEY, "off", setting="false")
        return False
    against = [f"{who}: {why}" for who, why in reasons.items() if why is not None]
    if setting is True and against:
        raise SettingError(f"{KEY}=true: {'; '.join(against)}; set {KEY}: false (or auto).")
    if setting == "auto":
        against += [f"{who}: {why}" for who, why in (inexact or {}).items() if why is not None]
    if not against:
        note(KEY, "on", setting=str(setting).lower())
        return True
    note(KEY, "off", "; ".join(against))
    return False


def decide(setting: ShareSetting, modules: Sequence[Any]) -> bool:
    """Decide ``data.share_prompts`` for the run's modules and set it on each of them.

    Args:
        setting: the data group's ``share_prompts``.
        modules: the actor, critic and reference (``None`` or modules without an
            ``unshareable()`` are skipped: an adapter-free reference runs the actor's forward).
    """
    present = [m for m in modules if m is not None and hasattr(m, "unshareable")]
    reasons = {m.config_key.removesuffix(".init_args"): m.unshareable() for m in present}
    inexact = {m.config_key.removesuffix(".init_args"): float32_inside(m) for m in present}
    share = resolve_share_prompts(setting, reasons, inexact)
    for module in present:
        module.share_prompts = share
    return share


@dataclass(frozen=True)
class SharedPack:
    """A chunk's ``B`` rows (width ``T``) packed into ``R`` rows of width ``W``.

    Attributes:
        input_ids: ``int64[R, W]`` (0 on padding).
        position_ids: ``int64[R, W]``: each token's position in its own row.
        allowed: ``bool[R, 1, W, W]``, ``True`` where a query (dim 2) attends to a key (dim 3);
            padding attends to itself only.
        row: ``int64[B]``, the packed row holding each chunk row.
        column: ``int64[B, T]``, the packed column of each chunk position (a padding position
            points at its row's last token).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    allowed: torch.Tensor
    row: torch.Tensor
    column: torch.Tensor

    def inputs(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The keyword arguments of ``model``'s forward over the pack (mask in its format).

        ``sdpa`` takes the boolean mask; ``eager`` adds it to the scores, so it gets ``0`` and
        the dtype's lowest value, in the dtype of the model's embeddings.
        """
        hf = model.get_base_model() if hasattr(model, "get_base_model") else model
        mask = self.allowed
        if getattr(hf.config, "_attn_implementation", None) == "eager":
            dtype = hf.get_input_embeddings().weight.dtype
            mask = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)
        device = hf.get_input_embeddings().weight.device
        return {
            "input_ids": self.input_ids.to(device),
            "attention_mask": mask.to(device),
            "position_ids": self.position_ids.to(device),
        }

    def flat_index(self, start: int = 0) -> torch.Tensor:
        """``int64[B, T - start]``: where each chunk position from ``start`` on is.

        Position ``start + j`` of row ``b`` in the packed output of columns ``start …``,
        flattened over ``(R, W - start)``.
        """
        width = self.input_ids.shape[1] - start
        return self.row[:, None] * width + self.column[:, start:] - start

    def take(self, out: torch.Tensor, start: int = 0) -> torch.Tensor:
        """The chunk's ``[B, T - start, ...]`` outputs from packed ``out`` ``[R, W - start, ...]``.

        ``start``: the first column computed (a trimmed forward); every chunk position from
        ``start`` on lies at a packed column ``≥`` its own, so none is missing.
        """
        index = self.flat_index(start).to(out.device)
        flat = out.reshape(-1, *out.shape[2:])
        return flat[index.reshape(-1)].reshape(*index.shape, *out.shape[2:])


def _groups(ids: list[list[int]], starts: Sequence[int]) -> list[list[int]]:
    """Rows with equal prompts (tokens before the first response token), in first-seen order."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for b, row in enumerate(ids):
        groups.setdefault(tuple(row[: starts[b]]), []).append(b)
    return list(groups.values())


def pack_shared(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor
) -> SharedPack | None:
    """Pack a chunk's rows so each prompt is computed once (``None``: nothing to gain).

    Args:
        input_ids: ``int64[B, T]``, right-padded.
        attention_mask: ``bool[B, T]``.
        response_mask: ``bool[B, T]``; a row's prompt is everything before its first ``True``
            (a row without one is all prompt and shares with nothing shorter).

    Returns:
        The pack, or ``None`` when no two rows share a prompt or the pack would hold more
        padded tokens than the chunk (``R × W > B × T``).
    """
    b, t = input_ids.shape
    lengths = attention_mask.sum(dim=1).tolist()
    has = response_mask.any(dim=1)
    first = torch.where(has, response_mask.int().argmax(dim=1), attention_mask.sum(dim=1))
    starts = [min(int(s), n) for s, n in zip(first.tolist(), lengths, strict=True)]
    ids = [row[:n] for row, n in zip(input_ids.tolist(), lengths, strict=True)]
    groups = _groups(ids, starts)
    if all(len(g) == 1 for g in groups):
        return None
    sizes = [starts[g[0]] + sum(lengths[r] - starts[r] for r in g) for g in groups]
    width = max(t, *sizes)
    bins: list[list[int]] = []  # next fit: a bin holds whole groups, one after another
    used = width
    for k, size in enumerate(sizes):
        if used + size > width:
            bins.append([])
            used = 0
        bins[-1].append(k)
        used += size
    if len(bins) * width > b * t:
        return None
    return _build(ids, starts, lengths, groups, bins, width, t)


def _build(
    ids: list[list[int]],
    starts: list[int],
    lengths: list[int],
    groups: list[list[int]],
    bins: list[list[int]],
    width: int,
    t: int,
) -> SharedPack:
    """The tensors of :class:`SharedPack` for ``groups`` laid out in ``bins``."""
    n = len(bins)
    tokens = torch.zeros(n, width, dtype=torch.long)
    positions = torch.zeros(n, width, dtype=torch.long)
    # Per packed position: its block (a group in a bin), its segment (the prompt or one row's
    # rest) and whether it is a prompt token; padding gets ids no other position has.
    block = -1 - torch.arange(n * width).view(n, width)
    segment = block.clone()
    prompt = torch.zeros(n, width, dtype=torch.bool)
    row = torch.zeros(len(ids), dtype=torch.long)
    column = torch.zeros(len(ids), t, dtype=torch.long)
    for r, members in enumerate(bins):
        at = 0
        for k in members:
            rows = groups[k]
            p = starts[rows[0]]
            tokens[r, at : at + p] = torch.tensor(ids[rows[0]][:p], dtype=torch.long)
            positions[r, at : at + p] = torch.arange(p)
            block[r, at : at + p + sum(lengths[i] - p for i in rows)] = k
            segment[r, at : at + p] = len(ids)  # no row id: the prompt's own segment
            prompt[r, at : at + p] = True
            rest = at + p
            for i in rows:
                m = lengths[i] - p
                tokens[r, rest : rest + m] = torch.tensor(ids[i][p:], dtype=torch.long)
                positions[r, rest : rest + m] = torch.arange(p, p + m)
                segment[r, rest : rest + m] = i
                row[i] = r
                column[i, :p] = torch.arange(at, at + p)
                column[i, p : p + m] = torch.arange(rest, rest + m)
                column[i, p + m :] = column[i, p + m - 1] if p + m > 0 else at
                rest += m
            at = rest
    return SharedPack(tokens, positions, _allowed(block, segment, prompt), row, column)


def _allowed(block: torch.Tensor, segment: torch.Tensor, prompt: torch.Tensor) -> torch.Tensor:
    """``bool[R, 1, W, W]``: causal, within a block, own segment or the block's prompt."""
    width = block.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    same_block = block[:, :, None] == block[:, None, :]
    visible = (segment[:, :, None] == segment[:, None, :]) | prompt[:, None, :]
    return (causal & same_block & visible)[:, None]


def forward_inputs(pack: SharedPack | None, chunk: Any, model: nn.Module) -> dict[str, Any]:
    """``model``'s keyword inputs over ``chunk``: its rows as they are, or ``pack``'s layout."""
    if pack is None:
        return {"input_ids": chunk.input_ids, "attention_mask": chunk.attention_mask.long()}
    return pack.inputs(model)


def output_index(pack: SharedPack | None, shape: tuple[int, int], start: int) -> torch.Tensor:
    """``int64[B, T - start]``: each chunk position's place in the body's flattened output.

    The body's output (from position ``start``, over ``pack``'s layout or the chunk's own
    ``shape`` ``(B, T)``) flattened over all but its last dimension.
    """
    if pack is not None:
        return pack.flat_index(start)
    b, t = shape
    return torch.arange(b * (t - start)).view(b, t - start)


def pack_or_none(enabled: bool, chunk: Any) -> SharedPack | None:
    """:func:`pack_shared` of ``chunk`` (a :class:`~lppo.types.Chunk`) when ``enabled``."""
    if not enabled or chunk.input_ids.numel() == 0:
        return None
    return pack_shared(chunk.input_ids, chunk.attention_mask, chunk.response_mask)
