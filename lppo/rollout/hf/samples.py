"""``generate``'s output as samples: responses cut after EOS, their log-probabilities.

Two log-probabilities per sampled token: under the distribution it was sampled from
(``generate``'s processed scores: temperature, top-p, top-k, any processor) and, when asked,
under π itself (the raw logits at the sampling temperature, before any processor: the
log-probs the actor scores as π_old).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import transformers

from lppo.rollout.base import GenerationOutput


@dataclass
class Sample:
    """One generated sample (see :class:`~lppo.rollout.GenerationOutput` for the fields)."""

    input_ids: torch.Tensor
    response_mask: torch.Tensor
    gen_logprobs: torch.Tensor
    policy_logprobs: torch.Tensor | None
    completion: str
    truncated: bool


def cut_samples(
    batch: list[list[int]],
    tokens: torch.Tensor,
    logprobs: tuple[torch.Tensor, torch.Tensor | None],
    tokenizer: transformers.PreTrainedTokenizerBase,
    eos_token_id: int,
    ignore_eos: bool,
) -> list[Sample]:
    """One sample per row of ``batch``: its response cut after the first EOS (kept).

    Args:
        batch: each row's prompt ids.
        tokens: ``int64[B, T]`` generated tokens (CPU).
        logprobs: ``float32[B, T]`` their log-probabilities under the sampling distribution
            and under π itself (or ``None``), on CPU.
        tokenizer: decodes the completions (special tokens skipped).
        eos_token_id: the end-of-sequence token.
        ignore_eos: no stop token: every response runs to ``T`` tokens and none is truncated.
    """
    sampled, policy = logprobs
    samples = []
    for r, ids in enumerate(batch):
        is_eos = (tokens[r] == eos_token_id).nonzero()
        done = is_eos.numel() > 0 and not ignore_eos
        n = int(is_eos[0, 0]) + 1 if done else tokens.shape[1]
        response = tokens[r, :n]
        p = len(ids)
        mask = torch.zeros(p + n, dtype=torch.bool)
        mask[p:] = True
        text_ids = response[:-1] if done else response
        samples.append(
            Sample(
                input_ids=torch.cat([torch.tensor(ids, dtype=torch.int64), response]),
                response_mask=mask,
                gen_logprobs=_on_response(sampled[r, :n], p),
                policy_logprobs=None if policy is None else _on_response(policy[r, :n], p),
                completion=tokenizer.decode(text_ids.tolist(), skip_special_tokens=True),
                truncated=not (done or ignore_eos),
            )
        )
    return samples


def _on_response(values: torch.Tensor, prompt: int) -> torch.Tensor:
    """``float32[prompt + n]``: 0 on the prompt, then the response's ``values``."""
    out = torch.zeros(prompt + values.shape[0], dtype=torch.float32)
    out[prompt:] = values
    return out


def as_output(samples: Sequence[Sample], rows: Sequence[tuple[int, list[int]]]) -> GenerationOutput:
    """The samples as one output; ``rows`` are each sample's ``(prompt index, prompt ids)``."""
    policy = [x.policy_logprobs for x in samples]
    return GenerationOutput(
        input_ids=[x.input_ids for x in samples],
        response_mask=[x.response_mask for x in samples],
        gen_logprobs=[x.gen_logprobs for x in samples],
        policy_logprobs=None if any(p is None for p in policy) else policy,  # type: ignore[arg-type]
        completions=[x.completion for x in samples],
        truncated=torch.tensor([x.truncated for x in samples], dtype=torch.bool),
        prompt_index=torch.tensor([i for i, _ in rows], dtype=torch.int64),
        prompt_lengths=torch.tensor([len(ids) for _, ids in rows], dtype=torch.int64),
    )


def picked_logprobs(
    scores: tuple[torch.Tensor, ...], tokens: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probability of each generated token under ``softmax(scores / temperature)``.

    ``generate``'s processed scores give the sampling distribution (the temperature already
    applied: ``temperature`` 1); its raw logits at the sampling temperature give π itself.

    Args:
        scores: one ``[B, V]`` tensor per step.
        tokens: ``int64[B, T]`` generated tokens, ``T = len(scores)``.
        temperature: the divisor of ``scores``.

    Returns:
        ``float32[B, T]`` on CPU.
    """
    picked = [
        torch.log_softmax(
            s.float() / temperature if temperature != 1.0 else s.float(), dim=-1
        ).gather(1, tokens[:, j, None].to(s.device))
        for j, s in enumerate(scores)
    ]
    return torch.stack(picked, dim=1).squeeze(-1).cpu()
