"""GAE, token rewards and KL estimators against independent plain-Python references."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lppo.algorithms import (
    advantages_and_returns,
    gae,
    kl_penalty,
    last_valid_index,
    token_rewards,
)

# ----------------------------------------------------------------------------- references


def ref_gae(
    rewards: list[list[float]],
    values: list[list[float]],
    mask: list[list[bool]],
    gamma: float,
    lam: float,
) -> list[list[float]]:
    """Textbook GAE over each row's valid positions, by explicit double loop."""
    out = []
    for r, v, m in zip(rewards, values, mask, strict=True):
        row = [0.0] * len(m)
        pos = [t for t, ok in enumerate(m) if ok]
        deltas = []
        for j, k in enumerate(pos):
            next_v = v[pos[j + 1]] if j + 1 < len(pos) else 0.0
            deltas.append(r[k] + gamma * next_v - v[k])
        for j, k in enumerate(pos):
            total = 0.0
            for offset in range(len(pos) - j):
                total += (gamma * lam) ** offset * deltas[j + offset]
            row[k] = total
        out.append(row)
    return out


def ref_last_valid(mask: list[list[bool]]) -> list[int]:
    out = []
    for m in mask:
        idx = -1
        for t, ok in enumerate(m):
            if ok:
                idx = t
        out.append(idx)
    return out


def ref_token_rewards(
    score: list[float], mask: list[list[bool]], kl: list[list[float]] | None, beta: float
) -> list[list[float]]:
    out = []
    last = ref_last_valid(mask)
    for b, m in enumerate(mask):
        row = [0.0] * len(m)
        for t, ok in enumerate(m):
            if ok and kl is not None:
                row[t] -= beta * kl[b][t]
        if last[b] >= 0:
            row[last[b]] += score[b]
        out.append(row)
    return out


def assert_close(actual: torch.Tensor, expected: list[list[float]], tol: float = 1e-10) -> None:
    exp = torch.tensor(expected, dtype=torch.float64).reshape(actual.shape)
    torch.testing.assert_close(actual.to(torch.float64), exp, rtol=tol, atol=tol)


# ----------------------------------------------------------------------------- strategies


@st.composite
def batches(draw: st.DrawFn) -> dict:
    """Random ``[B, T]`` rewards / values / mask (holes, empty rows) plus γ and λ."""
    batch = draw(st.integers(1, 6))
    length = draw(st.integers(1, 14))
    seed = draw(st.integers(0, 2**31 - 1))
    density = draw(st.sampled_from([0.0, 0.3, 0.7, 1.0]))
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(batch, length, generator=g) < density
    empty_rows = draw(st.lists(st.integers(0, batch - 1), max_size=batch))
    for b in empty_rows:
        mask[b] = False
    rewards = torch.randn(batch, length, generator=g, dtype=torch.float64)
    values = torch.randn(batch, length, generator=g, dtype=torch.float64)
    unit = st.floats(0.0, 1.0, allow_nan=False)
    return {
        "rewards": rewards,
        "values": values,
        "mask": mask,
        "gamma": draw(st.one_of(st.sampled_from([0.0, 1.0]), unit)),
        "lam": draw(st.one_of(st.sampled_from([0.0, 1.0]), unit)),
        "lam_ret": draw(st.one_of(st.sampled_from([0.0, 1.0]), unit)),
    }


# ----------------------------------------------------------------------------- GAE


@given(batches())
def test_gae_matches_reference(b: dict) -> None:
    out = gae(b["rewards"], b["values"], b["mask"], b["gamma"], b["lam"])
    assert out.dtype == torch.float64
    assert out.shape == b["mask"].shape
    expected = ref_gae(
        b["rewards"].tolist(), b["values"].tolist(), b["mask"].tolist(), b["gamma"], b["lam"]
    )
    assert_close(out, expected)
    assert (out[~b["mask"]] == 0).all()


