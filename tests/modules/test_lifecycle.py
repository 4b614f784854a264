"""The step lifecycle ``begin → train_chunk* → finish | abort`` of actor and critic."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from _builders import filled_store, random_rows, tiny_backbone, tiny_lm

from lppo.algorithms import ClippedPPO
from lppo.iteration.chunks import iter_chunks, padding_chunk, read_chunk
from lppo.iteration.data_settings import DataSettings
from lppo.iteration.planner import ChunkPlanner
from lppo.modules import ActorModule, CriticModule, StepStateError
from lppo.types import (
    ADVANTAGES,
    OLD_LOGPROBS,
    RETURNS,
    VALUES,
    Normalizers,
    StepPlan,
)

ROLES = ["actor", "critic"]
NAMES = {"actor": [OLD_LOGPROBS, ADVANTAGES], "critic": [VALUES, RETURNS]}


class Poisonable:
    """Mixin: scale every chunk's per-token loss by ``poison`` (``inf`` / ``nan`` to break it)."""

    poison = 1.0

    def chunk_loss(self, chunk, sums):
        return super().chunk_loss(chunk, sums) * self.poison


class GradCapture:
    """Mixin recording the complete (unclipped) gradients handed to the optimizer."""

    def on_before_step(self, grad_norm: float) -> None:
        self.captured = {
            n: p.grad.detach().clone() for n, p in self.named_parameters() if p.grad is not None
        }


class Actor(GradCapture, Poisonable, ActorModule):
    pass


class Critic(GradCapture, Poisonable, CriticModule):
    pass


def make(role: str, **kwargs):
    if role == "actor":
        return Actor(tiny_lm(), **kwargs)
    return Critic(tiny_backbone(), **kwargs)


def sgd(lr: float = 1.0):
    return lambda params: torch.optim.SGD(params, lr=lr)


def setup(n: int = 6, seed: int = 0, budget_rows: int = 2, minibatches: int = 1, **rows_kw):
    """A store of ``n`` random rows and an epoch plan with several chunks per step."""
    cols = random_rows(n, seed, **rows_kw)
    store = filled_store(cols)
    longest = max(len(t) for t in cols["input_ids"])
    planner = ChunkPlanner(DataSettings(budget_rows * longest, seed=1, drop_budget=n))
    return store, planner.plan(store.meta(), minibatches=minibatches)


def run_step(module, store, step, role, chunks=None):
    module.begin(step)
    for chunk in chunks if chunks is not None else iter_chunks(store, step, NAMES[role]):
        module.train_chunk(chunk)
    return module.finish()


def count_steps(module) -> list[int]:
    """Count ``module.optimizer.step`` calls: the returned list grows by one per call."""
    opt = module.configure_optimizer()
    calls: list[int] = []
    opt.register_step_pre_hook(lambda *_: calls.append(1))
    return calls


def snapshot(module) -> tuple[dict, dict]:
    return copy.deepcopy(module.state_dict()), copy.deepcopy(module.optimizer.state_dict())


