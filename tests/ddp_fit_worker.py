"""A tiny PPO fit on ``--devices`` CPU processes (standalone script, launched by test_ddp.py).

Run as ``python ddp_fit_worker.py --devices N --out DIR [--dtype float64] [--num-nodes M]
[--tq-temp-dir DIR] [--old-values critic] [--max-staleness S] [--dynamic-sampling-rounds N]
[--lora] [--multi-turn] [--layout fsdp|fsdp_chunk] [--param-dtype bfloat16] [--cpu-offload]
[--critic-free] [--max-tokens-per-chunk T] [--iterations I] [--export] [--kill-at K] [--resume]``
(with ``N > 0`` the task's reward is pass/fail,
:class:`_builders.ThresholdCopyTask`, so groups are dropped and refilled; ``--lora`` trains LoRA
adapters on actor and critic; ``--multi-turn`` rolls out two-turn hidden-digit episodes with a
per-turn reward; ``--layout fsdp`` shards the models with FSDP2 (``ppo_fsdp``; ``fsdp_chunk``:
reducing every chunk's gradients; ``--param-dtype`` its mixed-precision compute dtype,
``--cpu-offload`` its CPU offload of the shards); ``--critic-free``
trains the actor alone with GRPO advantages; ``--export`` writes the final policy to ``DIR/hf``
(:class:`~lppo.callbacks.HFExport`); ``--kill-at K`` SIGKILLs every rank when iteration K (0-based)
has rolled out, after the checkpoint of iteration K - 1; ``--resume`` continues from
``--ckpt_path last``);
with ``--tq-temp-dir`` the replay is one
:class:`~lppo.replay.TransferQueueReplayStore` shared by every rank (rank 0 starts a local Ray
there, the other ranks attach to it) and each rank also records TransferQueue's own state of
the partition at the end (``tq``: partition, keys left, live rows, claims, released ids).
With ``N x M > 1`` the fit uses :class:`lppo.runtime.strategy.PPOStrategy`; Lightning re-runs this
script for ranks ``1..N-1`` (so it must not run under pytest, whose command would be relaunched
instead); with ``M > 1`` an external launcher (torchrun, SLURM's srun) starts every node. Five
prompts in blocks of one over two ranks: rank 0 generates three, rank 1 two (uneven rows), and
overlong responses are masked (uneven valid rows, counted against the drop budget). Every rank
writes ``DIR/rank<R>.json`` (per iteration the prompts of the rows it put; per step the chunks
it trained and the token ids of their rows; global step; rows left in its store; the dtypes
of the stored parameter shards, of the optimizer state and of the actor's weights during its
training forwards) and
``DIR/state<R>.pt`` (the final actor + critic parameters); rank 0's logger writes
``DIR/run/version_0/metrics.csv``. Ranks > 0 perturb their freshly built models, so the parity
also checks that the strategy starts every rank from rank 0's parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path
from typing import Any

import psutil
import torch
from _builders import ThresholdCopyTask
from lppo.callbacks import HFExport

from lppo.config import PPOConfig
from lppo.envs import HiddenDigitEnvironment, HiddenDigitTask
from lppo.estimators import GRPO
from lppo.iteration.data import ReplayDataModule
from lppo.iteration.hooks import IterationContext, PPOCallback
from lppo.layouts import DataParallelLayout, FSDPLayout
from lppo.layouts.fsdp import _param_groups, is_sharded, roots_of
from lppo.loop import attached_trainer
from lppo.modules import ActorModule, CriticModule
from lppo.modules.lora import LoRA
from lppo.modules.models import HFCausalLM
from lppo.replay import TransferQueueReplayStore
from lppo.rollout import HFGenerateEngine, MultiTurnEngine, RolloutEngine
from lppo.run.system import PPOSystem, RolloutSettings
from lppo.run.trainer import PPOTrainer
from lppo.runtime.ray_runtime import RaySettings
from lppo.runtime.strategy import PPOStrategy
from lppo.tasks import CopyTask, Task

ITERATIONS = 2
MAX_TOKENS_PER_CHUNK = 24
PROMPTS = 5


def spec(seed: int, dtype: str) -> HFCausalLM:
    return HFCausalLM(
        hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, seed=seed, dtype=dtype
    )


class PerturbedOnOtherRanks(PPOSystem):
    """Ranks > 0 build their models differently: the strategy must broadcast rank 0's states."""

    def configure_model(self) -> None:
        built = self.controller is not None
        super().configure_model()
        if not built and attached_trainer(self) is not None and self.trainer.global_rank > 0:
            with torch.no_grad():
                for p in self.parameters():
                    p.add_(0.1)


