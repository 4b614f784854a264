"""Resuming asynchronous rollouts (``max_staleness`` s = 1, 2) after a stop or a SIGKILL.

A real ``lppo fit`` on a dataset task (its walk position is the task's state, so a prompt
drawn twice or never shows) is killed with SIGKILL while the background rollout process
generates iteration t + 1 and the trainer is in iteration t's critic epoch, inside
``RolloutPipeline.publish``, and while a checkpoint is written. ``--ckpt_path last`` then
ends with bitwise the parameters, the admitted jobs and the task position of the
uninterrupted run with the same s, every iteration trained on exactly its rows, and the
killed trainer's background rollout process does not outlive it.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _async_helpers import RecordRows, assert_same, fit, params, read_rows

from lppo.run.checkpointing import ROLLOUTS_KEY, TMP_MARK
from lppo.tasks import DatasetTask

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "examples" / "data" / "arith.jsonl"
ITERATIONS, PROMPTS, SAMPLES = 4, 4, 2
ARGS = [
    "--config", str(ROOT / "configs" / "dataset.yaml"),
    "--model.task.class_path", "_fault_points.PausingDatasetTask",
    "--model.task.init_args.path", str(DATA),
    "--model.rollout.prompts_per_iteration", str(PROMPTS),
    "--model.rollout.samples_per_prompt", str(SAMPLES),
    "--model.ppo.critic_epochs", "2",
    "--trainer.max_epochs", str(ITERATIONS),
]  # fmt: skip
#: The longest a start, a run or a killed trainer's children may take (a hang fails).
BOUND_S = 600


def lppo_fit(root: Path, staleness: int, *extra: str) -> list[str]:
    """The command line of ``lppo fit`` with lag ``staleness``, recording rows to root/rows."""
    code = "from lppo.run.cli import main; main()"
    args = ["--trainer.default_root_dir", str(root)]
    args += ["--model.rollout.max_staleness", str(staleness)]
    args += ["--trainer.callbacks+=_async_helpers.RecordRows"]
    args += [f"--trainer.callbacks.path={root / 'rows.json'}"]
    return [sys.executable, "-c", code, "fit", *ARGS, *args, *extra]


def env() -> dict[str, str]:
    """PYTHONPATH for the fault points and helpers (the rollout process imports them too)."""
    tests = Path(__file__).resolve().parents[1]
    path = os.pathsep.join([str(tests), str(tests / "rollout")])
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1"}


def outcome(root: Path) -> dict[str, Any]:
    """The final checkpoint's parameters, admitted jobs (weights aside) and task position."""
    ckpt = torch.load(root / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["epoch"] == ITERATIONS - 1
    jobs = [{k: v for k, v in job.items() if k != "weights"} for job in ckpt[ROLLOUTS_KEY]["jobs"]]
    return {
        "state": ckpt["state_dict"],
        "rollouts": {**ckpt[ROLLOUTS_KEY], "jobs": jobs},
        "task": ckpt["lppo_task"],
        "rows": read_rows(root / "rows.json"),
    }


def expected_prompts() -> list[list[str]]:
    """Each iteration's prompts: the next ``PROMPTS`` rows of the dataset's first epoch."""
    task = DatasetTask(str(DATA), prompt_field="question", template="{question}=")
    order = task.order(0)
    assert ITERATIONS * PROMPTS <= len(order)  # one epoch: a prompt drawn twice shows
    walk = [task.texts[row] for row in order]
    return [walk[t * PROMPTS : (t + 1) * PROMPTS] for t in range(ITERATIONS)]


@pytest.fixture(scope="module", params=[1, 2], ids=lambda s: f"s{s}")
def straight(request: Any, tmp_path_factory: Any) -> tuple[int, dict[str, Any]]:
    """The uninterrupted run of each lag, checked against the dataset's walk."""
    s = request.param
    root = tmp_path_factory.mktemp(f"straight-s{s}")
    run = subprocess.run(lppo_fit(root, s), env=env(), capture_output=True, timeout=BOUND_S)
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    result = outcome(root)
    rows = result["rows"]
    assert sorted(rows) == list(range(ITERATIONS))
    for t, want in enumerate(expected_prompts()):
        assert [r["prompt"] for r in rows[t]] == [p for p in want for _ in range(SAMPLES)], t
        assert {tuple(r["provenance"]) for r in rows[t]} == {(t, max(0, t - s))}
    assert [j["iteration"] for j in result["rollouts"]["jobs"]] == [
        ITERATIONS + i for i in range(s + 1)
    ]
    return s, result


def descendants(pid: int) -> dict[int, str]:
    """The processes ``pid`` started (and theirs), with their command lines, from /proc."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # the process ended meanwhile
        children[ppid].append(int(stat.parent.name))
    found: dict[int, str] = {}
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            try:
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            except OSError:
                continue
            found[child] = cmdline.replace(b"\0", b" ").decode(errors="replace")
            todo.append(child)
    return found


def running(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def outliving(pids: list[int], bound_s: float = 60.0) -> list[int]:
    """Those of ``pids`` still running once all ended or ``bound_s`` passed."""
    deadline = time.monotonic() + bound_s
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [p for p in pids if running(p)]


def kill_when_reached(command: list[str], markers: list[Path], log: Path) -> None:
    """Start ``command``; once every marker exists, SIGKILL it; its children must not stay.

    Raises:
        AssertionError: the run ended or hung before the markers, a child of the killed
            trainer (the background rollout process) outlived it.
    """
    with log.open("wb") as out:
        proc = subprocess.Popen(command, env=env(), stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + BOUND_S
    while not all(m.exists() for m in markers):
        if proc.poll() is not None:
            pytest.fail(f"lppo fit ended before {markers}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"{markers} not reached in {BOUND_S} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    children = descendants(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert any("spawn_main" in cmd for cmd in children.values()), children  # the rollout process
    orphans = outliving(list(children))
    for pid in orphans:  # started by this test: never leave them behind
        os.kill(pid, signal.SIGKILL)
    assert not orphans, f"outlived the killed trainer: {[children[p] for p in orphans]}"


def kill_points(s: int) -> dict[str, tuple[str, str, int]]:
    """Name -> (PauseAt point, task pause, iteration of the last checkpoint) for a fresh run.

    * ``generating``: the trainer is in iteration 1's second critic epoch while the background
      rollout process generates (rewards) iteration 2;
    * ``publishing``: the trainer has drawn iteration s + 3's prompts inside iteration 2's
      ``publish`` (its version advanced, the job not admitted);
    * ``writing``: ``torch.save`` is writing iteration 2's checkpoint.
    """
    return {
        "generating": ("critic:1", "generate:2", 0),
        "publishing": ("", f"admit:{s + 3}", 1),
        "writing": ("write:2", "", 1),
    }


def pause_args(tmp_path: Path, trainer_point: str, task_pause: str) -> tuple[list[str], list[Path]]:
    """The command-line arguments of the pauses, and the markers they write."""
    args, markers = [], []
    if trainer_point:
        markers.append(tmp_path / "trainer-paused")
        args += ["--trainer.callbacks+=_fault_points.PauseAt"]
        args += [f"--trainer.callbacks.point={trainer_point}"]
        args += [f"--trainer.callbacks.marker={markers[-1]}"]
    if task_pause:
        markers.append(tmp_path / "task-paused")
        args += ["--model.task.init_args.pause", task_pause]
        args += ["--model.task.init_args.marker", str(markers[-1])]
    return args, markers


@pytest.mark.parametrize("point", ["generating", "publishing", "writing"])
def test_sigkill_then_resume_equals_the_uninterrupted_run(
    tmp_path: Path, straight: tuple[int, dict[str, Any]], point: str
) -> None:
    s, want = straight
    trainer_point, task_pause, last = kill_points(s)[point]
    pause, markers = pause_args(tmp_path, trainer_point, task_pause)
    kill_when_reached(lppo_fit(tmp_path, s, *pause), markers, tmp_path / "killed.log")
    checkpoints = tmp_path / "checkpoints"
    killed_at = torch.load(checkpoints / "last.ckpt", weights_only=False)["epoch"]
    assert killed_at == last
    if point == "writing":  # killed mid-write: the temporary file is there, last.ckpt intact
        assert any(TMP_MARK in p.name for p in checkpoints.iterdir())
    resumed = subprocess.run(
        lppo_fit(tmp_path, s, "--ckpt_path", "last"),
        env=env(),
        capture_output=True,
        timeout=BOUND_S,
    )
    assert resumed.returncode == 0, resumed.stderr.decode()[-3000:]
    got = outcome(tmp_path)
    # each iteration once (the killed run's record of a re-run iteration was replaced) ...
    assert sorted(got["rows"]) == list(range(ITERATIONS))
    # ... and the prompts trained are the uninterrupted run's: none skipped, none twice
    trained = collections.Counter(r["prompt"] for rows in got["rows"].values() for r in rows)
    assert trained == collections.Counter(
        r["prompt"] for rows in want["rows"].values() for r in rows
    )
    assert got["rows"] == want["rows"]  # the same samples, iteration by iteration
    assert_same(want["state"], got["state"])
    assert got["rollouts"] == want["rollouts"]
    assert got["task"] == want["task"]
    assert not any(TMP_MARK in p.name for p in checkpoints.iterdir())


def jobs(system: Any) -> tuple[dict[str, Any], list[Any]]:
    """The admitted jobs a checkpoint of ``system`` would hold: as plain data, and weights."""
    state = system.rollouts.state_dict()
    plain = [{k: v for k, v in job.items() if k != "weights"} for job in state["jobs"]]
    return {**state, "jobs": plain}, [job["weights"] for job in state["jobs"]]


@pytest.mark.parametrize("staleness", [1, 2])
def test_stop_and_resume_in_process_equals_the_straight_run(tmp_path: Path, staleness: int) -> None:
    def task() -> DatasetTask:
        return DatasetTask(str(DATA), prompt_field="question", template="{question}=")

    record = RecordRows(str(tmp_path / "straight.json"))
    _, straight = fit(tmp_path / "straight", 4, staleness, task=task(), callbacks=(record,))
    split = (RecordRows(str(tmp_path / "split.json")),)
    _, first = fit(tmp_path / "split", 2, staleness, task=task(), callbacks=split)
    # iterations 2 .. 2 + s were admitted (not generated: the run ended) and checkpointed
    assert sorted(first.rollouts.pending) == list(range(2, 3 + staleness))
    _, resumed = fit(
        tmp_path / "split", 4, staleness, task=task(), callbacks=split, ckpt_path="last"
    )
    assert_same(params(straight), params(resumed))
    assert resumed.task.state_dict() == straight.task.state_dict()
    (want, want_weights), (got, got_weights) = jobs(straight), jobs(resumed)
    assert got == want
    for a, b in zip(want_weights, got_weights, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert_same(a, b)
    rows = read_rows(tmp_path / "split.json")
    assert sorted(rows) == list(range(4))
    assert rows == read_rows(tmp_path / "straight.json")
