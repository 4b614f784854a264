"""``lppo fit`` with megatron modules on CPU processes (standalone script, launched by tests).

Run as ``python megatron_fit_worker.py [--record DIR] fit --config ... [overrides]``: installs
the megatron CPU shims (``tests/_megatron_cpu.py``), then runs ``lppo.run.cli.run`` with the
arguments after the worker's own. With ``trainer.devices > 1`` Lightning re-runs this script for
the other ranks (so it must not run under pytest, whose command would be relaunched instead).
With ``--record DIR`` every rank writes ``DIR/rank<R>.json`` (its data- and tensor-parallel
rank and size, and per iteration the prompt index and token ids of every row it put) and
``DIR/state<R>.pt`` (the final actor and critic parameters, tensor-parallel shards gathered
whole, megatron names).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import _megatron_cpu
import torch

from lppo.iteration.hooks import IterationContext, PPOCallback
from lppo.modules.megatron.convert import unshard
from lppo.run.cli import run


class Record(PPOCallback):
    """Records this rank's rows and groups; writes them with the full weights at the end."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.rollouts: list[dict[str, Any]] = []

    def on_rollout_end(self, ctx: IterationContext) -> None:
        cols = ctx.store.read(ctx.row_ids, ["prompt_index", "input_ids"])
        self.rollouts.append(
            {
                "iteration": ctx.iteration,
                "prompts": [int(p) for p in cols["prompt_index"]],
                "rows": [t.tolist() for t in cols["input_ids"]],
            }
        )

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        parallel = pl_module.controller.parallel
        rank = trainer.global_rank
        record = {
            "rank": rank,
            "world_size": trainer.world_size,
            "data": [parallel.data.rank, parallel.data.size],
            "tensor": [parallel.tensor.rank, parallel.tensor.size],
            "rollouts": self.rollouts,
        }
        (self.out / f"rank{rank}.json").write_text(json.dumps(record))
        state = {}
        for role in ("actor", "critic"):
            module = getattr(pl_module, role)
            group = module.parallel.tensor
            for name, p in module.ddp.module.named_parameters():
                state[f"{role}.{name}"] = unshard(name, group.all_gather(p.detach())).clone()
        torch.save(state, self.out / f"state{rank}.pt")


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["--record"]:
        out, args = args[1], args[2:]
        args = [
            *args,
            "--trainer.callbacks+=megatron_fit_worker.Record",
            f"--trainer.callbacks.out={out}",
        ]
    _megatron_cpu.install()
    try:
        run(args)
    finally:
        _megatron_cpu.uninstall()


if __name__ == "__main__":
    main()
