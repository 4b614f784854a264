"""Policy / value loss terms, entropy and exact global loss weights."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lppo.algorithms import entropy_from_logprobs, policy_loss, token_weights, value_loss
from lppo.algorithms.losses import LOG_RATIO_CLAMP
from lppo.types import Normalizers


def _policy(ratio: float, adv: float, **kw: float | None):
    logp = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 1, dtype=torch.float64)
    terms = policy_loss(logp, old, torch.tensor([[adv]], dtype=torch.float64), **kw)
    terms.loss.sum().backward()
    return terms, float(logp.grad)


# (ratio, advantage, clip_low, clip_high, dual_clip, expected loss, expected clipped)
POLICY_CASES = [
    # Inside the clip range: plain −A·r, never clipped.
    (1.1, 1.0, 0.2, 0.2, None, -1.1, False),
    (0.9, -1.0, 0.2, 0.2, None, 0.9, False),
    # A > 0, ratio above 1 + ε_high: clipped at −A·(1 + ε_high).
    (1.5, 1.0, 0.2, 0.2, None, -1.2, True),
    # A > 0, ratio below 1 − ε_low: the pessimistic max keeps −A·r (not clipped).
    (0.5, 1.0, 0.2, 0.2, None, -0.5, False),
    # A < 0, ratio below 1 − ε_low: clipped at −A·(1 − ε_low).
    (0.5, -1.0, 0.2, 0.2, None, 0.8, True),
    # A < 0, ratio above 1 + ε_high: the max keeps −A·r (not clipped).
    (1.5, -1.0, 0.2, 0.2, None, 1.5, False),
    # Asymmetric range [0.9, 1.3]: 1.25 is inside for A > 0 ...
    (1.25, 2.0, 0.1, 0.3, None, -2.5, False),
    # ... 1.35 is above it ...
    (1.35, 2.0, 0.1, 0.3, None, -2.6, True),
    # ... and 0.85 is below it for A < 0.
    (0.85, -2.0, 0.1, 0.3, None, 1.8, True),
    # Same ratios, symmetric 0.2: 1.25 clipped, 0.85 inside.
    (1.25, 2.0, 0.2, 0.2, None, -2.4, True),
    (0.85, -2.0, 0.2, 0.2, None, 1.7, False),
    # Dual clip c = 3, A < 0, huge ratio: loss −A·r = 5 capped at −c·A = 3, marked clipped.
    (5.0, -1.0, 0.2, 0.2, 3.0, 3.0, True),
    (5.0, -2.0, 0.2, 0.2, 3.0, 6.0, True),
    # Dual clip, A < 0, ratio below the cap: unchanged.
    (2.0, -1.0, 0.2, 0.2, 3.0, 2.0, False),
    # Dual clip never touches A > 0.
    (5.0, 1.0, 0.2, 0.2, 3.0, -1.2, True),
    (0.1, 1.0, 0.2, 0.2, 3.0, -0.1, False),
    # Dual clip with A < 0 and ratio clipped low: still the standard clipped value.
    (0.5, -1.0, 0.2, 0.2, 3.0, 0.8, True),
]


@pytest.mark.parametrize(("ratio", "adv", "lo", "hi", "dual", "loss", "clipped"), POLICY_CASES)
def test_policy_loss_hand_cases(
    ratio: float,
    adv: float,
    lo: float,
    hi: float,
    dual: float | None,
    loss: float,
    clipped: bool,
) -> None:
    terms, grad = _policy(ratio, adv, clip_low=lo, clip_high=hi, dual_clip=dual)
    assert float(terms.loss.detach()) == pytest.approx(loss, abs=1e-12)
    assert bool(terms.clipped) is clipped
    assert float(terms.ratio.detach()) == pytest.approx(ratio, rel=1e-12)
    # Clipped branches (standard or dual) carry no gradient; the unclipped one is −A·r.
    expected_grad = 0.0 if clipped else -adv * ratio
    assert grad == pytest.approx(expected_grad, abs=1e-12)


def test_policy_loss_rejects_bad_dual_clip() -> None:
    x = torch.zeros(1, 2)
    for c in (1.0, 0.5):
        with pytest.raises(ValueError, match="dual_clip"):
            policy_loss(x, x, x, dual_clip=c)


@given(st.integers(0, 2**31 - 1), st.sampled_from([None, 2.0, 4.0]))
def test_policy_loss_random(seed: int, dual: float | None) -> None:
    g = torch.Generator().manual_seed(seed)
    logp = torch.randn(4, 9, generator=g, dtype=torch.float64)
    old = torch.randn(4, 9, generator=g, dtype=torch.float64)
    adv = torch.randn(4, 9, generator=g, dtype=torch.float64)
    terms = policy_loss(logp, old, adv, clip_low=0.1, clip_high=0.3, dual_clip=dual)
    r = torch.exp(logp - old)
    torch.testing.assert_close(terms.ratio, r)
    ref = torch.maximum(-adv * r, -adv * r.clamp(0.9, 1.3))
    if dual is not None:
        ref = torch.where(adv < 0, torch.minimum(ref, -dual * adv), ref)
        assert (terms.loss[adv < 0] <= -dual * adv[adv < 0] + 1e-12).all()
    torch.testing.assert_close(terms.loss, ref)
    # The pessimistic bound is never below the unclipped surrogate (except under dual clip).
    if dual is None:
        assert (terms.loss >= -adv * r - 1e-12).all()
    torch.testing.assert_close(terms.approx_kl, (r - 1) - torch.log(r))
    assert (terms.approx_kl >= 0).all()


def test_approx_kl_zero_at_ratio_one_and_detached() -> None:
    logp = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    terms = policy_loss(logp, logp.detach().clone(), torch.randn(2, 5, dtype=torch.float64))
    assert (terms.approx_kl == 0).all()
    assert (terms.ratio == 1).all()
    assert not terms.clipped.any()
    assert not terms.approx_kl.requires_grad


# ----------------------------------------------------------------------------- value loss


# (value, old value, return, expected loss, expected clipped) with clip 0.2
VALUE_CASES = [
    (1.0, 0.0, 1.0, 0.5 * 0.8**2, True),  # moved too far towards the target: clip bites
    (0.1, 0.0, 1.0, 0.5 * 0.9**2, False),  # inside the clip range: V_clip == V
    (1.0, 0.0, 2.0, 0.5 * 1.8**2, True),
    (1.0, 0.0, -1.0, 0.5 * 2.0**2, False),  # moved away from the target: unclipped is worse
    (-1.0, 0.0, -0.1, 0.5 * 0.9**2, False),
]


@pytest.mark.parametrize(("v", "old", "ret", "loss", "clipped"), VALUE_CASES)
def test_value_loss_hand_cases(v: float, old: float, ret: float, loss: float, clipped: bool):
    t = value_loss(
        torch.tensor([[v]], dtype=torch.float64),
        torch.tensor([[old]], dtype=torch.float64),
        torch.tensor([[ret]], dtype=torch.float64),
        clip=0.2,
    )
    assert float(t.loss) == pytest.approx(loss, abs=1e-12)
    assert bool(t.clipped) is clipped


@given(st.integers(0, 2**31 - 1))
def test_value_loss_random(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    v, old, ret = (torch.randn(3, 6, generator=g, dtype=torch.float64) for _ in range(3))
    plain = value_loss(v, old, ret, clip=None)
    torch.testing.assert_close(plain.loss, 0.5 * (v - ret) ** 2)
    assert plain.clipped.dtype == torch.bool and not plain.clipped.any()
    clipped = value_loss(v, old, ret, clip=0.3)
    v_clip = old + (v - old).clamp(-0.3, 0.3)
    torch.testing.assert_close(
        clipped.loss, 0.5 * torch.maximum((v - ret) ** 2, (v_clip - ret) ** 2)
    )
    assert (clipped.loss >= plain.loss - 1e-12).all()
    active = (v - old).abs() > 0.3
    torch.testing.assert_close(clipped.clipped, active & ((v_clip - ret) ** 2 > (v - ret) ** 2))
    # A huge clip range is the unclipped loss.
    torch.testing.assert_close(value_loss(v, old, ret, clip=1e9).loss, plain.loss)


def test_value_clip_flag_ignores_rounding_inside_the_range() -> None:
    """Inside the clip range V_clip = old + (V - old) may differ from V by one ulp; that must
    neither count as clipped nor change the loss (it did: ~2% spurious clip fraction)."""
    g = torch.Generator().manual_seed(0)
    old = torch.randn(4096, generator=g) * 0.01  # |V| >> |V_old|: V - V_old is not exact
    v = torch.randn(4096, generator=g) * 0.05
    ret = torch.randn(4096, generator=g)
    inside = (v - old).abs() <= 0.2
    v, old, ret = v[inside], old[inside], ret[inside]
    assert (old + (v - old) != v).any()  # the rounding this test is about does occur
    terms = value_loss(v, old, ret, clip=0.2)
    assert not terms.clipped.any()
    torch.testing.assert_close(terms.loss, 0.5 * (v - ret) ** 2, rtol=0, atol=0)


# ----------------------------------------------------------------------------- entropy


def entropy_of(logits):
    return entropy_from_logprobs(torch.log_softmax(logits, dim=-1))


def test_entropy_of_logits_matches_manual() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 5, generator=g, dtype=torch.float64) * 3
    out = entropy_of(logits)
    assert out.shape == (2, 3)
    for b in range(2):
        for t in range(3):
            row = logits[b, t].tolist()
            top = max(row)
            z = sum(math.exp(x - top) for x in row)
            ps = [math.exp(x - top) / z for x in row]
            ref = -sum(p * math.log(p) for p in ps)
            assert float(out[b, t]) == pytest.approx(ref, rel=1e-12, abs=1e-12)


def test_entropy_extremes() -> None:
    uniform = torch.zeros(1, 1, 7, dtype=torch.float64)
    assert float(entropy_of(uniform)) == pytest.approx(math.log(7), rel=1e-12)
    peaked = torch.tensor([[[1000.0, 0.0, 0.0]]], dtype=torch.float64)
    assert float(entropy_of(peaked)) == pytest.approx(0.0, abs=1e-12)
    # Shift invariance.
    logits = torch.randn(2, 4, 6, dtype=torch.float64)
    torch.testing.assert_close(entropy_of(logits), entropy_of(logits + 50))


def test_entropy_with_masked_vocabulary_is_finite() -> None:
    """Logits masked to −inf (0 · log 0 = 0) give the entropy of the remaining entries."""
    logits = torch.tensor([[[0.0, 0.0, -math.inf, -math.inf]]], requires_grad=True)
    out = entropy_of(logits)
    assert float(out.detach()) == pytest.approx(math.log(2), rel=1e-6)
    out.sum().backward()
    assert torch.isfinite(logits.grad).all()


# ----------------------------------------------------------------------------- token weights


@st.composite
def split_masks(draw: st.DrawFn) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Rows with random masks (some empty), split into random chunks padded to their width."""
    n_rows = draw(st.integers(1, 12))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n_rows):
        length = int(torch.randint(1, 10, (1,), generator=g))
        rows.append(torch.rand(length, generator=g) < 0.6)
    rows[0][-1] = True  # at least one valid token in the step
    order = draw(st.permutations(range(n_rows)))
    cuts = sorted(draw(st.lists(st.integers(0, n_rows), max_size=5)))
    bounds = [0, *cuts, n_rows]
    chunks = []
    for a, b in itertools.pairwise(bounds):
        members = [rows[i] for i in order[a:b]]
        width = max((len(m) for m in members), default=0)
        mask = torch.zeros(len(members), width, dtype=torch.bool)  # may be a padding chunk
        for j, m in enumerate(members):
            mask[j, : len(m)] = m
        chunks.append(mask)
    return rows, chunks


