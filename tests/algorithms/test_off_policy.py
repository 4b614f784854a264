"""Importance weights against the engine's log-probs, and the mismatch diagnostics."""

from __future__ import annotations

import math

import pytest
import torch

from lppo.algorithms import OffPolicyCorrection, importance_weights, policy_loss
from lppo.iteration.mismatch import Mismatch


def _t(*values: float) -> torch.Tensor:
    return torch.tensor([list(values)], dtype=torch.float64)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"mode": "clip"}, "off_policy.mode='clip'"),
        ({"cap": 0.5}, "off_policy.cap=0.5"),
        ({"cap": math.inf}, "off_policy.cap=inf"),
        ({"floor": 0.0}, "off_policy.floor=0.0"),
        ({"floor": 1.5}, "off_policy.floor=1.5"),
    ],
)
def test_bad_settings_name_key_value_and_fix(kwargs, key):
    with pytest.raises(ValueError, match=r"model\.actor\.init_args\.") as info:
        OffPolicyCorrection(**kwargs)
    message = str(info.value)
    assert key in message
    assert any(word in message for word in ("use", "must"))


def test_floor_defaults_to_inverse_cap():
    assert OffPolicyCorrection(cap=4.0).lower == 0.25
    assert OffPolicyCorrection(cap=4.0, floor=0.5).lower == 0.5
    assert not OffPolicyCorrection().enabled
    assert OffPolicyCorrection(mode="mask").enabled


def test_truncate_and_mask_hand_cases():
    # w = π_old / μ: 0.25, 0.8, 1, 1.5, 3.
    w = [0.25, 0.8, 1.0, 1.5, 3.0]
    old = _t(*(math.log(x) for x in w)) - 1.0
    behaviour = torch.full_like(old, -1.0)
    cfg = dict(cap=2.0, floor=0.5)
    trunc = importance_weights(old, behaviour, OffPolicyCorrection("truncate", **cfg))
    mask = importance_weights(old, behaviour, OffPolicyCorrection("mask", **cfg))
    none = importance_weights(old, behaviour, OffPolicyCorrection("none", **cfg))
    torch.testing.assert_close(trunc.weight, _t(0.25, 0.8, 1.0, 1.5, 2.0), rtol=1e-12, atol=0)
    torch.testing.assert_close(mask.weight, _t(0.0, 0.8, 1.0, 1.5, 0.0), rtol=1e-12, atol=0)
    assert torch.equal(none.weight, torch.ones_like(old))
    want_outside = torch.tensor([[True, False, False, False, True]])
    for result in (trunc, mask, none):
        assert torch.equal(result.outside, want_outside)


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_behaviour_equal_to_old_gives_weight_exactly_one(mode):
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 7, generator=g, dtype=torch.float64) * 5
    iw = importance_weights(old, old.clone(), OffPolicyCorrection(mode, cap=1.0, floor=1.0))
    assert torch.equal(iw.weight, torch.ones_like(old))
    assert not iw.outside.any()


def test_weight_carries_no_gradient():
    g = torch.Generator().manual_seed(1)
    logp = (-torch.rand(3, 5, generator=g, dtype=torch.float64)).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    old.requires_grad_()
    behaviour = old.detach() + 0.5 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    behaviour.requires_grad_()
    adv = torch.randn(3, 5, generator=g, dtype=torch.float64)
    iw = importance_weights(old, behaviour, OffPolicyCorrection("truncate", cap=1.5))
    assert not iw.weight.requires_grad

    plain = policy_loss(logp, old, adv)
    (grad_plain,) = torch.autograd.grad(plain.loss.sum(), logp, retain_graph=True)
    corrected = (plain.loss * iw.weight).sum()
    grad_logp, grad_beh = torch.autograd.grad(corrected, (logp, behaviour), allow_unused=True)
    # ∂(w·L)/∂logπ = w·∂L/∂logπ: the weight is a constant per token.
    torch.testing.assert_close(grad_logp, iw.weight * grad_plain, rtol=1e-12, atol=0)
    assert grad_beh is None  # nothing flows into the engine's log-probs


def test_mismatch_metrics_hand_case_and_any_split():
    cfg = OffPolicyCorrection(cap=2.0)
    d = [0.0, 0.1, -0.9, 1.0, 0.0]
    behaviour = torch.full((1, 5), -2.0, dtype=torch.float64)
    old = behaviour + _t(*d)
    mask = torch.tensor([[True, True, True, True, False]])
    whole = Mismatch()
    whole.add(old, behaviour, mask, cfg)
    k3 = sum((math.exp(x) - 1) - x for x in d[:4]) / 4
    m = whole.metrics()
    assert m["mismatch_kl"] == pytest.approx(k3, rel=1e-12)
    assert m["mismatch_max_abs_log_ratio"] == pytest.approx(1.0)
    # e^-0.9 = 0.41 < 1/2 and e^1 = 2.72 > 2: two of four tokens outside.
    assert m["mismatch_outside_fraction"] == 0.5

    parts = Mismatch()
    for cols in (slice(0, 2), slice(2, 3), slice(3, 5)):
        parts.add(old[:, cols], behaviour[:, cols], mask[:, cols], cfg)
    for key, value in parts.metrics().items():
        assert value == pytest.approx(m[key], rel=1e-12), key


def test_mismatch_of_identical_logprobs_is_zero():
    lp = -torch.rand(2, 6, dtype=torch.float64)
    mm = Mismatch()
    mm.add(lp, lp.clone(), torch.ones(2, 6, dtype=torch.bool), OffPolicyCorrection())
    assert mm.metrics() == {
        "mismatch_kl": 0.0,
        "mismatch_max_abs_log_ratio": 0.0,
        "mismatch_outside_fraction": 0.0,
    }


def _halves(seed: int = 4):
    g = torch.Generator().manual_seed(seed)
    behaviour = -torch.rand(6, 9, generator=g, dtype=torch.float64) * 3
    old = behaviour + 0.8 * torch.randn(6, 9, generator=g, dtype=torch.float64)
    mask = torch.rand(6, 9, generator=g) > 0.3
    return old, behaviour, mask


def _mismatch_rank(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    from lppo.parallel import ProcessGroup

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        old, behaviour, mask = _halves()
        rows = slice(0, 2) if rank == 0 else slice(2, 6)  # uneven shares
        mm = Mismatch()
        mm.add(old[rows], behaviour[rows], mask[rows], OffPolicyCorrection(cap=1.5))
        mm.all_reduce(ProcessGroup(world, rank))
        torch.save(mm.metrics(), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_mismatch_reduced_over_ranks_equals_one_process(tmp_path):
    import torch.multiprocessing as mp

    out = str(tmp_path / "mm")
    mp.spawn(_mismatch_rank, args=(2, f"file://{tmp_path / 'init'}", out), nprocs=2, join=True)
    whole = Mismatch()
    whole.add(*_halves(), OffPolicyCorrection(cap=1.5))
    want = whole.metrics()
    for rank in range(2):
        got = torch.load(f"{out}.{rank}", weights_only=True)
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-12), (rank, key)


def test_auto_is_off_until_resolved_and_truncates_stale_rows():
    auto = OffPolicyCorrection()
    assert auto.mode == "auto" and not auto.enabled
    assert auto.resolved(stale=False).mode == "none"
    stale = auto.resolved(stale=True)
    assert stale.mode == "truncate" and stale.enabled and stale.cap == auto.cap
    explicit = OffPolicyCorrection("mask", cap=3.0)
    assert explicit.resolved(stale=True) is explicit
