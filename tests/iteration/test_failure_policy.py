"""Transactional iterations and the failure policy of model.ppo."""

from __future__ import annotations

import csv
import warnings

import pytest
import torch
from _builders import stored
from test_controller import make_controller, make_rollout
from test_resume import assert_same, fit, params

from lppo.config import PPOConfig
from lppo.errors import IterationError
from lppo.iteration.hooks import PPOCallback
from lppo.rollout import HFGenerateEngine
from lppo.validation import SettingError


class FailIn(PPOCallback):
    """Raises in the first chunk of ``phase`` of the given iterations."""

    def __init__(self, phase: str, iterations: tuple[int, ...]) -> None:
        self.phase = phase
        self.iterations = iterations

    def on_chunk_end(self, ctx, result):
        if ctx.iteration in self.iterations and ctx.phase == self.phase:
            raise RuntimeError("simulated failure")


def state(ctl):
    return [{k: v.clone() for k, v in m.state_dict().items()} for m in ctl.trainable_modules()], [
        None if m.optimizer is None else m.optimizer.state_dict() for m in ctl.trainable_modules()
    ]


@pytest.mark.parametrize("transactional", [True, False])
def test_a_failed_actor_phase_rolls_back_the_committed_critic_steps(transactional):
    ctl = make_controller(
        critic_epochs=2, transactional=transactional, callbacks=[FailIn("actor", (1,))]
    )
    ctl.run_iteration(stored(ctl, make_rollout(4, 0)), iteration=0)
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in ctl.trainable_modules()]
    critic_steps = ctl.critic.optimizer.state_dict()["state"][0]["step"].clone()
    versions = [m.weights_version for m in ctl.trainable_modules()]
    with pytest.raises(IterationError, match="iteration 2, phase actor"):
        ctl.run_iteration(stored(ctl, make_rollout(4, 1)), iteration=1)
    after = [m.state_dict() for m in ctl.trainable_modules()]
    restored = all(torch.equal(a[k], b[k]) for a, b in zip(before, after, strict=True) for k in a)
    critic_now = ctl.critic.optimizer.state_dict()["state"][0]["step"]
    assert restored is transactional  # without it the critic's two steps stay committed
    assert torch.equal(critic_now, critic_steps) is transactional
    if transactional:  # engines see new versions and resync to the restored weights
        assert all(
            m.weights_version > v for m, v in zip(ctl.trainable_modules(), versions, strict=True)
        )
    assert len(ctl.data.store) == 0


def test_transactional_iterations_train_bitwise_like_plain_ones():
    plain, txn = make_controller(), make_controller(transactional=True)
    for i in range(2):
        plain.run_iteration(stored(plain, make_rollout(4, i)), iteration=i)
        txn.run_iteration(stored(txn, make_rollout(4, i)), iteration=i)
    for a, b in zip(state(plain)[0], state(txn)[0], strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_failed_iterations_are_skipped_within_the_budget_then_stop_the_run(tmp_path):
    failing = FailIn("critic", (1, 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, system = fit(
            tmp_path / "run", 4, callbacks=[failing], max_failed_iterations=2, transactional=True
        )
    skipped = [str(w.message) for w in caught if "skipped (" in str(w.message)]
    assert len(skipped) == 2 and skipped[0].startswith("iteration 2 skipped (1 of model.ppo")
    assert (
        "iteration 2, phase critic, epoch 1, chunk 1: RuntimeError: simulated failure" in skipped[0]
    )
    assert system.failures.failed == 2 and len(system.controller.data.store) == 0
    rows = list(csv.DictReader(open(next((tmp_path / "run").glob("version_*/metrics.csv")))))
    failed = [r for r in rows if r.get("iteration/failed")]
    assert [float(r["iteration/failed_total"]) for r in failed] == [1.0, 2.0]
    # The counter is checkpointed: resuming with one more failure exceeds the budget.
    failing.iterations = (4,)
    with pytest.raises(IterationError, match=r"3 failed iterations exceed .*=2"):
        fit(tmp_path / "run", 6, ckpt_path="last", callbacks=[failing], max_failed_iterations=2)


def test_a_skipped_iteration_with_rollback_equals_never_running_it(tmp_path):
    """With transactional iterations, a skipped iteration leaves the models untouched."""
    _, straight = fit(tmp_path / "straight", 1)
    _, skipped = fit(
        tmp_path / "skip",
        2,
        callbacks=[FailIn("actor", (1,))],
        max_failed_iterations=1,
        transactional=True,
    )
    assert_same(params(straight), params(skipped))


def test_fail_fast_is_the_default(tmp_path):
    with pytest.raises(IterationError, match="iteration 1, phase critic"):
        fit(tmp_path / "run", 2, callbacks=[FailIn("critic", (0,))])


def test_max_failed_iterations_is_validated():
    with pytest.raises(SettingError, match=r"model\.ppo\.max_failed_iterations=-1"):
        PPOConfig(max_failed_iterations=-1)


class Outcomes(PPOCallback):
    """Records every ``on_iteration_end``: (iteration, failed message)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, str]] = []

    def on_iteration_end(self, ctx, result):
        self.seen.append((result.iteration, result.failed))


def test_a_failed_iteration_reaches_on_iteration_end(tmp_path):
    skipped, fatal = Outcomes(), Outcomes()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit(
            tmp_path / "skip",
            3,
            callbacks=[FailIn("actor", (1,)), skipped],
            max_failed_iterations=1,
        )
    assert [i for i, _ in skipped.seen] == [0, 1, 2]
    assert [bool(f) for _, f in skipped.seen] == [False, True, False]
    assert "iteration 2, phase actor" in skipped.seen[1][1]
    # A failure that stops the run is an iteration too: reported before the error propagates.
    with pytest.raises(IterationError, match="iteration 2, phase critic"):
        fit(tmp_path / "stop", 3, callbacks=[FailIn("critic", (1,)), fatal])
    assert [(i, bool(f)) for i, f in fatal.seen] == [(0, False), (1, True)]


class FailingEngine(HFGenerateEngine):
    """The Hugging Face engine, raising in its ``fail_at``-th ``generate`` call (0-based)."""

    resume_safe = ()

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at, self.calls = fail_at, 0

    def generate(self, *args, **kwargs):
        self.calls += 1
        if self.calls - 1 == self.fail_at:
            raise RuntimeError("the engine broke")
        return super().generate(*args, **kwargs)


def test_an_engine_failure_is_a_failed_iteration_counted_by_the_policy(tmp_path):
    """An engine that raises in iteration 2's rollout: skipped within the budget (warned,
    logged, counted), and fails the run as an IterationError naming the phase without one."""
    outcomes = Outcomes()
    with pytest.warns(RuntimeWarning, match=r"iteration 2 skipped \(1 of .*phase rollout: "
                      r"RuntimeError: the engine broke"):  # fmt: skip
        trainer, system = fit(tmp_path / "skip", 3, engine=FailingEngine(1),
                              callbacks=[outcomes], max_failed_iterations=1)  # fmt: skip
    assert system.failures.failed == 1 and trainer.current_epoch == 3
    assert [(i, bool(f)) for i, f in outcomes.seen] == [(0, False), (1, True), (2, False)]
    with pytest.raises(IterationError, match=r"iteration 2, phase rollout: RuntimeError: the en"):
        fit(tmp_path / "stop", 3, engine=FailingEngine(1))
