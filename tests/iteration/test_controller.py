"""Iteration-level semantics: retention, release exactly once, invalid rows, failure cleanup."""

from __future__ import annotations

import copy

import pytest
import torch
from _builders import random_rows, stored, tiny_backbone, tiny_lm
from lppo.callbacks import lifecycle

from lppo.algorithms import advantages_and_returns, kl_penalty, token_rewards
from lppo.config import PPOConfig
from lppo.errors import IterationError
from lppo.estimators import GAE
from lppo.iteration.chunks import read_chunk
from lppo.iteration.controller import PPOController
from lppo.iteration.data import ReplayDataModule
from lppo.iteration.hooks import PPOCallback
from lppo.iteration.planner import NoValidRows
from lppo.modules import ActorModule, CriticModule
from lppo.replay import MemoryReplayStore
from lppo.types import (
    ADVANTAGES,
    INPUT_IDS,
    OLD_LOGPROBS,
    REF_LOGPROBS,
    RESPONSE_MASK,
    RETURNS,
    REWARD,
    VALUES,
    Rollout,
)


class CountingStore(MemoryReplayStore):
    def __init__(self):
        super().__init__()
        self.release_calls: list[tuple[int, ...]] = []

    def release(self, ids):
        self.release_calls.append(tuple(ids))
        super().release(ids)


def make_rollout(n: int, seed: int, invalid: int = 0) -> Rollout:
    cols = random_rows(n, seed, invalid_rows=invalid)
    return Rollout(
        input_ids=cols[INPUT_IDS],
        response_mask=cols[RESPONSE_MASK],
        gen_logprobs=[torch.zeros(len(t)) for t in cols[INPUT_IDS]],
        reward=torch.stack(cols[REWARD]).float(),
        prompt_index=torch.arange(n),
    )


def make_controller(store=None, budget=30, drop_budget=0, callbacks=(), **cfg):
    data = ReplayDataModule(max_tokens_per_chunk=budget, store=store, drop_budget=drop_budget)
    actor = ActorModule(tiny_lm(), lr=1e-3)
    critic = CriticModule(tiny_backbone(), lr=1e-3)
    reference = None
    if cfg.get("kl_coef", 0.0) > 0:
        reference = ActorModule(tiny_lm(seed=7))
    gae = {k: cfg.pop(k) for k in ("gamma", "lam", "lam_returns", "whiten") if k in cfg}
    # score, recompute: Probe reads the scored columns at the first epoch's start
    config = PPOConfig(**{"old_values": "score", "old_logprobs": "recompute", **cfg})
    return PPOController(
        actor,
        critic,
        data,
        config,
        reference=reference,
        callbacks=[*callbacks, *lifecycle(callbacks)],
        estimator=GAE(**gae),
    )


class Probe(PPOCallback):
    """Records what the store holds at every epoch start and the columns before training."""

    def __init__(self):
        self.epochs: list[tuple[str, int, int, int]] = []
        self.snapshot = None

    def on_phase_epoch_start(self, ctx):
        store = ctx.store
        claimed = sum(1 for i in ctx.row_ids if i in store.claimed())
        self.epochs.append((ctx.phase, ctx.epoch, len(store), claimed))
        if self.snapshot is None:
            names = [REWARD, VALUES, OLD_LOGPROBS, ADVANTAGES, RETURNS]
            if store.has(REF_LOGPROBS, ctx.row_ids):
                names.append(REF_LOGPROBS)
            self.snapshot = read_chunk(store, ctx.row_ids, names)


def test_rows_retained_through_every_epoch_and_released_once():
    store, probe = CountingStore(), Probe()
    ctl = make_controller(
        store, callbacks=[probe], critic_epochs=3, actor_epochs=2, actor_minibatches=2
    )
    result = ctl.run_iteration(stored(ctl, make_rollout(6, 0)), iteration=0)
    assert [(p, e) for p, e, _, _ in probe.epochs] == [
        ("critic", 0),
        ("critic", 1),
        ("critic", 2),
        ("actor", 0),
        ("actor", 1),
    ]
    assert all(live == 6 and claimed == 6 for _, _, live, claimed in probe.epochs)
    assert store.release_calls == [tuple(range(6))]
    assert len(store) == 0 and store.claimed() == {}
    assert len(result.phase_steps("critic")) == 3
    assert len(result.phase_steps("actor")) == 4
    assert all(s.stepped for s in result.steps)


