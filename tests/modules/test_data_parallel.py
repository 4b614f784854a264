"""Data-parallel parity: two gloo ranks take exactly the step one process takes."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("dp_parity_worker.py")
WORLD_SIZE = 2
TIMEOUT_S = 120
RTOL = 1e-10

_spec = importlib.util.spec_from_file_location("dp_parity_worker", WORKER)
assert _spec is not None and _spec.loader is not None
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

pytestmark = pytest.mark.distributed


def rel_close(a: float, b: float, tol: float = RTOL) -> bool:
    if math.isnan(a) and math.isnan(b):
        return True
    return a == b or abs(a - b) <= tol * max(abs(a), abs(b))


def assert_tensors_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, what
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= RTOL * max(scale, 1e-300), f"{what}: max err {err:.3e} vs scale {scale:.3e}"


def launch(role: str, tmp_path: Path, *extra: str) -> dict:
    """Run the worker on ``WORLD_SIZE`` gloo ranks (``extra``: more worker arguments)."""
    init_file = tmp_path / "dist_init"
    out = tmp_path / "rank0.pt"
    env = dict(os.environ)
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("OMP_NUM_THREADS", "1")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                f"--rank={rank}",
                f"--world-size={WORLD_SIZE}",
                f"--init-file={init_file}",
                f"--out={out}",
                f"--role={role}",
                *extra,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(WORLD_SIZE)
    ]
    outputs: list[tuple[int | None, str]] = []
    try:
        for rank, proc in enumerate(procs):
            try:
                _, err = proc.communicate(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
                err = f"TIMEOUT after {TIMEOUT_S}s\n{err}"
            outputs.append((proc.returncode, f"--- rank {rank} stderr ---\n{err}"))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if any(rc != 0 for rc, _ in outputs) or not out.exists():
        report = "\n".join(text for _, text in outputs)
        codes = [rc for rc, _ in outputs]
        pytest.fail(f"data-parallel workers failed (exit codes {codes}):\n{report}")
    return torch.load(out, weights_only=False)


def test_ranks_get_uneven_real_chunks():
    """The setup exercises padding: the ranks hold different numbers of real chunks."""
    plans = [worker.plan_step(WORLD_SIZE, r)[1] for r in range(WORLD_SIZE)]
    real = [sum(1 for c in p.chunks if c) for p in plans]
    padding = [sum(1 for c in p.chunks if not c) for p in plans]
    assert len(set(real)) > 1, real
    assert sum(padding) >= 1, padding
    assert len({p.num_chunks for p in plans}) == 1
    assert sum(real) == worker.N_ROWS
    assert len({p.normalizers for p in plans}) == 1


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_two_ranks_sharing_prompts_match_one_process_per_row(role, tmp_path):
    """Two prompts answered 3 and 2 times, chunks of up to 3 rows in sample order, dealt over
    2 ranks; each rank's chunks share their prompts (``data.share_prompts``)."""
    plans = [worker.plan_step(WORLD_SIZE, r, shared=True)[1] for r in range(WORLD_SIZE)]
    assert any(len(c) > 1 for p in plans for c in p.chunks)  # something to share
    dp = launch(role, tmp_path, "--share")
    single = worker.run_step(role, world_size=1, rank=0, shared=False)
    assert rel_close(dp["stats"]["grad_norm"], single["stats"]["grad_norm"])
    for key, want in single["metrics"].items():
        assert rel_close(dp["metrics"][key], want), key
    for name, want in single["after"].items():
        assert_tensors_close(dp["after"][name], want, name)


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_two_ranks_match_one_process(role, tmp_path):
    dp = launch(role, tmp_path)
    single = worker.run_step(role, world_size=1, rank=0)

    assert dp["stats"]["stepped"] and single["stats"]["stepped"]
    for key in ("role", "epoch", "minibatch", "valid_tokens", "valid_rows", "lr"):
        assert dp["stats"][key] == single["stats"][key], key
    assert rel_close(dp["stats"]["grad_norm"], single["stats"]["grad_norm"]), (
        dp["stats"]["grad_norm"],
        single["stats"]["grad_norm"],
    )
    assert single["stats"]["grad_norm"] > 0
    # Rank 0 trained only its share of the chunks (no padding on rank 0, so all are real).
    assert dp["stats"]["chunks_trained"] == len(dp["chunks"]) < single["stats"]["chunks_trained"]

    # Parameters no rank gave a gradient stay gradient-free (optimizers skip them).
    assert "unused" not in single["grad_names"]
    assert dp["grad_names"] == single["grad_names"]
    assert len(single["grad_names"]) == len(single["after"]) - 1

    assert dp["metrics"].keys() == single["metrics"].keys()
    assert "loss" in single["metrics"]
    for key, want in single["metrics"].items():
        assert rel_close(dp["metrics"][key], want), (key, dp["metrics"][key], want)

    assert dp["before"].keys() == single["before"].keys() == single["after"].keys()
    moved = 0
    for name, want_after in single["after"].items():
        assert torch.equal(dp["before"][name], single["before"][name]), name
        assert_tensors_close(dp["after"][name], want_after, f"param {name}")
        # SGD with lr=1: before - after is the gradient itself; compare it at its own scale.
        want_grad = single["before"][name] - want_after
        got_grad = dp["before"][name] - dp["after"][name]
        assert_tensors_close(got_grad, want_grad, f"grad {name}")
        moved += int(want_grad.abs().max().item() > 0)
    assert moved > len(single["after"]) // 2


def test_two_ranks_match_one_process_for_every_objective(tmp_path):
    """The objective sweep (every objective × aggregation × KL in the loss × off-policy
    correction) on 2 gloo ranks equals one process: metrics, grad norm, parameters."""
    dp = launch("sweep", tmp_path)
    single = worker.run_sweep(world_size=1, rank=0)
    assert dp["combos"].keys() == single["combos"].keys() and len(single["combos"]) == 96
    assert 0 < len([c for c in dp["chunks"] if c]) < len(single["chunks"])
    for combo, want in single["combos"].items():
        got = dp["combos"][combo]
        assert got["stats"]["stepped"] and want["stats"]["stepped"], combo
        assert rel_close(got["stats"]["grad_norm"], want["stats"]["grad_norm"]), combo
        assert got["metrics"].keys() == want["metrics"].keys(), combo
        for key, value in want["metrics"].items():
            assert rel_close(got["metrics"][key], value), (combo, key)
        for name, param in want["after"].items():
            assert_tensors_close(got["after"][name], param, f"{combo} {name}")
