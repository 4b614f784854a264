"""Resume-safe settings are declared by the components; settings are their init arguments.

A plug-in engine defined here (nothing in lppo names it) keeps an argument under another
attribute name: it is recorded with its real value, its declared knob may change on resume,
any other knob may not.
"""

from __future__ import annotations

import copy
import os
import pickle
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_resume import fit

from lppo.algorithms import ClippedPPO
from lppo.estimators import GRPO
from lppo.init_args import Record, RecordsInitArgs, record
from lppo.iteration.data import ReplayDataModule
from lppo.modules import ActorModule
from lppo.modules.models import HFCausalLM
from lppo.rollout import HFGenerateEngine
from lppo.run.checkpointing import (
    RESUME_SAFE,
    SETTINGS_VERSION,
    CheckpointError,
    run_settings,
    settings_changes,
)
from lppo.run.system import PPOSystem
from lppo.run.trainer import PPOTrainer
from lppo.tasks import CopyTask


class RenamedEngine(HFGenerateEngine):
    """``HFGenerateEngine`` whose knobs have other names than the attributes holding them."""

    resume_safe = ("per_call",)

    def __init__(self, per_call: int | None = None, ordered: bool = False) -> None:
        super().__init__(batch_size=per_call, sort_by_length=ordered)


def system(engine=None, system_class=PPOSystem, **kwargs):
    spec = HFCausalLM(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    return system_class(
        actor=ActorModule(spec), critic=None, task=CopyTask(), engine=engine, **kwargs
    )


def settings(engine=None, system_class=PPOSystem, **kwargs):
    return run_settings(system(engine, system_class, **kwargs), ReplayDataModule())


def test_a_plugin_engine_is_recorded_with_its_real_init_arguments():
    engine = RenamedEngine(per_call=2, ordered=True)
    assert not hasattr(engine, "per_call")  # read back by name, it would be None
    recorded = settings(engine)
    assert recorded["model.engine.class_path"].endswith("test_resume_safe.RenamedEngine")
    assert recorded["model.engine.init_args.per_call"] == 2
    assert recorded["model.engine.init_args.ordered"] is True
    assert "model.engine.init_args.per_call" in recorded[RESUME_SAFE]


def test_its_declared_knob_applies_on_resume_and_another_is_refused():
    saved = settings(RenamedEngine(per_call=2))
    applicable, refused = settings_changes(saved, settings(RenamedEngine(per_call=3)))
    assert (applicable, refused) == (["model.engine.init_args.per_call: 2 -> 3"], [])
    applicable, refused = settings_changes(saved, settings(RenamedEngine(2, ordered=True)))
    assert (applicable, refused) == ([], ["model.engine.init_args.ordered: False -> True"])


def test_a_task_argument_stored_under_another_name_is_recorded():
    # CopyTask keeps alphabet_size as the alphabet itself.
    assert settings()["model.task.init_args.alphabet_size"] == 8
    saved = run_settings(system(), ReplayDataModule())
    resumed = system()
    resumed.task = CopyTask(alphabet_size=5)
    _, refused = settings_changes(saved, run_settings(resumed, ReplayDataModule()))
    assert refused == ["model.task.init_args.alphabet_size: 8 -> 5"]


def test_the_system_declares_its_own_resume_safe_settings():
    class ThreadedSystem(PPOSystem):
        resume_safe = ("num_threads",)

    recorded = settings(system_class=ThreadedSystem, num_threads=1)
    assert recorded["model.num_threads"] == 1
    assert "model.num_threads" in recorded[RESUME_SAFE]
    changed = settings(system_class=ThreadedSystem, num_threads=2)
    assert settings_changes(recorded, changed) == (["model.num_threads: 1 -> 2"], [])


def test_a_resume_safe_name_that_is_not_a_setting_is_refused():
    class Misdeclared(RenamedEngine):
        resume_safe = ("batch_size",)  # the base's attribute, not this class's argument

    with pytest.raises(TypeError, match=r"Misdeclared.resume_safe names \['batch_size'\]"):
        record(Misdeclared(per_call=2))


@dataclass
class Spec:
    width: int = 4


class Holder(RecordsInitArgs):
    def __init__(self, spec: Spec, factory=None, **kwargs) -> None:
        self.parts = (spec, factory, kwargs)


def test_settings_objects_nest_and_runtime_objects_are_left_out():
    rec = record(Holder(Spec(7), factory=print, scale=2.5))
    assert rec.settings == {
        "spec": Record(f"{__name__}.Spec", {"width": 7}),
        "scale": 2.5,
    }


def test_a_copied_or_pickled_component_keeps_its_record():
    engine = RenamedEngine(per_call=2)
    for clone in (copy.deepcopy(engine), pickle.loads(pickle.dumps(engine))):
        assert record(clone) == record(engine)


def test_checkpoints_written_before_the_resume_safe_entry_still_resume():
    current = settings()
    legacy = {k: v for k, v in current.items() if k not in (RESUME_SAFE, SETTINGS_VERSION)}
    legacy.pop("model.tokenizer_path")  # not recorded then
    legacy["model.actor.init_args.kwargs"] = None  # **kwargs was recorded as None then
    # read back by attribute name then: the copy task keeps alphabet_size under another name
    legacy["model.task.init_args.alphabet_size"] = None
    assert settings_changes(legacy, current) == ([], [])
    # What such a checkpoint did record is still compared.
    moved = dict(legacy, **{"model.seed": current["model.seed"] + 1})
    assert settings_changes(moved, current)[1] == [
        f"model.seed: {current['model.seed'] + 1!r} -> {current['model.seed']!r}"
    ]
    # A checkpoint of today's recorder is compared on every key.
    today = {RESUME_SAFE: [], SETTINGS_VERSION: current[SETTINGS_VERSION]}
    _, refused = settings_changes(dict(legacy, **today), current)
    assert refused == [
        "model.actor.init_args.kwargs: None -> '<absent>'",
        "model.task.init_args.alphabet_size: None -> 8",
        "model.tokenizer_path: '<absent>' -> None",
    ]


def test_checkpoints_written_before_callables_were_recorded_still_resume(tmp_path):
    """Version 1 left out objectives, verifiers, factories and trainer.precision."""
    spec = HFCausalLM(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    actor = ActorModule(spec, objective=ClippedPPO(clip_high=0.28))
    trainer = PPOTrainer(default_root_dir=str(tmp_path), accelerator="cpu")
    built = PPOSystem(actor=actor, critic=None, task=CopyTask())
    current = run_settings(built, ReplayDataModule(), trainer)
    assert current["trainer.precision"] == "32-true"
    objective = "model.actor.init_args.objective"
    assert current[f"{objective}.class_path"] == "lppo.algorithms.objectives.ClippedPPO"
    unrecorded = (SETTINGS_VERSION, "trainer.precision")
    old = {k: v for k, v in current.items() if k not in unrecorded and objective not in k}
    assert settings_changes(old, current) == ([], [])
    # What it recorded is still compared, and a component it did not have is refused.
    moved = dict(old, **{"model.seed": 7})
    assert settings_changes(moved, current)[1] == [f"model.seed: 7 -> {current['model.seed']}"]
    critic = {"model.critic.class_path": "lppo.modules.critic.CriticModule"}
    _, refused = settings_changes(old, dict(current, **critic))  # the helper's has no critic
    assert refused == ["model.critic.class_path: '<absent>' -> 'lppo.modules.critic.CriticModule'"]


@pytest.mark.slow
def test_a_real_resume_applies_the_declared_knob_and_refuses_another(tmp_path):
    fit(tmp_path, 1, engine=RenamedEngine(per_call=2))
    last = str(tmp_path / "checkpoints" / "last.ckpt")
    with pytest.raises(CheckpointError, match=r"model.engine.init_args.ordered: False -> True"):
        fit(tmp_path / "refused", 2, ckpt_path=last, engine=RenamedEngine(2, ordered=True))
    _, resumed = fit(tmp_path / "applied", 2, ckpt_path=last, engine=RenamedEngine(per_call=3))
    assert resumed.engine.batch_size == 3
    assert resumed.current_epoch == 2  # restored from iteration 1, trained iteration 2


def test_a_reward_model_records_its_classifier_spec():
    """Its spec was recorded as None when settings were read back by attribute name."""
    from lppo.modules import RewardModel
    from lppo.modules.models import HFCausalLM

    rec = record(RewardModel(HFCausalLM(hidden_size=32, num_layers=1, num_heads=2), weight=0.5))
    assert isinstance(rec.settings["model"], Record)
    assert rec.settings["model"].settings["hidden_size"] == 32 and rec.settings["weight"] == 0.5


# ------------------------------------------------------- every setting, through `lppo fit`
ROOT = Path(__file__).resolve().parents[2]
SHRUNK = ["--model.rollout.prompts_per_iteration", "4", "--model.rollout.samples_per_prompt", "2"]
ACTOR = "--model.actor.init_args"


def lppo_fit(
    config: str, root: Path, *extra: str, iterations: int = 1
) -> subprocess.CompletedProcess[str]:
    """``lppo fit`` on ``configs/<config>.yaml`` (shrunk) from the repository root."""
    args = ["fit", "--config", f"configs/{config}.yaml", *SHRUNK]
    args += ["--trainer.max_epochs", str(iterations), "--trainer.default_root_dir", str(root)]
    return subprocess.run(
        [sys.executable, "-m", "lppo.run.cli", *args, *extra],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"},
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("config", "changes", "listed"),
    [
        (
            "dataset",
            [
                "--model.task.init_args.path",
                "{tmp}/other.jsonl",
                "--model.task.init_args.verifier",
                "lppo.tasks.verifiers.ExactMatch",
                f"{ACTOR}.off_policy.mode",
                "truncate",
                f"{ACTOR}.objective.init_args.clip_high",
                "0.2",
                f"{ACTOR}.optimizer",
                "torch.optim.SGD",
                "--trainer.precision",
                "64-true",
            ],
            [
                "model.task.init_args.path: 'examples/data/arith.jsonl' -> '{tmp}/other.jsonl'",
                "model.task.init_args.verifier.class_path: 'lppo.tasks.verifiers.NumericAnswer'"
                " -> 'lppo.tasks.verifiers.ExactMatch'",
                "model.actor.init_args.off_policy.init_args.mode: 'auto' -> 'truncate'",
                "model.actor.init_args.objective.init_args.clip_high: 0.28 -> 0.2",
                "model.actor.init_args.optimizer.class_path: '<absent>' -> 'torch.optim.sgd.SGD'",
                "trainer.precision: '32-true' -> '64-true'",
            ],
        ),
        ("tiny", ["--model.task.init_args.alphabet_size", "5"], ["alphabet_size: 8 -> 5"]),
    ],
    ids=["dataset", "tiny"],
)
def test_a_resume_lists_every_changed_setting(tmp_path, config, changes, listed):
    """Data file, verifier, nested objects, factories, task arguments and precision."""
    shutil.copy(ROOT / "examples" / "data" / "arith.jsonl", tmp_path / "other.jsonl")
    first = lppo_fit(config, tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    record = {name: (tmp_path / name).read_bytes() for name in ("summary.json", "reward_curve.png")}
    changes = [c.replace("{tmp}", str(tmp_path)) for c in changes]
    resumed = lppo_fit(config, tmp_path, *changes, "--ckpt_path", "last", iterations=2)
    stderr = resumed.stderr
    assert resumed.returncode != 0
    assert "resuming with settings that differ from the checkpoint's" in stderr
    missing = [line for line in listed if line.replace("{tmp}", str(tmp_path)) not in stderr]
    assert not missing, stderr[-3000:]
    for name, before in record.items():  # the refused start keeps the finished run's record
        assert (tmp_path / name).read_bytes() == before, name


def test_strategy_layout_and_world_size_are_recorded_and_compared_on_resume(tmp_path):
    """ppo_fsdp -> ppo_ddp or 1 -> 2 ranks splits rows and weights otherwise: refused."""
    trainer = PPOTrainer(default_root_dir=str(tmp_path), accelerator="cpu")
    spec = HFCausalLM(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    built = PPOSystem(actor=ActorModule(spec), critic=None, task=CopyTask(), estimator=GRPO())
    saved = run_settings(built, ReplayDataModule(), trainer)
    assert (saved["trainer.world_size"], saved["trainer.strategy.layout"]) == (1, None)
    assert saved["trainer.strategy"].endswith("SingleDeviceStrategy")
    two = dict(saved, **{"trainer.world_size": 2, "trainer.strategy": "lppo.PPOStrategy"})
    two["trainer.strategy.layout"] = "lppo.layouts.fsdp.FSDPLayout"
    _, refused = settings_changes(saved, two)
    assert refused == [
        f"trainer.strategy: {saved['trainer.strategy']!r} -> 'lppo.PPOStrategy'",
        "trainer.strategy.layout: None -> 'lppo.layouts.fsdp.FSDPLayout'",
        "trainer.world_size: 1 -> 2",
    ]
    older = {k: v for k, v in saved.items() if not k.startswith("trainer.")}
    assert settings_changes(dict(older, **{SETTINGS_VERSION: 2}), saved) == ([], [])
