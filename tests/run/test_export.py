"""Hugging Face export: round trips of policy, tokenizer and critic; checkpoint == callback.

Everything loads offline (``local_files_only=True``). Fits are tiny: 4 prompts x 2 samples,
1-2 iterations, under ``tmp_path``.
"""

from __future__ import annotations

import random
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from _builders import tiny_lm
from lppo.callbacks import HFExport
from safetensors.torch import load_file
from torch import nn

from lppo.iteration.data import ReplayDataModule
from lppo.modules import ActorModule, CriticModule
from lppo.modules.models import HFCausalLM
from lppo.run.cli import run
from lppo.run.export import (
    CRITIC_DIR,
    POLICY_DIR,
    export_critic,
    export_from_checkpoint,
    export_policy,
    export_system,
    load_critic,
    main,
)
from lppo.run.system import PPOSystem, RolloutSettings
from lppo.run.trainer import PPOTrainer
from lppo.tasks import CopyTask
from lppo.types import Chunk

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"
TEMPERATURE = 0.5  # a power of two: dividing the logits by it is exact

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter:UserWarning")


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")


def spec(seed: int, dtype: str = "float32") -> HFCausalLM:
    return HFCausalLM(
        hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, seed=seed, dtype=dtype
    )


def make_system(dtype: str = "float32", critic: CriticModule | None = None) -> PPOSystem:
    return PPOSystem(
        actor=ActorModule(spec(0, dtype), lr=1e-2),
        critic=critic or CriticModule(spec(1, dtype), lr=1e-2),
        task=CopyTask(),
        rollout=RolloutSettings(
            prompts_per_iteration=4, samples_per_prompt=2, max_new_tokens=4, temperature=TEMPERATURE
        ),
        num_threads=1,
    )


def chunk() -> Chunk:
    """Two left-padded rows plus one full row of ids valid for the copy task's tokenizer."""
    ids = torch.tensor([[0, 0, 1, 5, 6, 7, 4], [1, 5, 6, 7, 8, 9, 4], [0, 1, 9, 8, 4, 9, 8]])
    mask = ids != 0
    return Chunk(row_ids=(0, 1, 2), input_ids=ids, attention_mask=mask, response_mask=mask)


def state(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "model.safetensors"))


def assert_same_dirs(a: Path, b: Path) -> None:
    """Same files with the same bytes (safetensors and JSON are written deterministically)."""
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for rel in files:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel


@pytest.fixture(scope="module", params=["float32", "float64"])
def trained(request: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[PPOSystem, Path]:
    """A system fitted 2 iterations with ``HFExport(critic=True, every_n_iterations=1)``."""
    root = tmp_path_factory.mktemp(f"fit-{request.param}")
    system = make_system(request.param)
    export = HFExport(critic=True, every_n_iterations=1)
    trainer = PPOTrainer(max_epochs=2, default_root_dir=str(root), callbacks=[export])
    trainer.fit(system, datamodule=ReplayDataModule(max_tokens_per_chunk=24))
    hf = root / "hf"
    assert export.exported == [hf / "iteration-0000", hf / "iteration-0001", hf]
    return system, hf


# ------------------------------------------------------------------------- round trips
def test_policy_round_trip_gives_the_same_logits(trained: tuple[PPOSystem, Path]) -> None:
    system, hf = trained
    actor = system.actor
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        hf / POLICY_DIR, local_files_only=True
    )
    dtype = next(actor.model.parameters()).dtype
    assert loaded.dtype == dtype
    fresh = spec(0, str(dtype).removeprefix("torch.")).build(len(system.tokenizer), 0, 1, 2)
    assert not torch.equal(fresh.lm_head.weight, loaded.lm_head.weight)  # it was trained
    c = chunk()
    actor.model.eval()
    loaded.eval()
    with torch.no_grad():
        ours = actor.model(input_ids=c.input_ids, attention_mask=c.attention_mask.long()).logits
        theirs = loaded(input_ids=c.input_ids, attention_mask=c.attention_mask.long()).logits
        scaled = actor.logits(c)
    assert torch.equal(ours, theirs)
    gen = transformers.GenerationConfig.from_pretrained(hf / POLICY_DIR, local_files_only=True)
    assert gen.do_sample and gen.temperature == TEMPERATURE
    assert gen.max_new_tokens == system.rollout.max_new_tokens
    assert torch.equal(scaled, theirs / gen.temperature)  # what the actor trained on