@given(batches())
def test_advantages_and_returns_match_reference(b: dict) -> None:
    r, v, m = b["rewards"], b["values"], b["mask"]
    adv, ret = advantages_and_returns(r, v, m, b["gamma"], b["lam"], lam_returns=b["lam_ret"])
    rl, vl, ml = r.tolist(), v.tolist(), m.tolist()
    assert_close(adv, ref_gae(rl, vl, ml, b["gamma"], b["lam"]))
    ret_adv = ref_gae(rl, vl, ml, b["gamma"], b["lam_ret"])
    expected_ret = [
        [a + vv if ok else 0.0 for a, vv, ok in zip(ar, vr, mr, strict=True)]
        for ar, vr, mr in zip(ret_adv, vl, ml, strict=True)
    ]
    assert_close(ret, expected_ret)
    assert (adv[~m] == 0).all() and (ret[~m] == 0).all()


@given(batches())
def test_lam_returns_defaults_to_lam(b: dict) -> None:
    r, v, m = b["rewards"], b["values"], b["mask"]
    adv, ret = advantages_and_returns(r, v, m, b["gamma"], b["lam"])
    adv2, ret2 = advantages_and_returns(r, v, m, b["gamma"], b["lam"], lam_returns=b["lam"])
    torch.testing.assert_close(adv, adv2, rtol=0, atol=0)
    torch.testing.assert_close(ret, ret2, rtol=0, atol=0)
    torch.testing.assert_close(ret, torch.where(m, adv + v, torch.zeros_like(adv)))


@given(batches(), st.integers(0, 2**31 - 1))
def test_gae_ignores_masked_positions(b: dict, seed: int) -> None:
    """Arbitrary rewards / values off the mask (holes, prompt, padding) change nothing."""
    r, v, m = b["rewards"], b["values"], b["mask"]
    g = torch.Generator().manual_seed(seed)
    noise_r = torch.randn(r.shape, generator=g, dtype=r.dtype) * 100
    noise_v = torch.randn(v.shape, generator=g, dtype=v.dtype) * 100
    r2 = torch.where(m, r, noise_r)
    v2 = torch.where(m, v, noise_v)
    a1, ret1 = advantages_and_returns(r, v, m, b["gamma"], b["lam"], b["lam_ret"])
    a2, ret2 = advantages_and_returns(r2, v2, m, b["gamma"], b["lam"], b["lam_ret"])
    torch.testing.assert_close(a1, a2, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret1, ret2, rtol=1e-12, atol=1e-12)


def test_gae_hand_computed() -> None:
    # Valid positions 1, 2, 4 (3 is a hole); γ = 0.5, λ = 0.5 so γλ = 0.25.
    rewards = torch.tensor([[9.0, 1.0, 0.0, 7.0, 2.0]], dtype=torch.float64)
    values = torch.tensor([[5.0, 0.5, 1.0, 3.0, 2.0]], dtype=torch.float64)
    mask = torch.tensor([[False, True, True, False, True]])
    d4 = 2.0 + 0.5 * 0.0 - 2.0  # 0
    d2 = 0.0 + 0.5 * 2.0 - 1.0  # 0
    d1 = 1.0 + 0.5 * 1.0 - 0.5  # 1
    a4 = d4
    a2 = d2 + 0.25 * a4
    a1 = d1 + 0.25 * a2
    out = gae(rewards, values, mask, gamma=0.5, lam=0.5)
    assert out.tolist() == [[0.0, a1, a2, 0.0, a4]]


def test_gae_monte_carlo_case() -> None:
    """γ = λ = 1: advantage = sum of future valid rewards − V_t (Monte-Carlo return − V)."""
    rewards = torch.tensor([[0.0, 1.0, 2.0, 3.0]], dtype=torch.float64)
    values = torch.tensor([[0.0, 0.25, 0.5, 0.75]], dtype=torch.float64)
    mask = torch.tensor([[False, True, True, True]])
    adv, ret = advantages_and_returns(rewards, values, mask, gamma=1.0, lam=1.0)
    assert adv.tolist() == [[0.0, 6.0 - 0.25, 5.0 - 0.5, 3.0 - 0.75]]
    assert ret.tolist() == [[0.0, 6.0, 5.0, 3.0]]
    # λ_returns = 0: one-step TD targets r_t + γ V_{t'}.
    _, ret0 = advantages_and_returns(rewards, values, mask, 1.0, 1.0, lam_returns=0.0)
    assert ret0.tolist() == [[0.0, 1.0 + 0.5, 2.0 + 0.75, 3.0]]


