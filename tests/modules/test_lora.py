"""LoRA (PEFT): only adapters train, the reference is the base model itself, and engines and
export get the merged weights."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import transformers
from _builders import filled_store, random_rows, tiny_backbone, tiny_lm

from lppo.iteration.chunks import iter_chunks, read_chunk
from lppo.iteration.data_settings import DataSettings
from lppo.iteration.planner import ChunkPlanner
from lppo.modules import ActorModule, CriticModule, shifted_logprobs
from lppo.modules.lora import AdapterFreeReference, LoRA
from lppo.run.cli import run
from lppo.types import ADVANTAGES, OLD_LOGPROBS, RETURNS, VALUES
from lppo.validation import SettingError

ROOT = Path(__file__).resolve().parents[2]
NAMES = [OLD_LOGPROBS, ADVANTAGES]


def steps(module, names, n: int = 3):
    """``n`` optimizer steps over random rows; returns the store and the last plan's rows."""
    store = filled_store(random_rows(6, seed=2))
    epoch = ChunkPlanner(DataSettings(20, seed=0)).plan(store.meta(), epoch=0)
    for _ in range(n):
        module.begin(epoch.steps[0])
        for chunk in iter_chunks(store, epoch.steps[0], names):
            module.train_chunk(chunk)
        assert module.finish().stepped
    return store, epoch.valid_rows


def lora_actor() -> ActorModule:
    actor = ActorModule(tiny_lm(), lr=1e-2, lora=LoRA(r=4, alpha=8))
    actor.configure_model()
    return actor


def test_only_the_adapters_train_and_hold_optimizer_state():
    actor = lora_actor()
    before = {n: p.detach().clone() for n, p in actor.named_parameters()}
    steps(actor, NAMES)
    changed = {n for n, p in actor.named_parameters() if not torch.equal(p, before[n])}
    trainable = {n for n, p in actor.named_parameters() if p.requires_grad}
    assert changed and changed <= trainable
    assert all(".lora_" in n for n in trainable)
    assert {n for n in changed if "lora_B" in n}  # B starts at 0 and moved
    state = actor.optimizer.state
    assert len(state) == len(trainable)
    adapters = sum(p.numel() for p in actor.trainable_parameters())
    assert adapters < 0.5 * sum(p.numel() for p in actor.parameters())


