"""Observation tokens of a multi-turn row are never trained on: their logits change nothing."""

from __future__ import annotations

import random

import pytest
import torch
from _builders import filled_store

from lppo.envs import HiddenDigitEnvironment, HiddenDigitTask
from lppo.iteration.chunks import read_chunk
from lppo.modules import ActorModule
from lppo.modules.models import HFCausalLM
from lppo.modules.tokenizer import build_char_tokenizer
from lppo.rollout import HFGenerateEngine, MultiTurnEngine, RolloutSettings
from lppo.stats import SumStats
from lppo.types import ADVANTAGES, INPUT_IDS, OLD_LOGPROBS, RESPONSE_MASK, REWARD

TASK = HiddenDigitTask()
TOK = build_char_tokenizer(TASK.vocabulary())


@pytest.fixture(scope="module")
def chunk_and_actor():
    ids = (len(TOK), TOK.pad_token_id, TOK.bos_token_id, TOK.eos_token_id)
    # untrimmed and materialized: the hook below perturbs the LM head's output at every
    # position (sliced, observation positions are not even computed: test_vocab.py)
    actor = ActorModule(
        HFCausalLM(dtype="float64", seed=3), entropy_coef=0.01, trim_prompt=False, vocab_chunk=0
    )
    actor.configure_model(*ids)
    engine = MultiTurnEngine(
        HFGenerateEngine(), HiddenDigitEnvironment(max_calls=2), max_turns=3, max_tokens=24
    )
    engine.setup(actor.policy(), TOK, RolloutSettings(max_new_tokens=4))
    out = engine.generate(TASK.sample_prompts(8, random.Random(0)), samples_per_prompt=2, seed=1)
    g = torch.Generator().manual_seed(0)
    cols = {
        INPUT_IDS: out.input_ids,
        RESPONSE_MASK: out.response_mask,
        OLD_LOGPROBS: [
            lp.double() + 0.05 * torch.randn(len(lp), generator=g) for lp in out.gen_logprobs
        ],
        ADVANTAGES: [
            torch.randn(len(m), generator=g, dtype=torch.float64) for m in out.response_mask
        ],
        REWARD: [torch.tensor(0.0) for _ in out.input_ids],
    }
    store = filled_store(cols)
    chunk = read_chunk(store, list(range(len(out))), [OLD_LOGPROBS, ADVANTAGES])
    observation = chunk.attention_mask & ~chunk.response_mask
    observation[:, 0] = False
    first_turn = out.prompt_lengths.max()
    observation[:, : int(first_turn)] = False  # the prompt: not an observation
    assert observation.any()  # some episodes called the environment
    return chunk, actor, observation


def loss_and_grads(actor, chunk, perturb: torch.Tensor | None):
    """The masked actor loss and its gradients; ``perturb`` adds noise to the logits that
    predict the marked tokens (position ``t - 1`` predicts token ``t``)."""
    handle = None
    if perturb is not None:
        noise = torch.zeros_like(perturb, dtype=torch.float64)
        noise[:, :-1] = perturb[:, 1:].double()

        def hook(module, inputs, output):
            g = torch.Generator().manual_seed(1)
            return output + 30.0 * noise[..., None] * torch.randn(
                output.shape, generator=g, dtype=output.dtype
            )

        handle = actor.model.get_output_embeddings().register_forward_hook(hook)
    try:
        actor.zero_grad(set_to_none=True)
        per_token = actor.chunk_loss(chunk, SumStats())
        loss = (per_token * chunk.response_mask).sum()
        loss.backward()
    finally:
        if handle is not None:
            handle.remove()
    grads = {n: p.grad.clone() for n, p in actor.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def test_perturbing_observation_logits_changes_neither_loss_nor_gradient(chunk_and_actor):
    chunk, actor, observation = chunk_and_actor
    loss, grads = loss_and_grads(actor, chunk, None)
    loss2, grads2 = loss_and_grads(actor, chunk, observation)
    assert torch.equal(loss, loss2)
    for name, grad in grads.items():
        assert torch.equal(grad, grads2[name]), name


def test_perturbing_policy_logits_does_change_them(chunk_and_actor):
    """The check above can fail: the same perturbation on policy tokens moves the loss."""
    chunk, actor, _ = chunk_and_actor
    loss, _ = loss_and_grads(actor, chunk, None)
    loss2, _ = loss_and_grads(actor, chunk, chunk.response_mask)
    assert not torch.allclose(loss, loss2)
