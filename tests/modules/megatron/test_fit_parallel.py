"""``lppo fit`` over data x tensor parallelism: megatron's groups become the run's groups.

The fits run ``tests/megatron_fit_worker.py`` (the megatron CPU shims, then ``lppo.run.cli``) in
subprocesses: Lightning re-runs the launching command for ranks 1..N-1, which must not be
pytest's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _ports import next_port

from lppo.run.cli import run

ROOT = Path(__file__).resolve().parents[3]
WORKER = ROOT / "tests" / "megatron_fit_worker.py"
CONFIG = str(ROOT / "configs" / "megatron_tp2.yaml")
#: Generous: the fits run side by side, with the other xdist worker's tests, on 2 cores.
TIMEOUT_S = 900
ACTOR = "--model.actor.init_args.model.init_args"
CRITIC = "--model.critic.init_args.backbone.init_args"
#: Two iterations of four prompts in blocks of one (the same blocks, so the same generation
#: seeds, for any number of data-parallel ranks), in float64.
SMALL = (
    "--trainer.accelerator=cpu",
    "--trainer.max_epochs=2",
    "--model.rollout.prompts_per_iteration=4",
    "--model.rollout.samples_per_prompt=2",
    "--model.rollout.prompts_per_block=1",
    f"{ACTOR}.hf.init_args.dtype=float64",
    f"{CRITIC}.hf.init_args.dtype=float64",
)
TP1 = (f"{ACTOR}.tensor_parallel_size=1", f"{CRITIC}.tensor_parallel_size=1")
#: float64; row-parallel layers sum partial products across ranks (another summation order),
#: as in test_tensor_parallel.py.
RTOL = 1e-10


def start(out: Path, *args: str) -> subprocess.Popen:
    """``megatron_fit_worker.py --record out fit --config megatron_tp2.yaml *args``."""
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env["MASTER_PORT"] = str(next_port())  # fits started side by side must not share one
    cmd = [sys.executable, str(WORKER), "--record", str(out), "fit", f"--config={CONFIG}"]
    cmd += [f"--trainer.default_root_dir={out / 'run'}", *args]
    return subprocess.Popen(
        cmd,
        cwd=out,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: a timeout kills every rank
    )


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    """Wait for ``proc`` (and the ranks it launched); its exit status and output."""
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"fit timed out after {TIMEOUT_S}s:\n{out[-6000:]}")
    return proc.returncode, out


def resume(run: Path) -> tuple[str, ...]:
    """Arguments resuming ``run``'s fit from its last checkpoint for a third iteration."""
    return ("--trainer.max_epochs=3", f"--ckpt_path={run / 'run' / 'checkpoints' / 'last.ckpt'}")


def assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Same names, dtypes and shapes; values equal to ``RTOL`` of each tensor's scale."""
    assert got.keys() == want.keys()
    for name, value in want.items():
        if not isinstance(value, torch.Tensor):  # megatron's _extra_state (None)
            assert got[name] == value, name
            continue
        mine = got[name]
        assert mine.dtype == value.dtype and mine.shape == value.shape, name
        err = (mine - value).abs().max().item()
        assert err <= RTOL * max(value.abs().max().item(), 1e-300), (name, err)


def assert_same_checkpoint(a: Path, b: Path) -> None:
    """``last.ckpt`` of runs ``a`` and ``b``: same weights and optimizer moments (``RTOL``)."""
    one, two = (
        torch.load(r / "run" / "checkpoints" / "last.ckpt", weights_only=False) for r in (a, b)
    )
    assert one["state_dict"]["actor.model.embedding.word_embeddings.weight"].shape[0] == 14
    assert_close(one["state_dict"], two["state_dict"])
    for x, y in zip(one["optimizer_states"], two["optimizer_states"], strict=True):
        assert x["state"].keys() == y["state"].keys()
        for i, state in y["state"].items():
            assert_close(x["state"][i], state)


def records(out: Path, world: int) -> tuple[list[dict], list[dict[str, torch.Tensor]]]:
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    states = [torch.load(out / f"state{r}.pt") for r in range(world)]
    return ranks, states


