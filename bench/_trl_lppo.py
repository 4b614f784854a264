"""One lppo run of the TRL side-by-side benchmark (runs in the lppo venv).

Usage: ``python _trl_lppo.py ROOT SETUP N ITERATIONS THREADS [KEY=VALUE ...]`` where the
optional settings are ``chunk_tokens``, ``score_chunk_tokens``, ``old_logprobs`` (``auto`` /
``recompute`` / ``actor`` / ``rollout``), ``old_values`` (``auto`` / ``score`` / ``critic``),
``gen_batch`` (engine batch size, 0 = all rows) and ``sort_by_length`` (``1``: length-sorted
generation batches), ``prefill_tokens`` (the engine's prefill piece budget), ``gen_cache``
(``dynamic`` / ``static``), ``trim_prompt`` (``1`` / ``0``: actor, reference, critic and
reward model run their last block only from the first response position on, or not,
:mod:`lppo.modules.tail`; left out: lppo's ``auto``), ``ranks`` (data-parallel processes,
``PPODDPStrategy`` over gloo, each with ``THREADS / ranks`` intra-op threads; default 1),
``balance_ranks``
(``1`` / ``0``: rows move between those processes to balance their tokens, or not; left out:
lppo's default, on) and ``profile`` (a path:
cProfile of the timed iterations is dumped there), ``estimator`` (``gae``, the default: PPO
with a critic, KL 0.05, 2 epochs; ``grpo``: lppo's critic-free defaults, ``lppo.estimators.GRPO``
with no critic, KL 0, one epoch; ``bench/trl_grpo_side_by_side.py``) and ``samples`` (samples
per prompt, default 1).

The run is a real ``lppo.PPOTrainer.fit`` of a :class:`~lppo.PPOSystem` built on the
benchmark's files (policy, critic backbone, reward model, tokenizer, prompts); the task serves
the same prompts every iteration and rewards 0, so the reward is the reward model's score, as
in TRL. Prints one JSON line with per-iteration seconds per phase (``IterationResult.seconds``:
generation = ``rollout``; scoring = ``collect`` + ``score`` + ``advantages``; training =
``critic`` + ``actor``; total = the trainer epoch, start to end), the plan's padding fraction
and the peak RSS summed over the ranks. With ``ranks > 1`` only rank 0 takes the driver's
turns; every rank waits for it at a barrier at the start and end of each iteration, so no rank
computes outside the turn.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _turns
from _trl_assets import load_prompts, peak_rss_mb


def build_task(prompts: list[list[int]]):
    from lppo.tasks import Prompt, Task

    texts = [" ".join(f"w{i - 4}" for i in ids) for ids in prompts]

    class FixedPrompts(Task):
        """The benchmark's prompts, every iteration, in order; reward 0 (the model scores)."""

        name = "fixed"

        def sample_prompts(self, n: int, generator: random.Random) -> list[Prompt]:
            return [Prompt(text=t, answer="") for t in texts[:n]]

        def reward(self, prompt: Prompt, completion: str) -> float:
            return 0.0

        def rewards(self, prompts: list[Prompt], completions: list[str]) -> list[float]:
            return [0.0] * len(completions)

        def vocabulary(self) -> str:
            return ""

        def max_prompt_length(self) -> int:
            return max(len(p) for p in prompts)

    return FixedPrompts()


def engine_knobs(opts: dict[str, str]) -> dict[str, object]:
    """``HFGenerateEngine`` arguments from the prefill / cache options (absent: its defaults)."""
    knobs: dict[str, object] = {}
    if "prefill_tokens" in opts:
        knobs["prefill_tokens"] = int(opts["prefill_tokens"])
    if "gen_cache" in opts:
        knobs["cache"] = opts["gen_cache"]
    return knobs


def build_system(root: str, n: int, opts: dict[str, str], prompts: list[list[int]]):
    import inspect

    from lppo import PPOSystem
    from lppo.config import PPOConfig
    from lppo.estimators import GAE, GRPO
    from lppo.modules import ActorModule, CriticModule, RewardModel
    from lppo.modules.models import HFCausalLM
    from lppo.rollout import HFGenerateEngine, RolloutSettings

    gen_batch = int(opts.get("gen_batch", "0")) or None
    samples = int(opts.get("samples", "1"))
    settings = {"prompts_per_iteration": n, "samples_per_prompt": samples, "max_new_tokens": 64}
    if "ignore_eos" in inspect.signature(RolloutSettings).parameters:
        settings["ignore_eos"] = True
    grpo = opts.get("estimator", "gae") == "grpo"
    ppo = {} if grpo else {"kl_coef": 0.05, "critic_epochs": 2, "actor_epochs": 2}
    # A key left out keeps lppo's default (``auto`` for all three).
    ppo.update({k: opts[k] for k in ("old_logprobs", "old_values") if k in opts})
    trim = {"trim_prompt": opts["trim_prompt"] == "1"} if "trim_prompt" in opts else {}
    return PPOSystem(
        actor=ActorModule(
            HFCausalLM(pretrained_path=os.path.join(root, "policy")), lr=1e-5, **trim
        ),
        critic=None
        if grpo
        else CriticModule(
            HFCausalLM(pretrained_path=os.path.join(root, "critic")), lr=1e-5, **trim
        ),
        task=build_task(prompts),
        engine=HFGenerateEngine(
            batch_size=gen_batch,
            prepend_bos=False,
            sort_by_length=opts.get("sort_by_length", "0") == "1",
            **engine_knobs(opts),
        ),
        estimator=GRPO() if grpo else GAE(gamma=1.0, lam=0.95),
        reward_model=RewardModel(
            HFCausalLM(pretrained_path=os.path.join(root, "reward")),
            task_weight=0.0,
            normalize=False,
            **trim,
        ),
        rollout=RolloutSettings(**settings),
        ppo=PPOConfig(**ppo),
        tokenizer_path=os.path.join(root, "tokenizer"),
        num_threads=None,
    )


