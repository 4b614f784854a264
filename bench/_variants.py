"""The model, and the three ways of training one critic epoch: streamed, merged, floor.

Every variant trains the same rows with the same weights, the same chunks and the same clipped
value loss, and takes one optimizer step at the end of the epoch. Each epoch function takes
``max_chunks`` (train only that many chunks, then drop the step: a warm-up that leaves the
weights untouched) and ``timers`` (filled with the epoch's breakdown when given).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import transformers
from _rows import FIELDS, Row, columns_of
from torch import nn

from lppo.iteration.chunks import collate, iter_chunks
from lppo.iteration.planner import ChunkPlanner
from lppo.modules import CriticModule
from lppo.modules.models import HFCausalLM
from lppo.replay import ReplayStore
from lppo.types import RETURNS, VALUES, Chunk, RowMeta, StepPlan, StepStats

#: Columns a critic chunk reads besides input_ids and response_mask.
CRITIC_COLUMNS = (VALUES, RETURNS)

Timers = dict[str, Any]


# --------------------------------------------------------------------------- model and plan
def build_backbone(hidden: int, layers: int, heads: int, vocab: int, seed: int) -> nn.Module:
    """A random float32 ``LlamaModel`` (MLP 4× hidden, sdpa), identical for every ``seed``."""
    spec = HFCausalLM(
        architecture="llama",
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        intermediate_size=4 * hidden,
        max_position_embeddings=1024,
        dtype="float32",
        seed=seed,
        attn_implementation="sdpa",
    )
    # No pad id, and LlamaConfig's own bos / eos ids: the rows are never padded with a token
    # id (attention masks do it), and a pad id would zero that embedding row.
    cfg = spec.make_config(vocab, None, 1, 2)  # type: ignore[arg-type]
    # The base model alone, not ``spec.build_backbone``: that builds the whole causal LM and
    # drops its LM head, and the heap it frees is then reused by the store being filled, which
    # makes the store's measured RssAnon growth look ~0.1× (256 rows) smaller than it is.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = transformers.AutoModel.from_config(
            cfg, attn_implementation=spec.attn_implementation
        )
    return model.to(spec.torch_dtype)


def make_critic(backbone: nn.Module) -> CriticModule:
    """The critic every variant trains: value clip 0.2, AdamW lr 1e-5, grad-norm clip 1.0."""
    return CriticModule(backbone, value_clip=0.2, lr=1e-5, max_grad_norm=1.0)


def plan_step(planner: ChunkPlanner, meta: RowMeta, epoch: int) -> StepPlan:
    """The one optimizer step of a critic epoch (minibatches=1)."""
    return planner.plan(meta, epoch=epoch, minibatches=1, phase="critic").steps[0]


# --------------------------------------------------------------------------- streamed
def epoch_streamed(
    critic: CriticModule,
    planner: ChunkPlanner,
    store: ReplayStore,
    epoch: int,
    max_chunks: int | None = None,
    timers: Timers | None = None,
) -> StepStats | None:
    """lppo's own path: plan, then read + pad each chunk from the store only when reached."""
    pc = time.perf_counter
    t0 = pc()
    plan = plan_step(planner, store.meta(), epoch)
    t_plan = pc() - t0
    critic.begin(plan)
    t_read = t_train = 0.0
    per_chunk = []
    it = iter_chunks(store, plan, CRITIC_COLUMNS)
    for _ in plan.chunks[:max_chunks]:
        a = pc()
        chunk = next(it)
        b = pc()
        critic.train_chunk(chunk)
        c = pc()
        t_read += b - a
        t_train += c - b
        per_chunk.append(c - a)
        del chunk  # the next chunk is read while only one is alive
    if max_chunks is not None:
        critic.abort()
        return None
    a = pc()
    stats = critic.finish()
    t_finish = pc() - a
    if timers is not None:
        timers.update(plan=t_plan, read_collate=t_read, train_chunk=t_train, finish=t_finish)
        timers["per_chunk"] = per_chunk
    return stats


# --------------------------------------------------------------------------- merged
def merged_payload(store: ReplayStore, order: list[int]) -> Chunk:
    """Read every row and pad it to the global longest row: the merged payload."""
    return collate(order, store.read(order, list(FIELDS)))


def payload_bytes(payload: Chunk) -> int:
    """Bytes of the payload's tensors (input_ids, both masks, values, returns)."""
    tensors = [payload.input_ids, payload.attention_mask, payload.response_mask]
    tensors += [t for t in (payload.values, payload.returns) if t is not None]
    return sum(t.numel() * t.element_size() for t in tensors)


def slice_payload(payload: Chunk, rows: tuple[int, ...], start: int, width: int) -> Chunk:
    """Rows ``start : start + len(rows)`` of the payload, cut to ``width`` tokens (views)."""
    assert payload.values is not None and payload.returns is not None
    end = start + len(rows)
    return Chunk(
        row_ids=rows,
        input_ids=payload.input_ids[start:end, :width],
        attention_mask=payload.attention_mask[start:end, :width],
        response_mask=payload.response_mask[start:end, :width],
        values=payload.values[start:end, :width],
        returns=payload.returns[start:end, :width],
    )


