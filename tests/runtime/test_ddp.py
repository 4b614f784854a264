"""Data-parallel fits through Lightning: ``PPODDPStrategy`` on 2 gloo processes equals 1 process.

The multi-process fits run as standalone scripts in subprocesses: ``strategy="ddp"``-style
launching inside pytest would re-run the pytest command in the child process.
"""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from _ports import next_port
from lightning.pytorch.strategies import DDPStrategy

from lppo.iteration.data_settings import DataSettings
from lppo.iteration.planner import ChunkPlanner
from lppo.run.trainer import PPOTrainer
from lppo.runtime.strategy import PPODDPStrategy, check_strategy
from lppo.types import RowMeta

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parents[1] / "ddp_fit_worker.py"
TIMEOUT_S = 240
#: float32 weights after the fits: two ranks sum each step's gradient in another order than one
#: process, and the trimmed last block (``trim_prompt: auto``) runs SDPA over another number of
#: queries per chunk; Adam turns such round-off in a near-zero gradient into up to ~1e-6 of a
#: weight (1.27e-6 seen once in 2048 weights). The float64 runs check exactness to 1e-10.
PARAM_RTOL, PARAM_ATOL = 1e-5, 2.5e-6
METRIC_RTOL, METRIC_ATOL = 1e-5, 1e-7

#: Logged per-step / per-iteration metrics that must agree (up to float32 summation order).
#: ``*/clip_fraction`` is left out: the value-clip indicator compares two float32 losses that
#: differ only by rounding when no clipping happens, so it flips with summation order.
CLOSE_METRICS = (
    "critic/loss",
    "critic/grad_norm",
    "critic/explained_variance",
    "critic/value_mean",
    "actor/loss",
    "actor/grad_norm",
    "actor/approx_kl",
    "actor/entropy",
    "rollout/reward_mean",
    "rollout/reward_std",
    "rollout/response_length_mean",
)
#: Logged values that must be identical (global quantities, not per-rank ones).
EQUAL_METRICS = (
    "iteration",
    "critic/valid_tokens",
    "critic/stepped",
    "critic/epoch",
    "actor/valid_tokens",
    "actor/stepped",
    "actor/minibatch",
    "actor/lr",
    "rollout/invalid_rows",
    "rollout/dropped_rows",
)


def _env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")
    }
    env["MASTER_PORT"] = str(next_port())  # a fresh one per launch: see tests/_ports.py
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def start(args: list[str], cwd: Path) -> subprocess.Popen:
    """Start ``python *args`` (which may launch more ranks)."""
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=cwd,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: a timeout kills the other ranks too
    )


def finish(proc: subprocess.Popen, args: list[str]) -> str:
    """Wait for ``proc``; fail with its output if it fails or times out."""
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"`{' '.join(args)}` timed out after {TIMEOUT_S}s:\n{out}")
    if proc.returncode != 0:
        pytest.fail(f"`{' '.join(args)}` exited with {proc.returncode}:\n{out}")
    return out


def finish_all(procs: list[subprocess.Popen], jobs: list[list[str]]) -> list[str]:
    """:func:`finish` each process in order; if one fails, kill the others' process groups."""
    try:
        return [finish(proc, args) for proc, args in zip(procs, jobs, strict=True)]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def run_script(args: list[str], cwd: Path) -> str:
    """Run ``python *args`` to completion; fail with its output if it fails."""
    return finish(start(args, cwd), args)


