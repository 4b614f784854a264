"""The learned reward model: scored per row in the streamed score phase, combined by weights."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch
from _builders import VOCAB, random_rows, stored, tiny_backbone, tiny_lm
from lppo.callbacks import lifecycle
from test_cli import fit_args

from lppo.iteration.chunks import iter_chunks
from lppo.iteration.controller import PPOController
from lppo.iteration.data import ReplayDataModule
from lppo.iteration.data_settings import DataSettings
from lppo.iteration.hooks import PPOCallback
from lppo.iteration.planner import ChunkPlanner
from lppo.modules import ActorModule, CriticModule, RewardModel
from lppo.modules.models import HFCausalLM
from lppo.replay import MemoryReplayStore
from lppo.run.cli import run
from lppo.types import INPUT_IDS, REWARD, RM_SCORE, TASK_REWARD, Rollout

PAD = VOCAB  # an id no random row uses, so Hugging Face's own pooling finds the last token


def classifier(seed: int = 0):
    spec = HFCausalLM(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, seed=seed)
    spec.torch_dtype = torch.float64
    return spec.build_classifier(VOCAB + 1, PAD, 0, 1)


def test_scores_are_per_row_whatever_the_chunking():
    cols = random_rows(7, seed=2)
    store = MemoryReplayStore()
    store.put(list(range(7)), cols)
    model = RewardModel(classifier())
    model.configure_model()
    want = [float(model.classifier(input_ids=ids[None]).logits[0, 0]) for ids in cols[INPUT_IDS]]
    for budget in (14, 1000):
        [step] = ChunkPlanner(DataSettings(budget, seed=1)).plan(store.meta()).steps
        got = {}
        for chunk in iter_chunks(store, step, []):
            got.update(zip(chunk.row_ids, model.score(chunk).tolist(), strict=True))
        assert [got[i] for i in range(7)] == pytest.approx(want, rel=1e-10, abs=1e-12)


def test_combination_and_running_normalization():
    model = RewardModel(classifier(), weight=0.5, task_weight=2.0)
    first, second = torch.tensor([1.0, 2.0, 4.0]), torch.tensor([3.0, 5.0])
    task = torch.tensor([1.0, 0.0, 1.0])
    out = model.combine(task, first)
    mu, sd = first.mean(), (first.var(unbiased=False) + 1e-8).sqrt()
    torch.testing.assert_close(out, 2.0 * task.double() + 0.5 * ((first - mu) / sd).double())
    out2 = model.combine(torch.zeros(2), second)
    both = torch.cat([first, second]).double()
    norm = (second.double() - both.mean()) / (both.var(unbiased=False) + 1e-8).sqrt()
    torch.testing.assert_close(out2, 0.5 * norm, rtol=1e-7, atol=1e-9)
    # The running moments are a buffer: checkpoints keep them.
    fresh = RewardModel(classifier())
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(fresh.running, model.running) and float(fresh.running[0]) == 5.0
    with pytest.raises(ValueError, match=r"model\.reward_model\.init_args\.weight"):
        RewardModel(classifier(), weight=math.inf)


class Snapshot(PPOCallback):
    def __init__(self):
        self.rows = None

    def on_phase_epoch_start(self, ctx):
        if self.rows is None:
            self.rows = ctx.store.read(ctx.row_ids, [REWARD, TASK_REWARD, RM_SCORE])


def test_controller_trains_on_the_combined_reward():
    cols = random_rows(6, seed=3)
    rollout = Rollout(
        input_ids=cols[INPUT_IDS],
        response_mask=cols["response_mask"],
        gen_logprobs=[torch.zeros(len(t)) for t in cols[INPUT_IDS]],
        reward=torch.stack(cols[REWARD]).float(),
        prompt_index=torch.arange(6),
    )
    rm = RewardModel(classifier(), weight=1.0, task_weight=0.5)
    rm.configure_model()
    snap = Snapshot()
    ctl = PPOController(
        ActorModule(tiny_lm(), lr=1e-3),
        CriticModule(tiny_backbone(), lr=1e-3),
        ReplayDataModule(max_tokens_per_chunk=30),
        callbacks=[snap, *lifecycle()],
        reward_model=rm,
    )
    result = ctl.run_iteration(stored(ctl, rollout), iteration=0)
    raw = torch.stack(snap.rows[RM_SCORE])
    task = torch.stack(snap.rows[TASK_REWARD]).double()
    torch.testing.assert_close(task.float(), rollout.reward)
    norm = (raw - raw.mean()) / (raw.var(unbiased=False) + 1e-8).sqrt()
    want = (0.5 * task + norm).float()
    torch.testing.assert_close(torch.stack(snap.rows[REWARD]), want)
    assert result.rollout.extra["rm_score_mean"] == pytest.approx(float(raw.mean()))
    assert result.rollout.reward_mean == pytest.approx(float(rollout.reward.double().mean()))


def test_reward_model_through_the_cli(tmp_path: Path):
    spec = {
        "class_path": "lppo.modules.models.HFCausalLM",
        "init_args": {"hidden_size": 16, "num_heads": 2},
    }
    rm = json.dumps({"class_path": "lppo.modules.RewardModel", "init_args": {"model": spec}})
    cli = run(fit_args(tmp_path, "--model.reward_model", rm, iterations=2))
    assert isinstance(cli.model.reward_model, RewardModel)
    assert float(cli.model.reward_model.running[0]) == 2 * 8  # every row of both iterations
    with open(Path(cli.trainer.logger.log_dir) / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("rollout/rm_score_mean")]
    assert len(rows) == 2
    assert all(math.isfinite(float(r["rollout/reward_combined_mean"])) for r in rows)