def main() -> None:
    root, setup, n, iterations, threads = sys.argv[1:6]
    opts = dict(a.split("=", 1) for a in sys.argv[6:])
    n, iterations, threads = int(n), int(iterations), int(threads)
    ranks = int(opts.get("ranks", "1"))
    if threads % ranks:
        raise SystemExit(f"threads={threads} is not a multiple of ranks={ranks}")
    # Lightning's DDP launcher re-runs this script per rank; only the driver's child (rank 0)
    # holds the turn pipe, so the other ranks must not touch it.
    leader = os.environ.get("LOCAL_RANK", "0") == "0"
    if not leader:
        os.environ.pop("LPPO_BENCH_TURN_FD", None)
    os.environ["OMP_NUM_THREADS"] = str(threads // ranks)
    import torch

    torch.set_num_threads(threads // ranks)
    from lightning.pytorch.callbacks import Callback

    from lppo import PPOTrainer
    from lppo.iteration.data import ReplayDataModule
    from lppo.iteration.hooks import PPOCallback

    rows: list[dict[str, float]] = []
    padding: list[dict[str, float]] = []
    work: list[dict[str, int]] = []

    class Record(PPOCallback):
        def on_train_epoch_start(self, trainer, pl_module) -> None:
            if leader:
                _turns.begin()
            trainer.strategy.barrier()  # every rank starts inside rank 0's turn
            self.start = time.perf_counter()

        def on_iteration_end(self, ctx, result) -> None:
            s = result.seconds
            self.row = {
                "generation": s.get("rollout", 0.0),
                "scoring": s.get("collect", 0.0) + s.get("score", 0.0) + s.get("advantages", 0),
                "training": s.get("critic", 0.0) + s.get("actor", 0.0),
            }
            padding.append(dict(getattr(result, "padding", {})))
            work.append(
                {
                    "tokens": int(result.tokens.get("rollout", 0)),
                    "optimizer_steps": len(result.phase_steps("actor")),
                    "imbalance": result.rollout.extra.get("rank_token_imbalance"),
                    "moved_rows": result.rollout.extra.get("moved_rows"),
                }
            )

        def on_train_epoch_end(self, trainer, pl_module) -> None:
            trainer.strategy.barrier()  # every rank has finished before the turn ends
            rows.append({**self.row, "total": time.perf_counter() - self.start})
            if leader:
                _turns.next_turn()

    class Profile(Callback):
        def __init__(self, path: str) -> None:
            import cProfile

            self.path, self.prof = path, cProfile.Profile()

        def on_train_epoch_start(self, trainer, pl_module) -> None:
            if trainer.current_epoch >= 1:
                self.prof.enable()

        def on_train_epoch_end(self, trainer, pl_module) -> None:
            self.prof.disable()

        def on_train_end(self, trainer, pl_module) -> None:
            self.prof.dump_stats(self.path)

    prompts = load_prompts(root, setup, n)
    system = build_system(root, n, opts, prompts)
    data_args = {"max_tokens_per_chunk": int(opts.get("chunk_tokens", "640"))}
    if "score_chunk_tokens" in opts:
        data_args["max_tokens_per_score_chunk"] = int(opts["score_chunk_tokens"])
    if "balance_ranks" in opts:
        data_args["balance_ranks"] = opts["balance_ranks"] == "1"
    data = ReplayDataModule(**data_args)
    callbacks: list[Callback] = [Record()]
    if "profile" in opts:
        callbacks.append(Profile(opts["profile"]))
    out = tempfile.mkdtemp(prefix="lppo-bench-")
    parallel = {"devices": 1}
    if ranks > 1:
        from lppo.runtime.strategy import PPODDPStrategy

        parallel = {"devices": ranks, "strategy": PPODDPStrategy()}
    trainer = PPOTrainer(
        max_epochs=iterations,
        accelerator="cpu",
        **parallel,
        default_root_dir=out,
        logger=False,
        enable_checkpointing=False,
        callbacks=callbacks,
    )
    trainer.fit(system, datamodule=data)
    peaks = trainer.strategy.all_gather(torch.tensor(peak_rss_mb(), dtype=torch.float64))
    if not leader:
        return
    result = {
        "side": "lppo",
        "iterations": rows,
        "padding_fraction": padding,
        "work": {
            "prompts": n,
            "samples": int(opts.get("samples", "1")),
            "tokens": [w["tokens"] for w in work],
            "optimizer_steps": statistics.median(w["optimizer_steps"] for w in work),
            "rank_token_imbalance": [w["imbalance"] for w in work],
            "moved_rows": [w["moved_rows"] for w in work],
        },
        "peak_rss_mb": float(peaks.sum()),
        "ranks": ranks,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
