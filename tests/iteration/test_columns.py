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

ROOT = Path(__file__).resolve().parents[2]


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


def test_estimators_declare_what_they_read_and_write() -> None:
    from lppo.estimators import GAE, GRPO, RLOO, ReinforcePP
    from lppo.types import PROMPT_INDEX

    assert (GAE().reads(), GAE().writes()) == ([VALUES], [ADVANTAGES, RETURNS])
    for outcome in (GRPO(), RLOO()):
        assert (outcome.reads(), outcome.writes()) == ([PROMPT_INDEX], [ADVANTAGES])
    assert (ReinforcePP().reads(), ReinforcePP().writes()) == ([], [ADVANTAGES])


def test_a_column_nobody_writes_is_refused_at_setup() -> None:
    """An estimator that reads a column no phase of the run writes fails before iteration 1."""
    from lppo.estimators import GRPO
    from lppo.iteration.controller import PPOController
    from lppo.iteration.data import ReplayDataModule

    class ReadsTaskScore(GRPO):
        def reads(self) -> list[str]:
            return [*super().reads(), "task_score"]

    with pytest.raises(SettingError, match=r"model.estimator=ReadsTaskScore reads the column "):
        PPOController(
            actor=ActorModule(spec(0)),
            critic=None,
            data=ReplayDataModule(),
            config=PPOConfig(),
            estimator=ReadsTaskScore(),
        )


def test_chunks_carry_data_only() -> None:
    """First-epoch producers are handed to ``begin``; no chunk carries a callable."""
    from lppo.types import Chunk

    hints = {f.name: str(f.type) for f in dataclasses.fields(Chunk)}
    assert not [n for n, t in hints.items() if "Callable" in t], hints


def test_first_epoch_columns_are_stored_on_commit_not_from_the_loss() -> None:
    """The actor's own π_old reaches the store when the controller commits, after backward."""
    from lppo.iteration.old_logprobs import FirstEpochLogprobs
    from lppo.parallel import ProcessGroup
    from lppo.replay.memory import MemoryReplayStore
    from lppo.types import Chunk, Normalizers, StepPlan

    store, ids = MemoryReplayStore(), [0, 1]
    store.put(ids, {"input_ids": [torch.zeros(3, dtype=torch.int64)] * 2})
    step = StepPlan((tuple(ids),), Normalizers(4, 2))
    own = FirstEpochLogprobs(store, step, OffPolicyCorrection(), ProcessGroup())
    chunk = Chunk(
        row_ids=tuple(ids),
        input_ids=torch.zeros(2, 3, dtype=torch.int64),
        attention_mask=torch.ones(2, 3, dtype=torch.bool),
        response_mask=torch.tensor([[False, True, True]] * 2),
        gen_logprobs=torch.full((2, 3), -1.0),
    )
    done = own.complete(chunk, torch.full((2, 3), -0.5))
    assert done.old_logprobs is not None
    assert done.old_logprobs.tolist() == [[0.0, -0.5, -0.5]] * 2
    assert OLD_LOGPROBS not in store.columns()
    own.commit()
    assert store.read(ids, [OLD_LOGPROBS])[OLD_LOGPROBS][1].tolist() == [0.0, -0.5, -0.5]
