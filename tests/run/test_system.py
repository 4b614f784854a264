"""PPOSystem under PPOTrainer: lppo hooks reach user callbacks, in order; setup validation."""

from __future__ import annotations

import pytest

from lppo.config import PPOConfig
from lppo.errors import IterationError
from lppo.iteration.data import ReplayDataModule
from lppo.iteration.hooks import PPOCallback
from lppo.modules import ActorModule, CriticModule
from lppo.modules.models import HFCausalLM
from lppo.run.system import PPOSystem, RolloutSettings
from lppo.run.trainer import PPOTrainer
from lppo.tasks import ArithmeticTask, CopyTask
from lppo.validation import SettingError


def spec(seed: int) -> HFCausalLM:
    return HFCausalLM(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, seed=seed)


def system(task=None, **ppo) -> PPOSystem:
    return PPOSystem(
        actor=ActorModule(spec(0), lr=1e-3),
        critic=CriticModule(spec(1), lr=1e-3),
        task=task or CopyTask(),
        rollout=RolloutSettings(prompts_per_iteration=4, samples_per_prompt=2, max_new_tokens=4),
        ppo=PPOConfig(**ppo),
        num_threads=1,
    )


class Recorder(PPOCallback):
    def __init__(self, fail_at: str | None = None):
        self.events: list[tuple] = []
        self.fail_at = fail_at

    def _rec(self, name, ctx=None):
        self.events.append((name, ctx.phase, ctx.epoch) if ctx is not None else (name,))
        if name == self.fail_at:
            raise RuntimeError(f"failing in {name}")

    def on_train_epoch_start(self, trainer, pl_module):
        self._rec("train_epoch_start")

    def on_train_epoch_end(self, trainer, pl_module):
        self._rec("train_epoch_end")

    def on_rollout_end(self, ctx):
        self._rec("rollout_end", ctx)

    def on_phase_epoch_start(self, ctx):
        self._rec("phase_epoch_start", ctx)

    def on_train_step_start(self, ctx):
        self._rec("train_step_start", ctx)

    def on_chunk_end(self, ctx, result):
        self._rec("chunk_end", ctx)

    def on_train_step_end(self, ctx):
        self._rec("train_step_end", ctx)

    def on_phase_epoch_end(self, ctx):
        self._rec("phase_epoch_end", ctx)

    def on_iteration_end(self, ctx, result):
        self._rec("iteration_end", ctx)

    def on_ppo_abort(self, ctx, error):
        self.events.append(("abort", ctx.phase, ctx.epoch, str(error)))


def run(tmp_path, callbacks, iterations=1, **ppo):
    trainer = PPOTrainer(max_epochs=iterations, default_root_dir=str(tmp_path), callbacks=callbacks)
    data = ReplayDataModule(max_tokens_per_chunk=24)
    trainer.fit(system(**ppo), datamodule=data)
    return trainer, data


def test_hooks_reach_user_callbacks_in_order(tmp_path):
    rec = Recorder()
    trainer, data = run(tmp_path, [rec], critic_epochs=2, actor_minibatches=2)
    names = [e[0] for e in rec.events]
    assert names[0] == "train_epoch_start" and names[1] == "rollout_end"
    assert names[-2:] == ["iteration_end", "train_epoch_end"]
    epochs = [(e[1], e[2]) for e in rec.events if e[0] == "phase_epoch_start"]
    assert epochs == [("critic", 0), ("critic", 1), ("actor", 0)]
    assert names.count("train_step_start") == 2 + 2
    assert names.count("train_step_end") == 4
    assert names.count("chunk_end") >= 4
    assert trainer.global_step == 2
    assert len(data.store) == 0


def test_failure_in_a_user_hook_aborts_and_releases(tmp_path):
    rec = Recorder(fail_at="phase_epoch_end")
    with pytest.raises(IterationError, match=r"iteration 1, phase critic, epoch 1"):
        run(tmp_path, [rec])
    aborts = [e for e in rec.events if e[0] == "abort"]
    assert aborts == [("abort", "critic", 0, "failing in phase_epoch_end")]


def test_token_budget_below_longest_row_fails_at_setup(tmp_path):
    trainer = PPOTrainer(max_epochs=1, default_root_dir=str(tmp_path))
    model = system(task=ArithmeticTask(max_value=99))
    with pytest.raises(ValueError, match=r"data.max_tokens_per_chunk=8 .* raise"):
        trainer.fit(model, datamodule=ReplayDataModule(max_tokens_per_chunk=8))
    assert model.actor.optimizer is None or all(
        len(s) == 0 for s in model.actor.optimizer.state.values()
    )


class _ShortVocabulary(CopyTask):
    """A copy task whose vocabulary() forgets a letter its prompts use."""

    def vocabulary(self) -> str:
        return super().vocabulary().replace("c", "")


def test_a_task_character_the_tokenizer_lacks_fails_at_setup(tmp_path):
    trainer = PPOTrainer(max_epochs=1, default_root_dir=str(tmp_path))
    with pytest.raises(SettingError, match=r"to <unk>: 'c' .*_ShortVocabulary\.vocabulary\(\)"):
        trainer.fit(system(task=_ShortVocabulary()), datamodule=ReplayDataModule())


@pytest.mark.parametrize("resize", [False, True])
def test_a_policy_checkpoint_of_another_vocabulary_needs_resize_embeddings(tmp_path, resize):
    checkpoint = tmp_path / "policy"
    HFCausalLM(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64).build(
        vocab_size=8, pad_token_id=0, bos_token_id=1, eos_token_id=2
    ).save_pretrained(checkpoint)
    model = system()
    model.actor = ActorModule(HFCausalLM(pretrained_path=str(checkpoint)), lr=1e-3)
    model.resize_embeddings = resize
    trainer = PPOTrainer(max_epochs=1, default_root_dir=str(tmp_path))
    if not resize:
        with pytest.raises(SettingError, match=r"model\.actor\.init_args\.model\.init_args\.pre"):
            trainer.fit(model, datamodule=ReplayDataModule(max_tokens_per_chunk=24))
        return
    trainer.fit(model, datamodule=ReplayDataModule(max_tokens_per_chunk=24))
    assert model.actor.model.get_input_embeddings().num_embeddings == len(model.tokenizer)


def test_resize_embeddings_must_be_a_bool():
    with pytest.raises(SettingError, match=r"model\.resize_embeddings='yes' must be true or"):
        PPOSystem(actor=ActorModule(spec(0)), critic=None, task=CopyTask(), resize_embeddings="yes")
