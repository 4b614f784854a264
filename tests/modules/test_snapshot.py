"""Parameters are never committed non-finite: a step that makes one non-finite is undone."""

from __future__ import annotations

import functools

import pytest
import torch
from _builders import tiny_backbone
from test_lifecycle import assert_identical, make, run_step, setup, snapshot

from lppo.modules import CriticModule
from lppo.modules.lifecycle import NonFiniteParameters
from lppo.modules.snapshot import TrainingState, parameters_finite

ROLES = ["actor", "critic"]


def exploding_optimizer(params, value: float = float("inf")):
    """SGD whose second step writes ``value`` into one parameter (a finite gradient norm)."""
    opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    calls = []

    def hook(optimizer, args, kwargs):
        calls.append(1)
        if len(calls) == 2:
            with torch.no_grad():
                optimizer.param_groups[0]["params"][0].view(-1)[-1] = value

    opt.register_step_post_hook(hook)
    return opt


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("role", ROLES)
def test_a_step_that_makes_a_parameter_non_finite_is_undone_bitwise(role, value):
    factory = functools.partial(exploding_optimizer, value=value)
    module = make(role, optimizer=factory, max_grad_norm=None)
    store, epoch = setup(n=4)
    assert run_step(module, store, epoch.steps[0], role).stepped
    state, optim = snapshot(module)
    version = module.weights_version
    stats = run_step(module, store, epoch.steps[0], role)
    assert not stats.stepped and "not finite after the step" in stats.skip_reason
    assert parameters_finite(module)
    assert_identical(module.state_dict(), state)
    assert_identical(module.optimizer.state_dict(), optim)
    assert module.weights_version == version  # nothing new for the engine to sync
    assert run_step(module, store, epoch.steps[0], role).stepped  # training goes on


@pytest.mark.parametrize("role", ROLES)
def test_without_rollback_a_non_finite_parameter_stops_the_run(role):
    module = make(role, optimizer=exploding_optimizer, rollback_non_finite=False)
    store, epoch = setup(n=4)
    run_step(module, store, epoch.steps[0], role)
    with pytest.raises(NonFiniteParameters, match=rf"model\.{role}\.init_args\.rollback_non"):
        run_step(module, store, epoch.steps[0], role)


def test_training_state_round_trip_includes_scheduler_and_fresh_optimizer():
    module = CriticModule(tiny_backbone(), lr=1e-2, warmup_steps=3)
    store, epoch = setup(n=4)
    fresh = TrainingState.capture(module)  # before any optimizer exists
    before = {k: v.clone() for k, v in module.state_dict().items()}
    run_step(module, store, epoch.steps[0], "critic")
    saved = TrainingState.capture(module)
    sched = module.scheduler.state_dict()
    run_step(module, store, epoch.steps[0], "critic")
    saved.restore(module)
    assert module.scheduler.state_dict()["last_epoch"] == sched["last_epoch"]
    fresh.restore(module)
    assert module.optimizer is None and module.scheduler is None
    assert_identical(module.state_dict(), before)
    assert saved.nbytes > 2 * sum(p.numel() * 4 for p in module.trainable_parameters())
