"""Declared columns: modules say what their chunks read; π_old producers are one class each."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
from test_old_logprobs import fit, params, spec

from lppo.algorithms.off_policy import OffPolicyCorrection
from lppo.config import PPOConfig
from lppo.iteration.columns import PI_OLD, Recompute, pi_old, register_pi_old
from lppo.modules import ActorModule, CriticModule
from lppo.types import ADVANTAGES, GEN_LOGPROBS, OLD_LOGPROBS, REF_LOGPROBS, RETURNS, VALUES
from lppo.validation import SettingError

ROOT = Path(__file__).resolve().parents[1]


def test_modules_declare_the_columns_their_chunks_read() -> None:
    assert CriticModule(spec(1)).reads() == [VALUES, RETURNS]
    assert ActorModule(spec(0)).reads() == [OLD_LOGPROBS, ADVANTAGES]
    stale = ActorModule(spec(0), off_policy=OffPolicyCorrection("truncate"), kl_loss_coef=0.1)
    assert stale.reads() == [OLD_LOGPROBS, ADVANTAGES, GEN_LOGPROBS, REF_LOGPROBS]


@dataclasses.dataclass(frozen=True)
class CountedRecompute(Recompute):
    """A new π_old producer: the actor's forward pass, counted (defined in this file only)."""

    name: str = "counted"
    calls: list[int] = dataclasses.field(default_factory=list)

    def from_chunk(self, chunk, actor):
        self.calls.append(len(chunk.row_ids))
        return super().from_chunk(chunk, actor)


def test_a_new_pi_old_producer_is_one_class_and_one_registration(tmp_path) -> None:
    """Registered from this test file alone, it is selectable and trains as its twin does."""
    with pytest.raises(SettingError, match=r"old_logprobs='counted'; use one of"):
        PPOConfig(old_logprobs="counted")  # type: ignore[arg-type]
    producer = CountedRecompute()
    register_pi_old(producer)
    try:
        assert pi_old("counted") is producer
        with pytest.raises(ValueError, match="exists already"):
            register_pi_old(producer)
        mine = fit(tmp_path / "counted", True, "counted")
        twin = fit(tmp_path / "recompute", True, "recompute")
    finally:
        PI_OLD.pop("counted", None)
    assert sum(producer.calls) == 3 * 16  # every row of the 3 iterations, scored by it
    assert torch.equal(params(mine[0].actor), params(twin[0].actor))
    for a, b in zip(mine[1].columns, twin[1].columns, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_the_files_a_new_producer_touches_are_its_own() -> None:
    """No module names a producer but the registry: the score phase and the controller ask it."""
    compared = re.compile(r"old_(logprobs|values)\s*(==|!=|in)\s")
    for rel in ("lppo/iteration/score_phase.py", "lppo/iteration/controller.py"):
        assert not compared.search((ROOT / rel).read_text()), rel
    sources = sorted((ROOT / "lppo").rglob("*.py"))
    naming = [str(p.relative_to(ROOT)) for p in sources if "FirstEpoch()" in p.read_text()]
    assert naming == ["lppo/iteration/columns.py"]


def test_the_old_values_producers_say_where_the_values_are_written() -> None:
    from lppo.iteration.columns import old_values

    assert old_values("score").stage == "score"
    assert old_values("critic").stage == "first_epoch"
    with pytest.raises(ValueError, match=r"old_values='auto' is not resolved"):
        old_values("auto")
