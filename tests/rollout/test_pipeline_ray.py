"""Asynchronous rollouts from Ray rollout workers (a thread drives them) and from the background
process, in both stores."""

from __future__ import annotations

import pytest
from _async_helpers import Provenance, assert_same, params, spec
from _async_helpers import fit as async_fit
from _tq import RAY, tq_store

from lppo.config import PPOConfig
from lppo.iteration.data import ReplayDataModule
from lppo.modules import ActorModule, CriticModule
from lppo.replay import MemoryReplayStore
from lppo.rollout import InlineRunner, ProcessRunner, RayWorkersEngine, ThreadRunner
from lppo.run.system import PPOSystem, RolloutSettings
from lppo.run.trainer import PPOTrainer
from lppo.tasks import CopyTask

pytestmark = pytest.mark.slow


def fit(root, runner, store, rows: Provenance) -> PPOSystem:
    """3 iterations, lag 1, one Ray worker for evaluation and one for the runner's copy."""
    system = PPOSystem(
        actor=ActorModule(spec(0), lr=1e-2),
        critic=CriticModule(spec(1), lr=1e-2),
        task=CopyTask(),
        engine=RayWorkersEngine(num_workers=1, timeout_s=600),
        rollout=RolloutSettings(
            prompts_per_iteration=4, samples_per_prompt=2, max_new_tokens=4, max_staleness=1
        ),
        ppo=PPOConfig(actor_minibatches=2),
        num_threads=1,
        runner=runner,
    )
    trainer = PPOTrainer(max_epochs=3, default_root_dir=str(root), callbacks=[rows], ray=RAY)
    data = ReplayDataModule(max_tokens_per_chunk=40, store=store)
    try:
        trainer.fit(system, datamodule=data)
    finally:
        system.teardown("fit")  # Lightning runs no teardown after a failure: free Ray's CPUs
    assert len(data.store) == 0  # every row released
    return system


@pytest.mark.parametrize("store", [MemoryReplayStore, tq_store])
def test_ray_workers_behind_a_thread_equal_the_oracle(tmp_path, store):
    oracle_rows, rows = Provenance(), Provenance()
    oracle = fit(tmp_path / "oracle", InlineRunner(), store(), oracle_rows)
    run = fit(tmp_path / "thread", None, store(), rows)
    assert isinstance(run.runner, ThreadRunner)  # chosen for an engine with its own processes
    assert_same(params(oracle), params(run))
    assert rows.rows == oracle_rows.rows == {0: {(0, 0)}, 1: {(1, 0)}, 2: {(2, 1)}}


def test_the_background_process_into_transfer_queue_equals_the_memory_store(tmp_path):
    memory_rows, tq_rows = Provenance(), Provenance()
    _, memory = async_fit(tmp_path / "memory", 4, 1, ProcessRunner(), callbacks=(memory_rows,))
    trainer, tq = async_fit(
        tmp_path / "tq", 4, 1, ProcessRunner(), callbacks=(tq_rows,), store=tq_store(), ray=RAY
    )
    assert_same(params(memory), params(tq))
    assert tq_rows.rows == memory_rows.rows == {0: {(0, 0)}, 1: {(1, 0)}, 2: {(2, 1)}, 3: {(3, 2)}}
    assert len(trainer.datamodule.store) == 0  # every row released
