"""Shared inputs of the TRL side-by-side benchmark: tokenizer, models and prompts on disk.

Both sides load exactly these files, so they train the same weights on the same tokens:
a word-level tokenizer (``w0 … w<V-5>`` plus four special tokens; ``V`` = 1,024 by default, or
a real model's vocabulary size such as SmolLM2's 49,152), a random Llama policy (hidden 256,
4 layers; 4.7M parameters at 1,024 entries, 29.9M at 49,152), a same-size critic and a random
``LlamaForSequenceClassification`` reward model, and the prompts of every setting as token ids.
Runs in either virtual environment (only ``transformers`` and ``tokenizers`` are used).
"""

from __future__ import annotations

import json
import os
import random

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
VOCAB = 1024
HIDDEN, LAYERS, HEADS, INTERMEDIATE = 256, 4, 4, 1024

#: The ``TrainingArguments`` both TRL benches share: CPU, fp32, seed 0, no saving, logging,
#: progress bars or loader workers (only timings and the trainer's own work remain).
TRAINER_ARGS = dict(
    save_strategy="no",
    report_to=[],
    logging_steps=10**9,
    use_cpu=True,
    bf16=False,
    fp16=False,
    seed=0,
    disable_tqdm=True,
    dataloader_num_workers=0,
)


def build_tokenizer(path: str, vocab_size: int = VOCAB) -> None:
    """A word-level fast tokenizer: ``"w5 w17"`` encodes to two ids, no special token added."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for i in range(vocab_size - len(SPECIALS)):
        vocab[f"w{i}"] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
    )
    tok.save_pretrained(path)


def llama_config(num_labels: int | None = None, vocab_size: int = VOCAB):
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=512,
        attention_dropout=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if num_labels is not None:
        cfg.num_labels = num_labels
    return cfg


def build_models(root: str, vocab_size: int = VOCAB) -> None:
    """Random policy (causal LM), critic and reward model (sequence classifiers, 1 label)."""
    import torch
    import transformers

    for name, seed, cls in (
        ("policy", 0, transformers.LlamaForCausalLM),
        ("critic", 1, transformers.LlamaForSequenceClassification),
        ("reward", 2, transformers.LlamaForSequenceClassification),
    ):
        torch.manual_seed(seed)
        model = cls(llama_config(None if name == "policy" else 1, vocab_size))
        model.save_pretrained(os.path.join(root, name))


def make_prompts(n: int, setup: str, seed: int = 0, vocab_size: int = VOCAB) -> list[list[int]]:
    """``n`` prompts as token ids: 16 tokens each (``equal``) or 8–128 (``variable``)."""
    rng = random.Random(f"{setup}-{n}-{seed}")
    lengths = [16 if setup == "equal" else rng.randint(8, 128) for _ in range(n)]
    return [[rng.randrange(len(SPECIALS), vocab_size) for _ in range(k)] for k in lengths]


def build(root: str, sizes: list[int], setups: list[str], vocab_size: int = VOCAB) -> None:
    """Write tokenizer, models and ``prompts-<setup>-<n>.json`` under ``root`` (idempotent).

    Raises:
        ValueError: ``root`` already holds models of another vocabulary size.
    """
    os.makedirs(root, exist_ok=True)
    config = os.path.join(root, "reward", "config.json")
    if not os.path.exists(config):
        build_tokenizer(os.path.join(root, "tokenizer"), vocab_size)
        build_models(root, vocab_size)
    with open(config) as f:
        held = json.load(f)["vocab_size"]
    if held != vocab_size:
        raise ValueError(f"{root} holds models of vocabulary {held}, not {vocab_size}: use --root")
    for setup in setups:
        for n in sizes:
            path = os.path.join(root, f"prompts-{setup}-{n}.json")
            with open(path, "w") as f:
                json.dump(make_prompts(n, setup, vocab_size=vocab_size), f)


def load_prompts(root: str, setup: str, n: int) -> list[list[int]]:
    with open(os.path.join(root, f"prompts-{setup}-{n}.json")) as f:
        return json.load(f)


def peak_rss_mb() -> float:
    """Whole-process peak resident memory (kernel high-water mark) in MB."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