def assert_identical(got, want, path: str = "") -> None:
    """Recursive bitwise equality of (nested) state dicts."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype, path
        assert torch.equal(got, want), f"{path} changed"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), path
        for k in want:
            assert_identical(got[k], want[k], f"{path}/{k}")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_identical(g, w, f"{path}[{i}]")
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def adam_steps(module) -> set[float]:
    return {float(s["step"]) for s in module.optimizer.state.values()}


def params(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


# ------------------------------------------------------------------ call order


@pytest.mark.parametrize("role", ROLES)
def test_calls_out_of_order_raise(role):
    store, epoch = setup()
    step = epoch.steps[0]
    module = make(role)
    chunk = next(iter(iter_chunks(store, step, NAMES[role])))

    with pytest.raises(StepStateError, match=rf"{role}\.train_chunk\(\) called with no open step"):
        module.train_chunk(chunk)
    with pytest.raises(StepStateError, match=rf"{role}\.finish\(\) called with no open step"):
        module.finish()
    module.abort()  # no open step: a no-op
    assert not module.step_open

    module.begin(step)
    assert module.step_open
    with pytest.raises(StepStateError, match=rf"{role}\.begin\(\) called while step .* is open"):
        module.begin(step)
    # The failed begin left the open step intact.
    with pytest.raises(StepStateError, match=rf"{role}\.finish\(\) with no chunk trained"):
        module.finish()
    assert module.step_open
    module.train_chunk(chunk)
    assert module.finish().stepped
    assert not module.step_open
    with pytest.raises(StepStateError, match="no open step"):
        module.finish()


@pytest.mark.parametrize("role", ROLES)
def test_finish_with_only_skipped_chunks_raises(role):
    store, epoch = setup(n=4, invalid_rows=2)
    assert epoch.invalid_rows == (0, 1)
    module = make(role)
    module.begin(epoch.steps[0])
    for rows in ((0,), (0, 1)):
        result = module.train_chunk(read_chunk(store, rows, NAMES[role]))
        assert result.skipped and not result.trained
    with pytest.raises(StepStateError, match=r"no chunk trained .*2 skipped.*abort\(\)"):
        module.finish()
    assert module.forward_count == 0
    module.abort()
    assert run_step(module, store, epoch.steps[0], role).stepped


@pytest.mark.parametrize("role", ROLES)
def test_begin_rejects_plan_without_valid_tokens(role):
    module = make(role)
    plan = StepPlan(chunks=((0,),), normalizers=Normalizers(valid_tokens=0, valid_rows=0))
    with pytest.raises(ValueError, match=rf"{role}\.begin\(\).*no valid token"):
        module.begin(plan)
    assert not module.step_open


# -------------------------------------------------------------- optimizer steps


@pytest.mark.parametrize("role", ROLES)
def test_exactly_one_optimizer_step_per_finish(role):
    store, epoch = setup(n=6, budget_rows=1)
    step = epoch.steps[0]
    assert step.num_chunks > 1
    module = make(role, lr=1e-3)
    calls = count_steps(module)
    for k in (1, 2, 3):
        stats = run_step(module, store, step, role)
        assert stats.stepped
        assert stats.chunks_trained == step.num_chunks
        assert len(calls) == k
        assert adam_steps(module) == {float(k)}
        assert len(module.optimizer.state) == len(module.trainable_parameters())
        assert all(p.grad is None for p in module.parameters())


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("minibatches", [2, 3])
def test_minibatches_take_one_step_each(role, minibatches):
    store, epoch = setup(n=8, budget_rows=2, minibatches=minibatches)
    assert len(epoch.steps) == minibatches
    module = make(role, lr=1e-3)
    calls = count_steps(module)
    total_valid = sum(store.meta().valid_tokens)
    seen: list[int] = []
    for k, step in enumerate(epoch.steps):
        assert step.minibatch == k
        stats = run_step(module, store, step, role)
        assert stats.stepped and stats.minibatch == k
        assert stats.valid_tokens == step.normalizers.valid_tokens
        assert stats.valid_rows == step.normalizers.valid_rows
        seen.extend(i for chunk in step.chunks for i in chunk)
    assert len(calls) == minibatches
    assert adam_steps(module) == {float(minibatches)}
    assert sorted(seen) == sorted(store.meta().ids)
    assert sum(s.normalizers.valid_tokens for s in epoch.steps) == total_valid
    assert sum(s.normalizers.valid_rows for s in epoch.steps) == len(seen)


# ---------------------------------------------------------- non-finite gradient


def _poison_data(role: str, value: float):
    """A chunk mutator putting ``value`` on one valid token of the loss's input."""

    def mutate(chunk):
        if chunk.is_padding:
            return chunk
        chunk = copy.copy(chunk)
        target = "advantages" if role == "actor" else "returns"
        col = getattr(chunk, target).clone()
        b, t = chunk.response_mask.nonzero()[0].tolist()
        col[b, t] = value
        setattr(chunk, target, col)
        return chunk

    return mutate


