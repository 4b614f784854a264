"""Per-request seeded decoding for the Hugging Face engine's multi-turn continuation.

``generate`` samples a whole batch from one global RNG, so a row's tokens depend on which
other rows share its batch. A multi-turn trajectory must not (its turns are batched with
whatever other episodes are still running), so this loop samples each request from its own
``torch.Generator`` seeded with the request's seed: a request's turn depends only on its
context, its seed and the weights (up to the float round-off of batched attention). The
scores are processed as ``generate`` samples them (temperature, then top-k, then top-p, with
``transformers``' own warpers), and the log-probabilities are those of the processed
distribution, like the single-turn engine's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import transformers
from transformers import LogitsProcessorList

from lppo.modules.models import cache_keyword
from lppo.rollout.base import RolloutSettings
from lppo.rollout.hf.sampler import warpers
from lppo.rollout.turns import TurnRequest, TurnSample


@torch.no_grad()
def sample_turns(
    model: transformers.PreTrainedModel,
    requests: Sequence[TurnRequest],
    sampling: RolloutSettings,
    eos_token_id: int,
    pad_token_id: int,
    greedy: bool = False,
) -> list[TurnSample]:
    """One turn per request: a left-padded batch decoded with a KV cache, one seed per row.

    Args:
        model: the causal LM (in eval mode).
        requests: the contexts to continue (at least one).
        sampling: temperature, top-k and top-p.
        eos_token_id: the end-of-turn token (a row stops after it).
        pad_token_id: fills the left padding.
        greedy: argmax decoding.

    Returns:
        One :class:`TurnSample` per request, in order.
    """
    device = model.device
    ids, mask = _left_padded(requests, pad_token_id, device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    process = LogitsProcessorList() if greedy else warpers(sampling)
    generators = [torch.Generator().manual_seed(r.seed) for r in requests]
    tokens: list[list[int]] = [[] for _ in requests]
    logprobs: list[list[float]] = [[] for _ in requests]
    ended = [False] * len(requests)
    active = [True] * len(requests)
    # Only the last position's logits are read: not a [rows, context, vocabulary] tensor.
    out = model(
        input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1
    )
    for _ in range(max(r.max_new_tokens for r in requests)):
        scores = process(ids, out.logits[:, -1, :].float())
        logp = torch.log_softmax(scores, dim=-1).cpu()
        picked = [pad_token_id] * len(requests)
        for b, request in enumerate(requests):
            if not active[b]:
                continue
            if greedy:
                token = int(logp[b].argmax())
            else:
                token = int(torch.multinomial(logp[b].exp(), 1, generator=generators[b]))
            picked[b] = token
            tokens[b].append(token)
            logprobs[b].append(float(logp[b, token]))
            ended[b] = token == eos_token_id
            active[b] = not ended[b] and len(tokens[b]) < request.max_new_tokens
        if not any(active):
            break
        step = torch.tensor(picked, dtype=torch.int64, device=device)[:, None]
        mask = torch.cat([mask, torch.ones_like(step)], dim=1)
        positions = positions[:, -1:] + 1
        out = _decode_step(model, out, step, mask, positions)
    return [
        TurnSample(tuple(t), tuple(p), e) for t, p, e in zip(tokens, logprobs, ended, strict=True)
    ]


def _left_padded(
    requests: Sequence[TurnRequest], pad_token_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The requests' contexts as a left-padded batch on ``device``.

    Args:
        requests: the contexts (at least one).
        pad_token_id: fills the left padding.
        device: where the batch goes (the model's device).

    Returns:
        ``(input_ids, attention_mask)``, both ``int64[B, W]`` with ``W`` the longest context;
        the mask is 1 on context tokens.
    """
    width = max(len(r.context) for r in requests)
    ids = torch.full((len(requests), width), pad_token_id, dtype=torch.int64)
    mask = torch.zeros((len(requests), width), dtype=torch.int64)
    for b, request in enumerate(requests):
        ids[b, width - len(request.context) :] = torch.tensor(request.context)
        mask[b, width - len(request.context) :] = 1
    return ids.to(device), mask.to(device)


def _decode_step(
    model: transformers.PreTrainedModel,
    out: transformers.modeling_outputs.CausalLMOutputWithPast,
    step: torch.Tensor,
    mask: torch.Tensor,
    positions: torch.Tensor,
) -> transformers.modeling_outputs.CausalLMOutputWithPast:
    """One decoding forward of the tokens just picked, over the KV cache ``out`` holds.

    Args:
        model: the causal LM.
        out: the previous forward's output (its cache is extended in place).
        step: the picked tokens, ``int64[B, 1]``.
        mask: the attention mask including ``step``, ``int64[B, T + 1]``.
        positions: the position ids of ``step``, ``int64[B, 1]``.

    Returns:
        The model's output for ``step``.
    """
    keyword = cache_keyword(model)
    kwargs = {keyword: out[keyword]}  # the output names the cache as the input does
    return model(
        input_ids=step, attention_mask=mask, position_ids=positions, use_cache=True, **kwargs
    )


def continue_turns(
    model: transformers.PreTrainedModel,
    requests: Sequence[TurnRequest],
    sampling: RolloutSettings,
    special: tuple[int, int],
    batch_size: int | None,
    sort_by_length: bool,
    greedy: bool,
) -> list[TurnSample]:
    """:func:`sample_turns` over ``requests`` in batches, with the model in eval mode.

    Args:
        model: the causal LM (its train/eval mode is restored afterwards).
        requests: the contexts to continue.
        sampling: temperature, top-k and top-p.
        special: ``(eos_token_id, pad_token_id)``.
        batch_size: most requests per batch (``None``: all at once).
        sort_by_length: batch requests of similar context length together; a request's turn
            does not depend on its batch, so this changes only the padding.
        greedy: argmax decoding.

    Returns:
        One :class:`TurnSample` per request, in order.
    """
    order = list(range(len(requests)))
    if sort_by_length:
        order.sort(key=lambda r: len(requests[r].context))
    step = batch_size or max(len(requests), 1)
    placed: list[TurnSample | None] = [None] * len(requests)
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(order), step):
            part = order[start : start + step]
            batch = [requests[r] for r in part]
            samples = sample_turns(model, batch, sampling, *special, greedy=greedy)
            for r, sample in zip(part, samples, strict=True):
                placed[r] = sample
    finally:
        model.train(was_training)
    return [x for x in placed if x is not None]
