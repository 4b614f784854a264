"""GPU check of the megatron-core backend: one critic and one actor epoch, three ways.

Not a test: it prints a markdown table. Needs one CUDA device (exits 0 with a note without
one). Usage::

    .venv/bin/python bench/megatron_gpu.py                # ~0.47B random Llama, bf16
    .venv/bin/python bench/megatron_gpu.py --hidden 256 --layers 2 --ffn 512 --rows 16   # quick

Model: a random Llama (``lppo.modules.models.HFCausalLM``, default hidden 1024, 24 layers, 16
heads, MLP 4096, vocab 32000: 0.47B parameters) converted into megatron-core's GPTModel
(``lppo.modules.megatron.MegatronGPT``), bf16, megatron's distributed optimizer. Rows: ``--rows``
random rows of ``--min-len``..``--max-len`` tokens (response = second half). Every variant trains
one optimizer step over the same rows ("an epoch"), after one untimed warm-up step:

* ``streamed``: ``ChunkPlanner(max_tokens_per_chunk=--chunk-tokens)`` chunks read from a
  ``MemoryReplayStore`` when reached, ``begin → train_chunk* → finish`` (lppo's lifecycle).
* ``merged``: the same lifecycle with one chunk holding every row (the merged payload).
* ``megatron``: megatron's own step on the same tokens: ``forward_backward_no_pipelining`` over
  fixed ``[--micro-batch, --max-len]`` micro-batches, masked per-token loss (cross entropy for
  the actor, squared error for the critic), ``finalize_model_grads`` with the token count, then
  the megatron optimizer's ``step``.

Reported per role and variant: real (unpadded) tokens per second over ``--repeats`` timed
steps, the peak CUDA memory allocated during them, and the grad norm of the last step
(streamed and merged train the same loss and must agree to bf16 round-off; megatron's step
trains a plain cross entropy / squared error, so only its speed and memory compare).
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch

from lppo.iteration.chunks import iter_chunks
from lppo.iteration.data_settings import DataSettings
from lppo.iteration.planner import ChunkPlanner
from lppo.layouts.megatron import tensor_parallel_grad_norm
from lppo.replay import MemoryReplayStore
from lppo.types import (
    ADVANTAGES,
    INPUT_IDS,
    OLD_LOGPROBS,
    RESPONSE_MASK,
    RETURNS,
    REWARD,
    VALUES,
)

NAMES = {"actor": [OLD_LOGPROBS, ADVANTAGES], "critic": [VALUES, RETURNS]}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--min-len", type=int, default=256)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--chunk-tokens", type=int, default=8192)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    return p.parse_args(argv)


def make_store(args: argparse.Namespace) -> MemoryReplayStore:
    """``--rows`` random rows with every column both roles read (prompt = first half)."""
    g = torch.Generator().manual_seed(0)
    cols: dict[str, list[torch.Tensor]] = {
        k: [] for k in (INPUT_IDS, RESPONSE_MASK, REWARD, OLD_LOGPROBS, ADVANTAGES, VALUES, RETURNS)
    }
    for _ in range(args.rows):
        n = int(torch.randint(args.min_len, args.max_len + 1, (1,), generator=g))
        mask = torch.zeros(n, dtype=torch.bool)
        mask[n // 2 :] = True
        cols[INPUT_IDS].append(torch.randint(3, args.vocab, (n,), generator=g))
        cols[RESPONSE_MASK].append(mask)
        cols[REWARD].append(torch.rand((), generator=g))
        for name in (OLD_LOGPROBS, ADVANTAGES, VALUES, RETURNS):
            x = torch.randn(n, generator=g) * mask
            cols[name].append(-x.abs() - 10.0 if name == OLD_LOGPROBS else x)
    store = MemoryReplayStore()
    store.put(list(range(args.rows)), cols)
    return store


def build(role: str, args: argparse.Namespace):
    """A megatron actor or critic on the GPU (distributed optimizer), built and ready."""
    from lppo.modules.megatron import MegatronActor, MegatronCritic, MegatronGPT
    from lppo.modules.models import HFCausalLM

    hf = HFCausalLM(
        architecture="llama",
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        intermediate_size=args.ffn,
        max_position_embeddings=max(args.max_len, 64),
        dtype=args.dtype,
        seed=0 if role == "actor" else 1,
    )
    spec = MegatronGPT(hf, distributed_optimizer=True)
    cls = MegatronActor if role == "actor" else MegatronCritic
    module = cls(spec, lr=1e-6)
    module.configure_model(args.vocab, 0, 1, 2)
    module.configure_optimizer()
    return module


def lppo_step(module, store: MemoryReplayStore, budget: int, role: str) -> float:
    """One lifecycle step over every row with chunks of at most ``budget`` tokens."""
    epoch = ChunkPlanner(DataSettings(budget, seed=0)).plan(store.meta())
    [step] = epoch.steps
    module.begin(step)
    for chunk in iter_chunks(store, step, NAMES[role]):
        module.train_chunk(chunk)
    return module.finish().grad_norm


def _micro_batches(store: MemoryReplayStore, args: argparse.Namespace, role: str):
    """Fixed-shape ``[micro_batch, max_len]`` batches of the rows, on the GPU."""
    from lppo.iteration.chunks import read_chunk

    ids = list(range(args.rows))
    out = []
    for i in range(0, len(ids), args.micro_batch):
        chunk = read_chunk(store, ids[i : i + args.micro_batch], NAMES[role])
        pad = args.max_len - chunk.input_ids.shape[1]
        fields = {
            "ids": chunk.input_ids,
            "mask": chunk.response_mask,
            "target": chunk.returns if role == "critic" else chunk.input_ids,
        }
        out.append({k: torch.nn.functional.pad(v, (0, pad)).cuda() for k, v in fields.items()})
    return out


def megatron_step(module, batches: list[dict], role: str) -> float:
    """megatron's own training step over ``batches`` (its schedule, loss, optimizer)."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    ddp = module.ddp
    config = ddp.module.config
    config.no_sync_func, config.finalize_model_grads_func = ddp.no_sync, finalize_model_grads
    t = batches[0]["ids"].shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device="cuda").triu(1)[None, None]

    def loss_func(mask: torch.Tensor, per_token: torch.Tensor):
        # a sum: with calculate_per_token_loss megatron divides by the step's token count
        loss = (per_token * mask).sum()
        return loss, mask.sum().to(torch.int), {"loss": loss.detach()}

    def forward_step(data, model):
        b = next(data)
        pos = torch.arange(t, device="cuda").expand(b["ids"].shape)
        out = model(b["ids"], pos, causal)
        if role == "actor":  # token t + 1 from position t
            target = torch.nn.functional.pad(b["target"][:, 1:], (0, 1))
            per_token = vocab_parallel_cross_entropy(out.float(), target)
        else:
            per_token = (out[..., 0].float() - b["target"].float()).square()
        return per_token, functools.partial(loss_func, b["mask"].float())

    ddp.zero_grad_buffer()
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(batches),
        model=[ddp],
        num_microbatches=len(batches),
        seq_length=t,
        micro_batch_size=batches[0]["ids"].shape[0],
        forward_only=False,
    )
    params = module.trainable_parameters()  # lppo's measure:
    grad_norm = tensor_parallel_grad_norm(module.ddp.module, params, module.parallel.tensor)
    module.optimizer.inner.step()
    config.no_sync_func = config.finalize_model_grads_func = None
    return grad_norm


