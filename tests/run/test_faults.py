"""Fault injection: an exception at every point of an iteration leaves a state to resume from.

For every point (each hook, every chunk of every epoch of both phases, each ``finish``, each
store call) an iteration of a transactional controller is made to fail there. Each time: the
error names the place, no row is left in the store, no step is left open, the models are
bitwise as at the iteration's start, and running the iteration again ends bitwise equal to a
run that never failed.
"""

from __future__ import annotations

import pytest
import torch
from _builders import stored
from test_controller import make_controller, make_rollout

from lppo.errors import IterationError
from lppo.iteration.hooks import PPOCallback
from lppo.replay import MemoryReplayStore

pytestmark = pytest.mark.slow

HOOKS = (
    "on_rollout_end",
    "on_phase_epoch_start",
    "on_train_step_start",
    "on_chunk_end",
    "on_train_step_end",
    "on_phase_epoch_end",
    "on_iteration_end",
)
STORE_CALLS = ("allocate", "put", "write", "read", "meta")
SETTINGS = {"critic_epochs": 2, "actor_minibatches": 2, "transactional": True}


class Boom(RuntimeError):
    """The injected fault."""


class Injector(PPOCallback):
    """Raises at the ``n``-th call of ``hook`` (counting from 0) while armed."""

    def __init__(self) -> None:
        self.hook, self.n, self.calls = "", -1, 0
        self.seen: dict[str, list[str]] = {h: [] for h in HOOKS}

    def arm(self, hook: str, n: int) -> None:
        self.hook, self.n, self.calls = hook, n, 0

    def _at(self, hook: str, ctx) -> None:
        if not self.hook:
            self.seen[hook].append(ctx.where())
        elif hook == self.hook:
            self.calls += 1
            if self.calls - 1 == self.n:
                self.hook = ""
                raise Boom(f"injected in {hook}")


for _hook in HOOKS:
    setattr(
        Injector,
        _hook,
        (lambda h: lambda self, ctx, *rest: self._at(h, ctx))(_hook),
    )


class FaultyStore(MemoryReplayStore):
    """Raises at the ``n``-th call of one store method while armed."""

    def __init__(self) -> None:
        super().__init__()
        self.method, self.n, self.calls = "", -1, 0
        self.counts = dict.fromkeys(STORE_CALLS, 0)

    def arm(self, method: str, n: int) -> None:
        self.method, self.n, self.calls = method, n, 0

    def _maybe(self, method: str) -> None:
        if not self.method:
            self.counts[method] += 1
        elif method == self.method:
            self.calls += 1
            if self.calls - 1 == self.n:
                self.method = ""
                raise Boom(f"injected in store.{method}")


for _name in STORE_CALLS:
    setattr(
        FaultyStore,
        _name,
        (
            lambda n: (
                lambda self, *a, **k: (
                    self._maybe(n),
                    getattr(MemoryReplayStore, n)(self, *a, **k),
                )[1]
            )
        )(_name),
    )


def snapshot(ctl):
    return [
        (
            {k: v.clone() for k, v in m.state_dict().items()},
            None if m.optimizer is None else repr(m.optimizer.state_dict()["state"]),
        )
        for m in ctl.trainable_modules()
    ]


def same(a, b) -> bool:
    return all(
        sa[1] == sb[1] and all(torch.equal(sa[0][k], sb[0][k]) for k in sa[0])
        for sa, sb in zip(a, b, strict=True)
    )


def reference_states():
    ctl = make_controller(**SETTINGS)
    states = []
    for i in range(2):
        ctl.run_iteration(stored(ctl, make_rollout(6, i)), iteration=i)
        states.append(snapshot(ctl))
    return states


def test_a_fault_anywhere_in_an_iteration_is_cleaned_up_and_resumable():
    want = reference_states()
    # The points of iteration 1, recorded by an unarmed run of it (chunking depends on the
    # rows only, not on the weights).
    probe, probe_store = Injector(), FaultyStore()
    probed = make_controller(store=probe_store, callbacks=[probe], **SETTINGS)
    probed.run_iteration(stored(probed, make_rollout(6, 1)), iteration=1)
    seen = {h: len(v) for h, v in probe.seen.items()}
    store_calls = dict(probe_store.counts)
    injector, store = Injector(), FaultyStore()
    ctl = make_controller(store=store, callbacks=[injector], **SETTINGS)
    ctl.run_iteration(stored(ctl, make_rollout(6, 0)), iteration=0)
    assert same(snapshot(ctl), want[0])
    points = [("hook", h, n) for h in HOOKS for n in range(seen[h])]
    points += [("store", m, n) for m in STORE_CALLS for n in range(store_calls[m])]
    points += [("finish", role, n) for role in ("critic", "actor") for n in range(2)]
    assert seen["on_chunk_end"] > 6 and len(points) > 30
    problems = []
    for kind, name, n in points:
        start = snapshot(ctl)
        if kind == "hook":
            injector.arm(name, n)
        elif kind == "store":
            store.arm(name, n)
        else:
            module = ctl.critic if name == "critic" else ctl.actor
            module.finish = _failing_once(module, n)
        try:  # the collect phase's put (the rollout source's), then the controller's phases
            ctl.run_iteration(stored(ctl, make_rollout(6, 1), iteration=1), iteration=1)
            problems.append(f"{kind} {name}[{n}]: no error")
            continue
        except IterationError as error:
            message = str(error)
        finally:
            for m in ctl.trainable_modules():
                m.__dict__.pop("finish", None)
        point = f"{kind} {name}[{n}]"
        if not message.startswith("iteration 2, phase ") or "Boom: injected" not in message:
            problems.append(f"{point}: message {message!r}")
        if len(store) != 0:
            problems.append(f"{point}: {len(store)} rows leaked")
        if any(m.step_open for m in ctl.trainable_modules()):
            problems.append(f"{point}: a step is still open")
        if not same(snapshot(ctl), start):
            problems.append(f"{point}: models not restored to the iteration's start")
    assert not problems, "\n".join(problems)
    ctl.run_iteration(stored(ctl, make_rollout(6, 1)), iteration=1)  # the resumed iteration
    assert same(snapshot(ctl), want[1])


def _failing_once(module, n):
    original = type(module).finish
    calls = []

    def finish():
        calls.append(1)
        if len(calls) - 1 == n:
            raise Boom(f"injected in {module.role}.finish")
        return original(module)

    return finish
