"""``RayWorkersEngine`` putting rows into the shared TransferQueue store from its workers.

Real Ray actors and a real TransferQueue: the rows the workers put equal the trainer's own put
of the samples they return; the trainer gets ids and per-row scalars only; a worker killed
mid-rollout is replaced without leaving rows behind (checked in TransferQueue's own state);
a failed call, and an iteration that fails after the workers put, leave nothing in the store.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
import ray
import torch
from _tq import RAY, tq_store
from lppo.callbacks import lifecycle
from replay.test_transfer_queue import catalog_rows, tq_keys

from lppo.config import PPOConfig
from lppo.envs import HiddenDigitEnvironment, HiddenDigitTask
from lppo.errors import IterationError
from lppo.estimators import GAE
from lppo.iteration.controller import PPOController
from lppo.iteration.data import ReplayDataModule
from lppo.iteration.hooks import PPOCallback
from lppo.modules import ActorModule, CriticModule
from lppo.modules.models import HFCausalLM
from lppo.modules.tokenizer import build_char_tokenizer
from lppo.parallel import ProcessGroup
from lppo.replay import MemoryReplayStore
from lppo.replay.rollout_rows import RowRules, StoredRollout
from lppo.rollout import (
    HFGenerateEngine,
    MultiTurnEngine,
    RolloutSettings,
    RolloutSource,
    RolloutWorkerError,
)
from lppo.rollout.ray_workers.engine import RayWorkersEngine
from lppo.run.system import PPOSystem
from lppo.run.trainer import PPOTrainer
from lppo.runtime.ray_runtime import configure_ray
from lppo.tasks import CopyTask
from lppo.types import GEN_LOGPROBS, INPUT_IDS, RESPONSE_MASK, REWARD, IterationResult
from lppo.validation import SettingError

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

TASK = CopyTask()
TOK = build_char_tokenizer(TASK.vocabulary())
# 2 blocks of 3 prompts, each cut into 2 parts: 4 parts, 2 per worker.
SAMPLING = RolloutSettings(
    prompts_per_iteration=6, samples_per_prompt=2, max_new_tokens=3, prompts_per_block=3
)
# Rewards above 0.5 count as bad and truncated rows are masked: both marks are exercised.
RULES = RowRules(max_abs_reward=0.5, mask_truncated=True)
COLUMNS = [INPUT_IDS, RESPONSE_MASK, GEN_LOGPROBS, REWARD, "prompt_index"]


def actor() -> ActorModule:
    module = ActorModule(HFCausalLM(hidden_size=32, num_layers=1, num_heads=2, seed=0), lr=1e-3)
    module.configure_model(len(TOK), TOK.pad_token_id, TOK.bos_token_id, TOK.eos_token_id)
    return module


class Results(PPOCallback):
    def __init__(self) -> None:
        self.results: list[IterationResult] = []

    def on_iteration_end(self, ctx, result) -> None:
        self.results.append(result)


def fit(tmp_path, store, multi_turn: bool = False) -> tuple[PPOSystem, list[IterationResult]]:
    """2 iterations with 2 Ray rollout workers (their own, not the module's: Ray has 4 CPUs);
    ``multi_turn``: each worker runs hidden-digit episodes (``MultiTurnEngine`` inside)."""
    spec = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}
    inner = None
    if multi_turn:
        env = HiddenDigitEnvironment(call_reward=0.25)
        inner = MultiTurnEngine(HFGenerateEngine(), env, max_turns=2, max_tokens=16)
    system = PPOSystem(
        actor=ActorModule(HFCausalLM(**spec, seed=0), lr=1e-2),
        critic=CriticModule(HFCausalLM(**spec, seed=1), lr=1e-2),
        task=HiddenDigitTask() if multi_turn else TASK,
        engine=RayWorkersEngine(num_workers=2, engine=inner, timeout_s=600),
        rollout=dataclasses.replace(SAMPLING, max_new_tokens=6),
        ppo=PPOConfig(max_abs_reward=0.5, actor_minibatches=2),
        num_threads=1,
    )
    results = Results()
    trainer = PPOTrainer(max_epochs=2, default_root_dir=str(tmp_path), callbacks=[results], ray=RAY)
    data = ReplayDataModule(max_tokens_per_chunk=40, store=store, drop_budget=11)
    try:
        trainer.fit(system, datamodule=data)
    finally:
        system.engine.close()  # Lightning runs no teardown after a failure: free Ray's CPUs
    return system, results.results


def test_a_fit_equals_the_return_samples_path(tmp_path):
    """First in the module (before the module's workers take Ray's CPUs)."""
    direct, got = fit(tmp_path / "direct", tq_store())
    local, want = fit(tmp_path / "local", MemoryReplayStore())
    assert direct.rollout_source.writer is direct.engine and local.rollout_source.writer is None
    assert [r.rollout for r in got] == [r.rollout for r in want]
    assert [r.steps for r in got] == [r.steps for r in want]
    assert sum(r.rollout.bad_rewards for r in got) > 0  # marked in the workers
    for a, b in zip(direct.actor.parameters(), local.actor.parameters(), strict=True):
        assert torch.equal(a, b)  # the second rollout came from the new weights alike


def test_multi_turn_rows_put_by_the_workers_equal_the_return_samples_path(tmp_path):
    """Episodes run inside the workers; their rows (turn rewards included) reach the store."""
    _, got = fit(tmp_path / "direct", tq_store(), multi_turn=True)
    _, want = fit(tmp_path / "local", MemoryReplayStore(), multi_turn=True)
    assert [r.rollout for r in got] == [r.rollout for r in want]
    assert [r.steps for r in got] == [r.steps for r in want]
    assert all(r.rollout.extra["turns_per_episode"] >= 1 for r in got)
    assert any(r.rollout.extra["tool_calls_per_episode"] > 0 for r in got)


class FailInActorPhase(PPOCallback):
    def on_chunk_end(self, ctx, result) -> None:
        if ctx.phase == "actor":
            raise RuntimeError("simulated failure")


def test_a_failed_fit_stops_its_rollout_workers(tmp_path):
    """Lightning runs no teardown after a failure; PPOTrainer.fit has the system stop them."""
    import os
    import time

    spec = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}
    engine = RayWorkersEngine(num_workers=2, timeout_s=600)
    system = PPOSystem(
        actor=ActorModule(HFCausalLM(**spec, seed=0), lr=1e-2),
        critic=CriticModule(HFCausalLM(**spec, seed=1), lr=1e-2),
        task=TASK,
        engine=engine,
        rollout=dataclasses.replace(SAMPLING, max_new_tokens=6),
        num_threads=1,
    )
    trainer = PPOTrainer(
        max_epochs=1, default_root_dir=str(tmp_path), callbacks=[FailInActorPhase()], ray=RAY
    )
    data = ReplayDataModule(max_tokens_per_chunk=40, store=MemoryReplayStore())
    try:
        with pytest.raises(IterationError, match="simulated failure"):
            trainer.fit(system, datamodule=data)
        pids = [pid for pid, _ in engine.placement]
        assert len(pids) == 2 and engine.workers == []
    finally:
        engine.close()
    deadline = time.monotonic() + 60  # ray.kill is asynchronous

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(alive(p) for p in pids)


@pytest.fixture(scope="module")
def workers():
    configure_ray(RAY)  # the session's Ray (tests/_tq.py)
    engine = RayWorkersEngine(num_workers=2, timeout_s=600)  # waits: a busy box
    engine.setup(actor().policy(), TOK, SAMPLING)
    yield engine
    engine.close()


def source(engine, store, rank: int = 0, world: int = 1) -> RolloutSource:
    # Seed 7: each of 2 ranks gets 1 bad reward and 2 valid rows of 6, so both marks and a
    # trainable step are exercised (the samples are the engine's Gumbel draws).
    return RolloutSource(
        TASK, engine, actor(), SAMPLING, seed=7, group=ProcessGroup(world, rank), store=store,
        rules=RULES,
    )  # fmt: skip


def stored_rows(store, stored: StoredRollout) -> dict[str, list[torch.Tensor]]:
    return store.read(stored.row_ids, COLUMNS)


def assert_same(got: StoredRollout, want: StoredRollout) -> None:
    assert got.row_ids == want.row_ids
    for name in ("reward", "response_tokens"):  # a rejected reward is NaN on both sides
        a, b = getattr(got, name), getattr(want, name)
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    assert (got.bad_rewards, got.dropped) == (want.bad_rewards, want.dropped)


def trainer_put(workers, rank: int = 0, world: int = 1) -> tuple[MemoryReplayStore, StoredRollout]:
    """The return-samples path: a local store; the trainer's source rewards and puts."""
    store = MemoryReplayStore()
    src = source(workers, store, rank, world)
    assert src.writer is None  # a local store: the samples come back to the trainer
    stored = src.collect(0)
    assert isinstance(stored, StoredRollout)  # put by the source, with put_rollout
    return store, stored


@pytest.mark.parametrize("rank", [0, 1])
def test_rows_put_by_the_workers_equal_the_trainers_put(workers, rank):
    """Bitwise the same rows, ids, order and statistics inputs; each rank its own blocks."""
    want_store, want = trainer_put(workers, rank, world=2)
    store = tq_store()
    try:
        src = source(workers, store, rank, world=2)
        assert src.writer is workers  # shared store + an engine that writes rows itself
        got = src.collect(0)
        # The trainer got ids, per-row scalars and the column names, never the samples' tensors
        assert isinstance(got, StoredRollout)
        assert {f.name for f in dataclasses.fields(got)} == {
            "row_ids", "reward", "response_tokens", "bad_rewards", "dropped", "sampling",
            "episodes", "worker_restarts", "columns",
        }  # fmt: skip
        assert got.sampling is None  # dynamic sampling is off (and refused with a writer)
        assert got.episodes is None  # single-turn rows
        # ... and the rows are in TransferQueue already: the workers put them.
        assert tq_keys(store) == {str(i) for i in got.row_ids}
        assert_same(got, want)
        assert 0 < got.bad_rewards < len(got)  # the marking ran in the workers
        expected, actual = stored_rows(want_store, want), stored_rows(store, got)
        for name in COLUMNS:
            assert all(torch.equal(a, b) for a, b in zip(actual[name], expected[name], strict=True))
        first = int(actual["prompt_index"][0])
        assert first == (0 if rank == 0 else 3)  # rank 1 generated the second block
    finally:
        store.close()


def test_a_worker_killed_mid_rollout_is_replaced_and_leaves_no_orphans(workers):
    _, want = trainer_put(workers)
    store = tq_store()
    try:
        before = workers.restarts
        got: list = []
        src = source(workers, store)
        thread = threading.Thread(target=lambda: got.append(src.collect(0)))
        thread.start()
        ray.kill(workers.workers[1], no_restart=True)  # mid-rollout: it holds parts 1 and 3
        thread.join(timeout=1800)  # bounded waits end it; a busy box is slow
        assert not thread.is_alive()
        assert_same(got[0], want)  # retried under the same ids: the same rows
        assert workers.restarts == before + 1  # one replacement for both of its parts
        assert tq_keys(store) == {str(i) for i in want.row_ids}
        assert catalog_rows(store) == len(want)
    finally:
        store.close()


class FailAt(PPOCallback):
    def __init__(self, hook: str) -> None:
        self.hook = hook

    def on_phase_epoch_start(self, ctx) -> None:
        if self.hook == "epoch":
            raise RuntimeError("fault after the rows were put")


def controller(store, callbacks=(), drop_budget: int = 0) -> PPOController:
    data = ReplayDataModule(max_tokens_per_chunk=64, store=store, drop_budget=drop_budget)
    critic = CriticModule(HFCausalLM(hidden_size=32, num_layers=1, num_heads=2, seed=1), lr=1e-3)
    critic.configure_model(len(TOK), TOK.pad_token_id, TOK.bos_token_id, TOK.eos_token_id)
    config = PPOConfig(max_abs_reward=0.5, mask_truncated=True)
    callbacks = [*callbacks, *lifecycle(callbacks)]
    return PPOController(actor(), critic, data, config, callbacks=callbacks, estimator=GAE())


def test_lost_samples_count_against_the_drop_budget_and_nothing_is_left(workers):
    store = tq_store()
    workers.max_restarts = 0
    try:
        ray.kill(workers.workers[1], no_restart=True)
        got = source(workers, store).collect(0)
        assert got.dropped == 4  # parts 1 and 3 (prompts 2 and 5, 2 samples each) were lost
        assert [int(p) for p in store.read(got.row_ids, ["prompt_index"])["prompt_index"]] == [
            0, 0, 1, 1, 3, 3, 4, 4
        ]  # fmt: skip
        assert tq_keys(store) == {str(i) for i in got.row_ids}  # the lost parts left nothing
        assert catalog_rows(store) == len(got) == 8
        with pytest.raises(IterationError, match=r"drop_budget"):
            controller(store).run_iteration(got, iteration=0)
        assert tq_keys(store) == set() and catalog_rows(store) == 0  # released on abort
    finally:
        workers.max_restarts = 2
        workers._load_all()  # replaces the dead worker
        store.close()


def test_a_failure_after_the_workers_put_releases_their_rows_once(workers):
    store = tq_store()
    try:
        got = source(workers, store).collect(0)
        assert catalog_rows(store) == len(got) == 12
        with pytest.raises(IterationError, match="fault after the rows were put"):
            controller(store, [FailAt("epoch")], drop_budget=12).run_iteration(got, iteration=0)
        assert tq_keys(store) == set() and catalog_rows(store) == 0
        with pytest.raises(KeyError):  # released already, by the abort path
            store.release(got.row_ids[:1])
        # The same rows through the whole iteration: released once at its end.
        got = source(workers, store).collect(1)
        result = controller(store, drop_budget=12).run_iteration(got, iteration=1)
        assert result.rollout.bad_rewards == got.bad_rewards
        assert tq_keys(store) == set() and catalog_rows(store) == 0
    finally:
        store.close()


def test_a_failed_call_leaves_nothing_in_the_store(workers):
    store = tq_store()
    workers.timeout_s = 1e-4
    try:
        with pytest.raises(RolloutWorkerError, match=r"model\.engine\.init_args\.timeout_s"):
            source(workers, store).collect(0)
    finally:
        workers.timeout_s = 600
    try:
        assert tq_keys(store) == set() and catalog_rows(store) == 0
        got = source(workers, store).collect(0)  # the replaced workers serve the next call
        assert got.dropped == 0 and catalog_rows(store) == len(got)
    finally:
        store.close()


def test_dynamic_sampling_is_refused_when_the_workers_put_the_rows(workers):
    """Workers that put rows themselves never show the trainer a group's rewards first."""
    store = tq_store()
    try:
        sampling = dataclasses.replace(SAMPLING, dynamic_sampling_rounds=1)
        with pytest.raises(SettingError, match=r"dynamic_sampling_rounds=1 with RayWorkersEngine"):
            RolloutSource(TASK, workers, actor(), sampling, store=store, rules=RULES)
    finally:
        store.close()
