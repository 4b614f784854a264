"""One engine's multi-turn rollout throughput, run inside a fresh worker process.

``MultiTurnEngine`` over the Hugging Face or the vLLM engine, on a random Llama and the copy
task's prompts, with :class:`~_turn_env.FixedTurnsEnvironment`: every episode lasts exactly
``k`` turns. Per turn count: one warm-up ``generate`` call, then ``repeats`` timed calls
(fresh seeds); trajectory tokens are the ``EpisodeReport``'s policy + observation tokens.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import torch
from _turn_env import FixedTurnsEnvironment

from lppo.modules.models import HFCausalLM
from lppo.modules.tokenizer import build_char_tokenizer
from lppo.rollout import MultiTurnEngine, RolloutSettings
from lppo.tasks import CopyTask

MODELS = {
    # configs/vllm.yaml's actor: head_dim 32 (vLLM's CPU attention needs >= 32).
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128),
    # ≈ 50M parameters, as in bench/rollout_engines.py.
    "50M": dict(hidden_size=640, num_layers=10, num_heads=10, intermediate_size=1728),
}
#: vLLM's own statistics (the prefix-cache hit rate). Chunked prefill is off on CPU by
#: VLLMEngine itself (seeded requests crash vLLM 0.32 when a prefill is split).
VLLM_KWARGS: dict[str, Any] = {"disable_log_stats": False}


def inner_engine(name: str, max_model_len: int) -> Any:
    """``hf``, ``vllm`` (vLLM's CPU default block size, 128) or ``vllm-b32`` (blocks of 32)."""
    from lppo.rollout import HFGenerateEngine, VLLMEngine

    if name == "hf":
        return HFGenerateEngine()
    kwargs = dict(VLLM_KWARGS, **({"block_size": 32} if name == "vllm-b32" else {}))
    return VLLMEngine(dtype="float32", max_model_len=max_model_len, engine_kwargs=kwargs)


def cache_counters(engine: MultiTurnEngine) -> tuple[float, float]:
    """vLLM's cumulative prefix-cache (queries, hits) in tokens; (0, 0) for Hugging Face."""
    llm = getattr(engine.engine, "llm", None)
    if llm is None:
        return 0.0, 0.0
    metrics = {m.name: float(getattr(m, "value", 0.0)) for m in llm.get_metrics()}
    return (
        metrics.get("vllm:prefix_cache_queries", 0.0),
        metrics.get("vllm:prefix_cache_hits", 0.0),
    )


def measure(engine: MultiTurnEngine, prompts: list, k: int, args: argparse.Namespace) -> dict:
    """Median rate of ``args.repeats`` timed ``generate`` calls of ``k``-turn episodes."""
    engine.environment.turns = k
    engine.generate(prompts, args.samples, seed=1000 * k)  # warm-up
    rates, walls, policy, observed = [], [], [], []
    q0, h0 = cache_counters(engine)
    for r in range(args.repeats):
        clock = time.perf_counter()
        out = engine.generate(prompts, args.samples, seed=1000 * k + r + 1)
        wall = time.perf_counter() - clock
        report = out.episodes
        assert report is not None and report.turns == k * len(out)
        rows = sum(len(i) - int(p) for i, p in zip(out.input_ids, out.prompt_lengths, strict=True))
        assert rows == report.policy_tokens + report.observation_tokens
        rates.append(rows / wall)
        walls.append(wall)
        policy.append(report.policy_tokens)
        observed.append(report.observation_tokens)
    q1, h1 = cache_counters(engine)
    return {
        "tokens_per_s": statistics.median(rates),
        "generate_s": statistics.median(walls),
        "rows": len(prompts) * args.samples,
        "policy_tokens": statistics.median(policy),
        "observation_share": sum(observed) / (sum(observed) + sum(policy)),
        "cache_hit": (h1 - h0) / (q1 - q0) if q1 > q0 else None,
    }


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """Set the engine up once, then measure every turn count of ``args.turns``."""
    torch.set_num_threads(args.threads)
    task = CopyTask(min_length=2, max_length=4, alphabet_size=8, transform="first")
    tokenizer = build_char_tokenizer(task.vocabulary())
    spec = HFCausalLM(**MODELS[args.model], seed=0, max_position_embeddings=args.max_tokens)
    ids = (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
    policy = spec.build(len(tokenizer), *ids).eval()
    env = FixedTurnsEnvironment(task.vocabulary(), observation_length=args.observation_tokens)
    engine = MultiTurnEngine(
        inner_engine(args.engine, args.max_tokens),
        env,
        max_turns=max(args.turns),
        max_tokens=args.max_tokens,
    )
    settings = RolloutSettings(
        prompts_per_iteration=args.prompts,
        samples_per_prompt=args.samples,
        max_new_tokens=args.new_tokens,
    )
    clock = time.perf_counter()
    engine.setup(policy, tokenizer, settings)
    setup = time.perf_counter() - clock
    prompts = task.sample_prompts(args.prompts, random.Random(0))
    turns = {str(k): measure(engine, prompts, k, args) for k in args.turns}
    engine.close()
    return {"setup_s": setup, "turns": turns}