def test_tokenizer_round_trip_gives_the_same_ids(trained: tuple[PPOSystem, Path]) -> None:
    system, hf = trained
    ours = system.tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(hf / POLICY_DIR, local_files_only=True)
    assert theirs.get_vocab() == ours.get_vocab()
    specials = ("pad_token_id", "bos_token_id", "eos_token_id", "unk_token_id")
    assert [getattr(theirs, k) for k in specials] == [getattr(ours, k) for k in specials]
    assert theirs.padding_side == "left"
    texts = [p.text + p.answer for p in system.task.sample_prompts(20, random.Random(0))]
    assert theirs(texts, padding=True)["input_ids"] == ours(texts, padding=True)["input_ids"]
    for text in texts:
        ids = theirs(text)["input_ids"]
        assert ids[0] == ours.bos_token_id
        assert theirs.decode(ids, skip_special_tokens=True) == text


def test_exported_policy_generates_like_the_actor(trained: tuple[PPOSystem, Path]) -> None:
    system, hf = trained
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        hf / POLICY_DIR, local_files_only=True
    )
    tok = transformers.AutoTokenizer.from_pretrained(hf / POLICY_DIR, local_files_only=True)
    prompts = [p.text for p in system.task.sample_prompts(4, random.Random(1))]
    enc = tok(prompts, padding=True, return_tensors="pt")
    greedy = {"do_sample": False, "max_new_tokens": 4}
    system.actor.model.eval()
    ours = system.actor.model.generate(**enc, **greedy)
    assert torch.equal(loaded.generate(**enc, **greedy), ours)


def test_critic_round_trip_gives_the_same_values(trained: tuple[PPOSystem, Path]) -> None:
    system, hf = trained
    critic = load_critic(hf / CRITIC_DIR)
    assert type(critic.backbone) is type(system.critic.backbone)
    assert next(critic.parameters()).dtype == next(system.critic.parameters()).dtype
    c = chunk()
    system.critic.eval()
    critic.eval()
    with torch.no_grad():
        assert torch.equal(critic.values(c), system.critic.values(c))


def test_periodic_exports_are_written_per_iteration(trained: tuple[PPOSystem, Path]) -> None:
    _, hf = trained
    assert_same_dirs(hf / "iteration-0001" / POLICY_DIR, hf / POLICY_DIR)
    assert_same_dirs(hf / "iteration-0001" / CRITIC_DIR, hf / CRITIC_DIR)
    first, last = state(hf / "iteration-0000" / POLICY_DIR), state(hf / POLICY_DIR)
    assert first.keys() == last.keys()
    assert any(not torch.equal(first[k], last[k]) for k in first)


def test_critic_with_a_causal_lm_backbone_keeps_its_class(tmp_path: Path) -> None:
    """A causal-LM backbone (hidden states from ``hidden_states[-1]``) is reloaded as one."""
    ours = CriticModule(tiny_lm(seed=4), head_seed=2)
    export_critic(types.SimpleNamespace(critic=ours), tmp_path)  # type: ignore[arg-type]
    theirs = load_critic(tmp_path)
    assert type(theirs.backbone) is type(ours.backbone)
    with torch.no_grad():
        assert torch.equal(theirs.values(chunk()), ours.values(chunk()))


# ----------------------------------------------------------------------- custom critic
class MLPHeadCritic(CriticModule):
    def __init__(self, head_hidden: int = 8, **kwargs: Any) -> None:
        self.head_hidden = head_hidden
        super().__init__(**kwargs)

    def make_value_head(self, hidden_size: int) -> nn.Module:
        with torch.random.fork_rng():
            torch.manual_seed(3)
            return nn.Sequential(
                nn.Linear(hidden_size, self.head_hidden), nn.Tanh(), nn.Linear(self.head_hidden, 1)
            )


def test_custom_value_head_needs_its_class(tmp_path: Path) -> None:
    system = make_system(critic=MLPHeadCritic(backbone=spec(1)))
    system.configure_model()
    out = export_critic(system, tmp_path)
    with pytest.raises(ValueError, match=r"saved by .*MLPHeadCritic.*pass critic_cls="):
        load_critic(out)
    critic = load_critic(out, MLPHeadCritic, head_hidden=8)
    with torch.no_grad():
        assert torch.equal(critic.values(chunk()), system.critic.values(chunk()))


