"""DAPO's dynamic sampling: every kept group carries a learning signal, refills are
deterministic whoever generates them, and a resumed run is the uninterrupted one."""

from __future__ import annotations

import csv
import math

import pytest
import torch
from _async_helpers import assert_same, fit, params
from _builders import ThresholdCopyTask

from lppo.errors import IterationError
from lppo.iteration.hooks import PPOCallback
from lppo.rollout import InlineRunner, ProcessRunner, RolloutSettings
from lppo.rollout.dynamic_sampling import informative_rows
from lppo.types import REWARD

PROMPTS = 4  # _async_helpers.fit: 4 prompts x 3 samples
BLOCKS = {"prompts_per_block": 1, "dynamic_sampling_rounds": 2}


class Groups(PPOCallback):
    """Records every iteration's rows as ``prompt_index -> rewards``."""

    def __init__(self) -> None:
        self.groups: dict[int, dict[int, list[float]]] = {}

    def on_rollout_end(self, ctx) -> None:
        cols = ctx.store.read(list(ctx.row_ids), ["prompt_index", REWARD])
        groups: dict[int, list[float]] = {}
        for p, r in zip(cols["prompt_index"], cols[REWARD], strict=True):
            groups.setdefault(int(p), []).append(float(r))
        self.groups[ctx.iteration] = groups


def metrics(root) -> list[dict[str, float]]:
    """The iterations' ``rollout/*`` counts of dynamic sampling, from metrics.csv."""
    with open(next(root.glob("version_*/metrics.csv"))) as f:
        rows = [r for r in csv.DictReader(f) if r.get("rollout/uniform_groups")]
    names = ("uniform_groups", "surplus_groups", "short_groups", "refills")
    return [{n: float(r[f"rollout/{n}"]) for n in names} for r in rows]


def sampled_rewards(root) -> list[float]:
    """The iterations' ``rollout/sampled_reward_mean``."""
    with open(next(root.glob("version_*/metrics.csv"))) as f:
        return [float(r["rollout/sampled_reward_mean"]) for r in csv.DictReader(f)
                if r.get("rollout/sampled_reward_mean")]  # fmt: skip


def test_informative_rows_drops_uniform_groups_and_keeps_the_first_up_to_the_quota():
    reward = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0, 0.5, math.nan, 0.0, 1.0, 3.0, 4.0])
    index = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5])
    rows, report = informative_rows(reward, index, quota=2)
    assert rows == [2, 3, 8, 9]  # groups 1 and 4 (group 3 has one finite reward: no signal)
    assert (report.uniform_groups, report.surplus_groups, report.nonfinite_groups) == (3, 1, 1)
    rows, report = informative_rows(reward, index, quota=5)
    assert rows == [2, 3, 8, 9, 10, 11] and report.surplus_groups == 0


def test_the_uniform_rule_is_exact_equality_of_finite_float64_rewards():
    """Rewards that differ below float32's resolution differ; a group is judged on its finite
    rewards (a NaN or infinite one makes its row invalid when put), and is counted."""
    reward = torch.tensor(
        [1.0, 1.0 + 1e-12, 0.3, 0.3, math.inf, 0.0, 1.0, -math.inf, 2.0, 2.0, math.nan, math.nan],
        dtype=torch.float64,
    )
    assert reward.dtype == torch.float64
    index = torch.tensor([0, 0, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4])
    rows, report = informative_rows(reward, index, quota=10)
    assert rows == [0, 1, 4, 5, 6]  # 1 vs 1 + 1e-12 kept; inf beside 0 and 1 kept
    assert (report.uniform_groups, report.nonfinite_groups) == (3, 3)
    assert report.metrics()["nonfinite_groups"] == 3.0


def test_every_kept_group_has_a_signal_and_the_counts_add_up(tmp_path):
    groups = Groups()
    task = ThresholdCopyTask(threshold=0.5)
    fit(tmp_path, 4, 0, InlineRunner(), task, (groups,), rollout=BLOCKS)
    counts = metrics(tmp_path)
    assert len(counts) == 4
    for t, got in groups.groups.items():
        for rewards in got.values():
            assert len(rewards) == 3 and len(set(rewards)) > 1, (t, got)
        # each block is one prompt: a refill prompt index is round * PROMPTS + block
        assert all(0 <= p < 3 * PROMPTS for p in got)
        assert len(got) + counts[t]["short_groups"] == PROMPTS, (t, got, counts[t])
    assert sum(c["uniform_groups"] for c in counts) > 0
    assert sum(c["refills"] for c in counts) > 0
    assert any(p >= PROMPTS for got in groups.groups.values() for p in got)  # refills kept


def test_the_sampled_reward_is_the_first_rounds_before_any_group_is_dropped(tmp_path):
    """``rollout/sampled_reward_mean`` equals ``rollout/reward_mean`` of the same run without
    dynamic sampling in its first iteration (same weights, same first-round prompts)."""
    task = ThresholdCopyTask(threshold=0.5)
    fit(tmp_path / "on", 1, 0, InlineRunner(), task, rollout=BLOCKS)
    fit(tmp_path / "off", 1, 0, InlineRunner(), task, rollout={"prompts_per_block": 1})
    with open(next((tmp_path / "off").glob("version_*/metrics.csv"))) as f:
        [plain] = [float(r["rollout/reward_mean"]) for r in csv.DictReader(f)
                   if r.get("rollout/reward_mean")]  # fmt: skip
    assert sampled_rewards(tmp_path / "on") == [pytest.approx(plain, rel=1e-12)]


