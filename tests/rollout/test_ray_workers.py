"""``RayWorkersEngine``: real Ray actor workers, each with its own Hugging Face engine."""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time

import psutil
import pytest
import torch
from _tq import RAY, ray_processes

from lppo.iteration.score_phase import rollout_stats
from lppo.modules import ActorModule
from lppo.modules.models import HFCausalLM
from lppo.modules.tokenizer import build_char_tokenizer
from lppo.parallel import SINGLE
from lppo.replay import MemoryReplayStore
from lppo.replay.rollout_rows import RowRules, put_rollout
from lppo.rollout import (
    GenerationOutput,
    HFGenerateEngine,
    RolloutSettings,
    RolloutSource,
    score,
    to_rollout,
)
from lppo.rollout.ray_workers.engine import RayWorkersEngine, RolloutWorkerError
from lppo.rollout.source import derive_seed
from lppo.runtime.ray_runtime import configure_ray
from lppo.tasks import CopyTask
from lppo.validation import SettingError

TASK = CopyTask()
TOK = build_char_tokenizer(TASK.vocabulary())
SAMPLING = RolloutSettings(samples_per_prompt=2, max_new_tokens=4)
SEED = 17

pytestmark = pytest.mark.slow


def policy(seed: int) -> torch.nn.Module:
    spec = HFCausalLM(hidden_size=32, num_layers=1, num_heads=2, seed=seed)
    return spec.build(len(TOK), TOK.pad_token_id, TOK.bos_token_id, TOK.eos_token_id)


