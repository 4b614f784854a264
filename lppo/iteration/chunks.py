"""Reading planned chunks out of a replay store: the only place rows are padded."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from lppo.replay.base import ReplayStore
from lppo.types import (
    ADVANTAGES,
    GEN_LOGPROBS,
    INPUT_IDS,
    OLD_LOGPROBS,
    REF_LOGPROBS,
    RESPONSE_MASK,
    RETURNS,
    REWARD,
    VALUES,
    Chunk,
    StepPlan,
)

#: Replay columns that map onto named :class:`~lppo.types.Chunk` attributes.
NAMED_COLUMNS = {
    OLD_LOGPROBS: "old_logprobs",
    GEN_LOGPROBS: "gen_logprobs",
    REF_LOGPROBS: "ref_logprobs",
    VALUES: "values",
    ADVANTAGES: "advantages",
    RETURNS: "returns",
    REWARD: "reward",
}


def pad_rows(rows: Sequence[torch.Tensor], length: int) -> torch.Tensor:
    """Right-pad ``[L_i, ...]`` tensors with zeros into one ``[B, length, ...]`` tensor."""
    first = rows[0]
    out = first.new_zeros((len(rows), length, *first.shape[1:]))
    for b, row in enumerate(rows):
        out[b, : row.shape[0]] = row
    return out


def collate(row_ids: Sequence[int], columns: dict[str, list[torch.Tensor]]) -> Chunk:
    """Pad one chunk's rows (``name -> one tensor per row``) into a :class:`Chunk`.

    ``columns`` must hold ``input_ids`` and ``response_mask``; row-level (0-dim) columns are
    stacked to ``[B]``, token-level ones padded to ``[B, T]``.
    """
    ids = columns[INPUT_IDS]
    width = max(int(t.shape[0]) for t in ids)
    lengths = torch.tensor([int(t.shape[0]) for t in ids])
    attention = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    named: dict[str, torch.Tensor] = {}
    extras: dict[str, torch.Tensor] = {}
    for name, rows in columns.items():
        if name in (INPUT_IDS, RESPONSE_MASK):
            continue
        value = torch.stack(list(rows)) if rows[0].dim() == 0 else pad_rows(rows, width)
        if name in NAMED_COLUMNS:
            named[NAMED_COLUMNS[name]] = value
        else:
            extras[name] = value
    return Chunk(
        row_ids=tuple(row_ids),
        input_ids=pad_rows(ids, width),
        attention_mask=attention,
        response_mask=pad_rows(columns[RESPONSE_MASK], width),
        extras=extras,
        **named,
    )


def unpad(chunk: Chunk, values: torch.Tensor) -> list[torch.Tensor]:
    """Split ``[B, T]`` values of ``chunk`` back into one ``[L_i]`` tensor per row (on CPU)."""
    lengths = chunk.attention_mask.sum(dim=1).tolist()
    return [values[b, :n].detach().cpu().clone() for b, n in enumerate(lengths)]


def read_chunk(store: ReplayStore, row_ids: Sequence[int], names: Sequence[str]) -> Chunk:
    """Read ``row_ids`` with columns ``names`` (plus ids and mask) and pad them into a chunk."""
    wanted = [INPUT_IDS, RESPONSE_MASK, *(n for n in names if n not in (INPUT_IDS, RESPONSE_MASK))]
    return collate(row_ids, store.read(row_ids, wanted))


def padding_chunk() -> Chunk:
    """A zero-weight chunk with no rows: keeps data-parallel ranks at equal chunk counts."""
    empty = torch.zeros((0, 0), dtype=torch.bool)
    return Chunk(
        row_ids=(),
        input_ids=torch.zeros((0, 0), dtype=torch.long),
        attention_mask=empty,
        response_mask=empty,
        is_padding=True,
    )


def iter_chunks(store: ReplayStore, plan: StepPlan, names: Sequence[str]) -> Iterator[Chunk]:
    """Stream the chunks of one step, reading each from the store only when it is reached."""
    for row_ids in plan.chunks:
        yield read_chunk(store, row_ids, names) if row_ids else padding_chunk()
