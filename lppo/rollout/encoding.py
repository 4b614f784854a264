"""How every engine turns a prompt's text into token ids (chat template, BOS)."""

from __future__ import annotations

from typing import Any

import transformers

from lppo.validation import SettingError


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


def check_tokenizer(tokenizer: Any, chat_template: bool) -> None:
    """Refuse a tokenizer an engine cannot generate with (the engines' setup and the plan).

    Args:
        tokenizer: the run's tokenizer.
        chat_template: the engine's ``chat_template`` setting.

    Raises:
        SettingError: the tokenizer has no EOS token (no response could end), or
            ``chat_template`` is on and the tokenizer has no chat template.
    """
    if tokenizer.eos_token_id is None:
        raise SettingError(
            f"model.tokenizer_path: the tokenizer ({type(tokenizer).__name__}) defines no EOS "
            "token, so no response could end; use a tokenizer directory that defines "
            "eos_token (its tokenizer_config.json / special_tokens_map.json)."
        )
    if chat_template and not getattr(tokenizer, "chat_template", None):
        raise SettingError(
            "model.engine.init_args.chat_template=true but the tokenizer has no chat "
            "template; use a tokenizer directory that has one (model.tokenizer_path) or set "
            "chat_template: false"
        )


def check_setup(chat_template: bool, tokenizer: Any, task: Any, sampling: Any) -> None:
    """An engine's ``check_setup`` capability: :func:`check_tokenizer` before anything starts."""
    check_tokenizer(tokenizer, chat_template)
