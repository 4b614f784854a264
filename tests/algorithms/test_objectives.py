"""GSPO, CISPO and the KL loss against float64 references written from their papers' formulas."""

from __future__ import annotations

import math

import pytest
import torch

from lppo.algorithms import CISPO, GSPO, ClippedPPO, kl_loss, token_weights
from lppo.replay.rollout_rows import RowRules, overlong_penalty
from lppo.types import Normalizers
from lppo.validation import SettingError


def batch(seed: int, rows: int = 5, length: int = 7, spread: float = 0.05):
    """Leaf log-probabilities near π_old, a ragged mask, one advantage per row."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, length, generator=g, dtype=torch.float64) * 3 - 0.1
    lp = (old + spread * torch.randn(rows, length, generator=g, dtype=torch.float64)).clone()
    lengths = torch.randint(1, length + 1, (rows,), generator=g)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    adv = torch.randn(rows, 1, generator=g, dtype=torch.float64).expand(rows, length).clone()
    return lp.requires_grad_(True), old, adv, mask


def seq_mean_token_mean(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    normalizers = Normalizers(int(mask.sum()), int(mask.any(-1).sum()))
    return (loss * token_weights(mask, normalizers, "seq_mean_token_mean")).sum()


@pytest.mark.parametrize("seed", range(6))
def test_gspo_is_the_papers_sequence_objective(seed):
    """With one advantage per sequence: −(1/G) Σ_i min(s_i·A_i, clip(s_i)·A_i), where
    s_i = (π_θ(y_i) / π_old(y_i))^(1/|y_i|) from the sequences' probabilities."""
    lp, old, adv, mask = batch(seed)
    eps_low, eps_high = 0.01, 0.015
    got = seq_mean_token_mean(GSPO(eps_low, eps_high)(lp, old, adv, mask).loss, mask)
    (got_grad,) = torch.autograd.grad(got, lp)

    ref_lp = lp.detach().clone().requires_grad_(True)
    terms = []
    for i in range(lp.shape[0]):
        m = mask[i]
        ratio_of_sequences = torch.exp(ref_lp[i][m].sum()) / torch.exp(old[i][m].sum())
        s = ratio_of_sequences ** (1.0 / int(m.sum()))
        a = adv[i, 0]
        terms.append(-torch.minimum(s * a, torch.clamp(s, 1 - eps_low, 1 + eps_high) * a))
    want = torch.stack(terms).mean()
    (want_grad,) = torch.autograd.grad(want, ref_lp)
    assert got.item() == pytest.approx(want.item(), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-10, atol=1e-14)


def test_gspo_token_advantages_get_the_sequence_ratio_gradient():
    """GSPO-token: ∂ℓ_t/∂log π_t = −A_t·s_i where the clip is inactive, 0 where it is."""
    lp, old, _, mask = batch(3, spread=0.02)
    adv = torch.randn(lp.shape, generator=torch.Generator().manual_seed(9), dtype=lp.dtype)
    terms = GSPO(0.005, 0.005)(lp, old, adv, mask)
    (grad,) = torch.autograd.grad((terms.loss * mask).sum(), lp)
    for i in range(lp.shape[0]):
        m = mask[i]
        s = math.exp(float((lp.detach()[i][m] - old[i][m]).mean()))
        for t in range(lp.shape[1]):
            if not m[t]:
                assert grad[i, t] == 0
                continue
            a = float(adv[i, t])
            clipped = (a > 0 and s > 1.005) or (a < 0 and s < 0.995)
            assert bool(terms.clipped[i, t]) == clipped
            want = 0.0 if clipped else -a * s
            assert float(grad[i, t]) == pytest.approx(want, rel=1e-12, abs=1e-15)
            assert float(terms.ratio[i, t]) == pytest.approx(s, rel=1e-12)
    assert terms.sequence_level


@pytest.mark.parametrize("bounds", [(1.0, 0.28), (0.2, 0.2), (0.5, 4.0)])
def test_cispo_is_reinforce_with_a_clipped_detached_weight(bounds):
    """ℓ_t = −sg(clip(r_t, 1 − ε_l, 1 + ε_h))·A_t·log π_t: value and gradient per token."""
    lp, old, adv, mask = batch(4, spread=0.5)
    eps_low, eps_high = bounds
    terms = CISPO(eps_low, eps_high)(lp, old, adv, mask)
    (grad,) = torch.autograd.grad(terms.loss.sum(), lp)
    for i, t in zip(*torch.nonzero(mask, as_tuple=True), strict=True):
        r = math.exp(float(lp.detach()[i, t] - old[i, t]))
        w = min(max(r, 1 - eps_low), 1 + eps_high)
        a, logp = float(adv[i, t]), float(lp.detach()[i, t])
        assert float(terms.loss[i, t]) == pytest.approx(-w * a * logp, rel=1e-12)
        assert float(grad[i, t]) == pytest.approx(-w * a, rel=1e-12)
        assert bool(terms.clipped[i, t]) == (r < 1 - eps_low or r > 1 + eps_high)
    clipped = int((terms.clipped & mask).sum())
    assert clipped < int(mask.sum()) and (clipped > 0 or bounds == (0.5, 4.0))


