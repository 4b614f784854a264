"""Run as a script: a short fit whose TransferQueue store starts its own Ray (``argv[1]`` as
``_temp_dir``) fails mid-actor-phase; print what ran while it was up and what is left after.

Output (last line, JSON): ``error`` (the IterationError), ``during`` (this process's
descendants mid-fit: the Ray it started, ``pid -> name``), ``after`` (those left once the fit
has failed), ``listening`` (their TCP listen addresses mid-fit), ``ray_initialized``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray
from _tq import listening_addresses, ray_processes

from lppo.config import PPOConfig
from lppo.errors import IterationError
from lppo.iteration.data import ReplayDataModule
from lppo.iteration.hooks import PPOCallback
from lppo.modules import ActorModule, CriticModule
from lppo.modules.models import HFCausalLM
from lppo.replay import TransferQueueReplayStore
from lppo.run.system import PPOSystem, RolloutSettings
from lppo.run.trainer import PPOTrainer
from lppo.runtime.ray_runtime import RaySettings
from lppo.tasks import CopyTask


class FailInActorPhase(PPOCallback):
    def __init__(self) -> None:
        self.during: dict[int, str] = {}
        self.listening: list[str] = []

    def on_chunk_end(self, ctx, result) -> None:
        if ctx.phase == "actor":
            self.during = ray_processes()
            self.listening = sorted(listening_addresses())
            raise RuntimeError("killed mid-phase")


def main(temp_dir: str, root: str) -> None:
    def spec(seed: int) -> HFCausalLM:
        return HFCausalLM(
            hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, seed=seed
        )

    system = PPOSystem(
        actor=ActorModule(spec(0), lr=1e-3),
        critic=CriticModule(spec(1), lr=1e-3),
        task=CopyTask(),
        rollout=RolloutSettings(prompts_per_iteration=4, samples_per_prompt=2, max_new_tokens=4),
        ppo=PPOConfig(),
        num_threads=1,
    )
    store = TransferQueueReplayStore()
    probe = FailInActorPhase()
    trainer = PPOTrainer(
        max_epochs=1, default_root_dir=root, callbacks=[probe], ray=RaySettings(temp_dir=temp_dir)
    )
    error = ""
    try:
        trainer.fit(system, datamodule=ReplayDataModule(max_tokens_per_chunk=24, store=store))
    except IterationError as e:
        error = str(e)
    report = {
        "error": error,
        "during": probe.during,
        "listening": probe.listening,
        "after": ray_processes(),
        "ray_initialized": ray.is_initialized(),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