def test_gae_dtype_promotion() -> None:
    rewards = torch.randn(2, 5, dtype=torch.float32)
    values = torch.randn(2, 5, dtype=torch.float64)
    mask = torch.ones(2, 5, dtype=torch.bool)
    assert gae(rewards, values, mask, 1.0, 0.95).dtype == torch.float64
    adv, ret = advantages_and_returns(rewards.float(), values.float(), mask, 1.0, 0.9, 0.5)
    assert adv.dtype == ret.dtype == torch.float32


# ----------------------------------------------------------------------------- rewards


@given(batches())
def test_last_valid_index_matches_reference(b: dict) -> None:
    out = last_valid_index(b["mask"])
    assert out.dtype == torch.int64
    assert out.tolist() == ref_last_valid(b["mask"].tolist())


def test_last_valid_index_empty_rows() -> None:
    mask = torch.tensor([[False, False, False], [True, False, True], [True, False, False]])
    assert last_valid_index(mask).tolist() == [-1, 2, 0]


@given(batches(), st.floats(-2.0, 2.0, allow_nan=False), st.booleans())
def test_token_rewards_match_reference(b: dict, beta: float, with_kl: bool) -> None:
    mask = b["mask"]
    g = torch.Generator().manual_seed(0)
    score = torch.randn(mask.shape[0], generator=g, dtype=torch.float64)
    kl = b["values"] if with_kl else None
    out = token_rewards(score, mask, kl, beta)
    assert out.dtype == torch.float64
    expected = ref_token_rewards(
        score.tolist(), mask.tolist(), kl.tolist() if kl is not None else None, beta
    )
    assert_close(out, expected, tol=1e-12)
    assert (out[~mask] == 0).all()


def test_token_rewards_hand_computed() -> None:
    mask = torch.tensor([[False, True, True, False], [False, False, False, False]])
    kl = torch.tensor([[10.0, 1.0, 2.0, 30.0], [5.0, 5.0, 5.0, 5.0]])
    score = torch.tensor([3.0, 4.0])
    out = token_rewards(score, mask, kl, kl_coef=0.5)
    # Score on the last valid token, −β·kl on valid tokens only, empty row gets nothing.
    assert out.tolist() == [[0.0, -0.5, 3.0 - 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    # kl_coef = 0 or kl = None: score only.
    plain = [[0.0, 0.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    assert token_rewards(score, mask, kl, kl_coef=0.0).tolist() == plain
    assert token_rewards(score, mask).tolist() == plain


def test_token_rewards_integer_score_gives_float32() -> None:
    mask = torch.tensor([[False, True, True]])
    out = token_rewards(torch.tensor([2]), mask)
    assert out.dtype == torch.float32
    assert out.tolist() == [[0.0, 0.0, 2.0]]


# ----------------------------------------------------------------------------- KL


@given(st.integers(0, 2**31 - 1))
def test_kl_estimators_match_formulas(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    lp = torch.randn(3, 7, generator=g, dtype=torch.float64) * 2
    ref = torch.randn(3, 7, generator=g, dtype=torch.float64) * 2
    k1, k2, k3 = (kl_penalty(lp, ref, k) for k in ("k1", "k2", "k3"))
    for b in range(3):
        for t in range(7):
            d = float(lp[b, t]) - float(ref[b, t])
            assert math.isclose(float(k1[b, t]), d, rel_tol=1e-12, abs_tol=1e-12)
            assert math.isclose(float(k2[b, t]), 0.5 * d * d, rel_tol=1e-12, abs_tol=1e-12)
            assert math.isclose(
                float(k3[b, t]), math.exp(-d) - 1.0 + d, rel_tol=1e-9, abs_tol=1e-12
            )
    assert (k2 >= 0).all()
    assert (k3 >= 0).all()


def test_kl_estimators_zero_when_equal() -> None:
    lp = torch.randn(2, 4, dtype=torch.float64)
    for kind in ("k1", "k2", "k3"):
        assert (kl_penalty(lp, lp.clone(), kind) == 0).all()


def test_kl_k3_nonnegative_for_tiny_and_huge_differences() -> None:
    d = torch.tensor([-30.0, -1e-8, 0.0, 1e-8, 30.0], dtype=torch.float64)
    k3 = kl_penalty(d, torch.zeros_like(d), "k3")
    assert (k3 >= 0).all() and torch.isfinite(k3).all()


def test_kl_bad_kind_raises() -> None:
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="k4"):
        kl_penalty(x, x, "k4")  # type: ignore[arg-type]
