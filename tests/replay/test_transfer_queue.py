"""TransferQueueReplayStore beyond the conformance suite, against real Ray + TransferQueue.

Row retention across critic and actor epochs, exactly-once release and cleanup when an
iteration is killed mid-phase, each checked in TransferQueue's OWN state (its controller's
partition metadata) and in the catalog; rows shared with another process; lifecycle (loopback,
what is stopped, stray processes) and configuration errors.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest
import ray
import torch
from _builders import random_rows, stored, tiny_backbone, tiny_lm
from _tq import RAY, listening_addresses, tq_store
from lppo.callbacks import lifecycle

from lppo.config import PPOConfig
from lppo.errors import IterationError
from lppo.estimators import GAE
from lppo.iteration.controller import PPOController
from lppo.iteration.data import ReplayDataModule
from lppo.iteration.hooks import PPOCallback
from lppo.modules import ActorModule, CriticModule
from lppo.replay import TransferQueueReplayStore
from lppo.replay._tq_catalog import CATALOG_NAME, CATALOG_NAMESPACE
from lppo.replay._tq_fields import to_batch
from lppo.replay._tq_runtime import tq_controller
from lppo.runtime.ray_runtime import RaySettings, acquire_ray, configure_ray, ray_module
from lppo.types import INPUT_IDS, RESPONSE_MASK, REWARD, Rollout
from lppo.validation import SettingError

pytestmark = pytest.mark.distributed
HERE = Path(__file__).resolve().parent


def tq_keys(store: TransferQueueReplayStore) -> set[str]:
    """The keys TransferQueue's controller holds for the store's partition (its own state)."""
    snap = ray.get(tq_controller().get_partition_snapshot.remote(store.partition))
    if snap is None:
        return set()
    assert len(snap.global_indexes) == len(snap.keys_mapping)
    return set(snap.keys_mapping)


def catalog_rows(store: TransferQueueReplayStore) -> int:
    catalog = ray.get_actor(CATALOG_NAME, namespace=CATALOG_NAMESPACE)
    return ray.get(catalog.partitions.remote()).get(store.partition, 0)


def rollout(n: int, seed: int) -> Rollout:
    cols = random_rows(n, seed)
    return Rollout(
        input_ids=cols[INPUT_IDS],
        response_mask=cols[RESPONSE_MASK],
        gen_logprobs=[torch.zeros(len(t), dtype=torch.float64) for t in cols[INPUT_IDS]],
        reward=torch.stack(cols[REWARD]),
        prompt_index=torch.arange(n),
    )


def controller(store, callbacks=(), actor_cls=ActorModule) -> PPOController:
    data = ReplayDataModule(max_tokens_per_chunk=30, store=store)
    config = PPOConfig(critic_epochs=2, actor_epochs=2, actor_minibatches=2)
    actor, critic = actor_cls(tiny_lm(), lr=1e-3), CriticModule(tiny_backbone(), lr=1e-3)
    callbacks = [*callbacks, *lifecycle(callbacks)]
    return PPOController(actor, critic, data, config, callbacks=callbacks, estimator=GAE())


class Probe(PPOCallback):
    """Records, at every phase epoch, the rows TransferQueue and the store hold."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int, int, int, int]] = []

    def on_phase_epoch_start(self, ctx) -> None:
        store = ctx.store
        claimed = sum(1 for i in ctx.row_ids if i in store.claimed())
        self.seen.append((ctx.phase, ctx.epoch, len(tq_keys(store)), len(store), claimed))


def test_rows_retained_through_every_epoch_then_released_in_transfer_queue() -> None:
    store, probe = tq_store(), Probe()
    try:
        ctl = controller(store, [probe])
        result = ctl.run_iteration(stored(ctl, rollout(6, 0)), iteration=0)
        assert [(p, e) for p, e, *_ in probe.seen] == [
            ("critic", 0),
            ("critic", 1),
            ("actor", 0),
            ("actor", 1),
        ]
        assert all(keys == live == claimed == 6 for *_, keys, live, claimed in probe.seen)
        assert tq_keys(store) == set() and len(store) == 0 and catalog_rows(store) == 0
        assert len(result.phase_steps("actor")) == 4
        # Released exactly once: the ids are gone for good.
        with pytest.raises(KeyError, match="released"):
            store.release([0])
    finally:
        store.close()


class Boom(PPOCallback):
    def __init__(self, phase: str, epoch: int) -> None:
        self.phase, self.epoch = phase, epoch

    def on_chunk_end(self, ctx, result) -> None:
        if ctx.phase == self.phase and ctx.epoch == self.epoch:
            raise ValueError("boom")


class ExplodingActor(ActorModule):
    """Raises inside the second chunk the actor trains (a chunk, not a callback, fails)."""

    chunks = 0

    def chunk_loss(self, chunk, sums):
        ExplodingActor.chunks += 1
        if ExplodingActor.chunks == 2:
            raise RuntimeError("chunk exploded")
        return super().chunk_loss(chunk, sums)