def test_invalid_rows_never_trained_but_counted_and_released():
    store = CountingStore()
    ctl = make_controller(store, drop_budget=2)
    result = ctl.run_iteration(stored(ctl, make_rollout(5, 1, invalid=2)), iteration=0)
    assert result.rollout.invalid_rows == 2
    assert result.steps[0].valid_rows == 3
    assert store.release_calls == [tuple(range(5))]


def test_non_finite_reward_makes_row_invalid():
    rollout = make_rollout(4, 2)
    rollout.reward[1] = float("nan")
    ctl = make_controller(drop_budget=1)
    result = ctl.run_iteration(stored(ctl, rollout), iteration=0)
    assert result.rollout.invalid_rows == 1
    assert result.steps[0].valid_rows == 3


def test_no_valid_row_fails_before_any_optimizer_step_and_releases():
    store = CountingStore()
    ctl = make_controller(store, drop_budget=10)
    before = copy.deepcopy(ctl.actor.state_dict()), copy.deepcopy(ctl.critic.state_dict())
    with pytest.raises(IterationError, match="iteration 1, phase score") as info:
        ctl.run_iteration(stored(ctl, make_rollout(3, 3, invalid=3)), iteration=0)
    assert isinstance(info.value.__cause__, NoValidRows)
    assert ctl.actor.optimizer is None and ctl.critic.optimizer is None
    for module, state in zip((ctl.actor, ctl.critic), before, strict=True):
        for k, v in module.state_dict().items():
            assert torch.equal(v, state[k])
    assert store.release_calls == [(0, 1, 2)]
    assert len(store) == 0


def test_failure_mid_phase_aborts_step_releases_rows_and_names_location():
    class Boom(PPOCallback):
        def on_chunk_end(self, ctx, result):
            if ctx.phase == "critic" and ctx.epoch == 1:
                raise ValueError("boom")

    store = CountingStore()
    ctl = make_controller(store, callbacks=[Boom()], critic_epochs=2)
    actor_before = copy.deepcopy(ctl.actor.state_dict())
    with pytest.raises(IterationError, match=r"iteration 5, phase critic, epoch 2, chunk 1: "):
        ctl.run_iteration(stored(ctl, make_rollout(4, 4)), iteration=4)
    assert not ctl.critic.step_open
    assert all(p.grad is None for p in ctl.critic.parameters())
    # One critic step (epoch 0) was taken; the actor never trained.
    assert ctl.critic.optimizer is not None
    assert ctl.actor.optimizer is None
    for k, v in ctl.actor.state_dict().items():
        assert torch.equal(v, actor_before[k])
    assert store.release_calls == [(0, 1, 2, 3)]
    # The controller is usable again afterwards.
    again = ctl.__class__(ctl.actor, ctl.critic, ctl.data, callbacks=lifecycle())
    result = again.run_iteration(stored(again, make_rollout(4, 5)), 5)
    assert len(result.steps) == 2


