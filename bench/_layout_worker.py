"""One variant of ``bench/layouts.py``: a PPO fit on ``--devices`` CPU ranks, measured per rank.

A standalone script (Lightning re-runs ``sys.argv`` for ranks > 0)::

    python bench/_layout_worker.py --variant fsdp --out DIR [--hidden 768 --layers 14 ...]

Every rank writes ``DIR/rank<R>.json``: local bytes (a ``DTensor`` counts its ``to_local()``
shard) of the actor's and the critic's parameters, gradients at their peak and optimizer state,
the reference's own parameters (those it does not share with the actor) and the engine's merged
copy (LoRA), the whole-process peak RSS (``ru_maxrss``) and the peak RSS of the measured
iterations (``VmHWM`` reset after the warm-up iteration), each iteration's wall seconds and
phase seconds, and the seconds the layout spent in its own calls (gradient reduction with
FSDP's synced zero-weight pass, idle chunks, gathering full weights for generation and scoring).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _memory import PeakProbe, status_kib

from lppo.config import PPOConfig
from lppo.estimators import GAE
from lppo.iteration.data import ReplayDataModule
from lppo.iteration.hooks import IterationContext, IterationResult, PPOCallback
from lppo.layouts import DataParallelLayout, FSDPLayout
from lppo.layouts.fsdp import _param_groups, local_part, roots_of
from lppo.modules import ActorModule, CriticModule
from lppo.modules.lora import LoRA
from lppo.modules.models import HFCausalLM
from lppo.rollout import HFGenerateEngine
from lppo.run.system import PPOSystem, RolloutSettings
from lppo.run.trainer import PPOTrainer
from lppo.runtime.strategy import PPOStrategy
from lppo.tasks import CopyTask

VARIANTS = ("ddp", "fsdp", "lora_ddp", "lora_fsdp", "fsdp_chunk")
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]

#: Seconds spent in the layout's own calls during the current iteration, by call.
LAYOUT_SECONDS: dict[str, float] = defaultdict(float)
#: Peak local gradient bytes per role ("actor" / "critic") over the measured iterations.
GRAD_PEAK: dict[str, int] = defaultdict(int)


def nbytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the local parts of ``tensors`` (a sharded tensor counts its own shard)."""
    total = 0
    for t in tensors:
        if t is not None:
            local = local_part(t)
            total += local.numel() * local.element_size()
    return total


def role(module: nn.Module) -> str:
    return "actor" if isinstance(module, ActorModule) else "critic"


def pending_fsdp_grads(module: nn.Module) -> int:
    """Bytes of FSDP's unsharded gradients accumulated (sync off) and not yet reduce-scattered."""
    total = 0
    for root in roots_of(module):
        for group in _param_groups(root):
            for fsdp_param in group.fsdp_params:
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                grads = [getattr(unsharded, "grad", None), fsdp_param.unsharded_accumulated_grad]
                total += nbytes(grads)
    return total


def held_grads(module: nn.Module) -> int:
    """Every gradient byte ``module`` holds now: ``.grad`` (local parts) + FSDP's pending ones."""
    return nbytes(p.grad for p in module.parameters()) + pending_fsdp_grads(module)


class Timed:
    """Mixin timing a layout's own calls into :data:`LAYOUT_SECONDS` (and the gradient peak)."""

    def reduce_gradients(
        self, module: nn.Module, params: Sequence[nn.Parameter], group: Any
    ) -> float:
        GRAD_PEAK[role(module)] = max(GRAD_PEAK[role(module)], held_grads(module))
        t = time.perf_counter()
        norm = super().reduce_gradients(module, params, group)  # type: ignore[misc]
        LAYOUT_SECONDS["reduce_gradients"] += time.perf_counter() - t
        GRAD_PEAK[role(module)] = max(GRAD_PEAK[role(module)], held_grads(module))
        return norm

    def idle_chunk(self, module: nn.Module) -> None:
        t = time.perf_counter()
        super().idle_chunk(module)  # type: ignore[misc]
        LAYOUT_SECONDS["idle_chunk"] += time.perf_counter() - t

    @contextlib.contextmanager
    def gathered(self, modules: Sequence[nn.Module | None]) -> Iterator[None]:
        """Times the gather at entry and the reshard at exit, not the forwards inside."""
        inner = super().gathered(modules)  # type: ignore[misc]
        t = time.perf_counter()
        inner.__enter__()
        LAYOUT_SECONDS["gather"] += time.perf_counter() - t
        try:
            yield
        finally:
            t = time.perf_counter()
            inner.__exit__(None, None, None)
            LAYOUT_SECONDS["gather"] += time.perf_counter() - t


class TimedDDP(Timed, DataParallelLayout):
    pass


class TimedFSDP(Timed, FSDPLayout):
    pass


