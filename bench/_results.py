"""What the worker processes returned, and the statistics the report is made of."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

VARIANTS = ("streamed", "merged", "floor")

#: Other processes' cores above which a run counts as slowed by them (contended).
BUSY = 0.25

Result = dict[str, Any]


class EpochRun(NamedTuple):
    """One timed epoch of a separate-process run (compared as a tuple: time first)."""

    time: float
    cpu: float
    foreign: float
    per_chunk: list[float]


@dataclass(frozen=True)
class PairedSummary:
    """The paired run of one row count, each chunk's time the minimum over its epochs.

    Attributes:
        ratio: (begin + Σ streamed chunks + finish) / (Σ floor chunks + clip/step).
        median: median of the per-chunk streamed / floor ratios.
        train_only: Σ ``train_chunk`` / Σ floor chunks.
        read_share: Σ store read + collate / (Σ floor chunks + clip/step).
        epochs: paired epochs run.
        load: least load other processes put on the CPU in one of those epochs (cores).
    """

    ratio: float
    median: float
    train_only: float
    read_share: float
    epochs: int
    load: float


def _col_min(epochs: list[Result], key: str) -> list[float]:
    """Per-chunk minimum of ``key`` over ``epochs``."""
    return [min(c) for c in zip(*(e[key] for e in epochs), strict=True)]


def summarize_paired(epochs: list[Result]) -> PairedSummary:
    """Summarize the epochs of the paired runs of one row count."""
    reads = zip(*(e["read"] for e in epochs), strict=True)
    trains = zip(*(e["train"] for e in epochs), strict=True)
    s_chunk = [
        min(r + t for r, t in zip(rs, ts, strict=True))
        for rs, ts in zip(reads, trains, strict=True)
    ]
    fixed_s = min(e["t_begin"] + e["t_finish"] for e in epochs)
    fixed_f = min(e["t_step"] for e in epochs)
    f_chunk = _col_min(epochs, "tf")
    return PairedSummary(
        ratio=(sum(s_chunk) + fixed_s) / (sum(f_chunk) + fixed_f),
        median=statistics.median(a / b for a, b in zip(s_chunk, f_chunk, strict=True)),
        train_only=sum(_col_min(epochs, "train")) / sum(f_chunk),
        read_share=sum(_col_min(epochs, "read")) / (sum(f_chunk) + fixed_f),
        epochs=len(epochs),
        load=min(e["foreign"] for e in epochs),
    )


class Results:
    """Worker results by row count and variant, and the statistics over their rounds.

    Attributes:
        rows: the row counts, in the order given.
        runs: ``rows -> variant -> one result per separate-process run``.
        paired: ``rows -> every epoch of the paired runs``.
    """

    def __init__(self, rows: Sequence[int]) -> None:
        self.rows = list(rows)
        self.runs: dict[int, dict[str, list[Result]]] = {n: {v: [] for v in VARIANTS} for n in rows}
        self.paired: dict[int, list[Result]] = {n: [] for n in rows}

    def add(self, n: int, variant: str, res: Result) -> None:
        """Record one worker's result."""
        if variant == "paired":
            self.paired[n] += res["epochs"]
        else:
            self.runs[n][variant].append(res)

    def first(self, n: int, variant: str) -> Result:
        """The first run (row / store / plan facts are the same in every run)."""
        return self.runs[n][variant][0]

    def per_raw_byte(self, n: int, key: str) -> float:
        """A store byte count of the streamed run (``store_nbytes``, ...) over the raw bytes."""
        s = self.first(n, "streamed")
        return s[key] / s["raw_bytes"]

    def epochs(self, n: int, variant: str) -> list[EpochRun]:
        """Every timed epoch over the runs of ``variant``."""
        out: list[EpochRun] = []
        for res in self.runs[n][variant]:
            cols = (res["times"], res["cpu"], res["foreign"], res["per_chunk"])
            out += [EpochRun(*x) for x in zip(*cols, strict=True)]
        return out

    def best(self, n: int, variant: str) -> float:
        """Fastest epoch, wall seconds."""
        return min(x.time for x in self.epochs(n, variant))

    def best_cpu(self, n: int, variant: str) -> float:
        """Least process CPU seconds of an epoch."""
        return min(x.cpu for x in self.epochs(n, variant))

    def best_load(self, n: int, variant: str) -> float:
        """Other processes' load (cores) during the fastest epoch."""
        return min(self.epochs(n, variant)).foreign

    def med(self, n: int, variant: str) -> float:
        """Median epoch, wall seconds."""
        return statistics.median(x.time for x in self.epochs(n, variant))

    def chunk_min(self, n: int, variant: str) -> float:
        """Σ over chunks of that chunk's fastest time over rounds + fastest remainder."""
        runs = self.epochs(n, variant)
        per = [min(col) for col in zip(*(x.per_chunk for x in runs), strict=True)]
        return sum(per) + min(x.time - sum(x.per_chunk) for x in runs)

    def peaks(self, n: int, variant: str) -> list[int]:
        """Peak RSS beyond the store of each run, bytes."""
        return [res["peak_beyond"] for res in self.runs[n][variant]]

    def peak(self, n: int, variant: str) -> int:
        """Highest peak RSS beyond the store over the runs, bytes."""
        return max(self.peaks(n, variant))

    def payload(self, n: int) -> int:
        """Bytes of the merged payload."""
        return self.first(n, "merged")["timers"]["payload_bytes"]

    def contended(self, n: int, variant: str) -> bool:
        """Whether even the best run of ``variant`` was slowed by other processes."""
        if variant == "paired":
            return min(e["foreign"] for e in self.paired[n]) > BUSY
        return self.best_load(n, variant) > BUSY

    def losses_agree(self, rel_tol: float = 1e-4) -> bool:
        """Every variant's first epoch loss equals the floor's, and paired sides agree."""
        separate = all(
            math.isclose(self.first(n, v)["loss"], self.first(n, "floor")["loss"], rel_tol=rel_tol)
            for n in self.rows
            for v in VARIANTS
        )
        paired = all(
            math.isclose(e["loss"], e["floor_loss"], rel_tol=rel_tol)
            for ep in self.paired.values()
            for e in ep
        )
        return separate and paired
