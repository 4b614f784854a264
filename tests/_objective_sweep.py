"""The objective sweep's pieces: its settings, its rows and an independent merged reference.

Used by ``tests/modules/test_objective_sweep.py`` (streamed chunks vs the merged batch) and by
``tests/modules/dp_parity_worker.py`` (two gloo ranks vs one process).
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass

import torch
from _builders import filled_store, random_rows, tiny_lm

from lppo.algorithms import (
    CISPO,
    GSPO,
    LOSS_AGGREGATIONS,
    ClippedPPO,
    OffPolicyCorrection,
    importance_weights,
)
from lppo.iteration.chunks import read_chunk
from lppo.modules import ActorModule, shifted_logprobs
from lppo.types import (
    ADVANTAGES,
    GEN_LOGPROBS,
    OLD_LOGPROBS,
    REF_LOGPROBS,
    RESPONSE_MASK,
)

#: Ranges wide enough that some tokens (rows, for GSPO) are clipped and some are not.
OBJECTIVES = {
    "ppo": lambda: ClippedPPO(clip_low=0.2, clip_high=0.28, dual_clip=3.0),
    "gspo": lambda: GSPO(clip_low=0.02, clip_high=0.03),
    "cispo": lambda: CISPO(clip_low=0.5, clip_high=0.2),
}
KL_LOSS = (None, "k1", "k2", "k3")
OFF_POLICY = ("none", "truncate")
#: ``L`` of ``seq_mean_token_sum_norm`` (longer than any row's response).
MAX_RESPONSE_TOKENS = 16
SAMPLES_PER_PROMPT = 3
ENTROPY_COEF = 0.01
KL_LOSS_COEF = 0.1
NAMES = [OLD_LOGPROBS, ADVANTAGES, GEN_LOGPROBS, REF_LOGPROBS]


@dataclass(frozen=True)
class Combo:
    """One point of the sweep."""

    objective: str
    aggregation: str
    kl_loss: str | None
    off_policy: str

    def actor(
        self, model: torch.nn.Module, cls: type[ActorModule] = ActorModule, **kwargs: object
    ) -> ActorModule:
        """A ``cls`` actor on a copy of ``model`` with these settings and no gradient clipping."""
        actor = cls(
            copy.deepcopy(model),
            objective=OBJECTIVES[self.objective](),
            loss_aggregation=self.aggregation,
            entropy_coef=ENTROPY_COEF,
            kl_loss_coef=KL_LOSS_COEF if self.kl_loss else 0.0,
            kl_loss_kind=self.kl_loss or "k3",
            off_policy=OffPolicyCorrection(self.off_policy, cap=1.3),
            max_grad_norm=None,
            **kwargs,
        )
        actor.max_response_tokens = MAX_RESPONSE_TOKENS
        return actor


def combos(objectives=tuple(OBJECTIVES), aggregations=LOSS_AGGREGATIONS) -> list[Combo]:
    """Every combination of the given objectives and aggregations with KL and correction."""
    grid = itertools.product(objectives, aggregations, KL_LOSS, OFF_POLICY)
    return [Combo(*point) for point in grid]


def sweep_rows(n_prompts: int, seed: int, invalid: int = 1) -> dict[str, list[torch.Tensor]]:
    """Rows whose π_old is the tiny model's own log-probabilities plus noise (ratios near 1).

    ``prompt_index`` groups them by ``SAMPLES_PER_PROMPT``; ``ref_logprobs`` and
    ``gen_logprobs`` are π_old plus independent noise.
    """
    n = n_prompts * SAMPLES_PER_PROMPT
    cols = random_rows(n, seed, min_len=4, max_len=14, invalid_rows=invalid)
    cols["prompt_index"] = [torch.tensor(i // SAMPLES_PER_PROMPT) for i in range(n)]
    model = tiny_lm()
    g = torch.Generator().manual_seed(seed + 7)
    for name in (OLD_LOGPROBS, REF_LOGPROBS, GEN_LOGPROBS):
        cols[name] = []
    with torch.no_grad():
        for ids, mask in zip(cols["input_ids"], cols[RESPONSE_MASK], strict=True):
            lp, _ = shifted_logprobs(model(input_ids=ids[None]).logits, ids[None])
            old = lp[0] + 0.15 * torch.randn(len(ids), generator=g, dtype=lp.dtype)
            for name, scale in ((OLD_LOGPROBS, 0.0), (REF_LOGPROBS, 0.3), (GEN_LOGPROBS, 0.2)):
                x = old + scale * torch.randn(len(ids), generator=g, dtype=lp.dtype)
                cols[name].append(torch.where(mask, x, torch.zeros_like(x)))
    return cols


def sweep_store(n_prompts: int, seed: int, invalid: int = 1):
    """A memory store of :func:`sweep_rows`."""
    return filled_store(sweep_rows(n_prompts, seed, invalid))


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """The merged batch's loss, row by row, written from each mode's definition."""
    if mode == "token_mean":
        return loss[mask].mean()
    per_row = []
    for row, m in zip(loss, mask, strict=True):
        if not m.any():
            continue
        if mode == "seq_mean_token_mean":
            per_row.append(row[m].mean())
        elif mode == "seq_mean_token_sum":
            per_row.append(row[m].sum())
        elif mode == "seq_mean_token_sum_norm":
            per_row.append(row[m].sum() / MAX_RESPONSE_TOKENS)
        else:
            raise ValueError(mode)
    return torch.stack(per_row).mean()


def textbook_kl(lp: torch.Tensor, ref: torch.Tensor, kind: str) -> torch.Tensor:
    """Schulman's estimators from the probabilities ``p = π_θ``, ``q = π_ref``."""
    p, q = lp.exp(), ref.exp()
    if kind == "k1":
        return torch.log(p / q)
    if kind == "k2":
        return 0.5 * torch.log(p / q).square()
    return q / p - torch.log(q / p) - 1.0