@pytest.mark.slow
@pytest.mark.distributed
def test_two_data_by_two_tensor_parallel_ranks_train_like_one_process(tmp_path):
    """4 processes (2 x 2) equal 1 process; each replica's rows are a 2-process DP run's."""
    fits = {
        "tp": start(tmp_path / "tp", *SMALL),  # the config as is: 4 devices, ppo_megatron, tp 2
        "dp": start(tmp_path / "dp", *SMALL, *TP1, "--trainer.devices=2"),
        "one": start(tmp_path / "one", *SMALL, *TP1, "--trainer.devices=1"),
    }
    for name, proc in fits.items():
        rc, out = finish(proc)
        assert rc == 0, f"{name} fit failed:\n{out[-6000:]}"
    tp, tp_states = records(tmp_path / "tp", 4)
    dp, _ = records(tmp_path / "dp", 2)
    [one], [one_state] = records(tmp_path / "one", 1)

    # megatron's layout: tensor-parallel pairs (0, 1), (2, 3); data-parallel ranks 0-2, 1-3
    assert [(r["data"], r["tensor"]) for r in tp] == [
        ([d, 2], [t, 2]) for d in range(2) for t in range(2)
    ]
    assert [(r["data"], r["tensor"]) for r in dp] == [([0, 2], [0, 1]), ([1, 2], [0, 1])]
    for d in range(2):
        # both tensor-parallel ranks of a replica put the same rows (prompts and samples) ...
        assert tp[2 * d]["rollouts"] == tp[2 * d + 1]["rollouts"]
        # ... which are those of data-parallel rank d of a 2-process run
        assert tp[2 * d]["rollouts"] == dp[d]["rollouts"]
    for it in range(2):
        prompts = [p for d in range(2) for p in tp[2 * d]["rollouts"][it]["prompts"]]
        assert prompts == one["rollouts"][it]["prompts"] == [0, 0, 1, 1, 2, 2, 3, 3]
        assert tp[0]["rollouts"][it]["prompts"] == [0, 0, 1, 1]  # split, not repeated

    # every rank holds the same full weights, the single process's to round-off
    for state in tp_states[1:]:
        assert state.keys() == tp_states[0].keys()
        assert all(torch.equal(state[k], tp_states[0][k]) for k in state)
    assert_close(tp_states[0], one_state)
    # the checkpoint holds whole tensors (weights and AdamW moments): the single process's
    assert_same_checkpoint(tmp_path / "tp", tmp_path / "one")

    # resumed from its checkpoint for a third iteration, 2 x 2 still equals 1 process
    resumed = {
        name: start(tmp_path / f"{name}3", *SMALL, *extra, *resume(tmp_path / name))
        for name, extra in (("tp", ()), ("one", (*TP1, "--trainer.devices=1")))
    }
    for name, proc in resumed.items():
        rc, out = finish(proc)
        assert rc == 0, f"resumed {name} fit failed:\n{out[-6000:]}"
    [tp3, _, _, _], [tp3_state, *_] = records(tmp_path / "tp3", 4)
    [one3], [one3_state] = records(tmp_path / "one3", 1)
    assert [r["iteration"] for r in tp3["rollouts"]] == [r["iteration"] for r in one3["rollouts"]]
    assert_close(tp3_state, one3_state)


def test_processes_not_divisible_by_tensor_parallel_size_fail_at_setup(tmp_path):
    """1 process for tensor_parallel_size 2: refused naming the key and the process count."""
    with pytest.raises(ValueError) as error:
        run(
            [
                "fit",
                f"--config={CONFIG}",
                "--trainer.devices=1",
                "--trainer.strategy=auto",
                "--trainer.accelerator=cpu",
                f"--trainer.default_root_dir={tmp_path}",
            ]
        )
    message = str(error.value)
    assert "model.actor.init_args.model.init_args.tensor_parallel_size=2" in message
    assert "trainer.devices x trainer.num_nodes = 1" in message


@pytest.mark.distributed
def test_tensor_parallel_with_fsdp_fails_at_setup(tmp_path):
    """ppo_fsdp shards Hugging Face models: megatron modules under it are refused."""
    rc, out = finish(
        start(
            tmp_path / "fsdp",
            "--trainer.accelerator=cpu",
            "--trainer.devices=2",
            "--trainer.strategy=ppo_fsdp",
            "--trainer.max_epochs=1",
        )
    )
    assert rc != 0
    assert "is a megatron-core module (Megatron" in out, out[-6000:]
    assert "FSDPLayout; set trainer.strategy=ppo_megatron" in out
    assert not (tmp_path / "fsdp" / "rank0.json").exists()  # nothing trained
