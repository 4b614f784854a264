"""``vocab_chunk``: log-probs and entropy slice by slice over the vocabulary, exact and flat.

Float64 random models; every sliced result is compared with the materialized log-softmax
(``vocab_chunk: 0``) on the same weights: log-probs, entropy and every gradient (untied and
tied output projections, temperature, ``trim_prompt``, LoRA on the output projection, the
adapter-free reference), a whole streamed step under every objective × loss aggregation × KL
in the loss × off-policy correction (loss, gradients, grad norm, every metric), and a
``configs/grpo.yaml`` fit in 64-true. No tensor of ``[tokens, vocabulary]`` elements exists,
forward or backward. FSDP2 on 2 ranks: ``tests/layouts/test_fsdp.py``.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import torch
from _builders import tiny_lm
from _objective_sweep import NAMES, combos, sweep_store
from test_parity import CapturingActor, assert_grads_close, rel_close, streamed
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lppo.iteration.data_settings import DataSettings
from lppo.iteration.planner import ChunkPlanner
from lppo.modules import ActorModule
from lppo.modules.lora import LoRA
from lppo.modules.models import HFCausalLM
from lppo.modules.vocab import resolve_vocab_chunk, slice_size, unsliceable
from lppo.run.cli import run
from lppo.types import Chunk
from lppo.validation import SettingError

VOCAB = 50
RTOL = 1e-10
GRPO = Path(__file__).resolve().parents[2] / "configs" / "grpo.yaml"


def llama(seed: int = 0, tied: bool = False, vocab: int = VOCAB, hidden: int = 32) -> nn.Module:
    spec = HFCausalLM(
        hidden_size=hidden,
        num_layers=2,
        num_heads=4,
        intermediate_size=48,
        dtype="float64",
        seed=seed,
    )
    model = spec.build(vocab, 0, 1, 2)
    if tied:  # one Parameter for the embedding and the output projection (SmolLM2's layout)
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def chunk(rows: int = 4, seed: int = 3, vocab: int = VOCAB) -> Chunk:
    """Right-padded rows with random prompt / response lengths and holes in the responses."""
    gen = torch.Generator().manual_seed(seed)
    draw = lambda low, high: int(torch.randint(low, high, (1,), generator=gen))  # noqa: E731
    lengths = [(draw(2, 9), draw(1, 8)) for _ in range(rows)]
    width = max(p + r for p, r in lengths)
    ids = torch.zeros((rows, width), dtype=torch.long)
    attention = torch.zeros(ids.shape, dtype=torch.bool)
    response = torch.zeros(ids.shape, dtype=torch.bool)
    for b, (p, r) in enumerate(lengths):
        ids[b, : p + r] = torch.randint(3, vocab, (p + r,), generator=gen)
        attention[b, : p + r] = True
        response[b, p : p + r] = torch.rand(r, generator=gen) > 0.2
        response[b, p] = True
    return Chunk(tuple(range(rows)), ids, attention, response)


def actor(model: nn.Module, vocab_chunk: int | str, temperature: float = 1.0, **kw) -> ActorModule:
    module = ActorModule(copy.deepcopy(model), vocab_chunk=vocab_chunk, **kw)
    module.configure_model()
    module.temperature = temperature
    return module


def grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def assert_rel(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = max(want.abs().max().item(), 1e-30)
    assert (got - want).abs().max().item() <= RTOL * scale


def compare(plain: ActorModule, sliced: ActorModule, c: Chunk) -> None:
    """Log-probs and entropy on the response, zeros off it, and the gradients of a mix."""
    lp, ent = plain.token_logprobs(c, with_entropy=True)
    lq, eq = sliced.token_logprobs(c, with_entropy=True)
    mask = c.response_mask
    assert lq.shape == eq.shape == mask.shape
    assert_rel(lq[mask], lp[mask])
    assert_rel(eq[mask], ent[mask])
    assert bool((lq[~mask] == 0).all()) and bool((eq[~mask] == 0).all())
    weights = torch.linspace(-1.0, 2.0, int(mask.sum()), dtype=lp.dtype)
    ((lp[mask] * weights).sum() + (ent[mask] * weights.flip(0)).sum()).backward()
    ((lq[mask] * weights).sum() + (eq[mask] * weights.flip(0)).sum()).backward()
    want, got = grads(plain), grads(sliced)
    assert got.keys() == want.keys() and want
    for name in want:
        assert_rel(got[name], want[name])


@pytest.mark.parametrize("size", [1, 7, VOCAB, "auto"])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sliced_logprobs_entropy_and_gradients_equal_the_materialized(size, tied, temperature):
    model = llama(tied=tied)
    plain = actor(model, 0, temperature, trim_prompt=False)
    sliced = actor(model, size, temperature, trim_prompt=False)
    assert sliced.vocab_chunk == size and plain.vocab_chunk == 0
    compare(plain, sliced, chunk())


def test_sliced_with_trim_prompt_and_gpt2_equal_the_materialized():
    model = llama(seed=4)
    compare(actor(model, 0, 1.3), actor(model, 9, 1.3, trim_prompt=True), chunk(seed=8))
    gpt2 = tiny_lm()  # tied embeddings, a bias-free Conv1D body, vocabulary 23
    compare(actor(gpt2, 0, 0.8), actor(gpt2, 5, 0.8), chunk(vocab=23))


def test_sliced_score_equals_the_materialized_and_costs_no_graph():
    model = llama(seed=2)
    c = chunk(rows=5, seed=6)
    got, want = actor(model, 11).score(c), actor(model, 0).score(c)
    assert_rel(got, want)
    assert not got.requires_grad


def test_lora_on_the_output_projection_and_the_adapter_free_reference():
    lora = LoRA(r=4, alpha=8.0, target_modules=["lm_head", "q_proj"], seed=1)
    plain = actor(llama(seed=5), 0, 0.9, lora=lora)
    with torch.no_grad():  # B starts at 0: give the head's adapter an effect and a gradient
        for name, p in plain.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)) * 0.1)
    sliced = copy.deepcopy(plain)
    sliced.vocab_chunk = 6
    c = chunk(seed=9)
    compare(plain, sliced, c)
    assert any("lm_head.lora_A" in n for n in grads(sliced))
    reference_plain, reference_sliced = plain.reference_policy(), sliced.reference_policy()
    assert_rel(reference_sliced.score(c), reference_plain.score(c))
    base = actor(llama(seed=5), 0, 0.9).score(c)
    assert_rel(reference_sliced.score(c), base)


class _OpSizes(TorchDispatchMode):
    """Records the largest element count of any tensor an op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("size", [0, 128])
