"""Shared builders for tests: tiny float64 models and random replay rows."""

from __future__ import annotations

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model

from lppo.iteration.controller import PPOController
from lppo.replay import MemoryReplayStore
from lppo.replay.rollout_rows import StoredRollout
from lppo.rollout.source import put_samples
from lppo.tasks import CopyTask
from lppo.tasks.base import Prompt
from lppo.types import (
    ADVANTAGES,
    INPUT_IDS,
    OLD_LOGPROBS,
    RESPONSE_MASK,
    RETURNS,
    REWARD,
    VALUES,
    Rollout,
)

VOCAB = 23


def gpt2_config() -> GPT2Config:
    return GPT2Config(
        vocab_size=VOCAB,
        n_positions=64,
        n_embd=16,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )


def tiny_lm(seed: int = 0, dtype: torch.dtype = torch.float64) -> GPT2LMHeadModel:
    """Deterministic tiny GPT-2 LM (float64 keeps every op in float64, unlike Llama's RMSNorm)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = GPT2LMHeadModel(gpt2_config())
    return model.to(dtype)


def tiny_backbone(seed: int = 0, dtype: torch.dtype = torch.float64) -> GPT2Model:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = GPT2Model(gpt2_config())
    return model.to(dtype)


def random_rows(
    n: int,
    seed: int,
    min_len: int = 3,
    max_len: int = 14,
    invalid_rows: int = 0,
    dtype: torch.dtype = torch.float64,
) -> dict[str, list[torch.Tensor]]:
    """``n`` random rows with every column the actor and critic read.

    Responses get a random mask with holes (environment-masked tokens); the first
    ``invalid_rows`` rows have an all-False response mask.
    """
    g = torch.Generator().manual_seed(seed)
    cols: dict[str, list[torch.Tensor]] = {
        k: [] for k in (INPUT_IDS, RESPONSE_MASK, REWARD, OLD_LOGPROBS, ADVANTAGES, VALUES, RETURNS)
    }
    for i in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        prompt = int(torch.randint(1, length, (1,), generator=g))
        mask = torch.zeros(length, dtype=torch.bool)
        mask[prompt:] = torch.rand(length - prompt, generator=g) > 0.2
        if not mask.any():
            mask[-1] = True
        if i < invalid_rows:
            mask[:] = False
        cols[INPUT_IDS].append(torch.randint(0, VOCAB, (length,), generator=g))
        cols[RESPONSE_MASK].append(mask)
        cols[REWARD].append(torch.rand((), generator=g, dtype=dtype))
        for name, scale in ((OLD_LOGPROBS, 1.0), (ADVANTAGES, 1.0), (VALUES, 0.5), (RETURNS, 1.0)):
            x = torch.randn(length, generator=g, dtype=dtype) * scale
            if name == OLD_LOGPROBS:
                x = -x.abs() - 2.5
            cols[name].append(torch.where(mask, x, torch.zeros_like(x)))
    return cols


def shared_prompt_rows(samples: list[int], seed: int) -> dict[str, list[torch.Tensor]]:
    """Rows answering ``len(samples)`` prompts, prompt ``k`` ``samples[k]`` times, in order.

    Prompts of 3 to 6 tokens, responses of 1 to 7 whose first token is trained and the rest
    masked at random (holes, like tool observations); every column of :func:`random_rows`.
    """
    n = sum(samples)
    cols = random_rows(n, seed)
    g = torch.Generator().manual_seed(seed + 1)
    b = 0
    for count in samples:
        size = int(torch.randint(3, 7, (1,), generator=g))
        prompt = torch.randint(3, VOCAB, (size,), generator=g)
        for _ in range(count):
            r = int(torch.randint(1, 8, (1,), generator=g))
            response = torch.randint(3, VOCAB, (r,), generator=g)
            mask = torch.cat(
                [torch.zeros(len(prompt), dtype=torch.bool), torch.rand(r, generator=g) > 0.3]
            )
            mask[len(prompt)] = True
            cols[INPUT_IDS][b] = torch.cat([prompt, response])
            cols[RESPONSE_MASK][b] = mask
            for name in (OLD_LOGPROBS, ADVANTAGES, VALUES, RETURNS):
                x = torch.randn(len(mask), generator=g, dtype=torch.float64)
                x = -x.abs() - 2.5 if name == OLD_LOGPROBS else x
                cols[name][b] = torch.where(mask, x, torch.zeros_like(x))
            b += 1
    return cols


def filled_store(cols: dict[str, list[torch.Tensor]]) -> MemoryReplayStore:
    store = MemoryReplayStore()
    n = len(cols[INPUT_IDS])
    store.put(list(range(n)), cols)
    return store


def stored(controller: PPOController, rollout: Rollout, iteration: int = 0) -> StoredRollout:
    """Put ``rollout`` into ``controller``'s store as the rollout source does (its row rules).

    The overlong punishment's ``max_new_tokens`` is the longest response of ``rollout``.
    """
    longest = max((int(m.sum()) for m in rollout.response_mask), default=0)
    rules = controller.config.row_rules(longest)
    return put_samples(controller.data.store, rollout, rules, iteration)


class ThresholdCopyTask(CopyTask):
    """The copy task with a pass/fail reward: 1 when the copy reward reaches ``threshold``.

    Groups whose samples all pass or all fail are common, which dynamic sampling drops.
    """

    def __init__(self, threshold: float = 0.5, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.threshold = threshold

    def reward(self, prompt: Prompt, completion: str) -> float:
        return float(super().reward(prompt, completion) >= self.threshold)


def sliding_window_model(vocab_size: int) -> transformers.PreTrainedModel:
    """A small Mistral whose layers attend over a window of 4 tokens."""
    cfg = transformers.MistralConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=4,
    )
    return transformers.MistralForCausalLM(cfg)