class KillAt(PPOCallback):
    """SIGKILLs this process once iteration ``at`` has rolled out (no cleanup runs)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_rollout_end(self, ctx: IterationContext) -> None:
        if ctx.iteration == self.at:
            os.kill(os.getpid(), signal.SIGKILL)


class RecordPlans(PPOCallback):
    """Records the chunks this rank trains in every step; writes them at the end of the fit."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.steps: list[dict[str, Any]] = []
        self.rollouts: list[dict[str, Any]] = []
        #: dtypes of the actor's first projection weight seen by its forwards with grad on.
        self.forward_dtypes: set[str] = set()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # The weight as the forward sees it: FSDP's gathered (mixed-precision) parameter.
        linear = next(m for m in pl_module.actor.model.modules() if isinstance(m, torch.nn.Linear))

        def record(module: torch.nn.Module, _: Any) -> None:
            if torch.is_grad_enabled():
                self.forward_dtypes.add(str(module.weight.dtype))

        linear.register_forward_pre_hook(record)

    def on_rollout_end(self, ctx: IterationContext) -> None:
        prompts = ctx.store.read(ctx.row_ids, ["prompt_index"])["prompt_index"]
        self.rollouts.append({"iteration": ctx.iteration, "prompts": [int(p) for p in prompts]})

    def on_train_step_start(self, ctx: IterationContext) -> None:
        assert ctx.plan is not None
        ids = [i for c in ctx.plan.chunks for i in c]
        tokens = ctx.store.read(ids, ["input_ids"])["input_ids"] if ids else []
        self.steps.append(
            {
                "iteration": ctx.iteration,
                "phase": ctx.phase,
                "epoch": ctx.epoch,
                "minibatch": ctx.minibatch,
                "chunks": [list(c) for c in ctx.plan.chunks],
                "rows": [t.tolist() for t in tokens],
            }
        )

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        dist = torch.distributed
        rank = trainer.global_rank
        # Local addresses of this process's connected TCP sockets (the process group's
        # connections; the rendezvous store of rank 0 also listens, on torch's choice of address).
        sockets = [c for c in psutil.Process().net_connections(kind="tcp") if c.raddr]
        store = pl_module.controller.data.store
        record = {
            "rank": rank,
            "world_size": trainer.world_size,
            "node_rank": trainer.node_rank,
            "cluster": type(getattr(trainer.strategy, "cluster_environment", None)).__name__,
            "socket_ips": sorted({c.laddr.ip for c in sockets if c.laddr}),
            "strategy": type(trainer.strategy).__name__,
            "layout": type(getattr(trainer.strategy, "layout", None)).__name__,
            "sharded_parameters": sum(is_sharded(p) for p in pl_module.parameters()),
            "parameters": sum(1 for _ in pl_module.parameters()),
            "trim_prompt": [
                getattr(m, "trim_prompt", None) for m in (pl_module.actor, pl_module.critic)
            ],
            "backend": dist.get_backend() if dist.is_initialized() else None,
            "global_step": trainer.global_step,
            "rows_left": len(store.meta().ids),
            "steps": self.steps,
            "rollouts": self.rollouts,
            "tq": tq_state(store) if store.shared else None,
            "forward_dtypes": sorted(self.forward_dtypes),
            "offloaded": offloaded(pl_module),
            "parameter_dtypes": sorted({str(p.dtype) for p in pl_module.parameters()}),
            "optimizer_dtypes": sorted(
                {
                    str(value.dtype)
                    for optimizer in trainer.optimizers
                    for entry in optimizer.state.values()
                    for value in entry.values()
                    if isinstance(value, torch.Tensor) and value.dim() > 0
                }
            ),
        }
        (self.out / f"rank{rank}.json").write_text(json.dumps(record))
        full = trainer.strategy.lightning_module_state_dict()  # gathered under ppo_fsdp
        state = {k: v.detach().cpu().clone() for k, v in full.items()}
        torch.save(state, self.out / f"state{rank}.pt")


def offloaded(module: torch.nn.Module) -> bool:
    """Whether FSDP keeps any of ``module``'s shards offloaded to CPU (``cpu_offload``)."""
    groups = [g for root in roots_of(module) for g in _param_groups(root)]
    return any(p.offload_to_cpu for g in groups for p in g.fsdp_params)


