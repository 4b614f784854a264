"""One TRL 1.12.0 ``PPOTrainer`` run of the side-by-side benchmark (runs in the TRL venv).

Usage: ``python _trl_trl.py ROOT SETUP N ITERATIONS THREADS [RANKS]`` (ROOT from
``_trl_assets``). Prints one JSON line: per-iteration seconds of generation / scoring /
training / total and the peak RSS summed over the ranks. ``RANKS > 1``: this process becomes
rank 0 of that many data-parallel gloo processes of ``THREADS / RANKS`` threads each
(accelerate's ``MULTI_CPU``, started as ``torchrun`` would: ``RANK`` / ``WORLD_SIZE`` /
``MASTER_*``), each generating, scoring and training ``N / RANKS`` rows per iteration with the
gradients all-reduced (TRL's DDP wrap); ``gradient_accumulation_steps`` shrinks so one
minibatch is still all N rows. Only rank 0 takes the driver's turns; the ranks meet at a
barrier when a turn starts and before it ends, so no rank computes outside it. Phases are timed
by wrapping the module-level ``batch_generation`` and ``forward`` functions TRL's training loop
calls (generation ends when ``batch_generation`` returns; training starts at the first forward
with gradients; an iteration ends at ``on_step_end``); nothing of TRL's own computation is
changed.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _turns
from _trl_assets import TRAINER_ARGS, load_prompts, peak_rss_mb


def launch_ranks(ranks: int, threads: int) -> list[subprocess.Popen]:
    """Make this process rank 0 of ``ranks`` and start the others (``torchrun``'s variables)."""
    if ranks == 1 or "RANK" in os.environ:
        return []
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = {
        "WORLD_SIZE": str(ranks),
        "LOCAL_WORLD_SIZE": str(ranks),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": str(threads // ranks),
    }
    os.environ.update(common, RANK="0", LOCAL_RANK="0")
    env = {k: v for k, v in os.environ.items() if k != "LPPO_BENCH_TURN_FD"}
    return [
        subprocess.Popen(
            [sys.executable, *sys.argv],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        for r in range(1, ranks)
    ]


def main() -> None:
    root, setup, n, iterations, threads = sys.argv[1:6]
    n, iterations, threads = int(n), int(iterations), int(threads)
    ranks = int(sys.argv[6]) if len(sys.argv) > 6 else 1
    if threads % ranks or n % (8 * ranks):
        raise SystemExit(f"threads={threads} and N={n} must be multiples of ranks={ranks} (N: 8x)")
    others = launch_ranks(ranks, threads)
    leader = os.environ.get("RANK", "0") == "0"
    import torch

    torch.set_num_threads(threads // ranks)

    def sync() -> None:
        if ranks > 1:
            torch.distributed.barrier()

    import transformers
    from datasets import Dataset
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as mod

    marks: list[dict[str, float]] = []
    current: dict[str, float] = {}

    generate = mod.batch_generation

    def timed_generation(*args, **kwargs):
        if leader:
            _turns.begin()  # an iteration starts with its generation
        sync()
        current["start"] = current["gen_start"] = time.perf_counter()
        out = generate(*args, **kwargs)
        current["gen_end"] = time.perf_counter()
        return out

    fwd = mod.forward

    def timed_forward(*args, **kwargs):
        if torch.is_grad_enabled() and "train_start" not in current:
            current["train_start"] = time.perf_counter()
        return fwd(*args, **kwargs)

    mod.batch_generation = timed_generation
    mod.forward = timed_forward

    class Marks(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            sync()
            marks.append({**current, "end": time.perf_counter()})
            current.clear()
            if leader:
                _turns.next_turn()

    tok = transformers.AutoTokenizer.from_pretrained(os.path.join(root, "tokenizer"))
    tok.padding_side = "left"
    load = transformers.AutoModelForSequenceClassification.from_pretrained
    policy = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(root, "policy"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(root, "policy"))
    critic = load(os.path.join(root, "critic"), num_labels=1)
    reward = load(os.path.join(root, "reward"), num_labels=1)
    prompts = load_prompts(root, setup, n)
    dataset = Dataset.from_dict({"input_ids": prompts})
    out = tempfile.mkdtemp(prefix="trl-bench-")
    config = PPOConfig(
        output_dir=out,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=n // 8 // ranks,
        num_mini_batches=1,
        num_ppo_epochs=2,
        total_episodes=n * iterations,
        response_length=64,
        stop_token=None,
        temperature=1.0,
        kl_coef=0.05,
        learning_rate=1e-5,
        num_sample_generations=0,
        **TRAINER_ARGS,
    )
    trainer = PPOTrainer(
        args=config,
        processing_class=tok,
        model=policy,
        ref_model=ref,
        reward_model=reward,
        value_model=critic,
        train_dataset=dataset,
        eval_dataset=dataset.select(range(8)),
        callbacks=[Marks()],
    )
    if trainer.accelerator.num_processes != ranks:
        got = trainer.accelerator.num_processes
        raise SystemExit(f"accelerate runs {got} processes, not {ranks}")
    trainer.train()
    rows = []
    for m in marks:
        gen = m["gen_end"] - m["gen_start"]
        rows.append(
            {
                "generation": gen,
                "scoring": m["train_start"] - m["gen_end"],
                "training": m["end"] - m["train_start"],
                "total": m["end"] - m["start"],
            }
        )
    peak = torch.tensor([peak_rss_mb()], dtype=torch.float64)
    if ranks > 1:
        torch.distributed.all_reduce(peak)
    for proc in others:
        if proc.wait() != 0:
            raise SystemExit(f"rank {others.index(proc) + 1} exited with {proc.returncode}")
    if leader:
        result = {"side": "trl", "iterations": rows, "peak_rss_mb": float(peak), "ranks": ranks}
        print(json.dumps(result))


if __name__ == "__main__":
    main()
