"""Plain-PyTorch floor of the benchmark's training phase (runs in the lppo venv).

Usage: ``python _trl_floor.py ROOT SETUP N EPOCHS THREADS CHUNK_TOKENS``. Rows are the
benchmark's prompts followed by 64 random response tokens; they are packed with lppo's
planner (metadata only) into the chunks lppo trains (for equal lengths, micro-batches of 8 rows
of 80 tokens: TRL's micro-batches) and pre-padded before the clock starts. Timed: for each of
``EPOCHS`` epochs the critic (backbone + linear head, clipped value loss) and then the policy
(clipped PPO loss) run forward and backward over every chunk and take one AdamW step with
gradient clipping; no lppo code runs inside the timed loop. The whole training phase runs
twice and the second is timed (the first is a warm-up, like lppo's and TRL's first iteration).
Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _turns
from _trl_assets import VOCAB, load_prompts, peak_rss_mb


def main() -> None:
    root, setup, n, epochs, threads, budget = sys.argv[1:7]
    n, epochs, threads, budget = int(n), int(epochs), int(threads), int(budget)
    import torch
    import transformers

    from lppo.iteration.data_settings import DataSettings
    from lppo.iteration.planner import ChunkPlanner
    from lppo.types import RowMeta

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    rows = [
        torch.cat([torch.tensor(p), torch.randint(4, VOCAB, (64,), generator=gen)])
        for p in load_prompts(root, setup, n)
    ]
    prompt_len = [len(p) for p in load_prompts(root, setup, n)]
    meta = RowMeta(ids=tuple(range(n)), lengths=tuple(len(r) for r in rows), valid_tokens=(64,) * n)
    planner = ChunkPlanner(DataSettings(max_tokens_per_chunk=budget))
    chunks = []
    for epoch in range(epochs):
        step = planner.plan(meta, epoch=epoch, phase="floor").steps[0]
        for ids in step.chunks:
            width = max(len(rows[i]) for i in ids)
            x = torch.zeros((len(ids), width), dtype=torch.long)
            att = torch.zeros((len(ids), width), dtype=torch.bool)
            mask = torch.zeros((len(ids), width), dtype=torch.bool)
            for b, i in enumerate(ids):
                x[b, : len(rows[i])] = rows[i]
                att[b, : len(rows[i])] = True
                mask[b, prompt_len[i] : len(rows[i])] = True
            old = torch.randn(x.shape, generator=gen) * 0.1 - 7.0
            adv = torch.randn(x.shape, generator=gen)
            values = torch.randn(x.shape, generator=gen) * 0.1
            returns = torch.randn(x.shape, generator=gen)
            chunks.append((epoch, x, att, mask, old, adv, values, returns))
    policy = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(root, "policy"))
    backbone = transformers.AutoModel.from_pretrained(os.path.join(root, "critic"))
    head = torch.nn.Linear(backbone.config.hidden_size, 1)
    critic_params = [*backbone.parameters(), *head.parameters()]
    opt_actor = torch.optim.AdamW(policy.parameters(), lr=1e-5)
    opt_critic = torch.optim.AdamW(critic_params, lr=1e-5)
    valid = sum(int(c[3].sum()) for c in chunks) / epochs

    def critic_chunk(x, att, mask, values, returns) -> None:
        hidden = backbone(input_ids=x, attention_mask=att.long()).last_hidden_state
        v = torch.nn.functional.pad(head(hidden[:, :-1]).squeeze(-1), (1, 0))
        clipped = values + (v - values).clamp(-0.2, 0.2)
        loss = torch.maximum((v - returns) ** 2, (clipped - returns) ** 2) * 0.5
        ((loss * mask).sum() / valid).backward()

    def actor_chunk(x, att, mask, old, adv) -> None:
        logits = policy(input_ids=x, attention_mask=att.long()).logits[:, :-1]
        logp = torch.log_softmax(logits, dim=-1).gather(-1, x[:, 1:, None]).squeeze(-1)
        logp = torch.nn.functional.pad(logp, (1, 0))
        ratio = torch.exp(logp - old)
        loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
        ((loss * mask).sum() / valid).backward()

    def train() -> float:
        start = time.perf_counter()
        for epoch in range(epochs):
            for e, x, att, mask, _, _, values, returns in chunks:
                if e == epoch:
                    critic_chunk(x, att, mask, values, returns)
            torch.nn.utils.clip_grad_norm_(critic_params, 1.0)
            opt_critic.step()
            opt_critic.zero_grad(set_to_none=True)
        for epoch in range(epochs):
            for e, x, att, mask, old, adv, _, _ in chunks:
                if e == epoch:
                    actor_chunk(x, att, mask, old, adv)
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            opt_actor.step()
            opt_actor.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    _turns.begin()
    train()  # warm-up, like the first iteration of lppo and TRL
    _turns.next_turn()
    seconds = train()
    _turns.next_turn()
    print(json.dumps({"side": "floor", "training": seconds, "peak_rss_mb": peak_rss_mb()}))


if __name__ == "__main__":
    main()