def test_the_reference_is_the_base_model_and_holds_no_weights():
    actor = lora_actor()
    base = tiny_lm()
    store, rows = steps(actor, NAMES)
    reference = actor.reference_policy()
    assert isinstance(reference, AdapterFreeReference)
    assert not list(reference.parameters()) and not reference.state_dict()
    chunk = read_chunk(store, rows, NAMES)
    got = reference.score(chunk)
    lp, _ = shifted_logprobs(base(input_ids=chunk.input_ids).logits, chunk.input_ids)
    want = torch.where(chunk.response_mask, lp, torch.zeros_like(lp))
    # padding positions aside (attention masks differ), the base model's own log-probs
    m = chunk.response_mask
    torch.testing.assert_close(got[m], want.detach()[m], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(actor.score(chunk)[m], got[m])  # the adapted policy moved


def test_engines_get_the_merged_weights_of_the_trained_policy():
    actor = lora_actor()
    store, rows = steps(actor, NAMES)
    policy = actor.policy()
    assert type(policy) is type(tiny_lm())  # a plain Hugging Face model, not PEFT's
    assert not any(p.requires_grad for p in policy.parameters())
    chunk = read_chunk(store, rows, NAMES)
    ids, mask = chunk.input_ids, chunk.attention_mask.long()
    want, _ = actor.token_logprobs(chunk)
    got, _ = shifted_logprobs(policy(input_ids=ids, attention_mask=mask).logits, ids)
    m = chunk.response_mask
    torch.testing.assert_close(got[m], want.detach()[m], rtol=1e-12, atol=1e-12)
    assert actor.policy() is policy  # refreshed in place, not rebuilt
    steps(actor, NAMES, n=1)
    again, _ = shifted_logprobs(actor.policy()(input_ids=ids, attention_mask=mask).logits, ids)
    assert not torch.equal(again, got)


def test_a_lora_critic_trains_its_head_and_adapters_and_exports_a_plain_backbone(tmp_path):
    from lppo.run.export import load_critic

    critic = CriticModule(tiny_backbone(), lr=1e-2, lora=LoRA(r=4, alpha=8))
    before = {n: p.detach().clone() for n, p in critic.named_parameters()}
    store, rows = steps(critic, [VALUES, RETURNS])
    changed = {n for n, p in critic.named_parameters() if not torch.equal(p, before[n])}
    assert changed == {n for n, p in critic.named_parameters() if p.requires_grad}
    assert any(n.startswith("value_head") for n in changed)
    assert all(".lora_" in n or n.startswith("value_head") for n in changed)

    class System:  # what export_critic reads
        pass

    system = System()
    system.critic = critic
    from lppo.run.export import export_critic

    export_critic(system, tmp_path / "critic")
    loaded = load_critic(tmp_path / "critic", dtype="float64")
    chunk = read_chunk(store, rows, [VALUES, RETURNS])
    m = chunk.response_mask
    torch.testing.assert_close(
        loaded.values(chunk)[m], critic.values(chunk).detach()[m], rtol=1e-10, atol=1e-12
    )


def test_lora_settings_are_checked_at_construction():
    with pytest.raises(SettingError, match=r"model\.actor\.init_args\.lora\.r=0"):
        ActorModule(tiny_lm(), lora=LoRA(r=0))
    with pytest.raises(SettingError, match=r"trim_prompt=true with .*lora"):
        ActorModule(tiny_lm(), lora=LoRA(), trim_prompt=True)
    with pytest.raises(SettingError, match=r"target_modules=\[\] adapts nothing"):
        CriticModule(tiny_backbone(), lora=LoRA(target_modules=[]))


def fit(root: Path, epochs: int, *extra: str) -> None:
    args = ["fit", "--config", str(ROOT / "configs" / "lora.yaml"), "--trainer.max_epochs",
            str(epochs), "--model.rollout.prompts_per_iteration", "8",
            "--trainer.default_root_dir", str(root), *extra]  # fmt: skip
    run(args)


def test_a_lora_fit_exports_an_ordinary_model_and_resumes_bitwise(tmp_path):
    fit(tmp_path / "straight", 3, "--trainer.callbacks+=lppo.callbacks.HFExport")
    fit(tmp_path / "split", 2)
    fit(tmp_path / "split", 3, "--ckpt_path", "last")
    state = [
        torch.load(tmp_path / r / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
        for r in ("straight", "split")
    ]
    assert state[0].keys() == state[1].keys()
    assert not any(k.startswith("reference.") for k in state[0])  # no copy of the weights
    for key in state[0]:
        assert torch.equal(state[0][key], state[1][key]), key

    # The exported directory is an ordinary model with the trained adapters merged in: it
    # gives the trained (adapted) policy's logits.
    exported = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "straight" / "hf" / "policy"
    )
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapted = LoRA(r=16, alpha=32, target_modules=[*targets, "lm_head"]).wrap(
        copy.deepcopy(exported)
    )
    actor = {
        k.removeprefix("actor.model."): v for k, v in state[0].items() if k.startswith("actor.")
    }
    adapted.load_state_dict(actor)
    assert any(v.abs().max() > 0 for k, v in actor.items() if "lora_B" in k)
    ids = torch.randint(
        0, exported.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        want, got = adapted(input_ids=ids).logits, exported(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_adapter_alone_is_exported_and_goes_back_on_the_base_model(tmp_path):
    """``HFExport(adapter=true)`` writes PEFT's adapter directory; on the base model it gives
    the logits of the merged export of the same checkpoint."""
    import peft

    from lppo.modules.models import HFCausalLM
    from lppo.run.export import export_from_checkpoint

    fit(tmp_path / "run", 2, "--trainer.callbacks+=lppo.callbacks.HFExport",
        "--trainer.callbacks.adapter=true")  # fmt: skip
    adapter_dir = tmp_path / "run" / "hf" / "policy"
    assert (adapter_dir / "adapter_config.json").is_file()
    assert not (adapter_dir / "model.safetensors").exists()
    merged_dir = tmp_path / "merged"
    export_from_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt", merged_dir, critic=False)
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir / "policy")
    tok = transformers.AutoTokenizer.from_pretrained(adapter_dir)
    spec = HFCausalLM(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, seed=0)
    base = spec.build(len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    adapted = peft.PeftModel.from_pretrained(base, adapter_dir)
    ids = torch.randint(0, len(tok), (3, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = merged(input_ids=ids).logits, adapted(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_exporting_an_adapter_without_lora_is_refused_at_setup(tmp_path):
    args = ["fit", "--config", str(ROOT / "configs" / "grpo.yaml"), "--trainer.max_epochs", "1",
            "--trainer.callbacks+=lppo.callbacks.HFExport", "--trainer.callbacks.adapter=true",
            "--trainer.default_root_dir", str(tmp_path)]  # fmt: skip
    with pytest.raises(SettingError, match=r"adapter=true but model.actor.init_args.lora is null"):
        run(args)