def read_metrics(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def close(a: float, b: float, rtol: float = METRIC_RTOL, atol: float = METRIC_ATOL) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= atol + rtol * max(abs(a), abs(b))


# ------------------------------------------------------------------ fast checks, no launch
@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn", DDPStrategy()])
def test_lightning_ddp_with_two_devices_is_rejected(strategy, tmp_path):
    message = r"trainer\.strategy=DDPStrategy .*trainer\.strategy=ppo_ddp"
    with pytest.raises(ValueError, match=message):
        PPOTrainer(strategy=strategy, devices=2, accelerator="cpu", default_root_dir=str(tmp_path))


def test_ppo_ddp_name_builds_the_strategy(tmp_path):
    trainer = PPOTrainer(
        strategy="ppo_ddp", devices=2, accelerator="cpu", default_root_dir=str(tmp_path)
    )
    assert type(trainer.strategy) is PPODDPStrategy
    assert trainer.num_devices == 2


@pytest.mark.parametrize(
    ("devices", "want"), [(2, PPODDPStrategy), ("2", PPODDPStrategy), (1, None)]
)
def test_auto_strategy_with_several_devices_is_ppo_ddp(devices, want, tmp_path):
    trainer = PPOTrainer(devices=devices, accelerator="cpu", default_root_dir=str(tmp_path))
    if want is None:
        assert not isinstance(trainer.strategy, PPODDPStrategy)
    else:
        assert type(trainer.strategy) is want and trainer.num_devices == 2


def test_check_strategy():
    check_strategy(DDPStrategy(), 1)  # one process: no gradient sync to conflict with
    check_strategy(PPODDPStrategy(), 4)
    with pytest.raises(ValueError, match=r"trainer\.devices=1"):
        check_strategy(DDPStrategy(), 2)


def test_owned_rows_are_planned_like_one_process_and_trained_by_their_owner():
    lengths = tuple(6 + i % 4 for i in range(11))
    valid = tuple(0 if i in (2, 7) else 2 + i % 3 for i in range(11))
    whole = ChunkPlanner(DataSettings(20, drop_budget=2))
    # Rank 0 holds the first 7 rows (store ids 0..6), rank 1 the other 4 (its own ids 0..3).
    ids = (*range(7), *range(4))
    owners = (0,) * 7 + (1,) * 4
    meta = RowMeta(ids=ids, lengths=lengths, valid_tokens=valid)
    single = RowMeta(ids=tuple(range(100, 111)), lengths=lengths, valid_tokens=valid)
    ranks = [ChunkPlanner(DataSettings(20, drop_budget=2), world_size=2, rank=r) for r in range(2)]
    for phase, minibatches in (("score", 1), ("critic", 1), ("actor", 3)):
        want = whole.plan(single, phase=phase, iteration=3, minibatches=minibatches)
        plans = [
            p.plan(meta, phase=phase, iteration=3, minibatches=minibatches, owners=owners)
            for p in ranks
        ]
        for k, step in enumerate(want.steps):
            mine = [plan.steps[k] for plan in plans]
            assert all(s.normalizers == step.normalizers for s in mine)
            assert len(mine[0].chunks) == len(mine[1].chunks)  # equal counts: no deadlock
            # Same rows as the single process (positions k: id 100 + k there, owner's id here).
            got = Counter((r, i) for r, s in enumerate(mine) for c in s.chunks for i in c)
            positions = [i - 100 for c in step.chunks for i in c]
            assert got == Counter((owners[k], ids[k]) for k in positions)
        assert len(plans[0].invalid_rows) == len(want.invalid_rows) == 2


def test_fixed_rows_per_rank_splits_each_ranks_own_rows():
    meta = RowMeta(ids=(0, 1, 2, 3, 0, 1, 2, 3), lengths=(5,) * 8, valid_tokens=(2,) * 8)
    owners = (0,) * 4 + (1,) * 4
    plans = [
        ChunkPlanner(DataSettings(10, fixed_rows_per_rank=True), world_size=2, rank=r).plan(
            meta, minibatches=2, owners=owners
        )
        for r in range(2)
    ]
    for plan in plans:
        assert [sum(len(c) for c in s.chunks) for s in plan.steps] == [2, 2]
        assert [s.normalizers.valid_rows for s in plan.steps] == [4, 4]
    uneven = RowMeta(ids=(0, 1, 2, 0, 1, 2), lengths=(5,) * 6, valid_tokens=(2,) * 6)
    with pytest.raises(ValueError, match=r"same number of valid rows, got \[4, 2\]"):
        ChunkPlanner(DataSettings(10, fixed_rows_per_rank=True), world_size=2).plan(
            uneven, minibatches=1, owners=(0, 0, 0, 0, 1, 1)
        )


# ------------------------------------------------------------- launched multi-process fits
@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(("dtype", "staleness"), [("float32", 0), ("float64", 0), ("float64", 1)])
def test_two_processes_train_like_one(dtype, staleness, tmp_path):
    """With ``staleness`` 1 every rank generates its blocks in its own background process."""
    single, dp = tmp_path / "single", tmp_path / "dp"
    single.mkdir()
    dp.mkdir()
    lag = f"--max-staleness={staleness}"
    jobs = [
        [str(WORKER), "--devices=2", f"--out={dp}", f"--dtype={dtype}", lag],
        [str(WORKER), "--devices=1", f"--out={single}", f"--dtype={dtype}", lag],
    ]
    iterations = 2 + staleness
    procs = [start(args, tmp_path) for args in jobs]  # concurrently: 3 single-thread processes
    finish_all(procs, jobs)

    [one] = [json.loads((single / "rank0.json").read_text())]
    ranks = [json.loads((dp / f"rank{r}.json").read_text()) for r in range(2)]
    assert one["world_size"] == 1
    for r, record in enumerate(ranks):
        assert (record["rank"], record["world_size"]) == (r, 2)
        assert record["strategy"] == "PPOStrategy"
        assert record["backend"] == "gloo"
        assert record["global_step"] == one["global_step"] == 2 * iterations  # 2 actor steps
        assert record["rows_left"] == 0  # every rank released its rows
    assert one["rows_left"] == 0

    # Generation is split by prompt blocks: rank 0 put prompts 0-2, rank 1 prompts 3-4 (each
    # prompt's samples on one rank), together the single process's rows. To balance tokens,
    # rows at the blocks' boundary then move to the other rank (lppo.iteration.balance): its
    # iteration rows are its block, then the rows it received (the end of rank 0's block, or the
    # start
    # of rank 1's).
    generated = [[p for p in range(3) for _ in range(3)], [p for p in (3, 4) for _ in range(3)]]
    moved = 0
    for it in range(iterations):
        got = [rec["rollouts"][it]["prompts"] for rec in ranks]
        assert [rows[: len(block)] for rows, block in zip(got, generated, strict=True)] == generated
        assert generated[0] + generated[1] == one["rollouts"][it]["prompts"]
        to_0, to_1 = got[0][len(generated[0]) :], got[1][len(generated[1]) :]
        assert not (to_0 and to_1)
        assert to_0 == generated[1][: len(to_0)]
        assert to_1 == generated[0][len(generated[0]) - len(to_1) :]
        moved += len(to_0) + len(to_1)
    assert moved > 0

    # Same steps everywhere; every step trains the single process's rows (same token ids),
    # each rank only rows it generated, with equal chunk counts (zero-weight padding).
    keys = ("iteration", "phase", "epoch", "minibatch")
    steps = [[tuple(s[k] for k in keys) for s in rec["steps"]] for rec in (one, *ranks)]
    assert steps[0] == steps[1] == steps[2]
    trained, uneven = [0, 0], 0
    for k, want in enumerate(one["steps"]):
        mine = [rec["steps"][k] for rec in ranks]
        assert len(mine[0]["chunks"]) == len(mine[1]["chunks"])
        got = Counter(tuple(row) for s in mine for row in s["rows"])
        assert got == Counter(tuple(row) for row in want["rows"]), want
        for r in range(2):
            trained[r] += len(mine[r]["rows"])
        uneven += len(mine[0]["rows"]) != len(mine[1]["rows"])
    assert trained[0] > 0 and trained[1] > 0 and uneven > 0  # both ranks trained, unevenly
    assert any(not c for rec in ranks for s in rec["steps"] for c in s["chunks"])  # padding

    # Parameters: both ranks hold the same weights, equal to one process's (float32, other
    # summation order); rank 1 started from perturbed weights, so rank 0's were broadcast.
    float32 = dtype == "float32"
    param_tol = (PARAM_RTOL, PARAM_ATOL) if float32 else (1e-10, 1e-12)
    metric_tol = (METRIC_RTOL, METRIC_ATOL) if float32 else (1e-9, 1e-12)
    want = torch.load(single / "state0.pt")
    got = [torch.load(dp / f"state{r}.pt") for r in range(2)]
    assert got[0].keys() == got[1].keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[0][name], got[1][name]), name
        torch.testing.assert_close(
            got[0][name],
            value,
            rtol=param_tol[0],
            atol=param_tol[1],
            msg=lambda m, n=name: f"{n}: {m}",
        )

    # Logged metrics (rank 0 only logs): the same rows, the same values.
    a = read_metrics(single / "run" / "version_0" / "metrics.csv")
    b = read_metrics(dp / "run" / "version_0" / "metrics.csv")
    assert not (dp / "run" / "version_1").exists()
    assert len(a) == len(b) > 0
    compared = Counter()
    for row_a, row_b in zip(a, b, strict=True):
        for key in (*CLOSE_METRICS, *EQUAL_METRICS):
            assert (row_a.get(key) or "") == "" or key in row_b, key
            if not row_a.get(key):
                assert not row_b.get(key), key
                continue
            x, y = float(row_a[key]), float(row_b[key])
            ok = x == y if key in EQUAL_METRICS else close(x, y, *metric_tol)
            assert ok, (key, row_a["step"], x, y)
            compared[key] += 1
    for key in ("critic/loss", "actor/loss", "critic/grad_norm", "actor/grad_norm"):
        assert compared[key] >= 4, compared
    # The two-rank run logs what the balancing moved and what imbalance is left.
    logged = [row for row in b if row.get("rollout/moved_rows")]
    assert len(logged) == iterations
    assert sum(float(row["rollout/moved_rows"]) for row in logged) == moved
    assert all(0 <= float(row["rollout/rank_token_imbalance"]) < 1 for row in logged)
    assert not any(row.get("rollout/moved_rows") for row in a)  # one process: nothing to move


