"""One rank of the data-parallel parity check (standalone script, also imported by the test).

Run as ``python dp_parity_worker.py --rank R --world-size W --init-file F --out O --role R
[--layout fsdp] [--abort-first] [--vocab-chunk N] [--share]``: joins a gloo process group through
``file://F``, trains one optimizer step of the tiny float64 actor or critic on this rank's
share of the rows, and rank 0 ``torch.save``s the step's stats, metrics and the parameters
before and after the step to ``O``.

The optimizer is plain SGD with ``lr=1`` and no clipping, so ``before - after`` is exactly the
step's (all-reduced) gradient.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
from pathlib import Path

import torch

TESTS_DIR = Path(__file__).resolve().parents[1]
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

from _builders import (  # noqa: E402
    filled_store,
    random_rows,
    shared_prompt_rows,
    tiny_backbone,
    tiny_lm,
)
from _objective_sweep import NAMES as SWEEP_NAMES  # noqa: E402
from _objective_sweep import combos, sweep_store  # noqa: E402

from lppo.algorithms import ClippedPPO  # noqa: E402
from lppo.iteration.chunks import iter_chunks  # noqa: E402
from lppo.iteration.data_settings import DataSettings  # noqa: E402
from lppo.iteration.planner import ChunkPlanner  # noqa: E402
from lppo.layouts import FSDPLayout  # noqa: E402
from lppo.layouts.base import ParallelContext  # noqa: E402
from lppo.layouts.fsdp import is_sharded  # noqa: E402
from lppo.modules import ActorModule, CriticModule  # noqa: E402
from lppo.types import ADVANTAGES, OLD_LOGPROBS, RETURNS, VALUES  # noqa: E402

N_ROWS = 5
DATA_SEED = 11
PLAN_SEED = 3
SGD_LR = 1.0


def rows(shared: bool = False) -> dict[str, list[torch.Tensor]]:
    """The step's rows: identical in every process (no row shorter than half the longest).

    ``shared``: two prompts answered 3 and 2 times (:func:`_builders.shared_prompt_rows`).
    """
    if shared:
        return shared_prompt_rows([3, 2], DATA_SEED)
    return random_rows(N_ROWS, DATA_SEED, min_len=8, max_len=14)


def budget(shared: bool = False) -> int:
    """The longest row: one row per chunk, so 5 chunks over 2 ranks (``shared``: up to 3)."""
    return max(len(t) for t in rows(shared)["input_ids"]) * (3 if shared else 1)


def plan_step(world_size: int, rank: int, shared: bool = False):
    """The (single) step plan of ``rank`` out of ``world_size`` (``shared``: sample order)."""
    store = filled_store(rows(shared))
    settings = DataSettings(budget(shared), seed=PLAN_SEED)
    planner = ChunkPlanner(settings, world_size, rank, sample_order=shared)
    [step] = planner.plan(store.meta(), epoch=0, minibatches=1).steps
    return store, step


class GradNames:
    """Mixin recording which parameters hold a gradient when the optimizer is about to step."""

    def on_before_step(self, grad_norm: float) -> None:
        self.grad_names = sorted(n for n, p in self.named_parameters() if p.grad is not None)


class Actor(GradNames, ActorModule):
    pass


class Critic(GradNames, CriticModule):
    pass


def build_module(role: str, vocab_chunk: int = 0):
    """A fresh tiny float64 module with an SGD optimizer and no clipping.

    The actor computes its log-probabilities materialized, or ``vocab_chunk`` vocabulary
    entries at a time (:mod:`lppo.modules.vocab`). It also holds a trainable parameter the
    loss never uses (like an untied LM head under a critic): it must stay gradient-free, as in
    one process, so optimizers skip it.
    """

    def sgd(params):
        return torch.optim.SGD(params, lr=SGD_LR)

    if role == "actor":
        module = Actor(
            tiny_lm(seed=0),
            objective=ClippedPPO(clip_high=0.28),
            entropy_coef=0.01,
            max_grad_norm=None,
            optimizer=sgd,
            vocab_chunk=vocab_chunk,
        )
        module.configure_model()
        assert module.vocab_chunk == vocab_chunk
        names = [OLD_LOGPROBS, ADVANTAGES]
    elif role == "critic":
        module = Critic(tiny_backbone(seed=0), value_clip=0.2, max_grad_norm=None, optimizer=sgd)
        names = [VALUES, RETURNS]
    else:
        raise ValueError(f"unknown role {role!r}")
    module.unused = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    return module, names


def whole(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of ``module``, whole (FSDP shards gathered: a collective), cloned."""
    return {n: _full(p.detach()).clone() for n, p in module.named_parameters()}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if is_sharded(t) else t