@given(split_masks(), st.integers(0, 2**31 - 1))
def test_token_weights_sum_to_one_and_reproduce_the_merged_loss(
    data: tuple[list[torch.Tensor], list[torch.Tensor]], seed: int
) -> None:
    rows, chunks = data
    norm = Normalizers(
        valid_tokens=sum(int(m.sum()) for m in rows),
        valid_rows=sum(int(m.any()) for m in rows),
    )
    g = torch.Generator().manual_seed(seed)
    losses = [torch.randn(c.shape, generator=g, dtype=torch.float64) for c in chunks]
    # Merged references computed row by row.
    token_total, token_n, row_means = 0.0, 0, []
    for c, ell in zip(chunks, losses, strict=True):
        for b in range(c.shape[0]):
            vals = ell[b][c[b]].tolist()
            token_total += sum(vals)
            token_n += len(vals)
            if vals:
                row_means.append(sum(vals) / len(vals))
    refs = {
        "token_mean": token_total / token_n,
        "seq_mean_token_mean": sum(row_means) / len(row_means),
    }
    for mode, ref in refs.items():
        weights = [token_weights(c, norm, mode) for c in chunks]
        for c, w in zip(chunks, weights, strict=True):
            assert w.dtype == torch.float64 and w.shape == c.shape
            assert (w[~c] == 0).all()
        total_w = sum(float(w.sum()) for w in weights)
        assert total_w == pytest.approx(1.0, abs=1e-12)
        loss = sum(float((w * ell).sum()) for w, ell in zip(weights, losses, strict=True))
        assert loss == pytest.approx(ref, abs=1e-12)