def boundary_split(parts: list[list[int]], whole: list[int]) -> bool:
    """Whether two ranks' iteration rows are the single process's rows split in two blocks,
    each block then followed by rows the balancing moved across the blocks' boundary (the
    start of rank 1's block on rank 0, or the end of rank 0's block on rank 1; one way only)."""
    for n0 in range(len(whole) + 1):
        own0, own1 = whole[:n0], whole[n0:]
        if parts[0][:n0] != own0 or parts[1][: len(own1)] != own1:
            continue
        to_0, to_1 = parts[0][n0:], parts[1][len(own1) :]
        if to_0 and to_1:
            continue
        if to_0 == own1[: len(to_0)] and to_1 == own0[len(own0) - len(to_1) :]:
            return True
    return False


@pytest.mark.distributed
def test_two_processes_with_dynamic_sampling_keep_one_process_groups(tmp_path):
    """Each prompt block refills itself, so the ranks' kept groups are the single process's
    (refill prompts included) and the run trains like one process (float64)."""
    single, dp = tmp_path / "single", tmp_path / "dp"
    single.mkdir()
    dp.mkdir()
    extra = ["--dtype=float64", "--dynamic-sampling-rounds=2"]
    jobs = [
        [str(WORKER), "--devices=2", f"--out={dp}", *extra],
        [str(WORKER), "--devices=1", f"--out={single}", *extra],
    ]
    finish_all([start(args, tmp_path) for args in jobs], jobs)
    one = json.loads((single / "rank0.json").read_text())
    ranks = [json.loads((dp / f"rank{r}.json").read_text()) for r in range(2)]
    kept = [one["rollouts"][it]["prompts"] for it in range(2)]
    for it in range(2):
        assert boundary_split([r["rollouts"][it]["prompts"] for r in ranks], kept[it])
    assert any(p >= 5 for prompts in kept for p in prompts), kept  # a refill's group was kept
    assert len({p for prompts in kept for p in prompts}) < 2 * 5 * 3  # and groups were dropped
    want = torch.load(single / "state0.pt")
    for r in range(2):
        got = torch.load(dp / f"state{r}.pt")
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=1e-10, atol=1e-12)


