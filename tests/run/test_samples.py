"""Sampled rows read back from a replay store, and the page that embeds them.

A real :class:`~lppo.replay.MemoryReplayStore` holds hand-made rows of a character tokenizer,
so every expected text and number is known in advance.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from lppo.modules.tokenizer import build_char_tokenizer
from lppo.replay import MemoryReplayStore
from lppo.run.sample_page import embedded_iterations, page_html
from lppo.run.samples import choose_rows, read_samples
from lppo.types import ADVANTAGES, GEN_LOGPROBS, INPUT_IDS, PROMPT_INDEX, RESPONSE_MASK, REWARD


def char_rows() -> tuple[MemoryReplayStore, Any]:
    """Three rows of two prompts in a store: a valid one, an invalid one, a long one."""
    tokenizer = build_char_tokenizer("abc=")
    store = MemoryReplayStore()
    texts = ["ab=ca", "ab=cc", "b=abcab"]
    ids = [torch.tensor(tokenizer(t)["input_ids"]) for t in texts]
    starts = [4, 4, 3]  # <bos> + the prompt
    masks = [torch.arange(len(i)) >= s for i, s in zip(ids, starts, strict=True)]
    masks[1] = torch.zeros_like(masks[1])  # invalid: its reward was rejected
    gen = [torch.where(m, -0.5, 0.0) for m in masks]
    gen[1] = torch.where(torch.arange(len(ids[1])) >= 4, -0.25, 0.0)
    store.put(
        [0, 1, 2],
        {
            INPUT_IDS: ids,
            RESPONSE_MASK: masks,
            GEN_LOGPROBS: gen,
            REWARD: [torch.tensor(v, dtype=torch.float64) for v in (1.0, 0.0, 0.5)],
            PROMPT_INDEX: [torch.tensor(p) for p in (0, 0, 1)],
        },
    )
    store.write([0, 2], {ADVANTAGES: [torch.where(m, 1.5, 0.0) for m in (masks[0], masks[2])]})
    return store, tokenizer


def test_rows_of_distinct_prompts_come_first() -> None:
    store, _ = char_rows()
    assert choose_rows(store, (0, 1, 2), 2) == (0, 2)
    assert choose_rows(store, (0, 1, 2), 3) == (0, 2, 1)
    assert choose_rows(store, (0, 1, 2), 0) == ()


def test_a_row_lists_at_most_max_tokens_and_counts_the_rest() -> None:
    store, tokenizer = char_rows()
    valid, invalid, long = read_samples(store, [0, 1, 2], tokenizer, 3, max_tokens=3)
    assert (valid.prompt, valid.completion, valid.reward) == ("<bos>ab=", "ca", 1.0)
    assert [t.text for t in valid.tokens] == ["c", "a"] and valid.tokens_omitted == 0
    assert [t.advantage for t in valid.tokens] == [1.5, 1.5]
    assert [t.text for t in long.tokens] == ["a", "b", "c"] and long.tokens_omitted == 2
    assert long.completion == "abcab" and long.response_tokens == 5
    # the invalid row: no trained token, its sampled tokens found by their log-probs
    assert not invalid.valid and invalid.trained_tokens == 0 and invalid.response_tokens == 2
    assert invalid.prompt == "<bos>ab=" and invalid.advantage_mean is None
    assert [(t.policy, t.trained, t.gen_logprob) for t in invalid.tokens] == [
        (True, False, -0.25),
        (True, False, -0.25),
    ]
    assert read_samples(store, [0], tokenizer, 3, max_tokens=0)[0].tokens == []


def test_the_page_embeds_any_text_without_ending_its_script() -> None:
    store, tokenizer = char_rows()
    row = read_samples(store, [0], tokenizer, 1, max_tokens=8)[0]
    row.completion = "</script><script>alert(1)</script> & <!-- "
    line = json.dumps(row.to_json())
    page = page_html({1: line + "\n", 4: line + "\n" + line + "\n"})
    assert "alert(1)</script>" not in page and "<!-- " not in page
    embedded = embedded_iterations(page)
    assert sorted(embedded) == [1, 4]
    assert json.loads(embedded[1]) == [json.loads(line)]
    assert [r["completion"] for r in json.loads(embedded[4])] == [row.completion] * 2


def test_token_texts_of_a_real_tokenizer_join_to_the_decoded_text() -> None:
    """Byte-level BPE (SmolLM2's): each token's text keeps its leading space."""
    from test_tools import _smollm2_tokenizer  # skips when the tokenizer is not installed

    tokenizer = _smollm2_tokenizer()
    text = "<|im_start|>assistant\n The answer is 19, café.<|im_end|>"
    ids = tokenizer(text)["input_ids"]
    store = MemoryReplayStore()
    prompt = len(tokenizer("<|im_start|>assistant\n")["input_ids"])
    mask = torch.arange(len(ids)) >= prompt
    store.put(
        [0],
        {
            INPUT_IDS: [torch.tensor(ids)],
            RESPONSE_MASK: [mask],
            GEN_LOGPROBS: [torch.where(mask, -1.0, 0.0)],
            REWARD: [torch.tensor(1.0, dtype=torch.float64)],
            PROMPT_INDEX: [torch.tensor(0)],
        },
    )
    [row] = read_samples(store, [0], tokenizer, 1, max_tokens=100)
    assert row.prompt + "".join(t.text for t in row.tokens) == tokenizer.decode(ids)
    assert [t.text for t in row.tokens][:3] == [" The", " answer", " is"]
