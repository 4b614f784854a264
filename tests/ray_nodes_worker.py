"""Run as a script: a short fit attached to Ray's own two-node test cluster on loopback.

``python ray_nodes_worker.py TEMP_DIR RUN_DIR`` starts ``ray.cluster_utils.Cluster`` with a
head node and a second node, both on ``127.0.0.1`` (the nodes are this process's children),
then runs a 2-iteration fit whose ``trainer.ray.address`` is the cluster's: two Ray rollout
workers (SPREAD) plus the TransferQueue store, both on that one cluster. After the fit it
stops the cluster. Output (last line, JSON): ``nodes`` (``[node id, IP]`` of every node),
``workers`` (``[pid, node id]`` of each rollout worker), ``iterations`` and ``global_step``
of the fit, ``listening`` (TCP listen addresses of the cluster's processes), ``during`` (this
process's descendants mid-fit, ``pid -> name``), ``after_fit`` (those left once the fit has
detached and lppo's actors have exited: the cluster's own), ``after`` (left once the cluster
is shut down).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _tq import listening_addresses, ray_processes

from lppo.iteration.data import ReplayDataModule
from lppo.iteration.hooks import PPOCallback
from lppo.modules import ActorModule, CriticModule
from lppo.modules.models import HFCausalLM
from lppo.replay import TransferQueueReplayStore
from lppo.rollout import RayWorkersEngine
from lppo.run.system import PPOSystem, RolloutSettings
from lppo.run.trainer import PPOTrainer
from lppo.runtime.ray_runtime import LOOPBACK, RaySettings
from lppo.tasks import CopyTask

MIB = 2**20
LPPO_ACTORS = {"ray::RolloutWorker", "ray::TransferQueueController", "ray::Catalog"}


class Probe(PPOCallback):
    """Records the cluster's nodes, processes and listeners once, mid-fit."""

    def __init__(self) -> None:
        self.nodes: list[list[str]] = []
        self.during: dict[int, str] = {}
        self.listening: list[str] = []

    def on_rollout_end(self, ctx) -> None:
        import ray

        if not self.nodes:
            self.nodes = [[n["NodeID"], n["NodeManagerAddress"]] for n in ray.nodes()]
            self.during = ray_processes()
            self.listening = sorted(listening_addresses())


def cluster(temp_dir: str):
    """Ray's own multi-node test cluster: a head (TransferQueue's 2 CPUs + 1) and one more node.

    ``node_ip_address`` keeps both on loopback (by default each node takes the machine's
    external IP).
    """
    from ray.cluster_utils import Cluster

    common = {"node_ip_address": LOOPBACK, "object_store_memory": 80 * MIB}
    head = {**common, "num_cpus": 3, "temp_dir": temp_dir, "include_dashboard": False}
    c = Cluster(initialize_head=True, head_node_args=head)
    c.add_node(**common, num_cpus=2)
    return c


def ray_processes_after_kill(during: dict[int, str]) -> dict[int, str]:
    """This process's descendants once what lppo started has exited.

    ``ray.kill`` returns before the actor's process exits, so first wait (60 s at most) for
    the processes of lppo's actors seen mid-fit; one still alive then is reported.
    """
    import psutil

    procs = []
    for pid, name in during.items():
        if name in LPPO_ACTORS:
            try:
                procs.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                pass
    psutil.wait_procs(procs, timeout=60)
    return ray_processes()


def main(temp_dir: str, root: str) -> None:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

    def spec(seed: int) -> HFCausalLM:
        return HFCausalLM(
            hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, seed=seed
        )

    # Cluster.add_node writes the address file into Ray's default temp dir (/tmp/ray unless
    # RAY_TMPDIR is set) and fails where that dir does not exist yet; keep it in the test's.
    os.environ["RAY_TMPDIR"] = temp_dir
    os.makedirs(os.path.join(temp_dir, "ray"), exist_ok=True)
    c = cluster(temp_dir)
    address = c.address
    try:
        engine = RayWorkersEngine(num_workers=2, timeout_s=240)
        system = PPOSystem(
            actor=ActorModule(spec(0), lr=1e-3),
            critic=CriticModule(spec(1), lr=1e-3),
            task=CopyTask(),
            engine=engine,
            rollout=RolloutSettings(
                prompts_per_iteration=4, samples_per_prompt=2, max_new_tokens=4
            ),
            num_threads=1,
        )
        probe = Probe()
        trainer = PPOTrainer(
            max_epochs=2,
            default_root_dir=root,
            callbacks=[probe],
            ray=RaySettings(address=address),  # the one knob: store and workers attach
        )
        data = ReplayDataModule(max_tokens_per_chunk=24, store=TransferQueueReplayStore())
        trainer.fit(system, datamodule=data)
        after_fit = ray_processes_after_kill(probe.during)
    finally:
        c.shutdown()
    report = {
        "address": address,
        "nodes": probe.nodes,
        "workers": engine.placement,
        "iterations": trainer.current_epoch,
        "global_step": trainer.global_step,
        "listening": probe.listening,
        "during": probe.during,
        "after_fit": after_fit,
        "after": ray_processes(),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