@pytest.mark.distributed
def test_two_processes_with_multi_turn_rows_train_like_one(tmp_path):
    """Multi-turn trajectories (a call, an observation, the answer; a per-turn reward) are the
    same whichever rank runs their block, and the run equals one process (float64)."""
    single, dp = tmp_path / "single", tmp_path / "dp"
    single.mkdir()
    dp.mkdir()
    jobs = [
        [str(WORKER), "--devices=2", f"--out={dp}", "--dtype=float64", "--multi-turn"],
        [str(WORKER), "--devices=1", f"--out={single}", "--dtype=float64", "--multi-turn"],
    ]
    finish_all([start(args, tmp_path) for args in jobs], jobs)
    one = json.loads((single / "rank0.json").read_text())
    ranks = [json.loads((dp / f"rank{r}.json").read_text()) for r in range(2)]
    for it in range(2):
        parts = [ranks[r]["rollouts"][it]["prompts"] for r in range(2)]
        assert boundary_split(parts, one["rollouts"][it]["prompts"])
    want = torch.load(single / "state0.pt")
    for r in range(2):
        got = torch.load(dp / f"state{r}.pt")
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=1e-10, atol=1e-12)


@pytest.mark.distributed
def test_two_processes_train_lora_adapters_like_one(tmp_path):
    """LoRA actor and critic under ppo_ddp: rank 0's frozen base weights reach every rank (rank
    1 built perturbed ones), only adapters and the value head move, and the run equals one
    process (float64)."""
    single, dp = tmp_path / "single", tmp_path / "dp"
    single.mkdir()
    dp.mkdir()
    jobs = [
        [str(WORKER), "--devices=2", f"--out={dp}", "--dtype=float64", "--lora"],
        [str(WORKER), "--devices=1", f"--out={single}", "--dtype=float64", "--lora"],
    ]
    finish_all([start(args, tmp_path) for args in jobs], jobs)
    want = torch.load(single / "state0.pt")
    assert any(".lora_B." in k and want[k].abs().max() > 0 for k in want)  # adapters trained
    for r in range(2):
        got = torch.load(dp / f"state{r}.pt")
        assert got.keys() == want.keys()
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=1e-10, atol=1e-12)