# ------------------------------------------------------------------------------ errors
def test_export_before_the_model_is_built_fails_clearly(tmp_path: Path) -> None:
    system = make_system()
    for export in (export_policy, export_critic, export_system):
        with pytest.raises(RuntimeError, match=r"not built yet\. Call system\.configure_model"):
            export(system, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_files_fail_clearly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "checkpoints" / "last.ckpt"
    with pytest.raises(FileNotFoundError, match=r"checkpoint not found: .*last\.ckpt"):
        export_from_checkpoint(missing, tmp_path / "out")
    with pytest.raises(SystemExit) as exc:
        main([str(missing), str(tmp_path / "out")])
    assert exc.value.code == 2
    assert "checkpoint not found" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="is not an exported critic"):
        load_critic(tmp_path)


def test_checkpoint_written_from_python_is_refused(trained: tuple[PPOSystem, Path]) -> None:
    _, hf = trained
    ckpt = hf.parent / "checkpoints" / "last.ckpt"
    with pytest.raises(ValueError, match="does not rebuild a PPOSystem"):
        export_from_checkpoint(ckpt, hf.parent / "out")


def test_invalid_every_n_iterations() -> None:
    with pytest.raises(ValueError, match="every_n_iterations=0"):
        HFExport(every_n_iterations=0)


def test_only_global_rank_zero_exports(tmp_path: Path) -> None:
    class Rank1:
        is_global_zero = False
        default_root_dir = str(tmp_path)
        current_epoch = 0

    system = make_system()
    system.configure_model()
    export = HFExport(every_n_iterations=1)
    export.on_train_epoch_end(Rank1(), system)  # type: ignore[arg-type]
    export.on_train_end(Rank1(), system)  # type: ignore[arg-type]
    # Every rank takes part in gathering the weights (ppo_fsdp); only rank zero writes.
    assert export.exported == [] and not (tmp_path / "hf").exists()


# --------------------------------------------------------------------------- from the CLI
def test_checkpoint_export_equals_the_export_at_the_end_of_fit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run(
        [
            "fit",
            "--config",
            str(TINY),
            "--trainer.max_epochs",
            "2",
            "--model.rollout.prompts_per_iteration",
            "4",
            "--model.rollout.samples_per_prompt",
            "2",
            "--trainer.default_root_dir",
            str(tmp_path),
            "--trainer.callbacks+=lppo.callbacks.HFExport",
            "--trainer.callbacks.critic=true",
        ]
    )
    hf = tmp_path / "hf"
    assert (tmp_path / "summary.json").is_file()  # monitoring callbacks ran under the run dir
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    paths = export_from_checkpoint(ckpt, tmp_path / "from-ckpt")
    assert paths == {"policy": tmp_path / "from-ckpt" / POLICY_DIR, "critic": paths["critic"]}
    assert_same_dirs(tmp_path / "from-ckpt", hf)
    capsys.readouterr()
    main([str(ckpt), str(tmp_path / "from-main"), "--no-critic"])
    assert "policy: " in capsys.readouterr().out
    assert_same_dirs(tmp_path / "from-main" / POLICY_DIR, hf / POLICY_DIR)
    assert not (tmp_path / "from-main" / CRITIC_DIR).exists()
    for module in ("lppo.run.export", "lppo.export"):  # the command line, old -m path too
        out = tmp_path / f"from-{module}"
        cmd = [sys.executable, "-m", module, str(ckpt), str(out), "--no-critic"]
        done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert_same_dirs(out / POLICY_DIR, hf / POLICY_DIR)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        hf / POLICY_DIR, local_files_only=True
    )
    system = PPOSystem.load_from_checkpoint(ckpt, map_location="cpu")
    c = chunk()
    with torch.no_grad():
        ours = system.actor.model.eval()(input_ids=c.input_ids).logits
        assert torch.equal(loaded.eval()(input_ids=c.input_ids).logits, ours)
        assert torch.equal(load_critic(hf / CRITIC_DIR).values(c), system.critic.values(c))
