"""megatron actor and critic on CPU: forward/backward, value head, lifecycle, parity, abort."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from _builders import filled_store, random_rows
from _mbuilders import VOCAB, main_grads, make, make_hf
from hypothesis import given, settings
from hypothesis import strategies as st

from lppo.iteration.chunks import iter_chunks
from lppo.iteration.data_settings import DataSettings
from lppo.iteration.planner import ChunkPlanner
from lppo.modules.megatron import MegatronActor, MegatronCritic
from lppo.modules.megatron.model import require_megatron
from lppo.modules.megatron.ops import vocab_parallel_logprobs
from lppo.parallel import SINGLE
from lppo.types import ADVANTAGES, OLD_LOGPROBS, RETURNS, VALUES

NAMES = {"actor": [OLD_LOGPROBS, ADVANTAGES], "critic": [VALUES, RETURNS]}
ROLES = ["actor", "critic"]
#: Streamed vs merged through the same megatron model: float64 round-off only (RoPE tables
#: are float32 in megatron, but identical for every chunking).
RTOL = 1e-10
#: megatron vs Hugging Face on the same weights: HF's Llama RMSNorm runs in float32.
HF_RTOL = 2e-6


class Capture:
    def on_before_step(self, grad_norm: float) -> None:
        self.captured = main_grads(self)


class CapturingActor(Capture, MegatronActor):
    pass


class CapturingCritic(Capture, MegatronCritic):
    pass


CAPTURING = {"actor": CapturingActor, "critic": CapturingCritic}


def rel_close(a: float, b: float, tol: float = RTOL) -> bool:
    return a == b or abs(a - b) <= tol * max(abs(a), abs(b), 1e-300)


def assert_grads_close(got, want, tol=RTOL):
    assert got.keys() == want.keys()
    for name in want:
        scale = want[name].abs().max().item()
        err = (got[name] - want[name]).abs().max().item()
        assert err <= tol * max(scale, 1e-30), f"{name}: max err {err:.3e} vs {scale:.3e}"


def plan_for(n, seed, budget_slack=0, budget=None, invalid=0, minibatches=1):
    cols = random_rows(n, seed, invalid_rows=invalid)
    store = filled_store(cols)
    longest = max(len(t) for t in cols["input_ids"])
    planner = ChunkPlanner(
        DataSettings(budget or longest + budget_slack, seed=1, drop_budget=invalid)
    )
    return store, planner.plan(store.meta(), epoch=0, minibatches=minibatches)


def run_step(module, store, step, role):
    module.begin(step)
    for chunk in iter_chunks(store, step, NAMES[role]):
        module.train_chunk(chunk)
    return module.finish()


def test_missing_extra_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron.core", None)
    with pytest.raises(ImportError, match=r"constraints.txt -e '\.\[megatron\]'"):
        require_megatron()


@pytest.mark.parametrize("role", ROLES)
def test_forward_backward_accumulates_into_megatrons_grad_buffer(role):
    store, epoch = plan_for(4, 0, budget_slack=0)
    module = make(role)
    step = epoch.steps[0]
    module.begin(step)
    chunks = list(iter_chunks(store, step, NAMES[role]))
    assert len(chunks) >= 2
    module.train_chunk(chunks[0])
    first = main_grads(module)
    module.train_chunk(chunks[1])
    second = main_grads(module)
    assert all(p.grad is None for p in module.parameters())  # the buffer holds them
    assert all(first[n].abs().sum() > 0 for n in first), "every parameter gets a gradient"
    assert any(not torch.equal(first[n], second[n]) for n in first), "chunks accumulate"
    stats = module.finish()
    assert stats.stepped and stats.grad_norm > 0
    assert all(g.abs().sum() == 0 for g in main_grads(module).values()), "zeroed after finish"


def test_value_head_replaces_the_output_layer_and_matches_hugging_face():
    store, epoch = plan_for(5, 2, budget=10_000)
    critic, hf = make("critic"), make_hf("critic")
    [chunk] = list(iter_chunks(store, epoch.steps[0], NAMES["critic"]))
    gpt = critic.backbone.module
    assert type(gpt.output_layer).__name__ == "ValueHead"
    assert not any(n.startswith("output_layer.weight") for n, _ in gpt.named_parameters())
    got, want = critic.values(chunk), hf.values(chunk)
    assert got.shape == chunk.input_ids.shape and (got[:, 0] == 0).all()
    real = chunk.attention_mask  # padding positions attend differently and are never used
    assert (got - want)[real].abs().max() <= HF_RTOL * want[real].abs().max()


@pytest.mark.parametrize("role", ROLES)
def test_one_step_matches_the_hugging_face_module(role):
    """Same weights, same rows: the megatron step is the HF step (losses, diagnostics, norm)."""
    store, epoch = plan_for(6, 4, budget_slack=5)
    step = epoch.steps[0]
    kwargs = {"max_grad_norm": None}
    got = run_step(make(role, **kwargs), store, step, role)
    want = run_step(make_hf(role, **kwargs), store, step, role)
    assert rel_close(got.grad_norm, want.grad_norm, HF_RTOL)
    for key, value in want.metrics.items():
        if "clip" in key:  # an indicator flips when a ratio sits at the clip edge
            continue
        assert rel_close(got.metrics[key], value, 1e-5), (key, got.metrics[key], value)


def test_vocab_parallel_logprobs_equal_log_softmax_on_one_rank():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, VOCAB, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, VOCAB, (3, 7), generator=g)
    lp, ent = vocab_parallel_logprobs(logits, targets, SINGLE, with_entropy=True)
    logp = torch.log_softmax(logits, -1)
    want_lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    want_ent = -(logp.exp() * logp).sum(-1)
    assert lp.dtype == torch.float64
    torch.testing.assert_close(lp, want_lp, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(ent, want_ent, rtol=1e-13, atol=1e-13)
    (gl,) = torch.autograd.grad((lp + 0.3 * ent).sum(), logits)
    (gw,) = torch.autograd.grad((want_lp + 0.3 * want_ent).sum(), logits)
    torch.testing.assert_close(gl, gw, rtol=1e-12, atol=1e-12)


@settings(max_examples=4)
@given(
    role=st.sampled_from(ROLES),
    n=st.integers(3, 7),
    data_seed=st.integers(0, 10_000),
    invalid=st.integers(0, 1),
    aggregation=st.sampled_from(["token_mean", "seq_mean_token_mean"]),
    entropy_coef=st.sampled_from([0.0, 0.01]),
)
def test_streamed_chunks_equal_one_merged_batch(
    role, n, data_seed, invalid, aggregation, entropy_coef
):
    """One chunk per row vs all rows in one chunk: same loss, grads, norm and diagnostics."""
    kwargs = {"max_grad_norm": None, "loss_aggregation": aggregation}
    if role == "actor":
        kwargs["entropy_coef"] = entropy_coef
    results = []
    for budget in (None, 100_000):
        store, epoch = plan_for(n, data_seed, budget=budget, invalid=invalid)
        module = make(role, cls=CAPTURING[role], **kwargs)
        stats = run_step(module, store, epoch.steps[0], role)
        results.append((stats, module.captured, epoch.steps[0].num_chunks))
    (s1, g1, c1), (s2, g2, c2) = results
    assert c2 == 1 and c1 >= 2
    assert rel_close(s1.grad_norm, s2.grad_norm)
    assert_grads_close(g1, g2)
    for key in s1.metrics:
        tol = 1e-8 if key == "explained_variance" else RTOL
        assert rel_close(s1.metrics[key], s2.metrics[key], tol), key


@pytest.mark.parametrize("role", ROLES)
def test_minibatches_take_one_step_each_and_clip(role):
    store, epoch = plan_for(8, 5, budget_slack=3, minibatches=2)
    module = make(role, max_grad_norm=1e-3, cls=CAPTURING[role])
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    versions = []
    for step in epoch.steps:
        stats = run_step(module, store, step, role)
        assert stats.stepped and stats.grad_norm > 1e-3
        versions.append(module.weights_version)
    assert versions == [1, 2]
    assert any(not torch.equal(p, before[n]) for n, p in module.named_parameters())


@pytest.mark.parametrize("role", ROLES)
def test_abort_restores_params_and_optimizer_state_bitwise(role):
    store, epoch = plan_for(6, 1, budget_slack=0)
    step = epoch.steps[0]
    module = make(role, lr=1e-3)
    assert run_step(module, store, step, role).stepped
    assert module.optimizer.state
    state = copy.deepcopy(module.state_dict())
    opt_state = copy.deepcopy(module.optimizer.state_dict())
    module.begin(step)
    for chunk in list(iter_chunks(store, step, NAMES[role]))[:2]:
        module.train_chunk(chunk)
    assert any(g.abs().sum() > 0 for g in main_grads(module).values())
    module.abort()
    assert not module.step_open
    assert all(g.abs().sum() == 0 for g in main_grads(module).values())
    now = module.state_dict()
    assert now.keys() == state.keys()
    for name, tensor in state.items():
        if isinstance(tensor, torch.Tensor):  # megatron's `_extra_state` entries are None
            assert torch.equal(now[name], tensor), name
    got = module.optimizer.state_dict()
    for pid, want in opt_state["state"].items():
        for key, tensor in want.items():
            assert torch.equal(got["state"][pid][key], tensor), (pid, key)
    # the next step is the one an uninterrupted module takes
    reference = make(role, lr=1e-3)
    run_step(reference, store, step, role)
    want = run_step(reference, store, step, role)
    assert run_step(module, store, step, role).grad_norm == want.grad_norm


def test_policy_is_a_hugging_face_llama_refreshed_after_steps():
    store, epoch = plan_for(4, 7, budget_slack=2)
    actor = make("actor", lr=1e-2)
    hf = make_hf("actor")
    policy = actor.policy()
    assert type(policy).__name__ == "LlamaForCausalLM"
    assert policy.state_dict().keys() == hf.model.state_dict().keys()
    for name, tensor in hf.model.state_dict().items():
        assert torch.equal(policy.state_dict()[name], tensor), name
    assert not any(p is q for p in policy.parameters() for q in actor.parameters())
    run_step(actor, store, epoch.steps[0], "actor")
    again = actor.policy()
    assert again is policy  # refreshed in place: an engine holding it samples the new weights
    exported = actor.spec.export_state(actor.model, SINGLE)
    for name, tensor in again.state_dict().items():
        assert torch.equal(tensor, exported[name]), name
    assert not torch.equal(
        again.state_dict()["model.embed_tokens.weight"],
        hf.model.state_dict()["model.embed_tokens.weight"],
    )


def test_reference_is_a_frozen_megatron_twin_holding_the_actor_s_weights():
    """reference_policy(): its own megatron model (no shared tensor), the actor's weights and
    log-probs, frozen: the actor's steps leave it as it was. A plain deep copy is refused."""
    store, epoch = plan_for(6, 3, budget_slack=2)
    chunk = next(iter_chunks(store, epoch.steps[0], NAMES["actor"]))
    actor = make("actor", lr=1e-2)
    run_step(actor, store, epoch.steps[0], "actor")  # weights other than the spec's
    reference = actor.reference_policy()
    assert type(reference.ddp).__name__ == "DistributedDataParallel"
    assert reference.spec is not actor.spec and reference.optimizer is None
    ours = {id(t) for t in [*actor.parameters(), *actor.buffers()]}
    assert not ours & {id(t) for t in [*reference.parameters(), *reference.buffers()]}
    assert not any(p.requires_grad for p in reference.parameters()) and not reference.training
    assert torch.equal(reference.score(chunk), actor.score(chunk))
    frozen = reference.score(chunk)
    run_step(actor, store, epoch.steps[0], "actor")
    assert not torch.equal(actor.score(chunk), frozen)
    assert torch.equal(reference.score(chunk), frozen)
    with pytest.raises(TypeError, match="reference_policy"):
        copy.deepcopy(actor)


