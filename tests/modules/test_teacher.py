"""``model.teacher``: scored exactly, frozen, trained on the same under any chunking, refused
where it cannot apply."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lppo.config import PPOConfig
from lppo.estimators import GRPO, Distill
from lppo.iteration.data import ReplayDataModule
from lppo.iteration.hooks import PPOCallback
from lppo.modules import ActorModule, Teacher
from lppo.modules.models import HFCausalLM
from lppo.modules.tokenizer import build_char_tokenizer
from lppo.run.system import PPOSystem, RolloutSettings
from lppo.run.trainer import PPOTrainer
from lppo.tasks import CopyTask
from lppo.types import INPUT_IDS, OLD_LOGPROBS, RESPONSE_MASK, TEACHER_LOGPROBS
from lppo.validation import SettingError

TEMPERATURE = 0.8


def spec(seed: int) -> HFCausalLM:
    return HFCausalLM(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=seed)


class TeacherColumns(PPOCallback):
    """Copies the rows' scored columns out of the store as the actor's first epoch starts."""

    def __init__(self) -> None:
        self.columns: list[dict[str, list[torch.Tensor]]] = []
        self.teacher_at_start: dict[str, torch.Tensor] = {}
        self.actor_at_start: dict[str, torch.Tensor] = {}

    def on_phase_epoch_start(self, ctx) -> None:
        teacher = ctx.trainer.lightning_module.teacher
        if teacher is not None and not self.teacher_at_start:
            self.teacher_at_start = {n: p.clone() for n, p in teacher.named_parameters()}
            actor = ctx.trainer.lightning_module.actor
            self.actor_at_start = {n: p.detach().clone() for n, p in actor.named_parameters()}
        if ctx.phase == "actor" and ctx.epoch == 0:
            names = [INPUT_IDS, RESPONSE_MASK, OLD_LOGPROBS, TEACHER_LOGPROBS]
            self.columns.append(ctx.store.read(ctx.row_ids, names))


def fit(
    root: Path,
    budget: int,
    estimator=None,
    teacher=True,
    iterations: int = 2,
    ckpt_path: str | None = None,
):
    system = PPOSystem(
        actor=ActorModule(spec(0), lr=1e-2),
        critic=None,
        task=CopyTask(),
        estimator=estimator if estimator is not None else Distill(GRPO(), coef=0.5),
        teacher=Teacher(spec(5)) if teacher else None,
        rollout=RolloutSettings(
            prompts_per_iteration=6, samples_per_prompt=2, max_new_tokens=5, temperature=TEMPERATURE
        ),
        ppo=PPOConfig(actor_epochs=2, actor_minibatches=2),
        num_threads=1,
    )
    seen = TeacherColumns()
    trainer = PPOTrainer(
        max_epochs=iterations,
        default_root_dir=str(root),
        accelerator="cpu",
        precision="64-true",
        callbacks=[seen],
    )
    data = ReplayDataModule(max_tokens_per_chunk=budget)
    trainer.fit(system, datamodule=data, ckpt_path=ckpt_path)
    return system, seen


def own_logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """log softmax(logits / T) of each next token of one row, by a plain full forward pass."""
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0, :-1].to(torch.float64)
    picked = torch.log_softmax(logits / TEMPERATURE, dim=-1).gather(-1, ids[1:, None])[:, 0]
    return torch.cat([torch.zeros(1, dtype=torch.float64), picked])


def test_teacher_logprobs_are_the_teacher_models_own_and_it_stays_frozen(tmp_path: Path):
    system, seen = fit(tmp_path, budget=24)
    teacher = system.teacher
    assert teacher is not None and not teacher.training
    assert all(not p.requires_grad and p.dtype == torch.float64 for p in teacher.parameters())
    for name, p in teacher.named_parameters():  # as the first iteration found them
        assert torch.equal(p, seen.teacher_at_start[name]), name
    assert len(seen.columns) == 2
    for cols in seen.columns:
        for ids, mask, got in zip(
            cols[INPUT_IDS], cols[RESPONSE_MASK], cols[TEACHER_LOGPROBS], strict=True
        ):
            want = own_logprobs(teacher.model, ids)
            torch.testing.assert_close(got[mask], want[mask], rtol=1e-10, atol=1e-12)
            assert float(got[~mask].abs().sum()) == 0.0
    # the sample log shows it, token by token
    logged = [json.loads(line) for line in (tmp_path / "samples" / "iteration-0001.jsonl").open()]
    tokens = [t for row in logged for t in row["tokens"] if t["trained"]]
    assert tokens and all(isinstance(t["teacher_logprob"], float) for t in tokens)


def test_distillation_trains_the_same_weights_under_any_chunk_budget(tmp_path: Path):
    small, small_seen = fit(tmp_path / "small", budget=16)
    large, _ = fit(tmp_path / "large", budget=400)
    for (name, a), (_, b) in zip(
        small.actor.named_parameters(), large.actor.named_parameters(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=name)
    start = small_seen.actor_at_start
    assert any(not torch.equal(p, start[n]) for n, p in small.actor.named_parameters())  # trained


def test_a_teacher_nothing_reads_is_refused(tmp_path: Path):
    with pytest.raises(
        SettingError, match=r"model.teacher is set, but nothing .*'teacher_logprobs'"
    ):
        fit(tmp_path, budget=24, estimator=GRPO(), iterations=1)


def test_distill_without_a_teacher_is_refused(tmp_path: Path):
    with pytest.raises(
        SettingError, match=r"Distill reads the column 'teacher_logprobs'.*model.teacher"
    ):
        fit(tmp_path, budget=24, teacher=False, iterations=1)


def test_a_teacher_with_another_tokenizer_is_refused(tmp_path: Path):
    other = build_char_tokenizer(CopyTask(alphabet_size=12).vocabulary())
    model = spec(5).build(len(other), other.pad_token_id, other.bos_token_id, other.eos_token_id)
    model.save_pretrained(tmp_path / "teacher")
    other.save_pretrained(tmp_path / "teacher")
    system = PPOSystem(
        actor=ActorModule(spec(0)),
        critic=None,
        task=CopyTask(),
        estimator=Distill(),
        teacher=Teacher(HFCausalLM(pretrained_path=str(tmp_path / "teacher"))),
        rollout=RolloutSettings(prompts_per_iteration=2, samples_per_prompt=2, max_new_tokens=4),
    )
    key = "model.teacher.init_args.model.init_args.pretrained_path"
    with pytest.raises(
        SettingError, match=rf"{key}=.*not the run's.*share the student's tokenizer"
    ):
        system.configure_model()


def test_a_resumed_distillation_run_equals_the_uninterrupted_one(tmp_path: Path):
    straight, _ = fit(tmp_path / "straight", budget=24, iterations=3)
    fit(tmp_path / "split", budget=24, iterations=2)
    resumed, _ = fit(tmp_path / "split", budget=24, iterations=3, ckpt_path="last")
    a, b = straight.state_dict(), resumed.state_dict()
    assert a.keys() == b.keys() and any(k.startswith("teacher.") for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_a_given_teacher_model_with_too_few_embeddings_is_refused():
    tok = build_char_tokenizer(CopyTask().vocabulary())
    small = spec(5).build(len(tok) - 3, tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    with pytest.raises(SettingError, match=r"model.teacher.init_args.model: .* token embeddings"):
        Teacher(small).check_tokenizer(tok)


def test_a_teacher_path_that_is_not_a_directory_is_refused_naming_the_key(tmp_path: Path):
    tok = build_char_tokenizer(CopyTask().vocabulary())
    teacher = Teacher(HFCausalLM(pretrained_path=str(tmp_path / "not-trained-yet")))
    key = r"model.teacher.init_args.model.init_args.pretrained_path='.*not-trained-yet'"
    with pytest.raises(SettingError, match=rf"{key} is not a directory"):
        teacher.check_tokenizer(tok)