def _poison_loss(module, value: float):
    module.poison = value
    return lambda chunk: chunk


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("value", [math.inf, math.nan])
@pytest.mark.parametrize("how", ["data", "loss"])
def test_nonfinite_gradient_skips_the_step(role, value, how):
    store, epoch = setup(n=5, budget_rows=1)
    step = epoch.steps[0]
    module = make(role, lr=1e-3, warmup_steps=4)
    calls = count_steps(module)
    first = run_step(module, store, step, role)
    assert first.stepped and len(calls) == 1
    assert module.scheduler.last_epoch == 1
    state, opt_state = snapshot(module)
    lr_before = module.optimizer.param_groups[0]["lr"]

    mutate = _poison_data(role, value) if how == "data" else _poison_loss(module, value)
    chunks = [mutate(c) for c in iter_chunks(store, step, NAMES[role])]
    stats = run_step(module, store, step, role, chunks=chunks)

    assert not stats.stepped
    assert not math.isfinite(stats.grad_norm)
    assert len(calls) == 1
    assert module.scheduler.last_epoch == 1
    assert module.optimizer.param_groups[0]["lr"] == lr_before
    assert all(p.grad is None for p in module.parameters())
    assert not module.step_open
    assert_identical(module.state_dict(), state, "params")
    assert_identical(module.optimizer.state_dict(), opt_state, "optimizer")

    # The next step is a normal one.
    module.poison = 1.0
    before = params(module)
    again = run_step(module, store, step, role)
    assert again.stepped and math.isfinite(again.grad_norm)
    assert again.lr == stats.lr == lr_before
    assert len(calls) == 2
    assert module.scheduler.last_epoch == 2
    assert adam_steps(module) == {2.0}
    assert any(not torch.equal(before[n], p) for n, p in module.named_parameters())


# ------------------------------------------------------------------------ abort


@pytest.mark.parametrize("role", ROLES)
def test_abort_restores_begin_state(role):
    store, epoch = setup(n=6, budget_rows=1)
    step = epoch.steps[0]
    assert step.num_chunks >= 3
    module = make(role, lr=1e-3, warmup_steps=3)
    calls = count_steps(module)
    assert run_step(module, store, step, role).stepped
    assert module.optimizer.state  # a real step happened: the state is non-empty
    state, opt_state = snapshot(module)
    forwards = module.forward_count

    module.begin(step)
    chunks = list(iter_chunks(store, step, NAMES[role]))
    for chunk in chunks[:3]:
        module.train_chunk(chunk)
    assert module.forward_count == forwards + 3
    assert any(p.grad is not None for p in module.parameters())
    module.abort()

    assert not module.step_open
    assert all(p.grad is None for p in module.parameters())
    assert len(calls) == 1
    assert module.scheduler.last_epoch == 1
    assert_identical(module.state_dict(), state, "params")
    assert_identical(module.optimizer.state_dict(), opt_state, "optimizer")
    module.abort()  # idempotent

    # A fresh step after abort behaves as if the aborted one never happened.
    reference = make(role, lr=1e-3, warmup_steps=3)
    run_step(reference, store, step, role)
    want = run_step(reference, store, step, role)
    got = run_step(module, store, step, role)
    assert got.stepped and len(calls) == 2
    assert got.grad_norm == want.grad_norm
    assert got.metrics == want.metrics
    assert_identical(module.state_dict(), reference.state_dict(), "params")


# ----------------------------------------------------- skipped / padding chunks


@pytest.mark.parametrize("role", ROLES)
def test_invalid_and_padding_chunks_run_no_forward(role):
    store, epoch = setup(n=5, budget_rows=1, invalid_rows=1)
    assert epoch.invalid_rows == (0,)
    step = epoch.steps[0]
    names = NAMES[role]

    reference = make(role, optimizer=sgd())
    want = run_step(reference, store, step, role)

    module = make(role, optimizer=sgd())
    module.begin(step)
    n_forward = module.forward_count
    invalid = read_chunk(store, (0,), names)
    assert invalid.num_valid_tokens == 0 and invalid.num_tokens > 0
    result = module.train_chunk(invalid)
    assert result.skipped and not result.trained and result.loss == 0.0
    assert module.forward_count == n_forward
    result = module.train_chunk(padding_chunk())
    assert not result.skipped and not result.trained and result.tokens == 0
    assert module.forward_count == n_forward
    assert all(p.grad is None for p in module.parameters())
    for chunk in iter_chunks(store, step, names):
        module.train_chunk(chunk)
    assert module.forward_count == n_forward + step.num_chunks
    module.train_chunk(padding_chunk())
    module.train_chunk(invalid)
    stats = module.finish()

    assert stats.chunks_skipped == 2
    assert stats.chunks_trained == step.num_chunks + 2  # padding chunks are counted as trained
    assert stats.tokens == want.tokens
    assert stats.grad_norm == want.grad_norm
    assert stats.metrics == want.metrics
    assert_identical(module.state_dict(), reference.state_dict(), "params")


