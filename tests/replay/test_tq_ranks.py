"""Two data-parallel ranks over ONE TransferQueue store, end to end, against one process.

``tests/ddp_fit_worker.py --tq-temp-dir DIR`` on 2 gloo ranks (``ppo_ddp``): rank 0 starts a
local Ray (loopback) with TransferQueue; rank 1 attaches to it and uses rank 0's partition
(:meth:`TransferQueueReplayStore.connect`). Each rank puts, scores, trains and releases only
the row ids it was handed by the shared store. The fit must end where the single-process fit
with the embedded store ends (float32, tight tolerance), every row must have been released
exactly once (TransferQueue's own controller holds no key of the partition, the catalog no
live row and no claim, and its released ids are exactly the ids handed out), nothing may hang
(bounded waits), and no process of that Ray may outlive the fit.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time

import psutil
import pytest
import torch
from test_ddp import PARAM_ATOL, PARAM_RTOL, WORKER, close, finish_all, read_metrics, start

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
ROWS_PER_ITERATION = 15  # ddp_fit_worker: 5 prompts x 3 samples
ITERATIONS = 2


def processes_under(temp_dir: str) -> list[int]:
    """Pids of live processes started for the Ray session rooted at ``temp_dir``."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and temp_dir in " ".join(
                proc.info["cmdline"] or []
            ):
                found.append(proc.pid)
        except psutil.NoSuchProcess:
            pass
    return found


def test_two_ranks_share_one_store_and_train_like_one_process(tmp_path):
    single, dp = tmp_path / "single", tmp_path / "dp"
    single.mkdir()
    dp.mkdir()
    temp_dir = tempfile.mkdtemp(prefix="lppo-", dir="/tmp")  # Ray's socket paths are short
    jobs = [
        [str(WORKER), "--devices=2", f"--out={dp}", f"--tq-temp-dir={temp_dir}"],
        [str(WORKER), "--devices=1", f"--out={single}"],
    ]
    procs = [start(args, tmp_path) for args in jobs]
    finish_all(procs, jobs)
    deadline = time.monotonic() + 30  # Ray's reaper may take a moment after the driver exits
    while processes_under(temp_dir) and time.monotonic() < deadline:
        time.sleep(1)
    assert processes_under(temp_dir) == []  # nothing of rank 0's Ray outlived the fit
    shutil.rmtree(temp_dir, ignore_errors=True)

    one = json.loads((single / "rank0.json").read_text())
    ranks = [json.loads((dp / f"rank{r}.json").read_text()) for r in range(2)]
    tq = [rec["tq"] for rec in ranks]
    assert one["tq"] is None and None not in tq
    assert tq[0]["partition"] == tq[1]["partition"]  # one store, seen by both ranks

    # Released exactly once: TransferQueue's own controller and the catalog hold nothing, and
    # the released ids are exactly the ids handed out (a second release would have raised).
    handed_out = ITERATIONS * ROWS_PER_ITERATION
    for state in tq:
        assert state["keys"] == [] and state["live"] == [] and state["claims"] == []
        assert state["next_id"] == handed_out
        assert state["released"] == [[0, handed_out]], state["released"]

    # Each rank put its own prompts' rows (row ids of the shared store) and trained only them.
    for it in range(ITERATIONS):
        got = [rec["rollouts"][it]["prompts"] for rec in ranks]
        assert got == [[p for p in range(3) for _ in range(3)], [3, 3, 3, 4, 4, 4]]
    for k, want in enumerate(one["steps"]):
        mine = [rec["steps"][k] for rec in ranks]
        assert len(mine[0]["chunks"]) == len(mine[1]["chunks"])
        got = sorted(tuple(row) for s in mine for row in s["rows"])
        assert got == sorted(tuple(row) for row in want["rows"]), want
        ids = [set(i for c in s["chunks"] for i in c) for s in mine]
        assert not ids[0] & ids[1]  # no rank trains another's row
    for rec in ranks:
        assert rec["global_step"] == one["global_step"] == 4
        assert rec["rows_left"] == 0

    # The single-process result, float32.
    want = torch.load(single / "state0.pt")
    got = [torch.load(dp / f"state{r}.pt") for r in range(2)]
    for name, value in want.items():
        assert torch.equal(got[0][name], got[1][name]), name
        torch.testing.assert_close(got[0][name], value, rtol=PARAM_RTOL, atol=PARAM_ATOL)
    a = read_metrics(single / "run" / "version_0" / "metrics.csv")
    b = read_metrics(dp / "run" / "version_0" / "metrics.csv")
    assert len(a) == len(b) > 0
    for row_a, row_b in zip(a, b, strict=True):
        for key in ("critic/loss", "actor/loss", "actor/grad_norm", "rollout/reward_mean"):
            if row_a.get(key):
                assert close(float(row_a[key]), float(row_b[key])), (key, row_a, row_b)
