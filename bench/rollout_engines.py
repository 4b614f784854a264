"""Rollout throughput and iteration time: Hugging Face generate vs vLLM, same model and prompts.

Run in the vLLM venv (it has both engines): ``bash .ci/vllm --co -q`` creates it, then

    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python bench/rollout_engines.py

Every measurement runs in its own fresh subprocess (vLLM binds threads and pins torch to one
thread in its process; the Hugging Face side is pinned to the same thread count) and the two
engines alternate, so both see the same machine load. Reported: response tokens per second of
``generate`` (median of ``--repeats`` calls after one warm-up) on the tiny default model and a
~50M-parameter random Llama, the same prompts and sampling settings, and the median wall time
of a full RL iteration (rollout, score, critic, actor, weight sync) of ``configs/vllm.yaml``'s
setup with each engine. Progress goes to stderr, the markdown report to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

MODELS = {
    # configs/vllm.yaml's actor: head_dim 32 (vLLM's CPU attention needs >= 32).
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128),
    # ≈ 50M parameters: 10 layers of 4·640² + 3·640·1728.
    "50M": dict(hidden_size=640, num_layers=10, num_heads=10, intermediate_size=1728),
}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def _engine(name: str):
    from lppo.rollout import HFGenerateEngine, VLLMEngine

    if name == "hf":
        return HFGenerateEngine()
    return VLLMEngine(dtype="float32", max_model_len=256)


def _policy(model: str, tokenizer):
    from lppo.modules.models import HFCausalLM

    spec = HFCausalLM(**MODELS[model], seed=0, max_position_embeddings=256)
    ids = (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
    return spec.build(len(tokenizer), *ids).eval()


def worker_generate(args: argparse.Namespace) -> dict[str, float]:
    import random

    import torch

    from lppo.modules.tokenizer import build_char_tokenizer
    from lppo.rollout import RolloutSettings
    from lppo.tasks import CopyTask

    torch.set_num_threads(args.threads)
    task = CopyTask(min_length=2, max_length=4, alphabet_size=8, transform="first")
    tokenizer = build_char_tokenizer(task.vocabulary())
    policy = _policy(args.model, tokenizer)
    settings = RolloutSettings(
        prompts_per_iteration=args.prompts, samples_per_prompt=4, max_new_tokens=args.new_tokens
    )
    engine = _engine(args.engine)
    clock = time.perf_counter()
    engine.setup(policy, tokenizer, settings)
    setup = time.perf_counter() - clock
    prompts = task.sample_prompts(args.prompts, random.Random(0))
    engine.generate(prompts, 4, seed=0)  # warm-up
    times, tokens = [], []
    for r in range(args.repeats):
        clock = time.perf_counter()
        out = engine.generate(prompts, 4, seed=r + 1)
        times.append(time.perf_counter() - clock)
        tokens.append(sum(int(m.sum()) for m in out.response_mask))
    median = statistics.median(times)
    return {
        "setup_s": setup,
        "generate_s": median,
        "tokens": statistics.median(tokens),
        "tokens_per_s": statistics.median(n / t for n, t in zip(tokens, times, strict=True)),
    }


def worker_iteration(args: argparse.Namespace) -> dict[str, float]:
    import torch

    from lppo.algorithms import ClippedPPO, OffPolicyCorrection
    from lppo.config import PPOConfig
    from lppo.iteration.data import ReplayDataModule
    from lppo.iteration.hooks import PPOCallback
    from lppo.modules import ActorModule, CriticModule
    from lppo.modules.models import HFCausalLM
    from lppo.run.system import PPOSystem, RolloutSettings
    from lppo.run.trainer import PPOTrainer
    from lppo.tasks import CopyTask

    class Timer(PPOCallback):
        def __init__(self) -> None:
            self.walls: list[float] = []
            self.sync: list[float] = []

        def on_train_epoch_start(self, trainer, pl_module) -> None:
            self.start = time.perf_counter()

        def on_train_epoch_end(self, trainer, pl_module) -> None:
            self.walls.append(time.perf_counter() - self.start)
            self.sync.append(float(getattr(pl_module.engine, "last_sync_seconds", 0.0)))

    torch.set_num_threads(args.threads)
    spec = dict(MODELS[args.model], max_position_embeddings=256)
    system = PPOSystem(
        actor=ActorModule(
            HFCausalLM(**spec, seed=0),
            lr=3e-3,
            objective=ClippedPPO(clip_high=0.28),
            off_policy=OffPolicyCorrection("truncate", cap=2.0),
        ),
        critic=CriticModule(HFCausalLM(**spec, seed=1), lr=3e-3, value_clip=0.5),
        task=CopyTask(min_length=2, max_length=4, alphabet_size=8, transform="first"),
        engine=_engine(args.engine),
        rollout=RolloutSettings(
            prompts_per_iteration=args.prompts, samples_per_prompt=4, max_new_tokens=6
        ),
        ppo=PPOConfig(critic_epochs=2, actor_epochs=2, actor_minibatches=2),
        num_threads=args.threads,
    )
    timer = Timer()
    trainer = PPOTrainer(
        max_epochs=args.iterations,
        default_root_dir=tempfile.mkdtemp(prefix="lppo-bench-"),  # one run per directory
        callbacks=[timer],
    )
    trainer.fit(system, datamodule=ReplayDataModule(max_tokens_per_chunk=512))
    steady = timer.walls[1:] or timer.walls  # the first iteration pays one-off warm-ups
    return {
        "iteration_s": statistics.median(steady),
        "first_iteration_s": timer.walls[0],
        "sync_s": statistics.median(timer.sync[1:] or timer.sync),
    }


def run_worker(kind: str, engine: str, model: str, args: argparse.Namespace) -> dict[str, float]:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        kind,
        "--engine",
        engine,
        "--model",
        model,
        "--threads",
        str(args.threads),
        "--prompts",
        str(args.prompts),
        "--new-tokens",
        str(args.new_tokens),
        "--repeats",
        str(args.repeats),
        "--iterations",
        str(args.iterations),
    ]
    print(f"[bench] {kind} {engine} {model}", file=sys.stderr, flush=True)
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1])


def report(args: argparse.Namespace) -> None:
    gen: dict[tuple[str, str], dict[str, float]] = {}
    for model in args.models:
        for engine in ("hf", "vllm"):
            gen[engine, model] = run_worker("generate", engine, model, args)
    it: dict[tuple[str, str], dict[str, float]] = {}
    for model in args.iteration_models:
        for engine in ("hf", "vllm"):
            it[engine, model] = run_worker("iteration", engine, model, args)
    print(f"\nthreads {args.threads}, {args.prompts} prompts x 4 samples\n")
    print(
        f"| generate, ≤ {args.new_tokens} new tokens | HF tok/s | vLLM tok/s | vLLM / HF |"
        " HF s | vLLM s | vLLM setup s |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for model in args.models:
        h, v = gen["hf", model], gen["vllm", model]
        print(
            f"| {model} | {h['tokens_per_s']:.0f} | {v['tokens_per_s']:.0f} | "
            f"{v['tokens_per_s'] / h['tokens_per_s']:.2f} | {h['generate_s']:.2f} | "
            f"{v['generate_s']:.2f} | {v['setup_s']:.1f} |"
        )
    if it:
        print("\n| RL iteration (6 new tokens) | HF s | vLLM s | vLLM / HF | vLLM sync s |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for model in args.iteration_models:
            h, v = it["hf", model], it["vllm", model]
            print(
                f"| {model} | {h['iteration_s']:.2f} | {v['iteration_s']:.2f} | "
                f"{v['iteration_s'] / h['iteration_s']:.2f} | {v['sync_s']:.3f} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "50M"], choices=list(MODELS))
    parser.add_argument("--iteration-models", nargs="*", default=["tiny"], choices=list(MODELS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--worker", choices=["generate", "iteration"])
    parser.add_argument("--engine", choices=["hf", "vllm"])
    parser.add_argument("--model", choices=list(MODELS))
    args = parser.parse_args()
    if args.worker is None:
        report(args)
        return
    fn = worker_generate if args.worker == "generate" else worker_iteration
    print(json.dumps(fn(args)))


if __name__ == "__main__":
    main()