def measure(step: Callable[[], float], repeats: int) -> tuple[float, float, float]:
    """``(seconds per step, peak GiB, last grad norm)`` after one untimed warm-up step."""
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(repeats):
        norm = step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / repeats
    return seconds, torch.cuda.max_memory_allocated() / 2**30, norm


def run(args: argparse.Namespace) -> list[dict]:
    """Every (role, variant) measurement, as rows of the report."""
    store = make_store(args)
    tokens = sum(len(t) for t in store.read(list(range(args.rows)), [INPUT_IDS])[INPUT_IDS])
    rows = []
    for role in ("critic", "actor"):
        module = build(role, args)
        params = sum(p.numel() for p in module.parameters())
        batches = _micro_batches(store, args, role)
        variants = {
            "streamed": lambda m=module, r=role: lppo_step(m, store, args.chunk_tokens, r),
            "merged": lambda m=module, r=role: lppo_step(m, store, 10**9, r),
            "megatron": lambda m=module, b=batches, r=role: megatron_step(m, b, r),
        }
        for name, step in variants.items():
            seconds, peak, norm = measure(step, args.repeats)
            rows.append(
                {
                    "role": role,
                    "variant": name,
                    "params": params,
                    "tokens_per_s": tokens / seconds,
                    "peak_gib": peak,
                    "seconds": seconds,
                    "grad_norm": norm,
                }
            )
        del module, batches
        torch.cuda.empty_cache()
    return rows


def report(rows: list[dict], args: argparse.Namespace) -> str:
    head = (
        f"{rows[0]['params'] / 1e9:.2f}B params, {args.dtype}, {args.rows} rows of "
        f"{args.min_len}-{args.max_len} tokens, chunks of {args.chunk_tokens} tokens, "
        f"micro-batch {args.micro_batch}, {torch.cuda.get_device_name()}\n\n"
        "| role | variant | tokens/s | s/step | peak GiB | grad norm |\n|---|---|---|---|---|---|\n"
    )
    body = "".join(
        f"| {r['role']} | {r['variant']} | {r['tokens_per_s']:,.0f} | {r['seconds']:.3f} | "
        f"{r['peak_gib']:.1f} | {r['grad_norm']:.4g} |\n"
        for r in rows
    )
    return head + body


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not torch.cuda.is_available():
        print("bench/megatron_gpu.py needs a CUDA device; none here, nothing measured.")
        return 0
    start = time.perf_counter()
    print(report(run(args), args))
    print(f"total {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