def textbook(lp: torch.Tensor, ref: torch.Tensor, kind: str) -> torch.Tensor:
    p, q = lp.exp(), ref.exp()
    return {
        "k1": torch.log(p / q),
        "k2": 0.5 * torch.log(p / q) ** 2,
        "k3": q / p - torch.log(q / p) - 1,
    }[kind]


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_loss_values_and_gradients_are_the_textbook_estimators(kind):
    g = torch.Generator().manual_seed(1)
    lp = (-torch.rand(40, generator=g, dtype=torch.float64) * 4).requires_grad_(True)
    ref = lp.detach() + 0.7 * torch.randn(40, generator=g, dtype=torch.float64)
    got = kl_loss(lp, ref, kind)
    (got_grad,) = torch.autograd.grad(got.sum(), lp)
    leaf = lp.detach().clone().requires_grad_(True)
    want = textbook(leaf, ref, kind)
    (want_grad,) = torch.autograd.grad(want.sum(), leaf)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-10, atol=1e-12)
    d = (lp - ref).detach()
    analytic = {"k1": torch.ones_like(d), "k2": d, "k3": 1 - torch.exp(-d)}[kind]
    torch.testing.assert_close(got_grad, analytic, rtol=1e-10, atol=1e-12)


def test_kl_loss_stays_finite_far_from_the_reference():
    lp = torch.tensor([-0.01, -200.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-300.0, -0.01], dtype=torch.float64)
    for kind in ("k1", "k2", "k3"):
        value = kl_loss(lp, ref, kind)
        (grad,) = torch.autograd.grad(value.sum(), lp)
        assert torch.isfinite(value).all() and torch.isfinite(grad).all(), kind


@pytest.mark.parametrize(
    ("length", "want"),
    [(0, 0.0), (12, 0.0), (13, -0.25), (14, -0.5), (16, -1.0)],
)
def test_overlong_penalty_is_dapos_linear_ramp(length, want):
    rules = RowRules(overlong_buffer=4, overlong_penalty=1.0, max_new_tokens=16)
    assert overlong_penalty(length, rules) == pytest.approx(want)
    assert overlong_penalty(length, RowRules(max_new_tokens=16)) == 0.0


@pytest.mark.parametrize(
    ("cls", "kwargs", "key"),
    [
        (ClippedPPO, {"clip_low": 1.0}, "clip_low"),
        (ClippedPPO, {"dual_clip": 1.0}, "dual_clip"),
        (GSPO, {"clip_high": -1e-4}, "clip_high"),
        (CISPO, {"clip_low": 1.5}, "clip_low"),
        (CISPO, {"clip_high": 0.0}, "clip_high"),
    ],
)
def test_bad_objective_settings_name_the_key(cls, kwargs, key):
    prefix = r"model\.actor\.init_args\.objective\.init_args\."
    with pytest.raises(SettingError, match=rf"{prefix}{key}="):
        cls(**kwargs)


def test_gspo_cap_bounds_the_value_and_stops_the_gradient():
    """Beyond ±20 the sequence log-ratio is the cap's, and no gradient flows (as verl's clamp);
    inside, the token form's gradient ``s_i·∇log π_θ`` is untouched."""
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv = torch.full((1, 2), -1.0, dtype=torch.float64)
    for log_s, flows in ((25.0, False), (-25.0, False), (12.0, True)):
        lp = torch.full((1, 2), log_s - 1.0, dtype=torch.float64, requires_grad=True)
        old = torch.full((1, 2), -1.0, dtype=torch.float64)
        terms = GSPO()(lp, old, adv, mask)
        (grad,) = torch.autograd.grad(terms.loss.sum(), lp)
        want = math.exp(max(-20.0, min(20.0, log_s)))
        torch.testing.assert_close(terms.ratio.detach(), torch.full((1, 2), want).double())
        assert bool((grad != 0).any()) is flows, log_s


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_has_one_clamp_policy_in_the_reward_and_the_loss(kind):
    """``d`` is clamped to ±20 in both places: the value at ±25 is the value at ±20 (finite in
    float32, k3 ≤ e^20 − 21) and the loss's gradient there is 0."""
    from lppo.algorithms import kl_penalty

    ref = torch.zeros(4)
    far = torch.tensor([25.0, -25.0, 1e4, -1e4])
    edge = torch.tensor([20.0, -20.0, 20.0, -20.0])
    assert torch.equal(kl_penalty(far, ref, kind), kl_penalty(edge, ref, kind))
    assert torch.isfinite(kl_penalty(far, ref, kind)).all()
    assert float(kl_penalty(far, ref, kind).max()) <= math.exp(20) - 21 + 1e3
    lp = far.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(kl_loss(lp, ref, kind).sum(), lp)
    assert torch.equal(grad, torch.zeros(4))
    assert torch.equal(kl_loss(far, ref, kind), kl_penalty(far, ref, kind))
