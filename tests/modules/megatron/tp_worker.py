"""One rank of the tensor- / data-parallel checks (standalone script; the test launches it).

``python tp_worker.py --rank R --world-size W --init-file F --out O --layout tp|dp``: joins a gloo
group through ``file://F`` and builds the tiny float64 megatron actor and critic, either with
``tensor_parallel_size=W`` (``tp``: the same Hugging Face weights, sharded; every rank trains
every chunk) or with ``tensor_parallel_size=1`` (``dp``: megatron's data-parallel group of W
ranks, each training its planner share of the chunks, lppo's data group the default group). It
scores a chunk and takes two optimizer steps each (two minibatches, clipped), and rank 0 saves
the stats, the scores and the full weights (shards gathered, Hugging Face names for the actor's
policy) to ``O``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
for path in (HERE, HERE.parents[1]):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import _megatron_cpu  # noqa: E402
from _builders import filled_store, random_rows  # noqa: E402
from _mbuilders import make  # noqa: E402

from lppo.iteration.chunks import iter_chunks, read_chunk  # noqa: E402
from lppo.iteration.data_settings import DataSettings  # noqa: E402
from lppo.iteration.planner import ChunkPlanner  # noqa: E402
from lppo.modules.megatron.convert import unshard  # noqa: E402
from lppo.types import ADVANTAGES, OLD_LOGPROBS, RETURNS, VALUES  # noqa: E402

NAMES = {"actor": [OLD_LOGPROBS, ADVANTAGES], "critic": [VALUES, RETURNS]}


def run(world_size: int, rank: int, layout: str) -> dict:
    cols = random_rows(8, 21, min_len=6, max_len=14)
    store = filled_store(cols)
    longest = max(len(t) for t in cols["input_ids"])
    dp = world_size if layout == "dp" else 1
    planner = ChunkPlanner(
        DataSettings(longest + 4, seed=2), world_size=dp, rank=rank if dp > 1 else 0
    )
    epoch = planner.plan(store.meta(), minibatches=2)
    out: dict = {}
    for role in ("actor", "critic"):
        kwargs = {"lr": 1e-2, "max_grad_norm": 0.5}
        if role == "actor":
            kwargs["entropy_coef"] = 0.01
        module = make(role, tp=world_size // dp, **kwargs)
        tensor = module.parallel.tensor
        assert tensor.size == world_size // dp and module.parallel.data.size == dp
        chunk = read_chunk(store, list(range(8)), NAMES[role])
        scores = module.score(chunk)
        stats = []
        for step in epoch.steps:
            module.begin(step)
            for c in iter_chunks(store, step, NAMES[role]):
                module.train_chunk(c)
            stats.append(dataclasses.asdict(module.finish()))
        gpt = module.ddp.module
        weights = {n: unshard(n, tensor.all_gather(p.detach())) for n, p in gpt.named_parameters()}
        policy = module.policy().state_dict() if role == "actor" else None
        out[role] = {"scores": scores, "stats": stats, "weights": weights, "policy": policy}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--init-file", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--layout", choices=("tp", "dp"), default="tp")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{args.init_file}",
        rank=args.rank,
        world_size=args.world_size,
    )
    _megatron_cpu.install()
    result = run(args.world_size, args.rank, args.layout)
    if args.rank == 0:
        torch.save(result, args.out)
    _megatron_cpu.uninstall()


if __name__ == "__main__":
    main()
