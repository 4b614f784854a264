"""A character-level tokenizer built locally (no download) from a task's vocabulary.

Every character is one token. Ids are deterministic: the special tokens come first
(``<pad>=0``, ``<bos>=1``, ``<eos>=2``, ``<unk>=3``) followed by the distinct characters of the
vocabulary in sorted order. Encoding prepends ``<bos>`` (``add_special_tokens=True``, the
default); decoding concatenates characters with no separator, so ``decode(encode(s),
skip_special_tokens=True) == s`` for every ``s`` drawn from the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import transformers
from tokenizers import Tokenizer, decoders, models, processors

from lppo.modules.models import HFCausalLM
from lppo.tasks.base import Task
from lppo.validation import SettingError

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)


def char_vocab(vocabulary: str) -> dict[str, int]:
    """Return the ``token -> id`` map used by :func:`build_char_tokenizer`.

    Args:
        vocabulary: every character the tokenizer must know (duplicates and order ignored).

    Returns:
        Special tokens at ids 0..3, then the sorted distinct characters.
    """
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(set(vocabulary)):
        vocab[ch] = len(vocab)
    return vocab


def build_char_tokenizer(vocabulary: str) -> transformers.PreTrainedTokenizerFast:
    """Build a character-level fast tokenizer for ``vocabulary``.

    Args:
        vocabulary: every character prompts and answers can contain (e.g. from
            :meth:`lppo.tasks.Task.vocabulary`). Characters outside it encode to ``<unk>``.

    Returns:
        A tokenizer with ``pad``/``bos``/``eos``/``unk`` special tokens whose encodings start
        with ``<bos>`` and whose decoding inserts no spaces. Left padding is the default (what
        batched generation needs).

    Raises:
        ValueError: if ``vocabulary`` is empty.
    """
    if not vocabulary:
        raise ValueError("vocabulary must not be empty")
    vocab = char_vocab(vocabulary)
    # BPE without merges: every character is its own token; no pre-tokenizer, so whitespace
    # is an ordinary character too.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN))
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A $B",
        special_tokens=[(BOS_TOKEN, vocab[BOS_TOKEN])],
    )
    backend.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


def check_coverage(tokenizer: Any, texts: Sequence[str], fix: str) -> None:
    """Refuse a tokenizer that maps a character of ``texts`` to its unknown token.

    Such characters would reach the models as ``<unk>`` and never come back out of a
    completion, so the task's answers containing them could not be produced.

    Args:
        tokenizer: the run's tokenizer (one without an unknown token passes).
        texts: prompts and reference answers of the task.
        fix: what to do about it (appended to the message).

    Raises:
        SettingError: naming the characters (at most 20), a text holding the first, and ``fix``.
    """
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None or not texts:
        return
    missing: dict[str, None] = {}  # ordered set
    first: str | None = None
    for start in range(0, len(texts), 512):  # batched: a fast tokenizer encodes in parallel
        batch = list(texts[start : start + 512])
        for text, chars in zip(batch, _unknown_chars(tokenizer, batch, unk), strict=True):
            if chars and first is None:
                first = text
            missing.update(dict.fromkeys(chars))
    if missing:
        shown = "".join(list(missing)[:20])
        raise SettingError(
            f"the tokenizer maps {len(missing)} character(s) of the task's prompts and answers to "
            f"{tokenizer.unk_token}: {shown!r} (first in {first!r}); {fix}"
        )


def _unknown_chars(tokenizer: Any, texts: list[str], unk: int) -> list[list[str]]:
    """Per text, the characters the tokenizer encodes as ``unk``."""
    if not getattr(tokenizer, "is_fast", False):  # no offsets: one character at a time
        return [
            [c for c in dict.fromkeys(t) if unk in tokenizer.encode(c, add_special_tokens=False)]
            for t in texts
        ]
    enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    return [
        [c for i, (a, b) in zip(ids, spans, strict=True) if i == unk for c in text[a:b]]
        for text, ids, spans in zip(texts, enc["input_ids"], enc["offset_mapping"], strict=True)
    ]


def check_task_coverage(tokenizer: Any, task: Task, tokenizer_path: str | None) -> None:
    """:func:`check_coverage` of ``task.sample_texts()``, with the fix for the run's tokenizer.

    Args:
        tokenizer: the run's tokenizer.
        task: the task whose prompts and answers it must encode.
        tokenizer_path: ``model.tokenizer_path`` (``None``: the character tokenizer).
    """
    if tokenizer_path is None:
        fix = (
            f"add them to {type(task).__name__}.vocabulary() (the character tokenizer is built "
            "from it)."
        )
    else:
        fix = (
            f"use a tokenizer that has them (model.tokenizer_path={tokenizer_path!r}), or "
            "remove them from the task's text."
        )
    check_coverage(tokenizer, task.sample_texts(), fix)


def run_tokenizer(task: Task, tokenizer_path: str | None) -> Any:
    """The run's tokenizer, checked to cover the task (``model.tokenizer_path``).

    ``None`` builds a character tokenizer of the task's vocabulary; a path is loaded offline.
    """
    if tokenizer_path is None:
        tokenizer = build_char_tokenizer(task.vocabulary())
    else:
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            tokenizer_path, local_files_only=True
        )
    check_task_coverage(tokenizer, task, tokenizer_path)
    return tokenizer


def check_vocabularies(tokenizer: Any, modules: Sequence[Any], resize: bool) -> None:
    """Each Hugging Face checkpoint of ``modules`` (actor, critic, reward model) fits ``tokenizer``.

    Args:
        tokenizer: the run's tokenizer.
        modules: the actor, the critic and the reward model (``None`` where absent).
        resize: ``model.resize_embeddings`` (resize a differing vocabulary instead of refusing).
    """
    keys = (
        "actor.init_args.model",
        "critic.init_args.backbone",
        "reward_model.init_args.model",
    )
    for key, module in zip(keys, modules, strict=True):
        spec = getattr(module, "spec", None)
        if isinstance(spec, HFCausalLM):
            spec.check_vocabulary(f"model.{key}", tokenizer, resize)
