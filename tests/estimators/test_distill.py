"""On-policy distillation: ``Distill`` against an independent float64 reference, any chunking."""

from __future__ import annotations

import math

import pytest
import torch
from _builders import filled_store, random_rows
from hypothesis import given
from hypothesis import strategies as st

from lppo.algorithms import distill_advantages
from lppo.algorithms.losses import LOG_RATIO_CLAMP
from lppo.estimators import GAE, GRPO, Distill, EstimatorInputs
from lppo.iteration.data_settings import DataSettings
from lppo.iteration.planner import ChunkPlanner
from lppo.parallel import SINGLE
from lppo.types import ADVANTAGES, OLD_LOGPROBS, RESPONSE_MASK, REWARD, TEACHER_LOGPROBS
from lppo.validation import SettingError


def make_store(n_prompts: int, k: int, seed: int):
    """Rows of ``n_prompts`` prompts × ``k`` samples with a teacher's log-probs."""
    cols = random_rows(n_prompts * k, seed)
    g = torch.Generator().manual_seed(seed + 7)
    cols["prompt_index"] = [torch.tensor(i // k) for i in range(n_prompts * k)]
    cols[TEACHER_LOGPROBS] = [
        torch.where(m, -torch.rand(len(m), generator=g, dtype=torch.float64) * 3, 0.0)
        for m in cols[RESPONSE_MASK]
    ]
    return filled_store(cols), cols


def run(estimator, store, budget: int) -> tuple[dict[int, torch.Tensor], dict[str, float]]:
    [step] = (
        ChunkPlanner(DataSettings(budget, seed=3, drop_budget=len(store))).plan(store.meta()).steps
    )
    metrics = estimator.estimate(EstimatorInputs(store, step, SINGLE))
    ids = [i for c in step.chunks for i in c]
    return dict(zip(ids, store.read(ids, [ADVANTAGES])[ADVANTAGES], strict=True)), metrics


def ref_grpo(cols) -> dict[int, float]:
    """GRPO's row advantages from plain floats (population std, eps 1e-6)."""
    groups: dict[int, list[float]] = {}
    for g, r in zip(cols["prompt_index"], cols[REWARD], strict=True):
        groups.setdefault(int(g), []).append(float(r))
    out = {}
    for i, (g, r) in enumerate(zip(cols["prompt_index"], cols[REWARD], strict=True)):
        vals = groups[int(g)]
        mean = math.fsum(vals) / len(vals)
        std = math.sqrt(math.fsum((x - mean) ** 2 for x in vals) / len(vals))
        out[i] = (float(r) - mean) / (std + 1e-6)
    return out


@given(
    n_prompts=st.integers(1, 4),
    k=st.integers(2, 4),
    seed=st.integers(0, 10_000),
    budget=st.integers(14, 80),
    coef=st.sampled_from([1.0, 0.3]),
    with_task=st.booleans(),
)
def test_distill_matches_reference_under_any_chunking(n_prompts, k, seed, budget, coef, with_task):
    store, cols = make_store(n_prompts, k, seed)
    got, metrics = run(Distill(GRPO() if with_task else None, coef), store, budget)
    task = ref_grpo(cols) if with_task else {}
    kl_sum, kl_n = [], 0
    assert sorted(got) == list(range(n_prompts * k))
    for i, adv in got.items():
        mask = cols[RESPONSE_MASK][i].tolist()
        old, teacher = cols[OLD_LOGPROBS][i].tolist(), cols[TEACHER_LOGPROBS][i].tolist()
        want = [
            task.get(i, 0.0) - coef * (o - t) if m else 0.0
            for o, t, m in zip(old, teacher, mask, strict=True)
        ]
        kl_sum += [o - t for o, t, m in zip(old, teacher, mask, strict=True) if m]
        kl_n += sum(mask)
        torch.testing.assert_close(adv, torch.tensor(want, dtype=adv.dtype), rtol=1e-10, atol=1e-12)
    assert metrics["distill_reverse_kl"] == pytest.approx(math.fsum(kl_sum) / kl_n, rel=1e-12)
    assert ("advantage_abs_mean" in metrics) == with_task  # the task estimator's metrics too


def test_a_teacher_equal_to_the_student_gives_zero_advantages():
    store, cols = make_store(2, 3, seed=4)
    store.write(list(range(6)), {TEACHER_LOGPROBS: cols[OLD_LOGPROBS]})
    got, metrics = run(Distill(), store, 40)
    assert all(float(a.abs().max()) == 0.0 for a in got.values())
    assert metrics["distill_reverse_kl"] == 0.0


def test_the_log_ratio_is_clamped_as_every_kl():
    old = torch.tensor([[0.0, -50.0, -1.0]], dtype=torch.float64)
    teacher = torch.tensor([[0.0, -1.0, -60.0]], dtype=torch.float64)
    mask = torch.tensor([[False, True, True]])
    got = distill_advantages(old, teacher, mask, 2.0)
    assert got.tolist() == [[0.0, 2.0 * LOG_RATIO_CLAMP, -2.0 * LOG_RATIO_CLAMP]]


def test_reads_and_writes():
    assert Distill().reads() == [OLD_LOGPROBS, TEACHER_LOGPROBS]
    assert Distill(GRPO()).reads() == ["prompt_index", OLD_LOGPROBS, TEACHER_LOGPROBS]
    assert Distill().writes() == [ADVANTAGES] and not Distill().uses_critic


def test_bad_settings_name_the_key():
    with pytest.raises(SettingError, match=r"model.estimator.init_args.coef=0"):
        Distill(coef=0.0)
    with pytest.raises(SettingError, match=r"model.estimator.init_args.task=GAE.*critic-free"):
        Distill(GAE())