def test_kl_penalty_is_applied_and_whitening_is_global():
    probe = Probe()
    ctl = make_controller(budget=14, callbacks=[probe], kl_coef=0.3, kl_kind="k3", lam=0.9)
    result = ctl.run_iteration(stored(ctl, make_rollout(7, 6)), iteration=0)
    snap = probe.snapshot
    mask = snap.response_mask
    kl = kl_penalty(snap.old_logprobs, snap.ref_logprobs, "k3")
    assert result.rollout.kl_mean == pytest.approx(float(kl[mask].mean()), rel=1e-9)
    rewards = token_rewards(snap.reward, mask, kl, 0.3)
    adv, ret = advantages_and_returns(rewards, snap.values, mask, 1.0, 0.9)
    torch.testing.assert_close(snap.returns, ret, rtol=1e-9, atol=1e-12)
    white = (adv[mask] - adv[mask].mean()) / (adv[mask].var(unbiased=False) + 1e-8).sqrt()
    torch.testing.assert_close(snap.advantages[mask], white, rtol=1e-7, atol=1e-9)
    # Without the penalty the targets differ: the KL really reached the rewards.
    no_kl = advantages_and_returns(token_rewards(snap.reward, mask), snap.values, mask, 1.0, 0.9)
    assert not torch.allclose(no_kl[1][mask], snap.returns[mask])


def test_critic_warmup_skips_actor():
    ctl = make_controller(critic_warmup_iterations=2)
    result = ctl.run_iteration(stored(ctl, make_rollout(4, 7)), iteration=1)
    assert [s.role for s in result.steps] == ["critic"]
    result = ctl.run_iteration(stored(ctl, make_rollout(4, 8)), iteration=2)
    assert [s.role for s in result.steps] == ["critic", "actor"]


@pytest.mark.parametrize(
    ("key", "value", "name"),
    [
        ("critic_epochs", 0, "model.ppo.critic_epochs"),
        ("actor_epochs", 0, "model.ppo.actor_epochs"),
        ("actor_minibatches", 0, "model.ppo.actor_minibatches"),
        ("lam", 1.5, "model.estimator.init_args.lam"),
    ],
)
def test_bad_config_names_the_key(key, value, name):
    with pytest.raises(ValueError, match=f"{name}={value}"):
        make_controller(**{key: value})


def test_failing_cleanup_hook_does_not_hide_the_error():
    class Boom(PPOCallback):
        def on_chunk_end(self, ctx, result):
            raise ValueError("original")

    class BadCleanup(PPOCallback):
        def on_ppo_abort(self, ctx, error):
            raise OSError("cleanup broke")

    store = CountingStore()
    ctl = make_controller(store, callbacks=[BadCleanup(), Boom()])
    with pytest.raises(IterationError, match="ValueError: original") as info:
        ctl.run_iteration(stored(ctl, make_rollout(3, 9)), iteration=0)
    notes = getattr(info.value.__cause__, "__notes__", [])
    assert any("BadCleanup.on_ppo_abort failed" in n for n in notes)
    # The built-in cleanup still ran: rows released, no step open.
    assert store.release_calls == [(0, 1, 2)]
    assert not ctl.critic.step_open


def test_rows_get_their_ids_from_the_store():
    class OffsetStore(CountingStore):
        def allocate(self, n):
            return tuple(
                range(100 + len(self.release_calls) * 10, 100 + len(self.release_calls) * 10 + n)
            )

    store = OffsetStore()
    ctl = make_controller(store)
    ctl.run_iteration(stored(ctl, make_rollout(3, 0)), iteration=0)
    ctl.run_iteration(stored(ctl, make_rollout(2, 1)), iteration=1)
    assert store.release_calls == [(100, 101, 102), (110, 111)]


def test_controller_checks_that_the_rows_were_released():
    from lppo.callbacks import RowRetention

    class KeepsRows(RowRetention):
        def on_iteration_end(self, ctx, result):
            pass  # forgets to release

    store = CountingStore()
    ctl = make_controller(store, callbacks=[KeepsRows()])
    with pytest.raises(IterationError, match="rows were not released"):
        ctl.run_iteration(stored(ctl, make_rollout(3, 0)), iteration=0)
    # The failure path still released them, exactly once, through the same callback.
    assert store.release_calls == [(0, 1, 2)] and len(store) == 0