def in_process(model: torch.nn.Module, prompts, parts: int) -> list[list[int]]:
    """What each worker part must produce: the in-process engine on the same part and seed."""
    engine = HFGenerateEngine()
    engine.setup(model, TOK, SAMPLING)
    size = -(-len(prompts) // parts)
    rows = []
    for p in range(parts):
        seed = derive_seed(SEED, "part", p) if p else SEED
        out = engine.generate(prompts[p * size : (p + 1) * size], 2, seed)
        rows += [t.tolist() for t in out.input_ids]
    return rows


def rows(output: GenerationOutput) -> list[list[int]]:
    return [t.tolist() for t in output.input_ids]


@pytest.fixture(scope="module")
def workers():
    configure_ray(RAY)  # the session's Ray (tests/_tq.py)
    engine = RayWorkersEngine(num_workers=2, timeout_s=120)
    engine.setup(policy(0), TOK, SAMPLING)
    yield engine
    engine.close()


PROMPTS = TASK.sample_prompts(6, random.Random(0))


def test_workers_sample_what_the_in_process_engine_samples(workers):
    out = workers.generate(PROMPTS, 2, SEED)
    assert rows(out) == in_process(policy(0), PROMPTS, 2)
    assert out.prompt_index.tolist() == [i for i in range(6) for _ in range(2)]
    assert out.dropped == 0
    pids = {pid for pid, _ in workers._wait([w.where.remote() for w in workers.workers], "x")}
    assert len(pids) == 2  # two separate worker processes


def test_every_worker_samples_from_the_new_weights_after_a_sync(workers):
    new = policy(5)  # other weights, same architecture
    workers.sync_from(new, version=workers.weights_version + 1)
    versions = workers._wait([w.load.remote(workers._weights, 9) for w in workers.workers], "x")
    assert versions == [9, 9]
    workers._load_all()  # back to the engine's version everywhere
    out = workers.generate(PROMPTS, 2, SEED)
    # Part 0 ran on worker 0, part 1 on worker 1: each matches the new weights, not the old.
    assert rows(out) == in_process(new, PROMPTS, 2)
    assert rows(out) != in_process(policy(0), PROMPTS, 2)


def test_a_killed_worker_is_replaced_and_its_part_retried(workers):
    import ray

    want = rows(workers.generate(PROMPTS, 2, SEED))
    before = workers.restarts
    got: list[GenerationOutput] = []
    thread = threading.Thread(target=lambda: got.append(workers.generate(PROMPTS, 2, SEED)))
    thread.start()
    ray.kill(workers.workers[1], no_restart=True)  # mid-rollout
    thread.join(timeout=300)
    assert not thread.is_alive()
    assert rows(got[0]) == want  # the replacement sampled exactly what the dead worker would
    assert workers.restarts == before + 1 and got[0].dropped == 0


def test_lost_parts_are_dropped_and_counted(workers):
    import ray

    workers.max_restarts = 0
    try:
        ray.kill(workers.workers[1], no_restart=True)
        out = workers.generate(PROMPTS, 2, SEED)
    finally:
        workers.max_restarts = 2
        workers._load_all()  # replaces the dead worker
    assert out.dropped == 6  # part 1: 3 prompts x 2 samples
    assert to_rollout(out, [0.0] * len(out)).dropped == 6  # -> the controller's drop budget
    assert out.prompt_index.tolist() == [i for i in range(3) for _ in range(2)]


def kill(actor) -> None:
    """Kill a worker actor for real and wait until Ray reports it dead."""
    import ray

    ray.kill(actor, no_restart=True)
    # The kill lands asynchronously: a call sent right after it may still be served (seen in
    # CI on a loaded machine), so ask until Ray reports the actor dead.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            ray.get(actor.where.remote(), timeout=60)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.2)
    pytest.fail(f"{actor} still answers 60 s after ray.kill")


def test_workers_dying_at_a_weight_sync_are_replaced_logged_and_reported(workers, caplog):
    """Between rollouts (at the sync after the actor phase), and replacements dying too."""
    caplog.set_level(logging.WARNING, logger="lppo.rollout.ray_workers")
    before = workers.restarts
    spawn = workers._spawn
    doomed = [1]  # replacements killed as they start, before their weight load finishes

    def spawn_then_kill():
        actor = spawn()
        if doomed:
            doomed.pop()
            kill(actor)
        return actor

    workers._spawn = spawn_then_kill
    try:
        kill(workers.workers[1])  # dies between rollouts
        new = policy(7)
        workers.sync_from(new, version=workers.weights_version + 1)  # max_restarts=2: enough
        assert workers.restarts == before + 2  # the killed worker and its dying replacement
        assert rows(workers.generate(PROMPTS, 2, SEED)) == in_process(new, PROMPTS, 2)
        replaced = [r for r in caplog.records if "rollout worker 1" in r.getMessage()]
        assert len(replaced) == 2 and "replaced" in replaced[1].getMessage()
        # Beyond max_restarts: a clear error naming the worker and the knob.
        workers.max_restarts, doomed[:] = 1, [1]
        kill(workers.workers[0])
        with pytest.raises(RolloutWorkerError, match=r"rollout worker 0 .*max_restarts=1"):
            workers.sync_from(new, version=workers.weights_version + 1)
    finally:
        workers._spawn, workers.max_restarts = spawn, 2
    workers.sync_from(new, version=workers.weights_version + 1)  # the next sync replaces it
    assert workers.restarts == before + 4  # 1 in the failed sync (max_restarts=1), 1 now
    # The rollout source reports the replacements as rollout/worker_restarts.
    actor = ActorModule(HFCausalLM(hidden_size=32, num_layers=1, num_heads=2, seed=3))
    actor.configure_model(len(TOK), TOK.pad_token_id, TOK.bos_token_id, TOK.eos_token_id)
    actor.weights_version = workers.weights_version + 1
    workers.take_restarts()
    kill(workers.workers[1])
    rollout = RolloutSource(TASK, workers, actor, SAMPLING).collect(0)
    assert rollout.worker_restarts == 1
    stored = put_rollout(MemoryReplayStore(), range(len(rollout)), rollout, RowRules())
    assert rollout_stats(stored, SINGLE)[0].extra["worker_restarts"] == 1


def test_workers_that_cannot_be_placed_are_refused_at_setup(workers):
    """The session's Ray has 4 CPUs: Ray would queue 5 workers until ``timeout_s``."""
    engine = RayWorkersEngine(num_workers=5, timeout_s=600)
    refused = (
        r"num_workers=5 rollout workers need 5 free Ray CPUs \(one each\) but the "
        r"cluster has \d+ free of 4 \(model.rollout.max_staleness=1: .*second set"
    )
    with pytest.raises(SettingError, match=refused):
        engine.setup(policy(0), TOK, dataclasses.replace(SAMPLING, max_staleness=1))
    assert engine.workers == []
    assert len(workers.generate(PROMPTS, 2, SEED)) == 12  # Ray is still held by the others


def test_waits_are_bounded(workers):
    workers.timeout_s = 1e-4
    try:
        with pytest.raises(RolloutWorkerError, match=r"model\.engine\.init_args\.timeout_s"):
            workers.generate(PROMPTS, 2, SEED)
    finally:
        workers.timeout_s = 120


def test_greedy_evaluation_through_the_workers_is_the_in_process_greedy(workers):
    actor = ActorModule(HFCausalLM(hidden_size=32, num_layers=1, num_heads=2, seed=3))
    actor.configure_model(len(TOK), TOK.pad_token_id, TOK.bos_token_id, TOK.eos_token_id)
    actor.weights_version = workers.weights_version + 1  # the workers must be synced to it
    source = RolloutSource(TASK, workers, actor, SAMPLING)
    got = source.evaluate(PROMPTS, 1, SEED, greedy=True)
    assert workers.weights_version == actor.weights_version
    engine = HFGenerateEngine()
    engine.setup(actor.model, TOK, SAMPLING)
    want = engine.generate(PROMPTS, 1, seed=0, greedy=True)  # greedy: the seed is irrelevant
    assert rows(got.output) == rows(want)
    assert got.output.completions == want.completions
    assert got.rewards == score(TASK, PROMPTS, want).tolist()
    # The workers' parts sample from seeds of their own: greedy reached every worker.
    sampled = source.evaluate(PROMPTS, 1, SEED)
    assert rows(sampled.output) != rows(want)


def test_close_leaves_no_worker_process(workers):
    """Last in the module: closes the module's engine (its fixture's close is then a no-op)."""
    pids = [pid for pid, _ in workers._wait([w.where.remote() for w in workers.workers], "x")]
    assert set(pids) <= set(ray_processes())
    procs = [psutil.Process(pid) for pid in pids]
    workers.close()
    psutil.wait_procs(procs, timeout=60)
    assert not set(pids) & set(ray_processes())
