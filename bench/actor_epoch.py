"""Paired streamed / plain-loop ratio of one actor epoch and one critic epoch, in one process.

Usage (from the repository root)::

    .venv/bin/python bench/actor_epoch.py                    # 256 rows, 3 paired epochs
    .venv/bin/python bench/actor_epoch.py --rows 1024 --epochs 5

Rows as ``bench/critic_epoch.py`` makes them (prompt 16–64 + response 16–448 tokens) plus
random π_old log-probs and advantages, put into a ``MemoryReplayStore`` and planned by lppo's
``ChunkPlanner`` (``--chunk-tokens``). Per epoch and per role, chunk by chunk, alternating
which goes first: **streamed** = ``iter_chunks`` reads and pads the chunk from the store, then
``ActorModule`` / ``CriticModule.train_chunk`` (lppo's loss, token weights and diagnostics);
**floor** = the same chunk pre-padded before the clock starts, through the same model weights
in plain torch (forward, the same loss as a masked sum over the step's valid tokens,
backward). Each takes one clipped AdamW step at the end of the epoch (``finish`` vs a bare
``clip_grad_norm_`` + ``step``). Other processes slow both members of a pair alike, so the
ratio of the sums is far steadier than separate runs. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])

from _rows import iter_rows
from _variants import build_backbone

from lppo.iteration.chunks import iter_chunks
from lppo.iteration.data_settings import DataSettings
from lppo.iteration.planner import ChunkPlanner
from lppo.modules import ActorModule, CriticModule
from lppo.replay import MemoryReplayStore
from lppo.types import ADVANTAGES, OLD_LOGPROBS, RESPONSE_MASK, RETURNS, VALUES

COLUMNS = {"actor": (OLD_LOGPROBS, ADVANTAGES), "critic": (VALUES, RETURNS)}


def fill(n: int, vocab: int) -> MemoryReplayStore:
    store = MemoryReplayStore()
    gen = torch.Generator().manual_seed(1)
    for i, row in enumerate(iter_rows(n, seed=0, vocab=vocab)):
        mask = row[RESPONSE_MASK]
        row[OLD_LOGPROBS] = torch.where(mask, -7.0 + 0.1 * torch.randn(len(mask), generator=gen), 0)
        row[ADVANTAGES] = torch.where(mask, torch.randn(len(mask), generator=gen), 0.0)
        store.put([i], {k: [v] for k, v in row.items()})
    return store


def floor_actor(model, c, n_valid: int, clip: float) -> None:
    """Plain torch: logits → log-softmax → clipped PPO loss / global valid tokens → backward."""
    logits = model(input_ids=c.input_ids, attention_mask=c.attention_mask.long()).logits
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, c.input_ids[:, 1:, None])
    ratio = torch.exp(logp.squeeze(-1) - c.old_logprobs[:, 1:])
    adv, m = c.advantages[:, 1:], c.response_mask[:, 1:]
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip, 1 + clip))
    ((loss * m).sum() / n_valid).backward()


def floor_critic(backbone, head, c, n_valid: int, clip: float) -> None:
    """Plain torch: hidden → value head → clipped value loss / global valid tokens → backward."""
    h = backbone(input_ids=c.input_ids, attention_mask=c.attention_mask.long()).last_hidden_state
    v = head(h[:, :-1]).squeeze(-1)
    old, ret, m = c.values[:, 1:], c.returns[:, 1:], c.response_mask[:, 1:]
    v_clip = old + (v - old).clamp(-clip, clip)
    loss = 0.5 * torch.maximum((v - ret).square(), (v_clip - ret).square())
    ((loss * m).sum() / n_valid).backward()


def build(role: str, args: argparse.Namespace):
    """Two modules with identical weights: one trained by lppo, one by the plain loop."""
    if role == "actor":
        from transformers import LlamaForCausalLM

        body = build_backbone(args.hidden, args.layers, 4, args.vocab, seed=0)
        lm = LlamaForCausalLM(body.config)
        lm.model = body
        mods = [ActorModule(copy.deepcopy(lm), lr=1e-5, max_grad_norm=1.0) for _ in range(2)]
    else:
        body = build_backbone(args.hidden, args.layers, 4, args.vocab, seed=0)
        mods = [
            CriticModule(copy.deepcopy(body), value_clip=0.2, lr=1e-5, max_grad_norm=1.0)
            for _ in range(2)
        ]
    for m in mods:
        m.train()
    return mods


def paired_epoch(role: str, lppo_mod, floor_mod, store, planner, epoch: int) -> tuple:
    pc = time.perf_counter
    step = planner.plan(store.meta(), epoch=epoch, phase=role).steps[0]
    n_valid = step.normalizers.valid_tokens
    pre = list(iter_chunks(store, step, COLUMNS[role]))  # the floor's chunks, padded untimed
    opt = floor_mod.configure_optimizer()
    params = floor_mod.trainable_parameters()
    t_s = t_f = 0.0
    t = pc()
    lppo_mod.begin(step)
    t_s += pc() - t
    stream = iter_chunks(store, step, COLUMNS[role])
    for k, c in enumerate(pre):
        for who in "sf" if k % 2 == 0 else "fs":
            t = pc()
            if who == "s":
                lppo_mod.train_chunk(next(stream))
                t_s += pc() - t
            else:
                if role == "actor":
                    floor_actor(floor_mod.model, c, n_valid, 0.2)
                else:
                    floor_critic(floor_mod.backbone, floor_mod.value_head, c, n_valid, 0.2)
                t_f += pc() - t
    t = pc()
    stats = lppo_mod.finish()
    t_s += pc() - t
    t = pc()
    norm = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
    opt.step()
    opt.zero_grad(set_to_none=True)
    t_f += pc() - t
    return t_s, t_f, stats.grad_norm, norm, len(pre)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--epochs", type=int, default=3, help="paired epochs per role (+1 warm-up)")
    p.add_argument("--chunk-tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    store = fill(args.rows, args.vocab)
    planner = ChunkPlanner(DataSettings(max_tokens_per_chunk=args.chunk_tokens))
    print(
        f"`python bench/actor_epoch.py {' '.join(sys.argv[1:])}` ({args.rows} rows, "
        f"chunk budget {args.chunk_tokens}, hidden {args.hidden}, {args.layers} layers, "
        f"{args.threads} threads)\n"
    )
    print(
        "| role | chunks | streamed s (sum) | floor s (sum) | **streamed / floor** "
        "| per-epoch ratios | grad norm lppo / floor (last epoch) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | --- | --- |")
    for role in ("actor", "critic"):
        lppo_mod, floor_mod = build(role, args)
        paired_epoch(role, lppo_mod, floor_mod, store, planner, epoch=0)  # warm-up
        runs = [
            paired_epoch(role, lppo_mod, floor_mod, store, planner, epoch=e)
            for e in range(1, args.epochs + 1)
        ]
        s, f = sum(r[0] for r in runs), sum(r[1] for r in runs)
        per = ", ".join(f"{r[0] / r[1]:.3f}" for r in runs)
        med = statistics.median(r[0] / r[1] for r in runs)
        print(
            f"| {role} | {runs[-1][4]} | {s:.2f} | {f:.2f} | **{s / f:.3f}** (median "
            f"{med:.3f}) | {per} | {runs[-1][2]:.6f} / {runs[-1][3]:.6f} |"
        )
        print(f"{role} done", file=sys.stderr)


if __name__ == "__main__":
    main()
