"""A character-level tokenizer built locally (no download) from a task's vocabulary.

Every character is one token. Ids are deterministic: the special tokens come first
(``<pad>=0``, ``<bos>=1``, ``<eos>=2``, ``<unk>=3``) followed by the distinct characters of the
vocabulary in sorted order. Encoding prepends ``<bos>`` (``add_special_tokens=True``, the
default); decoding concatenates characters with no separator, so ``decode(encode(s),
skip_special_tokens=True) == s`` for every ``s`` drawn from the vocabulary.
"""

from __future__ import annotations

import transformers
from tokenizers import Tokenizer, decoders, models, processors

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
