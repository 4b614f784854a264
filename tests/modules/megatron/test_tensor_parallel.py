"""Over 2 gloo ranks, tensor parallelism 2 and megatron data parallelism 2 each equal one
process (actor and critic, two clipped steps each)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("tp_worker.py")
TIMEOUT_S = 240
#: float64; row-parallel layers sum partial products across ranks (another summation order).
RTOL = 1e-10

pytestmark = pytest.mark.distributed


def launch(world_size: int, tmp_path: Path, layout: str = "tp") -> dict:
    init_file = tmp_path / f"init{world_size}{layout}"
    out = tmp_path / f"{layout}{world_size}.pt"
    env = dict(os.environ)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env["OMP_NUM_THREADS"] = "1"
    cmd = [
        sys.executable,
        str(WORKER),
        f"--world-size={world_size}",
        f"--init-file={init_file}",
        f"--out={out}",
        f"--layout={layout}",
    ]
    procs = [
        subprocess.Popen(
            [*cmd, f"--rank={r}"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world_size)
    ]
    errors = []
    try:
        for proc in procs:
            try:
                _, err = proc.communicate(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            errors.append((proc.returncode, err[-4000:]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if any(rc != 0 for rc, _ in errors) or not out.exists():
        pytest.fail("tensor-parallel workers failed:\n" + "\n".join(e for _, e in errors))
    return torch.load(out, weights_only=False)


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, what
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= RTOL * max(scale, 1e-300), f"{what}: max err {err:.3e} vs scale {scale:.3e}"


def rel_close(a: float, b: float) -> bool:
    return a == b or abs(a - b) <= RTOL * max(abs(a), abs(b))


def assert_same_run(one: dict, two: dict) -> None:
    for role in ("actor", "critic"):
        a, b = one[role], two[role]
        assert_close(b["scores"], a["scores"], f"{role} scores")
        for s1, s2 in zip(a["stats"], b["stats"], strict=True):
            assert s1["stepped"] and s2["stepped"]
            assert s1["grad_norm"] > 0.5  # clipping was active
            assert rel_close(s2["grad_norm"], s1["grad_norm"]), (role, s1, s2)
            for key, value in s1["metrics"].items():
                if "clip_fraction" not in key:
                    assert rel_close(s2["metrics"][key], value), (role, key)
        assert a["weights"].keys() == b["weights"].keys()
        for name, tensor in a["weights"].items():
            assert_close(b["weights"][name], tensor, f"{role} {name}")
    for name, tensor in one["actor"]["policy"].items():
        assert_close(two["actor"]["policy"][name], tensor, f"policy {name}")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return launch(1, tmp_path_factory.mktemp("one"))


def test_tensor_parallel_two_equals_one(one_process, tmp_path):
    assert_same_run(one_process, launch(2, tmp_path, "tp"))


def test_megatron_data_parallel_two_equals_one(one_process, tmp_path):
    """megatron's grad buffers summed once per step over 2 ranks, each with its own chunks."""
    two = launch(2, tmp_path, "dp")
    for role in ("actor", "critic"):
        assert all(
            s["chunks_trained"] < o["chunks_trained"]
            for s, o in zip(two[role]["stats"], one_process[role]["stats"], strict=True)
        )
    assert_same_run(one_process, two)
