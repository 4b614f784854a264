"""Helpers of the asynchronous-rollout tests: tasks the background process unpickles, runs.

A module of its own, so the spawned rollout process imports these classes by name.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

import torch

from lppo.config import PPOConfig
from lppo.data import ReplayDataModule
from lppo.hooks import PPOCallback
from lppo.models import HFCausalLM
from lppo.modules import ActorModule, CriticModule
from lppo.system import PPOSystem, RolloutSettings
from lppo.tasks import CopyTask
from lppo.trainer import PPOTrainer
from lppo.types import FOR_ITERATION, POLICY_VERSION


class SlowCopyTask(CopyTask):
    """The copy task whose reward sleeps a random time (OS entropy: no RNG of the run moves)."""

    def __init__(self, max_delay_s: float = 0.05, fail_on: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.max_delay_s = max_delay_s
        self.fail_on = fail_on

    def rewards(self, prompts: list[Any], completions: list[str]) -> list[float]:
        time.sleep(random.SystemRandom().random() * self.max_delay_s)
        if self.fail_on == "*" or any(p.text == self.fail_on for p in prompts):
            raise RuntimeError(f"reward server down for {self.fail_on!r}")
        return super().rewards(prompts, completions)


class Jitter(PPOCallback):
    """Sleeps a random time after every training chunk (the trainer's side of the race)."""

    def __init__(self, max_delay_s: float = 0.02) -> None:
        self.max_delay_s = max_delay_s

    def on_chunk_end(self, ctx: Any, result: Any) -> None:
        time.sleep(random.SystemRandom().random() * self.max_delay_s)


class Provenance(PPOCallback):
    """Records every iteration's rows' ``(for_iteration, policy_version)`` pairs."""

    def __init__(self) -> None:
        self.rows: dict[int, set[tuple[int, int]]] = {}

    def on_rollout_end(self, ctx: Any) -> None:
        store = ctx.store
        cols = store.read(list(ctx.row_ids), [FOR_ITERATION, POLICY_VERSION])
        pairs = zip(cols[FOR_ITERATION], cols[POLICY_VERSION], strict=True)
        self.rows[ctx.iteration] = {(int(i), int(v)) for i, v in pairs}


def spec(seed: int) -> HFCausalLM:
    return HFCausalLM(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, seed=seed)


def fit(
    root: Any,
    iterations: int,
    staleness: int,
    runner: Any = None,
    task: Any = None,
    callbacks: tuple[Any, ...] = (),
    ckpt_path: str | None = None,
    warmup: int = 0,
    **ppo: Any,
) -> tuple[PPOTrainer, PPOSystem]:
    """A small GAE run with lag ``staleness`` (1 torch thread: the child matches it)."""
    system = PPOSystem(
        actor=ActorModule(spec(0), lr=3e-3),
        critic=CriticModule(spec(1), lr=3e-3),
        task=task if task is not None else CopyTask(),
        rollout=RolloutSettings(
            prompts_per_iteration=4,
            samples_per_prompt=3,
            max_new_tokens=4,
            max_staleness=staleness,
        ),
        ppo=PPOConfig(critic_epochs=2, actor_minibatches=2, critic_warmup_iterations=warmup, **ppo),
        num_threads=1,
        runner=runner,
    )
    trainer = PPOTrainer(
        max_epochs=iterations,
        default_root_dir=str(root),
        accelerator="cpu",
        callbacks=list(callbacks),
    )
    trainer.fit(system, datamodule=ReplayDataModule(max_tokens_per_chunk=40), ckpt_path=ckpt_path)
    return trainer, system


def params(system: PPOSystem) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in system.state_dict().items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