class Probe(PPOCallback):
    """Times every iteration; measures memory over the iterations after the first (warm-up)."""

    def __init__(self, out: Path, system: PPOSystem) -> None:
        self.out, self.system = out, system
        self.iterations: list[dict[str, Any]] = []
        self.steady_peak = 0
        self.method = "none"

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        LAYOUT_SECONDS.clear()
        if trainer.current_epoch == 1:
            GRAD_PEAK.clear()
            probe = PeakProbe()
            probe.start()  # resets VmHWM: the peak of the measured iterations
            self.method = probe.method
        self.t0 = time.perf_counter()

    def on_train_step_end(self, ctx: IterationContext) -> None:
        if ctx.module is not None:  # gradients of every chunk, before finish reduces them
            GRAD_PEAK[ctx.phase] = max(GRAD_PEAK[ctx.phase], held_grads(ctx.module))

    def on_iteration_end(self, ctx: IterationContext, result: IterationResult) -> None:
        self.phases = {k: round(v, 4) for k, v in result.seconds.items()}
        if ctx.trainer is not None and not self.iterations:  # kept if a later step fails
            self.write(ctx.trainer, completed=ctx.iteration)

    def write(self, trainer: Any, completed: int) -> None:
        """Write this rank's record (``completed``: the last iteration whose phases ran)."""
        record = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "completed_iteration": completed,
            **memory(self.system),
            "grad_peak": dict(GRAD_PEAK),
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "steady_peak_rss": self.steady_peak,
            "rss_method": self.method,
            "iterations": self.iterations,
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.iterations.append(
            {
                "seconds": time.perf_counter() - self.t0,
                "phases": self.phases,
                "layout": dict(LAYOUT_SECONDS),
            }
        )
        if trainer.current_epoch >= 1:
            self.steady_peak = status_kib("VmHWM") * 1024

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.write(trainer, completed=len(self.iterations) - 1)


def optimizer_bytes(module: Any) -> int:
    state = module.optimizer.state.values() if module.optimizer is not None else []
    return nbytes(v for s in state for v in s.values() if torch.is_tensor(v) and v.dim() > 0)


def memory(system: PPOSystem) -> dict[str, Any]:
    """Local bytes of the models' parameters and optimizer states, and the extra copies."""
    actor, critic, reference = system.actor, system.critic, system.reference
    assert critic is not None
    shared = {id(p) for p in actor.parameters()}
    merged = getattr(actor, "_merged", None)
    return {
        "parameters": sum(p.numel() for p in actor.model.parameters() if not _adapter(p, actor)),
        "actor_params": nbytes(actor.parameters()),
        "critic_params": nbytes(critic.parameters()),
        "actor_trainable": nbytes(actor.trainable_parameters()),
        "critic_trainable": nbytes(critic.trainable_parameters()),
        "actor_optimizer": optimizer_bytes(actor),
        "critic_optimizer": optimizer_bytes(critic),
        "reference_params": 0
        if reference is None
        else nbytes(p for p in reference.parameters() if id(p) not in shared),
        "reference_present": reference is not None,
        "engine_copy": 0 if merged is None else nbytes(merged._model[0].parameters()),
    }


def _adapter(p: nn.Parameter, actor: ActorModule) -> bool:
    """Whether ``p`` is a LoRA adapter weight (left out of the model's parameter count)."""
    return actor.lora is not None and p.requires_grad


def build(args: argparse.Namespace) -> PPOSystem:
    lora = None
    if args.variant.startswith("lora"):
        lora = LoRA(r=args.lora_rank, alpha=2 * args.lora_rank, target_modules=ATTENTION)

    def spec(seed: int) -> HFCausalLM:
        return HFCausalLM(
            architecture="llama",
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=args.heads,
            intermediate_size=args.ffn,
            seed=seed,
            dtype="float32",
        )

    return PPOSystem(
        actor=ActorModule(spec(0), lr=1e-5, lora=lora),
        critic=CriticModule(spec(1), lr=1e-5, lora=lora),
        task=CopyTask(min_length=2, max_length=4, alphabet_size=8, transform="first"),
        engine=HFGenerateEngine(),
        estimator=GAE(gamma=1.0, lam=0.95),
        rollout=RolloutSettings(
            prompts_per_iteration=args.prompts,
            samples_per_prompt=args.samples,
            max_new_tokens=args.new_tokens,
            prompts_per_block=1,
        ),
        ppo=PPOConfig(kl_coef=0.05, critic_epochs=1, actor_epochs=1, actor_minibatches=1),
        num_threads=1,
    )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--variant", choices=VARIANTS, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--devices", type=int, default=2)
    add_run_args(p)
    return p.parse_args(argv)


def run_args(args: argparse.Namespace) -> list[str]:
    """``args``' values of every :func:`add_run_args` setting, as this script's flags."""
    p = argparse.ArgumentParser()
    add_run_args(p)
    keys = vars(p.parse_args([]))
    return [x for key in keys for x in (f"--{key.replace('_', '-')}", str(getattr(args, key)))]


def add_run_args(p: argparse.ArgumentParser) -> None:
    """The model size and run length of a variant (one owner: the bench parses them too)."""
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=14)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=6)
    p.add_argument("--iterations", type=int, default=3)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    system = build(args)
    layout: Timed = TimedDDP()
    if "fsdp" in args.variant:
        layout = TimedFSDP(reduce_every_chunk=args.variant == "fsdp_chunk")
    trainer = PPOTrainer(
        max_epochs=args.iterations,
        default_root_dir=str(args.out / "run"),
        logger=False,
        enable_checkpointing=False,
        accelerator="cpu",
        devices=args.devices,
        strategy=PPOStrategy(layout=layout),
        callbacks=[Probe(args.out, system)],
    )
    trainer.fit(system, datamodule=ReplayDataModule(max_tokens_per_chunk=512))


if __name__ == "__main__":
    main()