def run_step(
    role: str,
    world_size: int,
    rank: int,
    layout: str = "ddp",
    abort_first: bool = False,
    vocab_chunk: int = 0,
    shared: bool | None = None,
) -> dict:
    """Train one step of ``role`` on this rank's chunks; return stats, metrics and parameters.

    ``layout="fsdp"`` shards the module's Hugging Face model with :class:`FSDPLayout`;
    ``abort_first`` trains every chunk of the step once and aborts before the real step.
    ``shared``: the rows of :func:`rows` ``(shared=True)``, with prompts shared (``True``) or
    per row (``False``).
    """
    module, names = build_module(role, vocab_chunk)
    module.share_prompts = bool(shared)
    if layout == "fsdp":
        parallel = FSDPLayout().context(world_size, rank)
        parallel.layout.prepare(module, parallel)
    else:
        parallel = ParallelContext.from_default_group()
    module.parallel = parallel
    store, step = plan_step(world_size, rank, shared is not None)
    before = whole(module)
    if abort_first:
        module.begin(step)
        for chunk in iter_chunks(store, step, names):
            module.train_chunk(chunk)
        module.abort()
        assert all(torch.equal(before[n], p) for n, p in whole(module).items())
    module.begin(step)
    for chunk in iter_chunks(store, step, names):
        module.train_chunk(chunk)
    stats = module.finish()
    after = whole(module)
    fields = dataclasses.asdict(stats)
    metrics = fields.pop("metrics")
    return {
        "stats": fields,
        "metrics": metrics,
        "before": before,
        "after": after,
        "grad_names": module.grad_names,
        "chunks": step.chunks,
        "sharded": sum(is_sharded(p) for p in module.parameters()),
    }


def run_sweep(world_size: int, rank: int) -> dict:
    """One SGD step per point of the objective sweep on this rank's chunks.

    Every objective × aggregation × KL in the loss × off-policy correction
    (``tests/_objective_sweep.py``), on 9 rows of one row per chunk (uneven over 2 ranks).

    Returns:
        ``{repr(combo): {"stats", "metrics", "after"}}``.
    """
    store = sweep_store(n_prompts=3, seed=DATA_SEED, invalid=0)
    budget = max(len(t) for t in store.read(list(range(len(store))), ["input_ids"])["input_ids"])
    planner = ChunkPlanner(DataSettings(budget, seed=PLAN_SEED), world_size=world_size, rank=rank)
    [step] = planner.plan(store.meta(), epoch=0, minibatches=1).steps
    parallel = ParallelContext.from_default_group()
    model = tiny_lm(seed=0)
    results = {}
    for combo in combos():
        actor = combo.actor(model, optimizer=lambda params: torch.optim.SGD(params, lr=SGD_LR))
        actor.parallel = parallel
        actor.begin(step)
        for chunk in iter_chunks(store, step, SWEEP_NAMES):
            actor.train_chunk(chunk)
        fields = dataclasses.asdict(actor.finish())
        after = {n: p.detach().clone() for n, p in actor.named_parameters()}
        results[repr(combo)] = {"metrics": fields.pop("metrics"), "stats": fields, "after": after}
    return {"combos": results, "chunks": step.chunks}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--init-file", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--role", choices=("actor", "critic", "sweep"), required=True)
    parser.add_argument("--layout", choices=("ddp", "fsdp"), default="ddp")
    parser.add_argument("--abort-first", action="store_true")
    parser.add_argument("--vocab-chunk", type=int, default=0)
    parser.add_argument("--share", action="store_true")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        backend="gloo",
        init_method=f"file://{args.init_file.resolve()}",
        rank=args.rank,
        world_size=args.world_size,
    )
    try:
        if args.role == "sweep":
            result = run_sweep(args.world_size, args.rank)
        else:
            result = run_step(
                args.role,
                args.world_size,
                args.rank,
                args.layout,
                args.abort_first,
                args.vocab_chunk,
                True if args.share else None,
            )
        if args.rank == 0:
            torch.save(result, args.out)
        # FSDP's modules hold the process group through their device mesh in reference cycles:
        # collected here, while every rank still runs, not at interpreter exit, where gloo's
        # teardown against a peer that already left ended rank 1 with SIGABRT (1 CI run in ~20).
        del result
        gc.collect()
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