def tq_state(store: Any) -> dict[str, Any]:
    """TransferQueue's own view of the store's partition, and the catalog's."""
    import ray

    from lppo.replay._tq_runtime import tq_controller

    snap = ray.get(tq_controller().get_partition_snapshot.remote(store.partition))
    state = store._call("state")
    return {
        "partition": store.partition,
        "keys": [] if snap is None else sorted(snap.keys_mapping),
        "live": state["ids"],
        "claims": state["claims"],
        "released": state["released"],
        "next_id": state["next_id"],
    }


def task(args: argparse.Namespace) -> Task:
    if args.multi_turn:
        return HiddenDigitTask()
    return ThresholdCopyTask(0.5) if args.dynamic_sampling_rounds else CopyTask()


def engine(args: argparse.Namespace) -> RolloutEngine:
    if not args.multi_turn:
        return HFGenerateEngine()
    environment = HiddenDigitEnvironment(call_reward=0.25)
    return MultiTurnEngine(HFGenerateEngine(), environment, max_turns=2, max_tokens=12)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--precision", default="32-true", help="trainer.precision")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--tq-temp-dir", default=None)
    parser.add_argument("--old-values", default="score")
    parser.add_argument("--max-staleness", type=int, default=0)
    parser.add_argument("--dynamic-sampling-rounds", type=int, default=0)
    parser.add_argument("--lora", action="store_true", help="LoRA adapters on actor and critic")
    parser.add_argument("--multi-turn", action="store_true", help="hidden-digit episodes")
    parser.add_argument("--layout", choices=["ddp", "fsdp", "fsdp_chunk"], default="ddp")
    parser.add_argument("--param-dtype", default=None, help="FSDPLayout.param_dtype")
    parser.add_argument("--cpu-offload", action="store_true", help="FSDPLayout.cpu_offload")
    parser.add_argument("--critic-free", action="store_true", help="GRPO, no critic")
    parser.add_argument("--max-tokens-per-chunk", type=int, default=MAX_TOKENS_PER_CHUNK)
    parser.add_argument("--iterations", type=int, default=ITERATIONS)
    parser.add_argument("--export", action="store_true", help="HFExport into DIR/hf")
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--resume", action="store_true", help="--ckpt_path last")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    lora = LoRA(r=4, alpha=8) if args.lora else None

    system = PerturbedOnOtherRanks(
        actor=ActorModule(spec(0, args.dtype), lr=3e-3, lora=lora),
        critic=None if args.critic_free else CriticModule(spec(1, args.dtype), lr=3e-3, lora=lora),
        estimator=GRPO() if args.critic_free else None,
        task=task(args),
        engine=engine(args),
        rollout=RolloutSettings(
            prompts_per_iteration=PROMPTS,
            samples_per_prompt=3,
            max_new_tokens=4,
            prompts_per_block=1,
            max_staleness=args.max_staleness,
            dynamic_sampling_rounds=args.dynamic_sampling_rounds,
        ),
        ppo=PPOConfig(
            critic_epochs=2,
            actor_minibatches=2,
            kl_coef=0.05,
            mask_truncated=True,
            old_values=args.old_values,
        ),
        num_threads=1,
    )
    callbacks: list[Any] = [RecordPlans(args.out)]
    if args.export:
        callbacks.append(HFExport(directory=str(args.out / "hf")))
    if args.kill_at is not None:
        callbacks.append(KillAt(args.kill_at))
    layout: Any = DataParallelLayout()
    if args.layout != "ddp":
        layout = FSDPLayout(
            param_dtype=args.param_dtype,
            cpu_offload=args.cpu_offload,
            reduce_every_chunk=args.layout == "fsdp_chunk",
        )
    strategy: Any = PPOStrategy(layout=layout) if args.devices * args.num_nodes > 1 else "auto"
    trainer = PPOTrainer(
        max_epochs=args.iterations + args.max_staleness,
        default_root_dir=str(args.out / "run"),
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        callbacks=callbacks,
        ray=RaySettings(temp_dir=args.tq_temp_dir),
        precision=args.precision,
    )
    store = TransferQueueReplayStore() if args.tq_temp_dir else None
    data = ReplayDataModule(
        max_tokens_per_chunk=args.max_tokens_per_chunk, drop_budget=3 * PROMPTS, store=store
    )
    trainer.fit(system, datamodule=data, ckpt_path="last" if args.resume else None)


if __name__ == "__main__":
    main()
