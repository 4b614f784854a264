"""Actor memory and iteration time: full fine-tuning vs LoRA, on a random Llama of ~85M parameters.

Usage (from the repository root; needs the ``[lora]`` extra)::

    .venv/bin/python bench/lora_memory.py                 # full and lora, r = 16
    .venv/bin/python bench/lora_memory.py --rank 64

Each variant is a fresh process running ``lppo.PPOTrainer.fit`` for two iterations of a
critic-free GRPO run (copy task; 8 prompts x 4 samples, 6 new tokens; KL in the loss, so a
reference policy exists) on a random Llama (hidden 768, 12 layers, 12 heads, MLP 2048:
~85M parameters, float32). The second iteration is measured: peak RSS from its start (the
kernel's high-water mark, reset), its seconds, and, at its end, the bytes of the actor's
parameters, of the reference's own parameters, of the trainable parameters (= their
gradients' size during a step) and of the optimizer state. **full**: every weight trains, the
reference is a frozen copy of the actor. **lora**: adapters of rank ``--rank`` on every linear
layer of the blocks; the reference is the actor with its adapters disabled; the rollout engine
samples from a merged copy of the weights.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

SPEC = dict(
    architecture="llama", hidden_size=768, num_layers=12, num_heads=12, intermediate_size=2048
)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def worker(variant: str, rank: int) -> dict:
    import torch
    from _memory import PeakProbe, release_free_heap, status_kib

    from lppo.config import PPOConfig
    from lppo.estimators import GRPO
    from lppo.iteration.data import ReplayDataModule
    from lppo.iteration.hooks import PPOCallback
    from lppo.modules import ActorModule
    from lppo.modules.lora import LoRA
    from lppo.modules.models import HFCausalLM
    from lppo.rollout import HFGenerateEngine
    from lppo.run.system import PPOSystem, RolloutSettings
    from lppo.run.trainer import PPOTrainer
    from lppo.tasks import CopyTask

    torch.set_num_threads(2)
    lora = LoRA(r=rank, alpha=2 * rank) if variant == "lora" else None
    system = PPOSystem(
        actor=ActorModule(HFCausalLM(**SPEC, seed=0), lr=1e-4, kl_loss_coef=0.01, lora=lora),
        critic=None,
        task=CopyTask(min_length=2, max_length=4, alphabet_size=8, transform="first"),
        engine=HFGenerateEngine(batch_size=32),
        estimator=GRPO(),
        rollout=RolloutSettings(prompts_per_iteration=8, samples_per_prompt=4, max_new_tokens=6),
        ppo=PPOConfig(actor_minibatches=2),
        num_threads=2,
    )
    out: dict = {"variant": variant}

    class Probe(PPOCallback):
        def on_train_epoch_start(self, trainer, pl_module) -> None:
            self.active = trainer.current_epoch == 1
            if self.active:
                release_free_heap()
                self.probe = PeakProbe()
                self.probe.start()

        def on_iteration_end(self, ctx, result) -> None:
            if not self.active:
                return
            actor, reference = system.actor, system.reference
            out["peak_rss"] = status_kib("VmHWM") * 1024  # reset when the iteration began
            out["peak_beyond_start"] = self.probe.peak_beyond()
            out["seconds"] = sum(result.seconds.values())
            out["actor_params"] = _bytes(actor.parameters())
            out["reference_params"] = _bytes(reference.parameters()) if reference else 0
            out["trainable"] = _bytes(actor.trainable_parameters())
            state = actor.optimizer.state.values()
            out["optimizer_state"] = _bytes(
                v for s in state for v in s.values() if torch.is_tensor(v) and v.dim() > 0
            )

    trainer = PPOTrainer(
        max_epochs=2,
        default_root_dir=tempfile.mkdtemp(prefix="lppo-lora-"),
        logger=False,
        enable_checkpointing=False,
        callbacks=[Probe()],
        accelerator="cpu",
    )
    trainer.fit(system, datamodule=ReplayDataModule(max_tokens_per_chunk=512))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--worker", metavar="VARIANT")
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.rank)))
        return
    results = {}
    for variant in ("full", "lora"):
        cmd = [sys.executable, __file__, "--worker", variant, "--rank", str(args.rank)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode or not line:
            raise RuntimeError(proc.stderr[-3000:])
        results[variant] = json.loads(line[-1])
        print(f"{variant}: {results[variant]}", file=sys.stderr)
    mib = 1024 * 1024
    full, lora = results["full"], results["lora"]
    print(f"`python bench/lora_memory.py --rank {args.rank}`\n")
    print("| per process | full fine-tuning | LoRA | LoRA / full |")
    print("| --- | ---: | ---: | ---: |")
    rows = [
        ("actor parameters (MiB)", "actor_params", mib),
        ("reference's own parameters (MiB)", "reference_params", mib),
        ("trainable parameters = gradients (MiB)", "trainable", mib),
        ("optimizer state (MiB)", "optimizer_state", mib),
        ("peak RSS in iteration 2 (MiB)", "peak_rss", mib),
        ("iteration 2 (s)", "seconds", 1),
    ]
    for label, key, unit in rows:
        a, b = full[key] / unit, lora[key] / unit
        ratio = f"{b / a:.3f}" if a else "-"
        print(f"| {label} | {a:,.1f} | {b:,.1f} | {ratio} |")


if __name__ == "__main__":
    main()