def test_no_tokens_by_vocabulary_tensor_exists_forward_or_backward(size):
    """With slices of 128 out of 4,096 entries the largest tensor of forward and backward is
    the output projection's own weight (and its gradient); the materialized path's is
    ``[tokens, vocabulary]`` (the control: this check can fail)."""
    vocab, hidden = 4096, 16
    module = actor(llama(vocab=vocab, hidden=hidden), size, 0.8, trim_prompt=False)
    c = chunk(rows=12, seed=1, vocab=vocab)
    tokens = int(c.response_mask.sum())
    with _OpSizes() as sizes:
        lp, ent = module.token_logprobs(c, with_entropy=True)
        (lp.sum() + ent.sum()).backward()
    if size:
        assert sizes.largest <= vocab * hidden < tokens * vocab // 2
    else:
        assert sizes.largest >= tokens * vocab


@pytest.mark.parametrize("objective", ["ppo", "gspo", "cispo"])
def test_a_streamed_step_is_exact_under_every_aggregation_kl_and_correction(objective):
    """Sliced (5 of 23 entries, τ = 0.7) against the materialized actor on the same chunks."""
    rng = random.Random(objective)
    model = tiny_lm()
    for combo in combos(objectives=(objective,)):
        store = sweep_store(n_prompts=3, seed=rng.randint(0, 10_000))
        budget = rng.randint(14, 60)
        settings = DataSettings(budget, seed=rng.randint(0, 99), drop_budget=len(store))
        epoch = ChunkPlanner(settings).plan(store.meta(), epoch=0)
        results = []
        for size in (0, 5):
            module = combo.actor(model, cls=CapturingActor, vocab_chunk=size)
            module.configure_model()
            module.temperature = 0.7
            assert module.vocab_chunk == size
            [(stats, captured)] = streamed(module, store, epoch.steps, NAMES)
            results.append((stats, captured))
        (want, want_grads), (got, got_grads) = results
        assert got.stepped and want.stepped, combo
        assert rel_close(got.grad_norm, want.grad_norm), combo
        assert_grads_close(got_grads, want_grads)
        assert got.metrics.keys() == want.metrics.keys(), combo
        for key, value in want.metrics.items():
            assert rel_close(got.metrics[key], value), (combo, key)