@pytest.mark.parametrize("role", ROLES)
def test_padding_only_step_finishes_without_update(role):
    """A rank whose chunks are all padding still closes the step (its peers hold the data)."""
    module = make(role, optimizer=sgd())
    before = params(module)
    plan = StepPlan(chunks=((), ()), normalizers=Normalizers(valid_tokens=3, valid_rows=1))
    module.begin(plan)
    for _ in plan.chunks:
        module.train_chunk(padding_chunk())
    stats = module.finish()
    assert module.forward_count == 0
    assert stats.chunks_trained == 2 and stats.tokens == 0 and stats.grad_norm == 0.0
    assert_identical(params(module), before, "params")


# ----------------------------------------------------------------- grad clipping


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("max_grad_norm", [1e-3, 1e6])
def test_clipping_applies_exactly_the_clipped_gradient(role, max_grad_norm):
    store, epoch = setup(n=5, budget_rows=2)
    step = epoch.steps[0]
    module = make(role, max_grad_norm=max_grad_norm, optimizer=sgd(lr=1.0))
    before = params(module)
    stats = run_step(module, store, step, role)
    assert stats.stepped

    grads = {n: g.clone() for n, g in module.captured.items()}
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()]))
    assert math.isclose(stats.grad_norm, norm.item(), rel_tol=1e-12)
    clipping = max_grad_norm < stats.grad_norm
    assert clipping == (max_grad_norm == 1e-3)
    torch.nn.utils.clip_grad_norm_(
        [torch.nn.Parameter(torch.empty(0))] + [_with_grad(g) for g in grads.values()],
        max_grad_norm,
    )
    if clipping:
        coef = max_grad_norm / (stats.grad_norm + 1e-6)
        for n, g in grads.items():
            torch.testing.assert_close(g, module.captured[n] * coef, rtol=1e-13, atol=0)
    update_norm_sq = 0.0
    eps = torch.finfo(torch.float64).eps
    for n, p in module.named_parameters():
        # SGD(lr=1) computes ``before - clipped_grad``: allow 1e-10 of the update plus the
        # rounding of the subtraction (a float32 clip coefficient would err by ~1e-7).
        want = grads[n]
        err = (p.detach() - (before[n] - want)).abs()
        bound = 1e-10 * want.abs() + 2 * eps * before[n].abs()
        assert bool((err <= bound).all()), (n, (err - bound).max().item())
        update_norm_sq += want.square().sum().item()
    if clipping:
        assert math.isclose(math.sqrt(update_norm_sq), max_grad_norm, rel_tol=1e-6)


def _with_grad(g: torch.Tensor) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.empty_like(g))
    p.grad = g
    return p


# -------------------------------------------------------------------- scheduler


@pytest.mark.parametrize("role", ROLES)
def test_warmup_ticks_once_per_real_step(role):
    store, epoch = setup(n=4, budget_rows=2)
    step = epoch.steps[0]
    lr, warm = 1e-3, 4
    module = make(role, lr=lr, warmup_steps=warm)
    lrs, stepped = [], []
    for k in range(6):
        module.poison = math.inf if k == 2 else 1.0
        stats = run_step(module, store, step, role)
        lrs.append(stats.lr)
        stepped.append(stats.stepped)
    assert stepped == [True, True, False, True, True, True]
    real = [0, 1, 2, 2, 3, 4]  # real steps taken before each step
    for got, n in zip(lrs, real, strict=True):
        assert math.isclose(got, lr * min(1.0, (n + 1) / warm), rel_tol=1e-12), (lrs, real)
    assert module.scheduler.last_epoch == 5
    assert math.isclose(module.optimizer.param_groups[0]["lr"], lr, rel_tol=1e-12)


