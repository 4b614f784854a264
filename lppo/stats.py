"""Mergeable statistics: exact across chunks and data-parallel ranks.

:class:`Moments` keeps count, mean and the sum of squared deviations (``M2``) and merges two
partial results with Chan et al.'s pairwise update, so a variance is never formed as the
cancellation-prone ``E[x²] − μ²``. :class:`SumStats` holds one optimizer step's diagnostic
sums, minima, maxima and moments, reduced over ranks through a
:class:`~lppo.parallel.ProcessGroup`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lppo.parallel import SINGLE, ProcessGroup


@dataclass
class Moments:
    """Count, mean and ``M2 = Σ (x − μ)²`` of a masked quantity, in float64.

    Unlike running ``Σx`` and ``Σx²``, the variance ``M2 / n`` keeps its precision when the mean
    is large compared with the spread (returns around 10⁶ varying by 10⁻², say).

    Attributes:
        count: number of entries seen.
        mu: their mean (0 when ``count`` is 0; read it as :attr:`mean`).
        m2: sum of squared deviations from the mean.
    """

    count: float = 0.0
    mu: float = 0.0
    m2: float = 0.0

    def update(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Fold the entries of ``x`` (where ``mask`` is ``True``, if given) into the moments."""
        v = (x.detach()[mask] if mask is not None else x.detach().reshape(-1)).to(torch.float64)
        if v.numel() == 0:
            return
        mu = v.mean()
        self.merge(Moments(float(v.numel()), float(mu), float((v - mu).square().sum())))

    def merge(self, other: Moments) -> None:
        """Fold another partial result in (Chan et al. 1979, pairwise update).

        ``n = n_a + n_b``, ``δ = μ_b − μ_a``, ``μ = μ_a + δ·n_b/n``,
        ``M2 = M2_a + M2_b + δ²·n_a·n_b/n``.
        """
        if other.count == 0:
            return
        if self.count == 0:
            self.count, self.mu, self.m2 = other.count, other.mu, other.m2
            return
        n = self.count + other.count
        delta = other.mu - self.mu
        self.mu += delta * other.count / n
        self.m2 += other.m2 + delta * delta * self.count * other.count / n
        self.count = n

    def all_reduce(self, group: ProcessGroup = SINGLE) -> None:
        """Merge the moments of every rank of ``group`` (in rank order, the same on each)."""
        if group.size == 1:
            return
        parts = group.all_gather_object((self.count, self.mu, self.m2))
        merged = Moments()
        for count, mu, m2 in parts:
            merged.merge(Moments(count, mu, m2))
        self.count, self.mu, self.m2 = merged.count, merged.mu, merged.m2

    @property
    def mean(self) -> float:
        """Mean of the entries.

        Raises:
            ValueError: no entry was seen.
        """
        if self.count == 0:
            raise ValueError("no valid entries: cannot compute a mean")
        return self.mu

    @property
    def var(self) -> float:
        """Population variance ``M2 / n``.

        Raises:
            ValueError: no entry was seen.
        """
        if self.count == 0:
            raise ValueError("no valid entries: cannot compute a variance")
        return max(self.m2 / self.count, 0.0)


@dataclass
class SumStats:
    """Diagnostics of one optimizer step: float64 sums, minima, maxima and moments.

    Every reported diagnostic is a ratio of these global quantities, never a mean of chunk
    means, so any chunking and any data-parallel size report the same numbers.

    Attributes:
        sums: ``name -> float64 0-dim tensor`` summed over tokens (or rows).
        mins: ``name -> float64 0-dim tensor`` running minimum.
        maxs: ``name -> float64 0-dim tensor`` running maximum.
        moments: ``name -> Moments`` of a quantity whose variance is reported.
    """

    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    mins: dict[str, torch.Tensor] = field(default_factory=dict)
    maxs: dict[str, torch.Tensor] = field(default_factory=dict)
    moments: dict[str, Moments] = field(default_factory=dict)

    def add(self, name: str, value: torch.Tensor | float) -> None:
        """Add ``value`` to the running sum ``name``."""
        v = torch.as_tensor(value, dtype=torch.float64).detach().cpu()
        self.sums[name] = self.sums[name] + v if name in self.sums else v.clone()

    def update_min(self, name: str, value: torch.Tensor) -> None:
        """Fold ``value`` (any shape, non-empty) into the running minimum ``name``."""
        v = value.detach().to(torch.float64).min().cpu()
        self.mins[name] = torch.minimum(self.mins[name], v) if name in self.mins else v

    def update_max(self, name: str, value: torch.Tensor) -> None:
        """Fold ``value`` (any shape, non-empty) into the running maximum ``name``."""
        v = value.detach().to(torch.float64).max().cpu()
        self.maxs[name] = torch.maximum(self.maxs[name], v) if name in self.maxs else v

    def update_moments(self, name: str, values: torch.Tensor) -> None:
        """Fold every entry of ``values`` into the moments ``name``."""
        self.moments.setdefault(name, Moments()).update(values)

    def get(self, name: str) -> float:
        """Return the sum ``name`` as a float (0.0 when never added)."""
        return float(self.sums[name]) if name in self.sums else 0.0

    def all_reduce(self, group: ProcessGroup = SINGLE) -> None:
        """Sum / min / max / merge every entry across ``group`` (no-op for one rank)."""
        if group.size == 1:
            return
        # Every rank must reduce the same names: gather the union first.
        names = group.all_gather_object(
            (sorted(self.sums), sorted(self.mins), sorted(self.maxs), sorted(self.moments))
        )
        for i, (table, op, fill) in enumerate(
            ((self.sums, "sum", 0.0), (self.mins, "min", torch.inf), (self.maxs, "max", -torch.inf))
        ):
            union = sorted({n for part in names for n in part[i]})
            if not union:
                continue
            default = torch.tensor(fill, dtype=torch.float64)
            flat = group.all_reduce(torch.stack([table.get(n, default) for n in union]), op)
            for n, v in zip(union, flat.unbind(0), strict=True):
                table[n] = v.clone()
        for name in sorted({n for part in names for n in part[3]}):
            self.moments.setdefault(name, Moments()).all_reduce(group)
