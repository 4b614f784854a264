"""Two simulated nodes on loopback, through the launchers users already have.

``torchrun --nnodes 2 --node-rank R`` against 127.0.0.1, and two processes carrying the
environment variables SLURM's ``srun`` sets on two nodes, each run the fit of
``ddp_fit_worker.py`` with ``trainer.num_nodes=2``; both must end where one process ends.
``GLOO_SOCKET_IFNAME`` is not set: lppo itself binds the process group to loopback, which the
test checks on every rank's open TCP sockets. And Ray's own multi-node test cluster
(``ray.cluster_utils.Cluster``, ``ray_nodes_worker.py``): two nodes on loopback, attached to by
``trainer.ray.address``, with a rollout worker on each node.
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
from _ports import next_port
from test_ddp import PARAM_ATOL, PARAM_RTOL, WORKER, _env, boundary_split, finish, finish_all

from lppo.runtime.strategy import SOCKET_IFNAME_VARS, bind_to_loopback, loopback_interface


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def node_env(**extra: str) -> dict[str, str]:
    env = _env()
    env.pop("GLOO_SOCKET_IFNAME", None)  # lppo must bind loopback by itself
    env.update(extra)
    return env


def launch(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def torchrun_node(node: int, port: int, out: Path) -> list[str]:
    return [
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=1",
        f"--node-rank={node}",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        str(WORKER),
        "--devices=1",
        "--num-nodes=2",
        f"--out={out}",
    ]


def slurm_env(node: int, port: int) -> dict[str, str]:
    """What ``srun`` sets for task ``node`` of a 2-node, 1-task-per-node job."""
    return node_env(
        SLURM_NTASKS="2",
        SLURM_NNODES="2",
        SLURM_NTASKS_PER_NODE="1",
        SLURM_PROCID=str(node),
        SLURM_LOCALID="0",
        SLURM_NODEID=str(node),
        SLURM_JOB_NAME="lppo-two-nodes",
        SLURM_JOB_ID="4242",
        SLURM_NODELIST="localhost",
        MASTER_PORT=str(port),
    )


@pytest.mark.slow
@pytest.mark.distributed
def test_two_nodes_through_torchrun_and_slurm_train_like_one_process(tmp_path):
    outs = {name: tmp_path / name for name in ("single", "torchrun", "slurm")}
    for out in outs.values():
        out.mkdir()
    tr_port, slurm_port = next_port(), next_port()
    worker = [str(WORKER), "--devices=1", "--num-nodes=2", f"--out={outs['slurm']}"]
    jobs = [
        ([str(WORKER), "--devices=1", f"--out={outs['single']}"], node_env()),
        *((torchrun_node(n, tr_port, outs["torchrun"]), node_env()) for n in range(2)),
        *((worker, slurm_env(n, slurm_port)) for n in range(2)),
    ]
    procs = [launch(args, env, tmp_path) for args, env in jobs]
    finish_all(procs, [args for args, _ in jobs])

    one = json.loads((outs["single"] / "rank0.json").read_text())
    want = torch.load(outs["single"] / "state0.pt")
    clusters = {"torchrun": "TorchElasticEnvironment", "slurm": "SLURMEnvironment"}
    for name, cluster in clusters.items():
        ranks = [json.loads((outs[name] / f"rank{r}.json").read_text()) for r in range(2)]
        for r, rec in enumerate(ranks):
            assert (rec["rank"], rec["node_rank"], rec["world_size"]) == (r, r, 2), name
            assert rec["cluster"] == cluster
            assert rec["backend"] == "gloo"
            ips = rec["socket_ips"]
            assert ips and all(is_loopback(ip) for ip in ips), ips
            assert rec["global_step"] == one["global_step"]
        # Each node generated its own prompts, together the single process's rollout; rows at
        # the boundary then moved to the other node to balance tokens (lppo.iteration.balance).
        for it, rollout in enumerate(one["rollouts"]):
            parts = [rec["rollouts"][it]["prompts"] for rec in ranks]
            assert boundary_split(parts, rollout["prompts"]), parts
        for r in range(2):
            got = torch.load(outs[name] / f"state{r}.pt")
            assert got.keys() == want.keys()
            for key, value in want.items():
                torch.testing.assert_close(got[key], value, rtol=PARAM_RTOL, atol=PARAM_ATOL)


def test_the_process_group_binds_to_loopback_unless_an_address_is_configured(monkeypatch):
    for name in SOCKET_IFNAME_VARS:
        monkeypatch.delenv(name, raising=False)
    bind_to_loopback("203.0.113.7")  # a real (multi-node) main address: left to gloo / NCCL
    assert not any(name in os.environ for name in SOCKET_IFNAME_VARS)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")  # the user's choice is kept
    bind_to_loopback("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == loopback_interface() is not None
    assert os.environ["NCCL_SOCKET_IFNAME"] == "ib0"


@pytest.mark.slow
@pytest.mark.distributed
def test_ray_workers_spread_over_two_ray_nodes_on_loopback(tmp_path):
    """Ray's multi-node test cluster (2 nodes on 127.0.0.1) attached by trainer.ray.address:
    the two rollout workers run on two different nodes, TransferQueue on the same cluster, a
    2-iteration fit completes, and nothing is left once the cluster is shut down."""
    import shutil
    import tempfile

    temp_dir = tempfile.mkdtemp(prefix="lppo-", dir="/tmp")  # Ray's socket paths are short
    script = Path(__file__).resolve().parents[1] / "ray_nodes_worker.py"
    args = [str(script), temp_dir, str(tmp_path / "run")]
    out = finish(launch(args, node_env(), tmp_path), args)
    shutil.rmtree(temp_dir, ignore_errors=True)
    report = json.loads(next(x for x in reversed(out.splitlines()) if x.startswith("{")))
    host, _ = report["address"].rsplit(":", 1)
    assert is_loopback(host)
    nodes = dict(report["nodes"])
    assert len(nodes) == 2 and all(is_loopback(ip) for ip in nodes.values()), nodes
    placed = {node for _, node in report["workers"]}
    assert placed == set(nodes)  # one rollout worker on each node
    assert (report["iterations"], report["global_step"]) == (2, 2)
    assert report["listening"] and all(is_loopback(ip) for ip in report["listening"])
    names = set(report["during"].values())
    assert {"gcs_server", "raylet", "ray::RolloutWorker", "ray::TransferQueueController"} <= names
    assert list(report["during"].values()).count("raylet") == 2  # two nodes, two raylets
    # What lppo started on the cluster (workers, TransferQueue) is gone after the fit; the
    # cluster's own processes after its shutdown.
    left = set(report["after_fit"].values())
    assert not {"ray::RolloutWorker", "ray::TransferQueueController", "ray::Catalog"} & left
    assert report["after"] == {}
    alive = [p for p in map(int, report["during"]) if psutil.pid_exists(p)]
    assert [psutil.Process(p).status() for p in alive] in ([], ["zombie"] * len(alive))