def epoch_merged(
    critic: CriticModule,
    planner: ChunkPlanner,
    store: ReplayStore,
    epoch: int,
    max_chunks: int | None = None,
    timers: Timers | None = None,
) -> StepStats | None:
    """One padded payload held for the epoch; micro-batches are the plan's rows sliced out."""
    pc = time.perf_counter
    t0 = pc()
    plan = plan_step(planner, store.meta(), epoch)
    order = [i for c in plan.chunks for i in c]
    payload = merged_payload(store, order)
    meta = store.meta(order)
    length = dict(zip(meta.ids, meta.lengths, strict=True))
    t_mat = pc() - t0
    if timers is not None:
        timers["payload_bytes"] = payload_bytes(payload)
        timers["payload_shape"] = list(payload.input_ids.shape)
    critic.begin(plan)
    start = 0
    per_chunk = []
    for rows in plan.chunks[:max_chunks]:
        chunk = slice_payload(payload, rows, start, max(length[i] for i in rows))
        a = pc()
        critic.train_chunk(chunk)
        per_chunk.append(pc() - a)
        del chunk
        start += len(rows)
    if max_chunks is not None:
        critic.abort()
        return None
    stats = critic.finish()
    del payload  # held for the whole epoch, as a merged-payload framework does
    if timers is not None:
        timers["materialize"] = t_mat
        timers["per_chunk"] = per_chunk
    return stats


# --------------------------------------------------------------------------- floor
class FloorBatch(NamedTuple):
    """One pre-padded chunk of the floor: plain tensors, attention mask already int64."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    values: torch.Tensor
    returns: torch.Tensor


def floor_batch(chunk: Chunk) -> FloorBatch:
    """The floor's copy of a padded chunk (the int64 mask is made here, not while timed)."""
    assert chunk.values is not None and chunk.returns is not None
    return FloorBatch(
        chunk.input_ids,
        chunk.attention_mask.long(),
        chunk.response_mask,
        chunk.values,
        chunk.returns,
    )


def prepad_rows(rows: Mapping[int, Row], plan: StepPlan) -> list[FloorBatch]:
    """The plan's chunks padded by lppo's ``collate`` from in-memory rows (no store)."""
    return [floor_batch(collate(ids, columns_of(rows, ids))) for ids in plan.chunks]


def prepad_store(store: ReplayStore, plan: StepPlan) -> list[FloorBatch]:
    """The plan's chunks read and padded by lppo's ``iter_chunks``."""
    return [floor_batch(c) for c in iter_chunks(store, plan, CRITIC_COLUMNS)]


@dataclass
class Floor:
    """A plain PyTorch copy of a critic's training: backbone, head, AdamW, clip settings.

    Attributes:
        backbone: the transformer, called directly.
        head: the value head, called directly.
        params: backbone then head parameters (the critic's optimizer order).
        opt: the AdamW optimizer over ``params``.
        value_clip: ε of the clipped value loss.
        max_grad_norm: grad-norm clip of the step.
    """

    backbone: nn.Module
    head: nn.Module
    params: list[nn.Parameter]
    opt: torch.optim.Optimizer
    value_clip: float
    max_grad_norm: float

    @classmethod
    def like(cls, critic: CriticModule) -> Floor:
        """Take ``critic``'s modules, optimizer and settings; its lifecycle is never used.

        The value head comes from ``CriticModule.make_value_head`` and the AdamW from
        ``configure_optimizer``, so the floor trains exactly what the critic would.
        """
        assert critic.backbone is not None and critic.value_head is not None
        assert critic.value_clip is not None and critic.max_grad_norm is not None
        critic.backbone.train()
        return cls(
            backbone=critic.backbone,
            head=critic.value_head,
            params=critic.trainable_parameters(),
            opt=critic.configure_optimizer(),
            value_clip=critic.value_clip,
            max_grad_norm=critic.max_grad_norm,
        )


def floor_chunk(floor: Floor, c: FloorBatch, n_valid: int) -> float:
    """Forward, clipped value loss as masked sum / global valid tokens, backward.

    Written out in plain torch on purpose (not ``lppo.algorithms.value_loss`` and
    ``token_weights``): the floor is what the same math costs with no lppo code at all.
    """
    h = floor.backbone(input_ids=c.input_ids, attention_mask=c.attention_mask)
    v = floor.head(h.last_hidden_state[:, :-1]).squeeze(-1)  # predicts positions 1..T-1
    old, ret, m = c.values[:, 1:], c.returns[:, 1:], c.response_mask[:, 1:]
    eps = floor.value_clip
    v_clip = old + torch.clamp(v - old, -eps, eps)
    per_tok = 0.5 * torch.maximum((v - ret).square(), (v_clip - ret).square())
    loss = (per_tok * m).sum() / n_valid
    loss.backward()
    return float(loss.detach())


def floor_step(floor: Floor) -> float:
    """Clip the grad norm, take the AdamW step, drop the gradients; return the norm."""
    norm = float(torch.nn.utils.clip_grad_norm_(floor.params, floor.max_grad_norm))
    floor.opt.step()
    floor.opt.zero_grad(set_to_none=True)
    return norm


def epoch_floor(
    floor: Floor,
    batches: list[FloorBatch],
    n_valid: int,
    max_chunks: int | None = None,
    timers: Timers | None = None,
) -> dict[str, float] | None:
    """Bare PyTorch loop over pre-padded chunks; one clipped AdamW step at the end."""
    pc = time.perf_counter
    floor.opt.zero_grad(set_to_none=True)
    total = 0.0
    per_chunk = []
    for c in batches[:max_chunks]:
        a = pc()
        total += floor_chunk(floor, c, n_valid)
        per_chunk.append(pc() - a)
    if max_chunks is not None:
        floor.opt.zero_grad(set_to_none=True)
        return None
    norm = floor_step(floor)
    if timers is not None:
        timers["per_chunk"] = per_chunk
    return {"loss": total, "grad_norm": norm}
