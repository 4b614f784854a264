"""``bench/race_update.py`` measures the difference of two updates, and no difference as none."""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import race_update  # noqa: E402


def tiny_model(seed: int = 0) -> torch.nn.Module:
    """A random two-layer Llama with a 64-entry vocabulary."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    return transformers.LlamaForCausalLM(config).eval()


def moved(model: torch.nn.Module, scale: float, seed: int = 1) -> torch.nn.Module:
    """A copy of ``model`` with every weight moved by ``scale`` × one fixed random direction."""
    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return out


def test_equal_updates_compare_equal() -> None:
    base = tiny_model()
    after = moved(base, 1e-3)
    report = race_update.weight_updates(base, after, copy.deepcopy(after))
    assert report["cosine"] == pytest.approx(1.0)
    assert report["norm_ratio_lppo_over_trl"] == pytest.approx(1.0)
    assert report["rel_diff"] == 0.0
    assert report["same_sign_fraction"] == 1.0


def test_a_larger_and_a_different_update_are_measured() -> None:
    base = tiny_model()
    report = race_update.weight_updates(base, moved(base, 2e-3), moved(base, 1e-3))
    assert report["norm_ratio_lppo_over_trl"] == pytest.approx(2.0, rel=1e-3)
    assert report["cosine"] == pytest.approx(1.0, abs=1e-6)
    other = race_update.weight_updates(base, moved(base, 1e-3, seed=2), moved(base, 1e-3))
    assert abs(other["cosine"]) < 0.1
    assert 0.4 < other["same_sign_fraction"] < 0.6
    assert other["worst_tensors"][0]["rel_diff"] >= other["worst_tensors"][-1]["rel_diff"]


def test_policy_change_follows_the_update() -> None:
    base = tiny_model()
    rows = [
        {"prompt": [1, 2, 3], "response": [4, 5], "advantage": 1.0},
        {"prompt": [1, 2, 3], "response": [6, 7, 8], "advantage": -1.0},
        {"prompt": [9, 9], "response": [10], "advantage": 0.0},
    ]
    change = race_update.policy_change(base, {"same": copy.deepcopy(base)}, rows)["same"]
    assert change == {
        "mean_logprob_shift_positive_advantage": 0.0,
        "mean_logprob_shift_negative_advantage": 0.0,
        "kl_from_start_k3": 0.0,
    }
    change = race_update.policy_change(base, {"moved": moved(base, 0.05)}, rows)["moved"]
    assert change["kl_from_start_k3"] > 0
    assert change["mean_logprob_shift_positive_advantage"] != 0


def sampled_rows(model: torch.nn.Module, greedy: bool, groups: int = 24, size: int = 8) -> list:
    """``groups`` prompts × ``size`` responses of 4 tokens drawn from ``model`` at temperature 1."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    with torch.no_grad():
        for g in range(groups):
            prompt = [1 + g % 60, 2 + g % 50, 3]
            for _ in range(size):
                seq = list(prompt)
                for _ in range(4):
                    probs = torch.softmax(model(torch.tensor([seq])).logits[0, -1], dim=-1)
                    pick = probs.argmax() if greedy else torch.multinomial(probs, 1, generator=gen)
                    seq.append(int(pick))
                rows.append({"prompt": prompt, "response": seq[len(prompt) :]})
    return rows


def test_sampler_check_tells_a_faithful_sampler_from_a_greedy_one() -> None:
    model = tiny_model()
    faithful = race_update.sampler_check(model, sampled_rows(model, greedy=False))
    assert faithful["tokens"] == 24 * 8 * 4
    assert abs(faithful["mean_nll_minus_entropy"]) < 3 * faithful["standard_error"]
    greedy = race_update.sampler_check(model, sampled_rows(model, greedy=True, groups=6))
    assert greedy["mean_nll_minus_entropy"] < -10 * greedy["standard_error"]
    assert greedy["first_token_pairs_agreeing"] == 1.0
    assert greedy["first_token_pairs_agreeing_if_independent"] < 0.5
