"""Real vocabularies: the actor epoch and the score phase, sliced over the vocabulary or not.

Usage (from the repository root)::

    .venv/bin/python bench/real_vocab.py                       # the full grid (≈ 40 min here)
    .venv/bin/python bench/real_vocab.py --vocab 49152 --prompt 32 --prompts 8
    .venv/bin/python bench/real_vocab.py --json runs/bench/real_vocab.json
    .venv/bin/python bench/real_vocab.py --head 2048 512 1024 4096   # the output projection alone

A random Llama (hidden size 256, 4 blocks, 4 heads, float32) with a vocabulary of 49,152
(SmolLM2) or 151,936 (Qwen) entries; 64 prompts × 8 samples, prompts of 32 or 256 random
tokens shared by a group's samples, 128 random response tokens, random π_old and advantages,
in a ``MemoryReplayStore`` planned by lppo's ``ChunkPlanner`` (``--chunk-tokens``, lppo's
default 4,096). Per case, in a fresh process each (one run each):

* **actor epoch**: ``begin`` / ``train_chunk`` over every chunk / ``finish`` (one AdamW step
  per minibatch, 2 minibatches), the actor's defaults otherwise (``trim_prompt: auto``: on),
  after one warm-up step on the first chunk (so AdamW's state exists, as it does in a run from
  its second iteration on: the epoch's peak is a steady iteration's, not the first one's);
* **score**: ``ActorModule.score`` over every chunk (π_old's phase; the reference's is the same).

``materialized`` is ``vocab_chunk: 0`` (the log-softmax of ``[tokens, vocabulary]``);
``sliced`` is ``vocab_chunk: auto`` (the default). ``--mode ... "sliced ×4"`` adds the sliced
path at 4 × the chunk budget (the memory it saved spent on larger chunks); ``shared`` is
``sliced`` with ``data.share_prompts`` on (each chunk computes a prompt once for the group's
rows it holds; chunks planned in sample order), its × columns against ``sliced`` (per row;
every other mode's against ``materialized``). Peak memory is the peak
RSS above the baseline taken just before the phase (model, optimizer state and rows built);
times are wall-clock. Prints a markdown table; ``--json`` writes the numbers.

``--head TOKENS SIZE ...`` times only the output projection's part of the actor's step (the
log-prob and entropy of ``TOKENS`` random hidden states of width 256, forward and backward, at
the largest ``--vocab``): materialized, then sliced at each ``SIZE`` entries per slice, twice
in turn in one process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, __file__.rsplit("/", 1)[0])

import torch
from _memory import MiB, PeakProbe

from lppo.iteration.chunks import iter_chunks
from lppo.iteration.data_settings import DataSettings
from lppo.iteration.planner import ChunkPlanner
from lppo.modules import ActorModule
from lppo.replay import MemoryReplayStore
from lppo.types import ADVANTAGES, INPUT_IDS, OLD_LOGPROBS, RESPONSE_MASK

VOCABS = (49_152, 151_936)
PROMPTS = (32, 256)
#: mode -> (``vocab_chunk``, chunk budget × ``--chunk-tokens``, ``data.share_prompts``)
MODES = {
    "materialized": (0, 1, False),
    "sliced": ("auto", 1, False),
    "sliced ×4": ("auto", 4, False),
    "shared": ("auto", 1, True),
}
#: what each mode's × column divides by
BASELINE = {"shared": "sliced"}
PHASES = ("actor", "score")


def build_actor(vocab: int, setting: int | str, share: bool = False) -> ActorModule:
    """The random Llama actor (seed 0) with ``vocab_chunk=setting``, built and resolved."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    actor = ActorModule(LlamaForCausalLM(config), vocab_chunk=setting, lr=1e-6)
    actor.configure_model()
    actor.share_prompts = share
    return actor


def fill(vocab: int, prompt: int, prompts: int, samples: int, response: int) -> MemoryReplayStore:
    """``prompts × samples`` rows: a group's samples share their prompt's tokens."""
    gen = torch.Generator().manual_seed(1)
    store = MemoryReplayStore()
    for i in range(prompts):
        head = torch.randint(0, vocab, (prompt,), generator=gen)
        for j in range(samples):
            ids = torch.cat([head, torch.randint(0, vocab, (response,), generator=gen)])
            mask = torch.arange(len(ids)) >= prompt
            old = torch.where(mask, -11.0 + 0.1 * torch.randn(len(ids), generator=gen), 0.0)
            adv = torch.where(mask, torch.randn(len(ids), generator=gen), 0.0)
            row = {INPUT_IDS: ids, RESPONSE_MASK: mask, OLD_LOGPROBS: old, ADVANTAGES: adv}
            store.put([i * samples + j], {k: [v] for k, v in row.items()})
    return store