def grpo_fit(root: Path, *extra: str):
    """A 3-iteration ``configs/grpo.yaml`` fit in 64-true into ``root`` (its CLI)."""
    fixed = ["--config", str(GRPO), "--trainer.max_epochs=3", "--trainer.precision=64-true"]
    return run(["fit", *fixed, f"--trainer.default_root_dir={root}", *extra])


def test_a_grpo_fit_in_64_true_trains_the_same_weights_sliced_or_not(tmp_path: Path):
    def fit(name: str, setting: str) -> dict[str, torch.Tensor]:
        cli = grpo_fit(tmp_path / name, f"--model.actor.init_args.vocab_chunk={setting}")
        assert cli.model.actor.vocab_chunk == (0 if setting == "0" else int(setting))
        return {n: p.detach().clone() for n, p in cli.model.actor.named_parameters()}

    plain, sliced = fit("plain", "0"), fit("sliced", "7")
    assert plain.keys() == sliced.keys()
    for name, want in plain.items():
        assert want.dtype == torch.float64
        assert_rel(sliced[name], want)
    assert any(not torch.equal(sliced[n], w) for n, w in plain.items())  # not the same path


# ----------------------------------------------------------------------------- settings
def test_auto_slices_fit_the_chunk():
    assert slice_size("auto", 512, 151_936) == 2048
    assert slice_size("auto", 1, 1024) == 1024
    assert slice_size("auto", 1 << 20, 49_152) == 128  # never below 128 entries
    assert slice_size(100_000, 8, 50) == 50


@pytest.mark.parametrize("bad", [-1, True, 1.5, "big", None])
def test_bad_settings_name_the_key(bad):
    with pytest.raises(SettingError, match=r"model.actor.init_args.vocab_chunk=.*auto"):
        ActorModule(llama(), vocab_chunk=bad)


def test_models_whose_logits_are_not_the_projection_are_refused_or_left_plain():
    import transformers

    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        final_logit_softcapping=30.0,
    )
    gemma = transformers.Gemma3ForCausalLM(config)
    assert "soft-caps" in (unsliceable(gemma) or "")
    assert resolve_vocab_chunk("auto", gemma, "k") == 0
    with pytest.raises(SettingError, match=r"k=64: the model soft-caps.*set k: 0 \(or auto\)"):
        resolve_vocab_chunk(64, gemma, "k")
    config.final_logit_softcapping = None
    assert unsliceable(transformers.Gemma3ForCausalLM(config)) is None


def test_a_subclass_that_overrides_logits_keeps_the_materialized_path():
    class Scaled(ActorModule):
        def logits(self, chunk: Chunk, start: int = 0) -> torch.Tensor:
            return 2.0 * super().logits(chunk, start)

    assert actor(llama(), "auto").vocab_chunk == "auto"
    scaled = Scaled(llama())
    scaled.configure_model()
    assert scaled.vocab_chunk == 0
    with pytest.raises(SettingError, match="Scaled overrides logits"):
        Scaled(llama(), vocab_chunk=64).configure_model()


def test_a_first_slice_of_very_negative_logits_stays_finite():
    """float32 logits near −200 in the first slice: ``exp(−m)`` would overflow there."""
    from lppo.modules.vocab import sliced_logprobs

    head = nn.Linear(8, 12)
    with torch.no_grad():
        head.bias[:4] = -200.0
    hidden = torch.randn(5, 8, requires_grad=True)
    targets = torch.tensor([0, 3, 5, 7, 11])
    lp, ent = sliced_logprobs(hidden, head, targets, 1.0, 4)
    logp = torch.log_softmax(head(hidden), dim=-1)
    torch.testing.assert_close(lp, logp.gather(1, targets[:, None]).squeeze(1))
    want = -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(ent, want)
