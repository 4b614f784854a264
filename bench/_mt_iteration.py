"""Training cost of multi-turn rows vs single-turn rows of the same length (one process).

Three ``PPOController``s with identical weights and settings (``configs/multiturn.yaml``'s:
GAE, 2 critic epochs, 2 actor epochs of 2 minibatches, 512-token chunks) train on rows of the
same token ids and the same total length, differing only in their layout:

- **single (span)**: prompt, then one contiguous response to the end of the row;
- **single (same trained)**: a longer prompt, then a contiguous response with as many tokens
  as the multi-turn rows' policy turns (the same valid-token count as multi-turn);
- **multi-turn**: prompt, then ``turns`` policy turns with an observation between each two
  (``response_mask`` false on the observations), a ``turn_rewards`` column and an
  ``EpisodeReport``, so the advantage phase takes the multi-turn path as a real rollout would.

Each round puts a fresh copy of the rows into each controller's store and runs one
``run_iteration`` per variant (the order reversed every round); the first round is a warm-up.
Timed: the controller's phases (collect, score, advantages, critic, actor), i.e. an iteration
minus its rollout, in wall seconds (``IterationResult.seconds``) and in this process's CPU
seconds (one torch thread, so CPU time is the work done and is less disturbed by other
processes than wall time).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from lppo.callbacks import lifecycle

from lppo.algorithms import ClippedPPO
from lppo.config import PPOConfig
from lppo.estimators import GAE
from lppo.iteration.controller import PPOController
from lppo.iteration.data import ReplayDataModule
from lppo.modules import ActorModule, CriticModule
from lppo.modules.models import HFCausalLM
from lppo.modules.tokenizer import build_char_tokenizer
from lppo.reports import EpisodeReport
from lppo.rollout.source import put_samples
from lppo.tasks import CopyTask
from lppo.types import TURN_REWARDS, Rollout

PHASES = ("collect", "score", "advantages", "critic", "actor")
VARIANTS = ("single (span)", "single (same trained)", "multi-turn")


def layouts(args: argparse.Namespace) -> tuple[int, dict[str, torch.Tensor]]:
    """The row length and each variant's response mask (the same for every row)."""
    p, t, n, o = args.prompt_tokens, args.turns, args.turn_tokens, args.observation_tokens
    length = p + t * n + (t - 1) * o
    multi = torch.zeros(length, dtype=torch.bool)
    for k in range(t):
        start = p + k * (n + o)
        multi[start : start + n] = True
    span = torch.zeros(length, dtype=torch.bool)
    span[p:] = True
    same = torch.zeros(length, dtype=torch.bool)
    same[length - t * n :] = True
    return length, {VARIANTS[0]: span, VARIANTS[1]: same, VARIANTS[2]: multi}


def make_rollout(variant: str, mask: torch.Tensor, args: argparse.Namespace, vocab: int) -> Rollout:
    """``args.rows`` rows of random ids (the same for every variant) with ``variant``'s mask."""
    gen = torch.Generator().manual_seed(0)
    n, length = args.rows, len(mask)
    ids = torch.randint(4, vocab, (n, length), generator=gen)
    ids[:, 0] = 1  # <bos>
    logprobs = -2.0 - torch.rand(n, length, generator=gen)
    reward = torch.rand(n, generator=gen)
    rollout = Rollout(
        input_ids=list(ids),
        response_mask=[mask.clone() for _ in range(n)],
        gen_logprobs=[torch.where(mask, lp, 0.0) for lp in logprobs],
        reward=reward,
        prompt_index=torch.arange(n) // 4,
    )
    if variant == "multi-turn":  # a 0.1 turn reward on the last token of every turn but the last
        ends = [i for i in range(length - 1) if mask[i] and not mask[i + 1]]
        turn = torch.zeros(length)
        turn[ends] = 0.1
        rollout.extras[TURN_REWARDS] = [turn.clone() for _ in range(n)]
        rollout.reward = reward + float(turn.sum())
        rollout.episodes = EpisodeReport(
            episodes=n,
            turns=n * args.turns,
            policy_tokens=n * int(mask.sum()),
            observation_tokens=n * (args.turns - 1) * args.observation_tokens,
        )
    return rollout


def make_controller(vocab: int, ids: tuple[int, int, int], args: argparse.Namespace):
    """A controller with ``configs/multiturn.yaml``'s model shape and PPO settings."""
    spec = dict(
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=4,
        intermediate_size=2 * args.hidden,
    )
    actor = ActorModule(
        HFCausalLM(**spec, seed=0), lr=3e-3, objective=ClippedPPO(clip_low=0.2, clip_high=0.28)
    )
    critic = CriticModule(HFCausalLM(**spec, seed=1), lr=3e-3, value_clip=0.5)
    actor.configure_model(vocab, *ids)
    critic.configure_model(vocab, *ids)
    config = PPOConfig(
        kl_coef=0.0,
        critic_epochs=2,
        actor_epochs=2,
        actor_minibatches=2,
        critic_warmup_iterations=0,
    )
    data = ReplayDataModule(max_tokens_per_chunk=args.chunk_tokens)
    return PPOController(
        actor, critic, data, config, callbacks=lifecycle(), estimator=GAE(gamma=1.0, lam=0.95)
    )


def run(args: argparse.Namespace) -> dict[str, object]:
    """Time the variants side by side; per-variant phase seconds and multi/single ratios."""
    torch.set_num_threads(args.threads)
    tokenizer = build_char_tokenizer(CopyTask(alphabet_size=8).vocabulary())
    ids = (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
    length, masks = layouts(args)
    rollouts = {v: make_rollout(v, masks[v], args, len(tokenizer)) for v in VARIANTS}
    controllers = {v: make_controller(len(tokenizer), ids, args) for v in VARIANTS}
    seconds: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds + 1):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
        for v in order:
            ctl = controllers[v]
            stored = put_samples(ctl.data.store, rollouts[v], ctl.config.row_rules(length), r)
            cpu = time.process_time()
            result = ctl.run_iteration(stored, r)
            cpu = time.process_time() - cpu
            if r > 0:  # round 0 is the warm-up
                seconds[v].append({**{p: result.seconds[p] for p in PHASES}, "cpu": cpu})
        print(f"[bench] iteration round {r}/{args.rounds} done", file=sys.stderr, flush=True)
    return summarize(seconds, masks, length)


def summarize(
    seconds: dict[str, list[dict[str, float]]], masks: dict[str, torch.Tensor], length: int
) -> dict[str, object]:
    """Per variant: trained tokens, median seconds per phase, the training total per round."""
    out: dict[str, object] = {"length": length}
    for v in VARIANTS:
        out[v] = {
            "trained_tokens": int(masks[v].sum()),
            "phases": {p: statistics.median(s[p] for s in seconds[v]) for p in PHASES},
            "totals": [sum(s[p] for p in PHASES) for s in seconds[v]],
            "cpu": [s["cpu"] for s in seconds[v]],
        }
    return out