def run_case(args: argparse.Namespace) -> dict:
    """One phase of one case in this process: its time and peak memory."""
    torch.set_num_threads(args.threads)
    setting, scale, share = MODES[args.mode]
    actor = build_actor(args.vocab, setting, share)
    store = fill(args.vocab, args.prompt, args.prompts, args.samples, args.response)
    budget = args.chunk_tokens * scale
    settings = DataSettings(budget, seed=0, drop_budget=len(store))
    planner = ChunkPlanner(settings, sample_order=share)
    plan = planner.plan(store.meta(), epoch=0, minibatches=1 if args.phase == "score" else 2)
    if args.phase == "actor":  # steady state: the optimizer's state exists, as from iteration 2
        step = plan.steps[0]
        actor.begin(step)
        actor.train_chunk(next(iter(iter_chunks(store, step, [OLD_LOGPROBS, ADVANTAGES]))))
        actor.finish()
    probe = PeakProbe()
    probe.start()
    start = time.perf_counter()
    chunks = 0
    if args.phase == "actor":
        for step in plan.steps:
            actor.begin(step)
            for chunk in iter_chunks(store, step, [OLD_LOGPROBS, ADVANTAGES]):
                actor.train_chunk(chunk)
                chunks += 1
            actor.finish()
    else:
        for step in plan.steps:
            for chunk in iter_chunks(store, step, []):
                actor.score(chunk)
                chunks += 1
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "peak_mib": probe.peak_beyond() / MiB, "chunks": chunks}


def spawn(args: argparse.Namespace, vocab: int, prompt: int, mode: str, phase: str) -> dict:
    """Run one case in a fresh interpreter (its own peak RSS); return its JSON line."""
    cmd = [
        sys.executable,
        __file__,
        "--case",
        f"--vocab={vocab}",
        f"--prompt={prompt}",
        f"--mode={mode}",
        f"--phase={phase}",
        f"--prompts={args.prompts}",
        f"--samples={args.samples}",
        f"--response={args.response}",
        f"--chunk-tokens={args.chunk_tokens}",
        f"--threads={args.threads}",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"case {vocab}/{prompt}/{mode}/{phase} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(results: list[dict]) -> str:
    """Markdown: per vocabulary and prompt length, each mode's time and memory per phase."""
    lines = [
        "| vocabulary | prompt | mode | actor epoch s | × | actor peak MiB | × "
        "| score s | × | score peak MiB | × |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    key = {(r["vocab"], r["prompt"], r["mode"], r["phase"]): r for r in results}
    for vocab in sorted({r["vocab"] for r in results}):
        for prompt in sorted({r["prompt"] for r in results}):
            for mode in (m for m in MODES if any(r["mode"] == m for r in results)):
                cells = []
                for phase in PHASES:
                    r = key.get((vocab, prompt, mode, phase))
                    b = key.get((vocab, prompt, BASELINE.get(mode, "materialized"), phase))
                    if r is None:
                        cells += ["–"] * 4
                        continue
                    cells += [
                        f"{r['seconds']:.1f}",
                        f"{r['seconds'] / b['seconds']:.2f}" if b else "–",
                        f"{r['peak_mib']:.0f}",
                        f"{r['peak_mib'] / max(b['peak_mib'], 1e-9):.2f}" if b else "–",
                    ]
                lines.append(f"| {vocab:,} | {prompt} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def head_only(tokens: int, sizes: list[int], vocab: int, threads: int) -> None:
    """Print the materialized and sliced log-prob + entropy step times of the head alone."""
    from lppo.algorithms.losses import entropy_from_logprobs
    from lppo.modules.vocab import sliced_logprobs

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    head = torch.nn.Linear(256, vocab, bias=False)
    hidden = torch.randn(tokens, 256, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))

    def materialized() -> None:
        logp = torch.log_softmax(head(hidden), dim=-1)
        picked = logp.gather(1, targets[:, None]).squeeze(1)
        (picked.sum() + 0.1 * entropy_from_logprobs(logp).sum()).backward()

    def sliced(size: int) -> None:
        picked, entropy = sliced_logprobs(hidden, head, targets, 1.0, size)
        (picked.sum() + 0.1 * entropy.sum()).backward()

    cases = [("materialized", materialized)]
    cases += [(f"sliced {size}", lambda size=size: sliced(size)) for size in sizes]
    print(f"| {tokens} tokens × {vocab:,} entries | round 1 s | round 2 s |")
    print("| --- | ---: | ---: |")
    times: dict[str, list[float]] = {name: [] for name, _ in cases}
    for _ in range(2):
        for name, run in cases:
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    for name, (first, second) in times.items():
        print(f"| {name} | {first:.2f} | {second:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, nargs="*", default=list(VOCABS))
    parser.add_argument("--prompt", type=int, nargs="*", default=list(PROMPTS))
    parser.add_argument("--mode", nargs="*", default=list(MODES)[:2], choices=list(MODES))
    parser.add_argument("--phase", nargs="*", default=list(PHASES), choices=list(PHASES))
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--response", type=int, default=128)
    parser.add_argument("--chunk-tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--head", type=int, nargs="+", default=None, metavar="N")
    parser.add_argument("--case", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.head:
        head_only(args.head[0], args.head[1:], max(args.vocab), args.threads)
        return
    if args.case:
        one = argparse.Namespace(**{**vars(args), "vocab": args.vocab[0], "prompt": args.prompt[0]})
        one.mode, one.phase = args.mode[0], args.phase[0]
        print(json.dumps(run_case(one)))
        return
    results = []
    for vocab in args.vocab:
        for prompt in args.prompt:
            for mode in args.mode:
                for phase in args.phase:
                    r = spawn(args, vocab, prompt, mode, phase)
                    r.update(vocab=vocab, prompt=prompt, mode=mode, phase=phase)
                    print(json.dumps(r), flush=True)
                    results.append(r)
    print(table(results))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {"args": {**vars(args), "json": str(args.json)}, "results": results}, indent=1
            )
        )


if __name__ == "__main__":
    main()