def merged_reference(actor: ActorModule, combo: Combo, store, rows) -> tuple[dict, dict, float]:
    """One padded batch of every valid row, aggregated by :func:`aggregate`.

    Returns:
        ``(metrics, grads, grad_norm)``.
    """
    chunk = read_chunk(store, rows, NAMES)
    model = copy.deepcopy(actor.model)
    out = model(input_ids=chunk.input_ids, attention_mask=chunk.attention_mask.long())
    lp, logp = shifted_logprobs(out.logits, chunk.input_ids)
    m = chunk.response_mask
    terms = OBJECTIVES[combo.objective]()(lp, chunk.old_logprobs, chunk.advantages, m)
    policy, metrics = terms.loss, {}
    if combo.off_policy != "none":
        iw = importance_weights(chunk.old_logprobs, chunk.gen_logprobs, actor.off_policy)
        policy = policy * iw.weight
        metrics["is_weight_mean"] = iw.weight[m].mean().item()
        metrics["is_outside_fraction"] = iw.outside[m].double().mean().item()
    entropy = torch.nn.functional.pad(-(logp.exp() * logp).sum(-1), (1, 0))
    per_token = policy - ENTROPY_COEF * entropy
    if combo.kl_loss is not None:
        kl = textbook_kl(lp, chunk.ref_logprobs, combo.kl_loss)
        per_token = per_token + KL_LOSS_COEF * kl
        metrics["kl_loss"] = kl[m].mean().item()
    loss = aggregate(per_token, m, combo.aggregation)
    loss.backward()
    grads = {f"model.{n}": p.grad.detach().clone() for n, p in model.named_parameters()}
    norm = torch.sqrt(sum(g.square().sum() for g in grads.values())).item()
    ratio = terms.ratio.detach()
    if terms.sequence_level:
        rows_clipped = (terms.clipped & m).any(-1)
        metrics["seq_clip_fraction"] = rows_clipped[m.any(-1)].double().mean().item()
    metrics.update(
        loss=loss.item(),
        policy_loss=policy[m].mean().item(),
        clip_fraction=terms.clipped[m].double().mean().item(),
        approx_kl=terms.approx_kl[m].mean().item(),
        entropy=entropy[m].mean().item(),
        ratio_mean=ratio[m].mean().item(),
        ratio_min=ratio[m].min().item(),
        ratio_max=ratio[m].max().item(),
    )
    return metrics, grads, norm