@pytest.mark.parametrize(
    ("callbacks", "actor_cls", "where"),
    [
        ([Boom("critic", 1)], ActorModule, r"phase critic, epoch 2, chunk 1: ValueError: boom"),
        ([Boom("actor", 1)], ActorModule, r"phase actor, epoch 2, chunk 1: ValueError: boom"),
        (
            [],
            ExplodingActor,
            r"phase actor, epoch 1, minibatch 2, chunk 1: RuntimeError: chunk exploded",
        ),
    ],
    ids=["callback-critic", "callback-actor", "chunk-actor"],
)
def test_iteration_killed_mid_phase_leaves_nothing_in_transfer_queue(
    callbacks, actor_cls, where
) -> None:
    ExplodingActor.chunks = 0
    store = tq_store()
    try:
        ctl = controller(store, callbacks, actor_cls)
        with pytest.raises(IterationError, match=where):
            ctl.run_iteration(stored(ctl, rollout(6, 1)), iteration=3)
        assert tq_keys(store) == set()
        assert catalog_rows(store) == 0 and store.claimed() == {} and store.nbytes() == 0
        # The store and a fresh controller go on; rows of the next iteration get new ids.
        ctl = controller(store)
        result = ctl.run_iteration(stored(ctl, rollout(4, 2)), iteration=4)
        assert len(result.phase_steps("critic")) == 2
        assert tq_keys(store) == set()
        assert min(store.allocate(1)) >= 10
    finally:
        store.close()


def test_discard_takes_back_a_put_whose_writer_died_half_way() -> None:
    store = tq_store()
    try:
        store.put([0], {INPUT_IDS: [torch.arange(3)]})
        # A writer reserved rows 1 and 2 and transferred their tensors, then died uncommitted.
        ids, cols = [1, 2], {INPUT_IDS: [torch.arange(4), torch.arange(5)]}
        specs = {INPUT_IDS: ("torch.int64", 1)}
        store._call("reserve_put", ids, specs, [4, 5], [0, 0], {INPUT_IDS: [32, 40]})
        store._transfer(ids, to_batch(cols, specs))
        assert catalog_rows(store) == 3 and tq_keys(store) == {"0", "1", "2"}
        store.discard([1, 2, 3])  # 3: allocated, never put
        assert catalog_rows(store) == 1 and tq_keys(store) == {"0"} and len(store) == 1
        with pytest.raises(KeyError, match="discarded while their put was in flight"):
            store._call("commit_put", ids)  # the writer, had it lived, finds its put undone
    finally:
        store.close()


@ray.remote(num_cpus=1)
def _worker_puts(store: TransferQueueReplayStore, n: int) -> tuple[list[int], list[int], int]:
    """In another process: allocate and put rows, and read the driver's rows."""
    try:
        ids = list(store.allocate(n))
        store.put(ids, {INPUT_IDS: [torch.arange(5 + i) for i in range(n)]})
        theirs = [i for i in store.meta().ids if i not in ids]
        seen = [len(t) for t in store.read(theirs, [INPUT_IDS])[INPUT_IDS]]
        return ids, seen, os.getpid()
    finally:
        store.close()


def test_rows_are_shared_with_another_process() -> None:
    store = tq_store()
    try:
        mine = list(store.allocate(2))
        store.put(mine, {INPUT_IDS: [torch.arange(3), torch.arange(2)]})
        assert store.shared
        theirs, lengths_seen, pid = ray.get(_worker_puts.remote(store, 3))
        assert pid != os.getpid()
        assert not set(theirs) & set(mine)  # ids unique across processes
        assert sorted(lengths_seen) == [2, 3]  # the worker read the driver's rows
        assert set(store.meta().ids) == {*mine, *theirs}
        got = store.read(theirs, [INPUT_IDS])[INPUT_IDS]
        assert [len(t) for t in got] == [5, 6, 7]
        assert tq_keys(store) == {str(i) for i in (*mine, *theirs)}
    finally:
        store.close()
    assert tq_keys(store) == set()  # the original dropped its partition at close


def test_services_bind_to_loopback() -> None:
    tq_store()  # the session's TransferQueue is up
    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
    info = ray.get(tq_controller().get_zmq_server_info.remote())
    assert info.ip == "127.0.0.1"
    assert listening_addresses() == {"127.0.0.1"}  # GCS, raylet, agents, controller, storage