def test_no_data_parallel_sync_before_finish_and_exactly_one_in_it():
    """Chunks only accumulate; megatron's bucket reduce starts once per step, in finish."""
    store, epoch = plan_for(6, 3, budget_slack=0)
    module = make("critic")
    calls: list[str] = []
    for group in module.ddp.bucket_groups:
        original = group.start_grad_sync

        def counted(*args, _original=original, **kwargs):
            calls.append("start")
            return _original(*args, **kwargs)

        group.start_grad_sync = counted
    step = epoch.steps[0]
    module.begin(step)
    chunks = list(iter_chunks(store, step, NAMES["critic"]))
    assert len(chunks) >= 3
    for chunk in chunks:
        module.train_chunk(chunk)
    assert calls == []
    module.finish()
    assert calls == ["start"] * len(module.ddp.bucket_groups)


def test_groups_of_another_layout_or_size_are_refused_at_setup():
    """A megatron module takes ppo_megatron's groups of megatron's sizes; checked when the
    controller hands the module its groups (setup), not at the first step after a rollout."""
    from lppo.layouts import MegatronLayout
    from lppo.layouts.base import ParallelContext
    from lppo.parallel import ProcessGroup
    from lppo.validation import SettingError

    module = make("actor")
    assert isinstance(module.parallel.layout, MegatronLayout)  # megatron's own until handed
    with pytest.raises(SettingError, match=r"trainer\.strategy=ppo_megatron"):
        module.parallel = ParallelContext()  # ppo_ddp's layout: its reduce reads .grad
    with pytest.raises(SettingError, match=r"model\.actor\.init_args\.model\.init_args\.tensor"):
        module.parallel = ParallelContext(ProcessGroup(size=2, rank=0), layout=MegatronLayout())
    module.parallel = MegatronLayout().context(1, 0)  # megatron's own sizes: accepted


def test_vocab_chunk_is_refused_with_the_reason_and_auto_stays_off():
    """Megatron already splits the vocabulary over tensor-parallel ranks: an explicit
    ``vocab_chunk`` is refused naming the key and why; ``auto`` resolves to off."""
    from lppo.validation import SettingError

    assert make("actor").vocab_chunk == 0
    with pytest.raises(SettingError, match=r"vocab_chunk=64: MegatronActor splits the vocab"):
        make("actor", vocab_chunk=64)
