"""Peak memory of a whole ``lppo fit`` iteration from 256 to 16,384 rows: streamed vs merged.

Usage (from the repository root)::

    .venv/bin/python bench/fit_memory.py                      # 256 1024 4096 16384 rows
    .venv/bin/python bench/fit_memory.py --rows 256 1024

Each measurement is a fresh process running ``lppo.PPOTrainer.fit`` on ``configs/tiny.yaml``'s
system (copy task, tiny random Llama policy and critic, GAE, 2 critic epochs, 2 actor epochs
of 2 minibatches, chunk budget 512 tokens, ``HFGenerateEngine(batch_size=256)``) with
``prompts_per_iteration = rows / 4``, for two iterations. The second is measured: garbage is
collected and glibc's free heap handed back (``malloc_trim``: the baseline is the live heap,
not what iteration 1 left allocated), then the kernel's peak-RSS mark (``VmHWM``) is reset when
it starts and read when it ends (rollout, scoring, advantages, both training phases; before the
rows are released). "Rows" is the replay store's ``nbytes()`` at its fullest; the figures that
must stay flat are the peak beyond the iteration's starting RSS minus the rows, and the
process's peak RSS during the iteration (both growths relative to the smallest row count).

Variants: **streamed** (lppo as shipped); **merged** (the same run plus the payload a merged
trainer holds: at ``on_rollout_end`` every row is read and padded to the longest row into one
batch, kept until the iteration ends; training itself is unchanged).
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


def worker(rows: int, variant: str) -> dict:
    import torch
    from _memory import PeakProbe, status_kib

    from lppo.algorithms import ClippedPPO
    from lppo.config import PPOConfig
    from lppo.estimators import GAE
    from lppo.iteration.chunks import read_chunk
    from lppo.iteration.data import ReplayDataModule
    from lppo.iteration.hooks import PPOCallback
    from lppo.modules import ActorModule, CriticModule
    from lppo.modules.models import HFCausalLM
    from lppo.rollout import HFGenerateEngine
    from lppo.run.system import PPOSystem, RolloutSettings
    from lppo.run.trainer import PPOTrainer
    from lppo.tasks import CopyTask

    torch.set_num_threads(1)
    spec = dict(
        architecture="llama", hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128
    )
    system = PPOSystem(
        actor=ActorModule(
            HFCausalLM(**spec, seed=0), lr=3e-3, objective=ClippedPPO(clip_high=0.28)
        ),
        critic=CriticModule(HFCausalLM(**spec, seed=1), lr=3e-3, value_clip=0.5),
        task=CopyTask(min_length=2, max_length=4, alphabet_size=8, transform="first"),
        engine=HFGenerateEngine(batch_size=256),  # generation memory bounded by the batch
        estimator=GAE(gamma=1.0, lam=0.95),
        rollout=RolloutSettings(
            prompts_per_iteration=rows // 4, samples_per_prompt=4, max_new_tokens=6
        ),
        ppo=PPOConfig(critic_epochs=2, actor_epochs=2, actor_minibatches=2),
        num_threads=1,
    )
    out: dict = {"rows": rows, "variant": variant}

    class Probe(PPOCallback):
        def on_train_epoch_start(self, trainer, pl_module) -> None:
            self.active = trainer.current_epoch == 1
            if self.active:
                self.probe = PeakProbe()
                self.probe.start()
                self.payload = None

        def on_rollout_end(self, ctx) -> None:
            if not self.active:
                return
            out["rows_bytes"] = ctx.store.nbytes()
            if variant == "merged":
                self.payload = read_chunk(ctx.store, ctx.row_ids, [])
                out["payload_bytes"] = sum(
                    t.numel() * t.element_size()
                    for t in (
                        self.payload.input_ids,
                        self.payload.attention_mask,
                        self.payload.response_mask,
                    )
                )

        def on_iteration_end(self, ctx, result) -> None:
            if self.active:
                out["peak_beyond_start"] = self.probe.peak_beyond()
                out["peak_rss"] = status_kib("VmHWM") * 1024  # reset when the iteration began
                out["seconds"] = sum(result.seconds.values())
                self.payload = None

    trainer = PPOTrainer(
        max_epochs=2,
        default_root_dir=tempfile.mkdtemp(prefix="lppo-mem-"),
        logger=False,
        enable_checkpointing=False,
        callbacks=[Probe()],
        accelerator="cpu",
    )
    trainer.fit(system, datamodule=ReplayDataModule(max_tokens_per_chunk=512))
    out["beyond_rows"] = out["peak_beyond_start"] - out["rows_bytes"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    p.add_argument("--variants", nargs="+", default=["streamed", "merged"])
    p.add_argument("--worker", nargs=2, metavar=("ROWS", "VARIANT"))
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(int(args.worker[0]), args.worker[1])))
        return
    results: dict = {}
    for n in args.rows:
        for v in args.variants:
            cmd = [sys.executable, __file__, "--worker", str(n), v]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if proc.returncode or not line:
                raise RuntimeError(proc.stderr[-3000:])
            results[(n, v)] = json.loads(line[-1])
            print(f"{n} {v}: {results[(n, v)]}", file=sys.stderr)
    mib = 1024 * 1024
    print(f"`python bench/fit_memory.py {' '.join(sys.argv[1:])}`\n")
    print("| rows per iteration | " + " | ".join(str(n) for n in args.rows) + " |")
    print("| --- |" + " ---: |" * len(args.rows))
    first = args.rows[0]
    print(
        "| rows in the store (`nbytes`) | "
        + " | ".join(
            f"{results[(n, args.variants[0])]['rows_bytes'] / mib:.1f} MiB" for n in args.rows
        )
        + " |"
    )
    for v in args.variants:
        base = results[(first, v)]["beyond_rows"]
        cells = []
        for n in args.rows:
            r = results[(n, v)]["beyond_rows"]
            cells.append(f"{r / mib:.1f} MiB ({(r / base - 1) * 100:+.0f} %)")
        print(f"| peak beyond start − rows: **{v}** | " + " | ".join(cells) + " |")
    for v in args.variants:
        base = results[(first, v)]["peak_rss"]
        cells = []
        for n in args.rows:
            r = results[(n, v)]["peak_rss"]
            cells.append(f"{r / mib:.0f} MiB ({(r / base - 1) * 100:+.1f} %)")
        print(f"| trainer peak RSS in the iteration: **{v}** | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