def test_token_weights_hand_values() -> None:
    mask = torch.tensor([[True, True, False], [False, False, True]])
    norm = Normalizers(valid_tokens=6, valid_rows=4)
    tm = token_weights(mask, norm, "token_mean")
    assert tm.tolist() == [[1 / 6, 1 / 6, 0.0], [0.0, 0.0, 1 / 6]]
    sm = token_weights(mask, norm, "seq_mean_token_mean")
    assert sm.tolist() == [[1 / 8, 1 / 8, 0.0], [0.0, 0.0, 1 / 4]]
    # A padding chunk has no weight and no NaN.
    empty = torch.zeros(0, 0, dtype=torch.bool)
    for mode in ("token_mean", "seq_mean_token_mean"):
        assert token_weights(empty, norm, mode).shape == (0, 0)
        w = token_weights(torch.zeros(2, 3, dtype=torch.bool), norm, mode)
        assert (w == 0).all()


def test_token_weights_bad_mode_raises() -> None:
    mask = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="seq_mean"):
        token_weights(mask, Normalizers(2, 1), "sum")  # type: ignore[arg-type]


def test_log_ratio_is_clamped_so_a_zero_advantage_stays_zero() -> None:
    """exp(1000) is inf and −0·inf is NaN: unguarded, one far-moved token poisons the step."""
    logprobs = torch.tensor([[0.0, -1.0, 0.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1000.0, -1.0, 1000.0]], dtype=torch.float64)
    adv = torch.tensor([[0.0, 1.0, 0.0]], dtype=torch.float64)
    terms = policy_loss(logprobs, old, adv)
    assert torch.isfinite(terms.loss).all() and torch.isfinite(terms.ratio).all()
    assert terms.loss[0, 0] == 0 and terms.loss[0, 2] == 0
    terms.loss.sum().backward()
    assert torch.isfinite(logprobs.grad).all()
    assert float(terms.ratio[0, 0]) == pytest.approx(math.exp(LOG_RATIO_CLAMP))
    assert float(terms.ratio[0, 2]) == pytest.approx(math.exp(-LOG_RATIO_CLAMP))
    # Inside the clamp nothing changes: the ratio is exactly exp(logπ − logπ_old).
    assert float(terms.ratio[0, 1]) == 1.0