def test_configuration_errors_name_the_key() -> None:
    with pytest.raises(ValueError, match=r"trainer\.ray\.num_cpus=0"):
        RaySettings(num_cpus=0)
    with pytest.raises(ValueError, match=r"trainer\.ray\.object_store_memory=1 "):
        RaySettings(object_store_memory=1)
    with pytest.raises(ValueError, match=r"trainer\.ray\.address=''"):
        RaySettings(address="")
    with pytest.raises(ValueError, match=r"data\.store\.init_args\.partition=''"):
        TransferQueueReplayStore(partition="")
    with pytest.raises(ValueError, match=r"data\.store\.init_args\.num_storage_units=0"):
        TransferQueueReplayStore(num_storage_units=0)


def test_too_few_ray_cpus_for_the_storage_units_are_refused_before_any_wait() -> None:
    """A local Ray with 4 logical CPUs cannot hold a controller and 4 storage units."""
    temp_dir = tempfile.mkdtemp(prefix="lppo-", dir="/tmp")
    out = subprocess.run(
        [sys.executable, "-c", TOO_FEW_CPUS, temp_dir],
        capture_output=True,
        text=True,
        timeout=300,
    )
    shutil.rmtree(temp_dir, ignore_errors=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    message = out.stdout.strip().splitlines()[-1]
    assert "data.store.init_args.num_storage_units=4 needs 5 free Ray CPUs" in message
    assert "trainer.ray.num_cpus" in message


TOO_FEW_CPUS = """
import sys
from lppo.runtime.ray_runtime import RaySettings, configure_ray, ray_owned_here
from lppo.replay import TransferQueueReplayStore
configure_ray(RaySettings(num_cpus=4, temp_dir=sys.argv[1]))
try:
    len(TransferQueueReplayStore(num_storage_units=4))
except ValueError as error:
    assert not ray_owned_here()  # the Ray started for it is stopped again
    print(error)
"""


def test_other_ray_settings_in_the_same_process_are_refused() -> None:
    tq_store()
    configure_ray(RaySettings(num_cpus=6))
    try:
        with pytest.raises(ValueError, match=r"trainer\.ray=.*already running"):
            acquire_ray()
    finally:
        configure_ray(RAY)


def test_missing_ray_names_the_extra_that_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ImportError, match=r"\[tq\]"):
        ray_module("tq")
    with pytest.raises(ImportError, match=r"\[ray\]"):
        ray_module("ray")


def test_missing_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from lppo.replay import _tq_runtime

    monkeypatch.setitem(sys.modules, "transfer_queue", None)
    with pytest.raises(ImportError, match=r"\[tq\]"):
        _tq_runtime.tq_module()


@pytest.mark.slow
def test_a_killed_storage_unit_fails_the_wait_within_timeout_s_naming_store_and_call() -> None:
    """SIGKILL of the real storage unit: the next read fails at the store's bound, not in
    minutes of TransferQueue's own retries (the subprocess timeout catches a hang)."""
    temp_dir = tempfile.mkdtemp(prefix="lppo-", dir="/tmp")  # Ray's socket paths are short
    try:
        out = subprocess.run(
            [sys.executable, str(HERE / "tq_storage_kill_worker.py"), temp_dir, "5"],
            capture_output=True,
            text=True,
            timeout=240,
        )
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["error"] == "StoreTimeoutError", report
    assert f"partition {report['partition']!r}" in report["message"]
    assert "TransferQueue kv_batch_get" in report["message"]
    assert "data.store.init_args.timeout_s=5" in report["message"]


def test_timeout_s_is_validated() -> None:
    with pytest.raises(SettingError, match=r"data\.store\.init_args\.timeout_s=0"):
        TransferQueueReplayStore(timeout_s=0)


def lingering(pids: list[int], grace_s: float) -> list[psutil.Process]:
    """The processes of ``pids`` still there after waiting up to ``grace_s`` for them to end."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    return [p for p in alive if p.is_running()]


def test_failed_fit_stops_everything_it_started_and_leaves_no_process(tmp_path: Path) -> None:
    """A fit with its own Ray + TransferQueue fails mid-actor-phase; then nothing is left."""
    temp_dir = tempfile.mkdtemp(prefix="lppo-", dir="/tmp")  # Ray's socket paths are short
    out = subprocess.run(
        [sys.executable, str(HERE / "tq_lifecycle_worker.py"), temp_dir, str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["error"].startswith("iteration 1, phase actor")
    names = set(report["during"].values())
    assert {"gcs_server", "raylet", "ray::TransferQueueController"} <= names, names
    assert {"ray::SimpleStorageUnit", "ray::Catalog"} <= names, names
    assert report["listening"] == ["127.0.0.1"]
    assert report["after"] == {} and not report["ray_initialized"]
    # And none of them outlives the fit's process: each is gone (or a zombie) within a grace
    # period, since a killed Ray process may still be tearing down when the fit returns on a
    # loaded machine; one that keeps running is left behind and fails here.
    still = lingering([int(p) for p in report["during"]], grace_s=30.0)
    assert all(p.status() == psutil.STATUS_ZOMBIE for p in still), still
    shutil.rmtree(temp_dir, ignore_errors=True)
