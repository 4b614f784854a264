"""Helpers of the asynchronous-rollout tests: tasks the background process unpickles, runs.

A module of its own, so the spawned rollout process imports these classes by name.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from typing import Any

import torch

from lppo.config import PPOConfig
from lppo.iteration.data import ReplayDataModule
from lppo.iteration.hooks import PPOCallback
from lppo.modules import ActorModule, CriticModule
from lppo.modules.models import HFCausalLM
from lppo.run.system import PPOSystem, RolloutSettings
from lppo.run.trainer import PPOTrainer
from lppo.runtime.ray_runtime import RaySettings
from lppo.tasks import CopyTask
from lppo.types import FOR_ITERATION, INPUT_IDS, POLICY_VERSION, RESPONSE_MASK


class SlowCopyTask(CopyTask):
    """The copy task whose reward sleeps a random time in ``[min_delay_s, max_delay_s]``.

    The delay draws on OS entropy, so no RNG of the run moves.
    """

    def __init__(
        self, max_delay_s: float = 0.05, fail_on: str = "", min_delay_s: float = 0.0, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.max_delay_s = max_delay_s
        self.min_delay_s = min_delay_s
        self.fail_on = fail_on

    def rewards(self, prompts: list[Any], completions: list[str]) -> list[float]:
        spread = self.max_delay_s - self.min_delay_s
        time.sleep(self.min_delay_s + random.SystemRandom().random() * spread)
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


class RecordRows(PPOCallback):
    """Writes every iteration's rows to a JSON file keyed by iteration (last write wins).

    Each row is recorded as its prompt (decoded up to the first response token), the whole
    row (prompt and response) and its ``(for_iteration, policy_version)``. An iteration run
    again after a resume replaces what the killed run wrote for it, so the file ends with
    each trained iteration once; it is replaced atomically, so a kill never leaves it torn.

    Args:
        path: the JSON file (read back by :func:`read_rows`).
    """

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = Path(path)

    def on_rollout_end(self, ctx: Any) -> None:
        tokenizer = ctx.trainer.lightning_module.tokenizer
        names = [INPUT_IDS, RESPONSE_MASK, FOR_ITERATION, POLICY_VERSION]
        cols = ctx.store.read(list(ctx.row_ids), names)
        rows = []
        for ids, mask, iteration, version in zip(*(cols[n] for n in names), strict=True):
            start = int(mask.nonzero()[0]) if bool(mask.any()) else len(ids)
            rows.append(
                {
                    "prompt": tokenizer.decode(ids[:start].tolist(), skip_special_tokens=True),
                    "row": tokenizer.decode(ids.tolist(), skip_special_tokens=False),
                    "provenance": [int(iteration), int(version)],
                }
            )
        recorded = read_rows(self.path) if self.path.exists() else {}
        recorded[ctx.iteration] = rows
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({str(k): v for k, v in sorted(recorded.items())}))
        os.replace(tmp, self.path)


def read_rows(path: Path) -> dict[int, list[dict[str, Any]]]:
    """What :class:`RecordRows` wrote: iteration -> its rows."""
    return {int(k): v for k, v in json.loads(Path(path).read_text()).items()}


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
    store: Any = None,
    ray: Any = None,
    rollout: dict[str, Any] | None = None,
    precision: str = "32-true",
    data: dict[str, Any] | None = None,
    **ppo: Any,
) -> tuple[PPOTrainer, PPOSystem]:
    """A small GAE run with lag ``staleness`` (1 torch thread: the child matches it).

    ``store`` is the replay store (``None``: in-process), ``ray`` the trainer's Ray settings,
    ``rollout`` further ``model.rollout`` settings, ``data`` further ``data`` settings.
    """
    system = PPOSystem(
        actor=ActorModule(spec(0), lr=3e-3),
        critic=CriticModule(spec(1), lr=3e-3),
        task=task if task is not None else CopyTask(),
        rollout=RolloutSettings(
            prompts_per_iteration=4,
            samples_per_prompt=3,
            max_new_tokens=4,
            max_staleness=staleness,
            **(rollout or {}),
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
        ray=ray if ray is not None else RaySettings(),
        precision=precision,
    )
    module = ReplayDataModule(max_tokens_per_chunk=40, store=store, **(data or {}))
    trainer.fit(system, datamodule=module, ckpt_path=ckpt_path)
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