@pytest.mark.parametrize("role", ROLES)
def test_custom_scheduler_factory_ticks_once_per_real_step(role):
    store, epoch = setup(n=4, budget_rows=2)
    step = epoch.steps[0]

    def sched(opt):
        return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    module = make(role, lr=1e-2, lr_scheduler=sched, warmup_steps=100)
    for k in range(3):
        module.poison = math.nan if k == 1 else 1.0
        run_step(module, store, step, role)
    assert isinstance(module.scheduler, torch.optim.lr_scheduler.StepLR)
    assert module.scheduler.last_epoch == 2
    assert math.isclose(module.optimizer.param_groups[0]["lr"], 1e-2 / 4, rel_tol=1e-12)


# ------------------------------------------------------------ constructor checks


@pytest.mark.parametrize(
    ("role", "kwargs", "key"),
    [
        ("actor", {"lr": 0.0}, "actor.lr"),
        ("actor", {"lr": -1e-5}, "actor.lr"),
        ("actor", {"max_grad_norm": 0.0}, "actor.max_grad_norm"),
        ("actor", {"loss_aggregation": "mean"}, "actor.loss_aggregation"),
        ("actor", {"warmup_steps": -1}, "actor.warmup_steps"),
        ("actor", {"entropy_coef": -0.1}, "actor.entropy_coef"),
        ("actor", {"kl_loss_coef": -0.1}, "actor.kl_loss_coef"),
        ("actor", {"kl_loss_kind": "k4"}, "actor.kl_loss_kind"),
        ("critic", {"lr": 0.0}, "critic.lr"),
        ("critic", {"max_grad_norm": -1.0}, "critic.max_grad_norm"),
        ("critic", {"loss_aggregation": "sum"}, "critic.loss_aggregation"),
        ("critic", {"warmup_steps": -2}, "critic.warmup_steps"),
        ("critic", {"value_clip": 0.0}, "critic.value_clip"),
        ("critic", {"value_clip": -0.2}, "critic.value_clip"),
    ],
)
def test_bad_constructor_args_name_the_key(role, kwargs, key):
    cls, model = (ActorModule, tiny_lm) if role == "actor" else (CriticModule, tiny_backbone)
    full = f"model.{role}.init_args.{key.rsplit('.', 1)[-1]}="
    with pytest.raises(ValueError, match=full.replace(".", r"\.")):
        cls(model(), **kwargs)


@pytest.mark.parametrize("role", ROLES)
def test_valid_edge_constructor_args(role):
    extra = {"objective": ClippedPPO(dual_clip=None)} if role == "actor" else {"value_clip": None}
    module = make(role, max_grad_norm=None, warmup_steps=0, **extra)
    store, epoch = setup(n=3)
    assert run_step(module, store, epoch.steps[0], role).stepped
    assert module.scheduler is None


def test_explained_variance_keeps_precision_when_returns_are_large():
    """Returns near 1e7 varying by 1e-2: E[x²]−μ² would cancel to noise; the merge does not."""
    store, epoch = setup(n=6, seed=4)
    step = epoch.steps[0]
    g = torch.Generator().manual_seed(0)
    ids = list(store.meta().ids)
    returns = [
        1e7 + 1e-2 * torch.randn(len(t), generator=g, dtype=torch.float64)
        for t in store.read(ids, [RETURNS])[RETURNS]
    ]
    store.write(ids, {RETURNS: returns})
    critic = make("critic", value_clip=None)
    preds, rets = [], []
    for chunk in iter_chunks(store, step, NAMES["critic"]):
        if chunk.is_padding:
            continue
        with torch.no_grad():
            preds.append(critic.values(chunk)[chunk.response_mask])
        rets.append(chunk.returns[chunk.response_mask])
    stats = run_step(critic, store, step, "critic")
    v, r = torch.cat(preds), torch.cat(rets)
    want = 1.0 - float((r - v).var(unbiased=False)) / float(r.var(unbiased=False))
    assert stats.metrics["explained_variance"] == pytest.approx(want, rel=1e-6)