@pytest.mark.slow
@pytest.mark.distributed
def test_cli_fit_on_two_processes(tmp_path):
    run = tmp_path / "run"
    out = run_script(
        [
            "-m",
            "lppo.run.cli",
            "fit",
            f"--config={ROOT / 'configs' / 'tiny.yaml'}",
            "--trainer.devices=2",
            "--trainer.accelerator=cpu",
            "--trainer.strategy=ppo_ddp",
            "--trainer.max_epochs=1",
            f"--trainer.default_root_dir={run}",
            "--model.rollout.prompts_per_iteration=4",
            "--data.max_tokens_per_chunk=24",
        ],
        cwd=tmp_path,
    )
    assert "Starting with 2 processes" in out
    assert (run / "checkpoints" / "last.ckpt").exists()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["iterations"] == 1
    rows = read_metrics(run / "version_0" / "metrics.csv")
    assert any(row.get("actor/loss") for row in rows)
    assert "strategy: ppo_ddp" in (run / "version_0" / "config.yaml").read_text()
    # rank zero samples its own rows: 2 prompts x 4 samples, the rows it trained (advantages)
    samples = (run / "samples" / "iteration-0001.jsonl").read_text().splitlines()
    sampled = [json.loads(line) for line in samples]
    assert [r["prompt_index"] for r in sampled] == [0, 1, 0, 0]
    assert all(r["advantage_mean"] is not None for r in sampled)
