"""GRPO, RLOO and REINFORCE++ against independent float64 references, under any chunking."""

from __future__ import annotations

import math

import pytest
import torch
from _builders import filled_store, random_rows
from hypothesis import given
from hypothesis import strategies as st

from lppo.estimators import GRPO, RLOO, EstimatorInputs, ReinforcePP
from lppo.iteration.data_settings import DataSettings
from lppo.iteration.planner import ChunkPlanner
from lppo.parallel import SINGLE
from lppo.types import ADVANTAGES, OLD_LOGPROBS, REF_LOGPROBS, RESPONSE_MASK, REWARD

KL_KINDS = ("k1", "k2", "k3")


def make_store(n_prompts: int, k: int, seed: int, invalid: int = 0):
    """Rows of ``n_prompts`` prompts × ``k`` samples with prompt_index and ref_logprobs."""
    cols = random_rows(n_prompts * k, seed, invalid_rows=invalid)
    g = torch.Generator().manual_seed(seed + 1)
    cols["prompt_index"] = [torch.tensor(i // k) for i in range(n_prompts * k)]
    cols[REF_LOGPROBS] = [
        torch.where(m, lp + 0.3 * torch.randn(len(lp), generator=g, dtype=lp.dtype), 0 * lp)
        for lp, m in zip(cols[OLD_LOGPROBS], cols[RESPONSE_MASK], strict=True)
    ]
    return filled_store(cols), cols


def run(estimator, store, budget: int, kl_coef: float, kl_kind: str) -> dict[int, torch.Tensor]:
    planner = ChunkPlanner(DataSettings(budget, seed=3, drop_budget=len(store)))
    [step] = planner.plan(store.meta()).steps
    estimator.estimate(EstimatorInputs(store, step, SINGLE, kl_coef, kl_kind))
    ids = [i for c in step.chunks for i in c]
    return dict(zip(ids, store.read(ids, [ADVANTAGES])[ADVANTAGES], strict=True))


def ref_kl(old: float, ref: float, kind: str) -> float:
    d = old - ref
    return {"k1": d, "k2": 0.5 * d * d, "k3": math.expm1(-d) + d}[kind]


def ref_scores(cols, kl_coef: float, kind: str) -> dict[int, tuple[int, float]]:
    """s_i = r_i − β Σ_t KL_t with plain Python floats, for valid rows only."""
    out = {}
    for i, mask in enumerate(cols[RESPONSE_MASK]):
        if not mask.any():
            continue
        kl = math.fsum(
            ref_kl(float(o), float(r), kind)
            for o, r, m in zip(cols[OLD_LOGPROBS][i], cols[REF_LOGPROBS][i], mask, strict=True)
            if m
        )
        out[i] = (int(cols["prompt_index"][i]), float(cols[REWARD][i]) - kl_coef * kl)
    return out


def grouped(scores):
    groups: dict[int, list[float]] = {}
    for g, v in scores.values():
        groups.setdefault(g, []).append(v)
    return groups


def ref_grpo(cols, kl_coef, kind, scale=True, eps=1e-6) -> dict[int, float]:
    scores = ref_scores(cols, kl_coef, kind)
    groups = grouped(scores)
    out = {}
    for i, (g, v) in scores.items():
        vals = groups[g]
        mean = math.fsum(vals) / len(vals)
        std = math.sqrt(math.fsum((x - mean) ** 2 for x in vals) / len(vals))
        out[i] = (v - mean) / (std + eps) if scale else v - mean
    return out


def ref_rloo(cols, kl_coef, kind) -> dict[int, float]:
    scores = ref_scores(cols, kl_coef, kind)
    out = {}
    for i, (g, v) in scores.items():
        others = [w for j, (h, w) in scores.items() if h == g and j != i]
        out[i] = v - math.fsum(others) / len(others)
    return out


def assert_row_advantages(got: dict[int, torch.Tensor], want: dict[int, float], cols) -> None:
    assert sorted(got) == sorted(want)
    for i, adv in got.items():
        mask = cols[RESPONSE_MASK][i]
        expected = torch.where(mask, torch.full_like(adv, want[i]), torch.zeros_like(adv))
        torch.testing.assert_close(adv, expected, rtol=1e-10, atol=1e-12)


settings_ = dict(
    n_prompts=st.integers(1, 5),
    k=st.integers(2, 5),
    seed=st.integers(0, 10_000),
    kl_coef=st.sampled_from([0.0, 0.1]),
    kind=st.sampled_from(KL_KINDS),
    budget=st.integers(14, 80),
)


@given(**settings_, scale=st.booleans())
def test_grpo_matches_reference_under_any_chunking(
    n_prompts, k, seed, kl_coef, kind, budget, scale
):
    store, cols = make_store(n_prompts, k, seed)
    got = run(GRPO(scale_by_std=scale), store, budget, kl_coef, kind)
    assert_row_advantages(got, ref_grpo(cols, kl_coef, kind, scale), cols)
    # One chunk per row vs everything in one chunk: the same numbers.
    store2, _ = make_store(n_prompts, k, seed)
    one = run(GRPO(scale_by_std=scale), store2, 10_000, kl_coef, kind)
    for i in got:
        torch.testing.assert_close(got[i], one[i], rtol=1e-12, atol=1e-14)


@given(**settings_)
def test_rloo_matches_reference_under_any_chunking(n_prompts, k, seed, kl_coef, kind, budget):
    store, cols = make_store(n_prompts, k, seed)
    got = run(RLOO(), store, budget, kl_coef, kind)
    assert_row_advantages(got, ref_rloo(cols, kl_coef, kind), cols)


def test_invalid_rows_leave_the_group_baseline():
    store, cols = make_store(2, 4, seed=5, invalid=2)  # prompt 0 keeps 2 valid samples
    got = run(RLOO(), store, 40, 0.0, "k1")
    assert sorted(got) == [2, 3, 4, 5, 6, 7]
    assert_row_advantages(got, ref_rloo(cols, 0.0, "k1"), cols)
    store, _ = make_store(2, 4, seed=5, invalid=3)  # prompt 0 has one valid sample left
    with pytest.raises(ValueError, match="samples_per_prompt"):
        run(RLOO(), store, 40, 0.0, "k1")


def ref_reinforce_pp(cols, kl_coef, kind, gamma) -> dict[int, list[float]]:
    returns = {}
    for i, mask in enumerate(cols[RESPONSE_MASK]):
        if not mask.any():
            continue
        valid = [t for t, m in enumerate(mask.tolist()) if m]
        r = {
            t: -kl_coef
            * ref_kl(float(cols[OLD_LOGPROBS][i][t]), float(cols[REF_LOGPROBS][i][t]), kind)
            for t in valid
        }
        r[valid[-1]] += float(cols[REWARD][i])
        g, out = 0.0, {}
        for t in reversed(valid):
            g = r[t] + gamma * g
            out[t] = g
        returns[i] = out
    flat = [v for row in returns.values() for v in row.values()]
    mean = math.fsum(flat) / len(flat)
    var = math.fsum((x - mean) ** 2 for x in flat) / len(flat)
    scale = 1.0 / math.sqrt(var + 1e-8)
    return {
        i: [
            (row[t] - mean) * scale if t in row else 0.0 for t in range(len(cols[RESPONSE_MASK][i]))
        ]
        for i, row in returns.items()
    }


@given(**settings_, gamma=st.sampled_from([1.0, 0.9]))
def test_reinforce_pp_matches_reference_under_any_chunking(
    n_prompts, k, seed, kl_coef, kind, budget, gamma
):
    store, cols = make_store(n_prompts, k, seed)
    got = run(ReinforcePP(gamma=gamma), store, budget, kl_coef, kind)
    want = ref_reinforce_pp(cols, kl_coef, kind, gamma)
    assert sorted(got) == sorted(want)
    for i, adv in got.items():
        torch.testing.assert_close(
            adv, torch.tensor(want[i], dtype=adv.dtype), rtol=1e-9, atol=1e-10
        )


def test_grpo_gives_zero_to_a_group_that_scored_alike():
    store, _ = make_store(1, 3, seed=1)
    store.write([0, 1, 2], {REWARD: [torch.tensor(0.5, dtype=torch.float64)] * 3})
    got = run(GRPO(), store, 100, 0.0, "k1")
    assert all(float(a.abs().max()) == 0.0 for a in got.values())


@pytest.mark.parametrize(
    ("cls", "kwargs", "key"), [(GRPO, {"eps": 0.0}, "eps"), (ReinforcePP, {"gamma": 2.0}, "gamma")]
)
def test_bad_settings_name_the_key(cls, kwargs, key):
    with pytest.raises(ValueError, match=f"model.estimator.init_args.{key}"):
        cls(**kwargs)


ESTIMATORS = {"grpo": GRPO, "rloo": RLOO, "reinforce_pp": ReinforcePP}


def _rank_worker(rank: int, world: int, init: str, out: str) -> None:
    """One gloo rank: estimate over this rank's share of the chunks; save its advantages."""
    import torch.distributed as dist

    from lppo.parallel import ProcessGroup

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        results = {}
        for name, cls in ESTIMATORS.items():
            store, _ = make_store(4, 3, seed=11)
            planner = ChunkPlanner(DataSettings(14, seed=3), world_size=world, rank=rank)
            [step] = planner.plan(store.meta()).steps
            inputs = EstimatorInputs(store, step, ProcessGroup(world, rank), 0.1, "k3")
            cls().estimate(inputs)
            ids = [i for c in step.chunks for i in c]
            results[name] = dict(zip(ids, store.read(ids, [ADVANTAGES])[ADVANTAGES], strict=True))
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_group_statistics_are_exact_across_ranks(tmp_path):
    """Two gloo ranks, each estimating only its own chunks, equal one process over all rows."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "adv")
    mp.spawn(_rank_worker, args=(2, f"file://{tmp_path / 'init'}", out), nprocs=2, join=True)
    parts = [torch.load(f"{out}.{r}", weights_only=True) for r in range(2)]
    for name, cls in ESTIMATORS.items():
        store, _ = make_store(4, 3, seed=11)
        want = run(cls(), store, 14, 0.1, "k3")
        got = {**parts[0][name], **parts[1][name]}
        assert set(parts[0][name]).isdisjoint(parts[1][name])  # no rank repeats another's rows
        assert sorted(got) == sorted(want)
        for i in want:
            torch.testing.assert_close(got[i], want[i], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("estimator", [GRPO(), RLOO(), ReinforcePP()])
def test_rewards_group_advantages_and_shaping_are_float64(estimator):
    """A reward is float64 from the task to the advantages (one number per row: nothing is
    rounded to float32 on the way, in any run), and so is DAPO's overlong penalty."""
    from lppo.replay.rollout_rows import RowRules, mark_invalid
    from lppo.rollout.base import GenerationOutput, to_rollout

    ids = [torch.tensor([1, 2, 3])] * 2
    mask = [torch.tensor([False, True, True])] * 2
    output = GenerationOutput(
        ids, mask, [torch.zeros(3)] * 2, ["a", "b"], torch.zeros(2, dtype=torch.bool),
        torch.zeros(2, dtype=torch.int64), torch.ones(2, dtype=torch.int64),
    )  # fmt: skip
    rewards = [1 / 3, 1 / 3 + 1e-12]
    rollout = to_rollout(output, rewards)
    assert rollout.reward.dtype == torch.float64 and rollout.reward.tolist() == rewards
    store, _ = make_store(3, 2, seed=5)
    assert {store.read([i], [REWARD])[REWARD][0].dtype for i in range(6)} == {torch.float64}
    advantages = run(estimator, store, 64, 0.0, "k1")
    assert {a.dtype for a in advantages.values()} == {torch.float64}
    third = torch.tensor(1 / 3, dtype=torch.float64)
    columns = {RESPONSE_MASK: [torch.ones(4, dtype=torch.bool)], REWARD: [third]}
    mark_invalid(columns, RowRules(overlong_buffer=2, overlong_penalty=1.0, max_new_tokens=4))
    assert columns[REWARD][0].dtype == torch.float64
    assert float(columns[REWARD][0]) == 1 / 3 - 1.0