@pytest.mark.parametrize("disable", [True, False])
def test_dropout_is_off_so_the_first_ratio_is_one(disable):
    from _builders import gpt2_config
    from transformers import GPT2LMHeadModel

    config = gpt2_config()
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.3
    with torch.random.fork_rng():
        torch.manual_seed(0)
        lm = GPT2LMHeadModel(config).double()
    data = ReplayDataModule(max_tokens_per_chunk=200, shuffle=False)
    ppo = PPOConfig(actor_minibatches=2, disable_dropout=disable)
    ctl = PPOController(
        ActorModule(lm, lr=1e-3), CriticModule(tiny_backbone()), data, ppo, callbacks=lifecycle()
    )
    result = ctl.run_iteration(stored(ctl, make_rollout(6, 3)), iteration=0)
    first = result.phase_steps("actor")[0].metrics
    if disable:
        # Old log-probs (scored in eval) and the first step's (in train) are the same numbers.
        assert first["ratio_min"] == first["ratio_max"] == 1.0
    else:
        assert first["ratio_max"] - first["ratio_min"] > 1e-3


class NaNActor(ActorModule):
    """An actor whose loss is NaN: every step it takes is skipped."""

    def chunk_loss(self, chunk, sums):
        return super().chunk_loss(chunk, sums) * float("nan")


@pytest.mark.parametrize(
    ("limits", "fails_at", "key"),
    [
        ({"max_consecutive_skipped_steps": 2}, 2, "max_consecutive_skipped_steps=2"),
        ({"max_skipped_steps": 1, "max_consecutive_skipped_steps": 10}, 1, "max_skipped_steps=1"),
    ],
)
def test_skipped_steps_are_warned_and_budgeted(limits, fails_at, key):
    data = ReplayDataModule(max_tokens_per_chunk=30)
    ctl = PPOController(
        NaNActor(tiny_lm(), lr=1e-3),
        CriticModule(tiny_backbone()),
        data,
        PPOConfig(**limits),
        callbacks=lifecycle(),
    )
    before = [p.detach().clone() for p in ctl.actor.parameters()]
    for i in range(fails_at):
        with pytest.warns(RuntimeWarning, match=r"actor step skipped, gradient norm nan"):
            result = ctl.run_iteration(stored(ctl, make_rollout(4, i)), iteration=i)
        assert not result.phase_steps("actor")[0].stepped
        assert result.phase_steps("critic")[0].stepped  # the critic trains on
    with pytest.raises(
        IterationError, match=rf"phase actor, epoch 1: SkippedStepsExceeded: .*{key}"
    ):
        ctl.run_iteration(stored(ctl, make_rollout(4, 9)), iteration=fails_at)
    assert all(torch.equal(a, b) for a, b in zip(before, ctl.actor.parameters(), strict=True))
    assert len(data.store) == 0


def test_absurd_rewards_make_rows_invalid():
    rollout = make_rollout(5, 4)
    rollout.reward[0] = 1e9
    rollout.reward[3] = float("-inf")
    ctl = make_controller(drop_budget=2, max_abs_reward=100.0)
    result = ctl.run_iteration(stored(ctl, rollout), iteration=0)
    assert result.rollout.bad_rewards == 2 and result.rollout.invalid_rows == 2
    assert result.steps[0].valid_rows == 3
    with pytest.raises(ValueError, match=r"model\.ppo\.max_abs_reward=0"):
        PPOConfig(max_abs_reward=0.0)


def test_a_snapshot_that_fails_leaves_no_row_behind(monkeypatch):
    """Rows handed to the controller are its to release from the first line on."""
    import lppo.iteration.controller as controller_module

    class NoRoomForTheSnapshot:
        def __init__(self, modules):
            raise MemoryError("cannot copy the modules' training state")

    monkeypatch.setattr(controller_module, "Transaction", NoRoomForTheSnapshot)
    store = CountingStore()
    ctl = make_controller(store, transactional=True)
    with pytest.raises(IterationError, match="phase collect: MemoryError: cannot copy"):
        ctl.run_iteration(stored(ctl, make_rollout(3, 0)), iteration=0)
    assert store.release_calls == [(0, 1, 2)] and len(store) == 0