@pytest.mark.parametrize("staleness", [0, 1])
def test_the_background_process_keeps_the_same_rows_as_the_trainer(tmp_path, staleness):
    """Refills run where the job runs; the rows (and so the run) never depend on where."""
    a, b = Groups(), Groups()
    task = ThresholdCopyTask(threshold=0.5)
    _, inline = fit(tmp_path / "i", 4, staleness, InlineRunner(), task, (a,), rollout=BLOCKS)
    _, process = fit(tmp_path / "p", 4, staleness, ProcessRunner(), task, (b,), rollout=BLOCKS)
    assert a.groups == b.groups
    assert_same(params(inline), params(process))
    assert metrics(tmp_path / "i") == metrics(tmp_path / "p")


def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path):
    """At lag 1 the checkpoint holds an admitted job with its refill blocks."""
    task = ThresholdCopyTask(threshold=0.5)
    runs = {}
    for name in ("straight", "split"):
        runs[name] = Groups()
    _, straight = fit(tmp_path / "s", 4, 1, InlineRunner(), task, (runs["straight"],),
                      rollout=BLOCKS)  # fmt: skip
    fit(tmp_path / "r", 2, 1, InlineRunner(), task, rollout=BLOCKS)
    _, resumed = fit(tmp_path / "r", 4, 1, InlineRunner(), task, (runs["split"],),
                     ckpt_path="last", rollout=BLOCKS)  # fmt: skip
    assert_same(params(straight), params(resumed))
    assert {t: runs["straight"].groups[t] for t in (2, 3)} == runs["split"].groups


def test_settings_that_cannot_work_fail_at_setup():
    with pytest.raises(ValueError, match=r"dynamic_sampling_rounds=2 with .*samples_per_prompt=1"):
        RolloutSettings(samples_per_prompt=1, dynamic_sampling_rounds=2)
    with pytest.raises(ValueError, match=r"model.rollout.dynamic_sampling_rounds=-1"):
        RolloutSettings(dynamic_sampling_rounds=-1)


NO_SIGNAL = ThresholdCopyTask(threshold=1.01)  # every sample fails: every group is uniform
ALL_SAMPLES = PROMPTS * 3  # what an iteration that keeps no group loses


def test_an_iteration_with_no_informative_group_fails_at_drop_budget_0(tmp_path):
    """Every group dropped, every refill spent: its samples are lost, so at the default
    ``data.drop_budget: 0`` the iteration fails (no step, no row left behind)."""
    groups = Groups()
    refused = r"phase collect: DropBudgetExceeded: dynamic sampling kept no prompt group.* its 12"
    with pytest.raises(IterationError, match=refused + r" samples .*drop_budget=0"):
        fit(tmp_path, 3, 0, InlineRunner(), NO_SIGNAL, (groups,), rollout=BLOCKS)
    assert groups.groups == {0: {}}


def test_a_failed_empty_iteration_counts_against_max_failed_iterations(tmp_path):
    with pytest.warns(RuntimeWarning, match=r"iteration 2 skipped \(2 of model.ppo.max_failed"):
        trainer, system = fit(tmp_path, 2, 0, InlineRunner(), NO_SIGNAL, rollout=BLOCKS,
                              max_failed_iterations=2)  # fmt: skip
    assert trainer.global_step == 0 and system.run_log.failed == 2
    with open(next(tmp_path.glob("version_*/metrics.csv"))) as f:
        assert [r["iteration/failed_total"] for r in csv.DictReader(f)] == ["1", "2"]


def test_within_the_drop_budget_an_empty_iteration_trains_nothing_and_is_logged(tmp_path):
    """A budget that covers the iteration's samples: warned, logged, and the run goes on."""
    groups = Groups()
    with pytest.warns(RuntimeWarning, match=r"iteration 3: dynamic sampling kept no prompt"):
        trainer, system = fit(tmp_path, 3, 0, InlineRunner(), NO_SIGNAL, (groups,),
                              rollout=BLOCKS, data={"drop_budget": ALL_SAMPLES})  # fmt: skip
    assert trainer.global_step == 0 and system.run_log.failed == 0
    assert groups.groups == {0: {}, 1: {}, 2: {}}
    assert len(trainer.datamodule.store) == 0
    for counts in metrics(tmp_path):
        assert counts == {
            "uniform_groups": 3 * PROMPTS,
            "surplus_groups": 0,
            "short_groups": PROMPTS,
            "refills": 2 * PROMPTS,
        }
    with open(next(tmp_path.glob("version_*/metrics.csv"))) as f:
        rows = [r for r in csv.DictReader(f) if r.get("rollout/untrained")]
    assert [(r["rollout/untrained"], r["rollout/short_samples"]) for r in rows] == [
        ("1.0", f"{ALL_SAMPLES}.0")
    ] * 3


def test_an_iteration_that_keeps_a_group_is_logged_as_trained(tmp_path):
    fit(tmp_path, 2, 0, InlineRunner(), ThresholdCopyTask(threshold=0.5), rollout=BLOCKS)
    with open(next(tmp_path.glob("version_*/metrics.csv"))) as f:
        rows = [r for r in csv.DictReader(f) if r.get("rollout/untrained")]
    assert [r["rollout/untrained"] for r in rows] == ["0.0", "0.0"]


def test_fixed_rows_per_rank_is_refused_at_setup(tmp_path):
    from pathlib import Path

    from lppo.run.cli import run
    from lppo.validation import SettingError

    config = Path(__file__).resolve().parents[2] / "configs" / "grpo.yaml"
    args = ["fit", "--config", str(config), "--trainer.max_epochs", "1",
            "--data.fixed_rows_per_rank", "true", "--model.rollout.dynamic_sampling_rounds", "1",
            "--trainer.default_root_dir", str(tmp_path)]  # fmt: skip
    with pytest.raises(SettingError, match=r"dynamic_sampling_rounds=1 with data.fixed_rows"):
        run(args)
