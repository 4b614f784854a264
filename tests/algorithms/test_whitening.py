"""Moments merged over chunks and iteration-wide whitening."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lppo.algorithms import Moments, whiten


@st.composite
def chunked(draw: st.DrawFn) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """An iteration split into chunks of different widths, masks with holes, padding junk."""
    n_chunks = draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    chunks = []
    for c in range(n_chunks):
        rows = draw(st.integers(1, 4))
        width = draw(st.integers(2 if c == 0 else 1, 9))
        # Each chunk has its own location / scale, so per-chunk stats differ from global ones.
        loc, scale = 3.0 * c - 2.0, 0.5 + c
        x = torch.randn(rows, width, generator=g, dtype=torch.float64) * scale + loc
        mask = torch.rand(rows, width, generator=g) < 0.7
        x = torch.where(mask, x, torch.full_like(x, 1e6))  # junk off the mask must not count
        chunks.append((x, mask))
    # Two distinct valid entries in the first chunk, so the variance is positive.
    x0, m0 = chunks[0]
    m0[0, :2] = True
    x0[0, :2] = torch.tensor([-1.0, 1.0], dtype=x0.dtype)
    return chunks


def global_moments(chunks: list[tuple[torch.Tensor, torch.Tensor]]) -> Moments:
    m = Moments()
    for x, mask in chunks:
        m.update(x, mask)
    return m


def concat_valid(chunks: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    return torch.cat([x[mask] for x, mask in chunks])


@given(chunked())
def test_moments_over_chunks_equal_concatenation(chunks: list) -> None:
    m = global_moments(chunks)
    flat = concat_valid(chunks)
    assert m.count == flat.numel()
    ref_mean = math.fsum(flat.tolist()) / flat.numel()
    ref_var = math.fsum((v - ref_mean) ** 2 for v in flat.tolist()) / flat.numel()
    assert m.mean == pytest.approx(ref_mean, abs=1e-12, rel=1e-12)
    assert m.var == pytest.approx(ref_var, abs=1e-12, rel=1e-12)
    # Order of chunks does not matter; neither does merging per-chunk moments (as all_reduce).
    rev = global_moments(chunks[::-1])
    assert rev.mean == pytest.approx(m.mean, abs=1e-12)
    assert rev.var == pytest.approx(m.var, abs=1e-12)
    parts = [global_moments([c]) for c in chunks]
    merged = Moments()
    for part in parts:
        merged.merge(part)
    assert merged.mean == pytest.approx(m.mean, abs=1e-12)
    assert merged.var == pytest.approx(m.var, abs=1e-12)


@given(chunked())
def test_whiten_is_standardized_over_the_whole_iteration(chunks: list) -> None:
    m = global_moments(chunks)
    outs = [whiten(x, mask, m) for x, mask in chunks]
    for (x, mask), y in zip(chunks, outs, strict=True):
        assert y.shape == x.shape and y.dtype == x.dtype
        assert (y[~mask] == 0).all()
    flat = torch.cat([y[mask] for (_, mask), y in zip(chunks, outs, strict=True)])
    assert float(flat.mean()) == pytest.approx(0.0, abs=1e-9)
    expected_var = m.var / (m.var + 1e-8)  # the eps floor shrinks it a hair below 1
    assert float(flat.var(unbiased=False)) == pytest.approx(expected_var, rel=1e-9)
    assert expected_var == pytest.approx(1.0, abs=1e-6)
    # One global affine map: y = (x − μ) / sqrt(σ² + eps) in every chunk.
    scale = 1.0 / math.sqrt(m.var + 1e-8)
    for (x, mask), y in zip(chunks, outs, strict=True):
        torch.testing.assert_close(y[mask], (x[mask] - m.mean) * scale, rtol=1e-12, atol=1e-12)


def test_whiten_uses_global_moments_not_the_chunks() -> None:
    """Per-chunk whitening would erase the gap between chunks; global whitening keeps it."""
    mask = torch.ones(1, 4, dtype=torch.bool)
    low = torch.tensor([[0.0, 1.0, 2.0, 3.0]], dtype=torch.float64)
    high = low + 100.0
    m = global_moments([(low, mask), (high, mask)])
    y_low, y_high = whiten(low, mask, m), whiten(high, mask, m)
    # Globally whitened: every "high" advantage stays above every "low" one.
    assert float(y_high.min()) > float(y_low.max())
    torch.testing.assert_close(y_high - y_low, torch.full_like(low, 100.0 / math.sqrt(m.var)))
    # Per-chunk whitening (the bug this function avoids) maps both chunks to the same values.
    per_low = whiten(low, mask, global_moments([(low, mask)]))
    per_high = whiten(high, mask, global_moments([(high, mask)]))
    torch.testing.assert_close(per_low, per_high)
    assert not torch.allclose(per_low, y_low)
    assert not torch.allclose(per_high, y_high)


def test_whiten_depends_only_on_the_moments_passed() -> None:
    x = torch.tensor([[1.0, 2.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[True, False, True]])
    m = Moments(count=4.0, mu=2.0, m2=16.0)  # mean 2, var 4
    y = whiten(x, mask, m, eps=0.0)
    assert y.tolist() == [[-0.5, 0.0, 1.5]]
    y_scaled = whiten(x, mask, m, shift_mean=False, eps=0.0)
    assert y_scaled.tolist() == [[0.5, 0.0, 2.5]]


def test_whiten_keeps_dtype_and_eps_floors_zero_variance() -> None:
    x = torch.full((2, 3), 7.0, dtype=torch.float32)
    mask = torch.tensor([[True, True, False], [False, True, True]])
    m = global_moments([(x, mask)])
    assert m.var == 0.0
    y = whiten(x, mask, m)
    assert y.dtype == torch.float32
    assert torch.isfinite(y).all() and (y == 0).all()


def test_moments_without_data_raise() -> None:
    m = Moments()
    with pytest.raises(ValueError, match="no valid entries"):
        _ = m.mean
    with pytest.raises(ValueError, match="no valid entries"):
        _ = m.var
    m.update(torch.ones(2, 3), torch.zeros(2, 3, dtype=torch.bool))
    assert m.count == 0
    with pytest.raises(ValueError):
        _ = m.mean
    with pytest.raises(ValueError):
        whiten(torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool), m)


def test_moments_update_detaches_and_uses_float64() -> None:
    x = torch.tensor([[1.0, 2.0, 4.0]], dtype=torch.float32, requires_grad=True)
    m = Moments()
    m.update(x, torch.tensor([[True, True, False]]))
    assert (m.count, m.mean, m.m2) == (2.0, 1.5, 0.5)
    assert all(isinstance(v, float) for v in (m.count, m.mu, m.m2))
    m.all_reduce()  # single-process group: no-op
    assert (m.count, m.mean, m.m2) == (2.0, 1.5, 0.5)
    assert m.mean == 1.5 and m.var == 0.25


def test_variance_keeps_precision_when_the_mean_is_large() -> None:
    """E[x²] − μ² cancels catastrophically at mean 1e8 and spread 1e-2; the merge does not."""
    g = torch.Generator().manual_seed(0)
    spread = torch.randn(4, 64, generator=g, dtype=torch.float64) * 1e-2
    x = 1e8 + spread
    mask = torch.ones_like(x, dtype=torch.bool)
    m = global_moments([(x[i : i + 1], mask[i : i + 1]) for i in range(4)])
    ref = float(spread.var(unbiased=False))
    assert m.var == pytest.approx(ref, rel=1e-6)
    # The one-pass formula on the same float64 data is off by orders of magnitude.
    flat = x.reshape(-1)
    naive = float((flat.square().sum() / flat.numel()) - flat.mean().square())
    assert abs(naive - ref) > 100 * ref
