"""How every engine turns a prompt's text into token ids (chat template, BOS)."""

from __future__ import annotations

import transformers


def prompt_text(
    tokenizer: transformers.PreTrainedTokenizerBase, text: str, chat_template: bool
) -> str:
    """The text that is encoded for a prompt (one user turn of the chat template if asked)."""
    if not chat_template:
        return text
    messages = [{"role": "user", "content": text}]
    return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def encode_prompt(
    tokenizer: transformers.PreTrainedTokenizerBase,
    text: str,
    prepend_bos: bool,
    chat_template: bool,
) -> list[int]:
    """Token ids of a prompt, as every engine encodes it (with BOS in front when asked).

    With ``chat_template`` the prompt is first wrapped as one user turn (the templated text is
    encoded without the tokenizer's own special tokens); the BOS token is then added only if
    the ids do not start with it, so it is never doubled.

    Raises:
        ValueError: if the prompt encodes to no token at all.
    """
    special = not chat_template
    ids = list(
        tokenizer(prompt_text(tokenizer, text, chat_template), add_special_tokens=special)[
            "input_ids"
        ]
    )
    bos = tokenizer.bos_token_id
    if prepend_bos and bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, int(bos))
    if not ids:
        raise ValueError(f"prompt {text!r} encodes to no token")
    return ids
