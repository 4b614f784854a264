"""The run plan: every ``auto`` decided once, logged as one block, saved, compared on resume."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from test_old_logprobs import spec

from lppo import PPOTrainer
from lppo.config import PPOConfig
from lppo.decisions import Decision, collecting, note
from lppo.estimators import GAE, GRPO
from lppo.iteration.data import ReplayDataModule
from lppo.layouts.base import ParallelContext
from lppo.modules import ActorModule, CriticModule
from lppo.modules.tokenizer import build_char_tokenizer
from lppo.rollout import HFGenerateEngine, RolloutSettings
from lppo.run.plan import PLAN_KEY, RunParts, RunPlan, plan_changes
from lppo.run.system import PPOSystem
from lppo.tasks import CopyTask

ROOT = Path(__file__).resolve().parents[2]


def parts(precision: str = "32-true", engine: object = None, **ppo: object) -> RunParts:
    tok = build_char_tokenizer(CopyTask().vocabulary())
    actor = ActorModule(spec(0))
    actor.configure_model(len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    return RunParts(
        actor=actor,
        critic=None,
        reference=None,
        engine=engine if engine is not None else HFGenerateEngine(),  # type: ignore[arg-type]
        estimator=GRPO(),
        ppo=PPOConfig(**ppo),  # type: ignore[arg-type]
        rollout=RolloutSettings(),
        data=ReplayDataModule().settings,
        runner=None,
        parallel=ParallelContext(),
        precision=precision,
    )


def test_every_auto_is_decided_with_its_reason() -> None:
    with collecting() as decisions:
        plan = RunPlan.resolve(parts(actor_minibatches=2))
    values = {d.key: d.value for d in decisions}
    assert plan.ppo.old_logprobs == values["model.ppo.old_logprobs"] == "engine"
    assert values["model.ppo.old_values"] == "score"
    assert values["model.runner"] == "InlineRunner" == type(plan.runner).__name__
    assert values["model.actor.init_args.off_policy.mode"] == "none"
    assert values["data.max_tokens_per_score_chunk"] == str(plan.score_chunk_tokens) == "16384"
    assert "auto" not in values.values()


def test_a_float64_run_takes_pi_old_from_the_actor_not_the_float32_engine() -> None:
    """Lightning converts the models after configure_model: the plan decides at 64-true."""
    with collecting() as decisions:
        plan = RunPlan.resolve(parts("64-true", actor_minibatches=2))
    assert plan.ppo.old_logprobs == "recompute"
    why = next(d.reason for d in decisions if d.key == "model.ppo.old_logprobs")
    assert "generate rounds the float64 policy's logits to float32" in why


def test_the_plan_is_logged_once_saved_and_handed_out(tmp_path, caplog) -> None:
    system = PPOSystem(
        actor=ActorModule(spec(0)),
        critic=CriticModule(spec(1)),
        estimator=GAE(),
        task=CopyTask(),
        rollout=RolloutSettings(prompts_per_iteration=4, samples_per_prompt=2, max_new_tokens=4),
        num_threads=1,
    )
    trainer = PPOTrainer(max_epochs=1, default_root_dir=str(tmp_path), accelerator="cpu")
    with caplog.at_level("INFO"):
        trainer.fit(system, datamodule=ReplayDataModule(max_tokens_per_chunk=64))
    assert caplog.text.count("lppo run plan") == 1
    assert "=auto:" not in caplog.text  # no decision logged outside the block
    assert system.plan is not None and system.controller is not None
    assert system.controller.config is system.plan.ppo
    assert system.runner is system.plan.runner
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    import torch

    saved = torch.load(ckpt, weights_only=False)[PLAN_KEY]
    assert saved == system.plan.state_dict()
    assert saved["model.ppo.old_values"] == {"setting": "auto", "value": "critic"}


def test_resume_refuses_an_auto_that_resolves_otherwise() -> None:
    plan = RunPlan(PPOConfig(), None, 1, [Decision("model.ppo.old_logprobs", "engine")])  # type: ignore[arg-type]
    same = {"model.ppo.old_logprobs": {"setting": "auto", "value": "engine"}}
    assert plan_changes(same, plan) == []
    other = {"model.ppo.old_logprobs": {"setting": "auto", "value": "actor"}}
    assert plan_changes(other, plan) == ["model.ppo.old_logprobs: auto was 'actor', now 'engine'"]
    explicit = {"model.ppo.old_logprobs": {"setting": "actor", "value": "actor"}}
    assert plan_changes(explicit, plan) == []  # a changed setting: settings_changes judges it
    assert plan_changes({}, plan) == []  # a checkpoint written before the plan existed


def test_a_component_on_its_own_logs_only_its_fallbacks(caplog) -> None:
    with caplog.at_level("INFO"):
        note("k.exact", "on")
        note("k.fallback", "off", "why")
    assert "k.exact" not in caplog.text
    assert "k.fallback=auto: off (why)" in caplog.text


def _sources(folder: str) -> dict[str, ast.Module]:
    root = ROOT / folder
    return {str(p.relative_to(ROOT)): ast.parse(p.read_text()) for p in root.rglob("*.py")}


def test_the_controller_reads_no_auto_value() -> None:
    tree = ast.parse((ROOT / "lppo" / "iteration" / "controller.py").read_text())
    autos = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value == "auto"]
    assert autos == [], f"lppo/iteration/controller.py compares with 'auto' at lines {autos}"


@pytest.mark.parametrize("folder", ["lppo", "callbacks"])
def test_no_engine_capability_is_probed_by_name(folder) -> None:
    """Engine capabilities are one typed record (lppo.rollout.capabilities), never getattr."""
    found = []
    for path, tree in _sources(folder).items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            if node.func.id in ("getattr", "hasattr") and node.args:
                target = ast.unparse(node.args[0])
                if "engine" in target.lower():
                    found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    assert found == []


def test_a_key_decided_again_shows_once_with_its_last_value() -> None:
    """trim_prompt: on for the module's body, then off under a layout that shards weights."""
    key = "model.actor.init_args.trim_prompt"
    later = Decision(key, "off", "under FSDPLayout, which shards the weights")
    plan = RunPlan(PPOConfig(), None, 1, [Decision(key, "on"), Decision("k", "v"), later])  # type: ignore[arg-type]
    assert plan.final() == [later, Decision("k", "v")]
    assert plan.state_dict()[key] == {"setting": "auto", "value": "off"}


def test_overlong_shaping_on_multi_turn_rows_is_refused_at_setup() -> None:
    """``max_new_tokens`` bounds each turn there: DAPO's per-response ramp would go below
    ``-overlong_penalty`` on a row of several turns."""
    from lppo.envs import HiddenDigitEnvironment
    from lppo.rollout import MultiTurnEngine
    from lppo.rollout.ray_workers import RayWorkersEngine
    from lppo.validation import SettingError

    for engine in (
        MultiTurnEngine(HFGenerateEngine(), HiddenDigitEnvironment()),
        RayWorkersEngine(engine=MultiTurnEngine(HFGenerateEngine(), HiddenDigitEnvironment())),
    ):
        with pytest.raises(SettingError, match=r"overlong_buffer=1 with a multi-turn engine"):
            RunPlan.resolve(parts(engine=engine, overlong_buffer=1))
    RunPlan.resolve(parts(engine=MultiTurnEngine(HFGenerateEngine(), HiddenDigitEnvironment())))


@pytest.mark.parametrize("estimator", ["GRPO", "RLOO"])
def test_a_group_estimator_with_one_sample_per_prompt_is_refused_at_setup(estimator) -> None:
    """GRPO would train on zero advantages; RLOO would fail inside iteration 1."""
    import dataclasses

    from lppo import estimators
    from lppo.validation import SettingError

    one = dataclasses.replace(parts(), rollout=RolloutSettings(samples_per_prompt=1))
    one = dataclasses.replace(one, estimator=getattr(estimators, estimator)())
    refused = rf"samples_per_prompt=1 with model.estimator={estimator}"
    with pytest.raises(SettingError, match=refused):
        RunPlan.resolve(one)
    RunPlan.resolve(dataclasses.replace(one, estimator=estimators.ReinforcePP()))


@pytest.mark.parametrize(
    "rollout",
    [{"max_staleness": 1_000_000}, {"dynamic_sampling_rounds": 1_000_000, "samples_per_prompt": 2}],
)
def test_knobs_whose_size_is_memory_are_bounded_at_setup(rollout) -> None:
    """A million admitted copies of the policy, or a million refill rounds of prompts drawn at
    admission, are refused before they exhaust the machine (they took 5 and 10.9 GB in under
    three minutes, still growing)."""
    import dataclasses

    from lppo.validation import SettingError

    big = dataclasses.replace(parts(), rollout=RolloutSettings(**rollout))
    with pytest.raises(SettingError, match=r"admitted iterations would hold .* GiB free; lower"):
        RunPlan.resolve(big)
    small = {k: 2 if k == "max_staleness" else v for k, v in rollout.items()}
    small = {k: 10 if k == "dynamic_sampling_rounds" else v for k, v in small.items()}
    RunPlan.resolve(dataclasses.replace(parts(), rollout=RolloutSettings(**small)))


def test_a_multi_turn_opening_longer_than_max_tokens_is_refused_at_setup() -> None:
    """The plan asks the engine (inside Ray workers too) to measure the opening of the task's
    longest prompt, before anything starts: it failed inside iteration 1 with a traceback. A tool
    environment's opening is the chat template's rendering (system prompt, tools' schemas)."""
    import dataclasses

    from _tools import add
    from test_tools import _tiny_tokenizer

    from lppo.envs import HiddenDigitEnvironment, HiddenDigitTask, ToolEnvironment
    from lppo.rollout import MultiTurnEngine
    from lppo.rollout.ray_workers import RayWorkersEngine
    from lppo.validation import SettingError

    task = HiddenDigitTask(prompt="d:" * 10)  # 21 tokens with BOS
    tok = build_char_tokenizer(task.vocabulary())
    for max_tokens, ok in ((21, False), (22, True)):
        digit = MultiTurnEngine(HFGenerateEngine(), HiddenDigitEnvironment(), max_tokens=max_tokens)
        for engine in (digit, RayWorkersEngine(engine=digit)):
            run = dataclasses.replace(parts(engine=engine), task=task, tokenizer=tok)
            if ok:
                RunPlan.resolve(run)
            else:
                with pytest.raises(SettingError, match=r"max_tokens=21: .* 21 tokens"):
                    RunPlan.resolve(run)
    tools = ToolEnvironment([add], template="hermes")
    engine = MultiTurnEngine(HFGenerateEngine(), tools, max_tokens=64)
    run = dataclasses.replace(parts(engine=engine), task=task, tokenizer=_tiny_tokenizer())
    with pytest.raises(SettingError, match=r"max_tokens=64: .* \(the environment's opening"):
        RunPlan.resolve(run)
    tools.close()


def test_ray_workers_that_cannot_be_placed_are_refused_before_ray_starts(tmp_path) -> None:
    """configs/ray_workers.yaml at lag 1: 2 workers x 2 sets and TransferQueue's 2 CPUs on
    ``trainer.ray.num_cpus: 4`` (Ray queued the second set; its start timed out after 300 s)."""
    import os
    import subprocess
    import sys
    import tempfile

    ray_dir = Path(tempfile.mkdtemp(prefix="lppo-ray-"))  # short: Ray's socket paths fit
    ray_dir.rmdir()
    args = ["fit", "--config", "configs/ray_workers.yaml", "--model.rollout.max_staleness", "1",
            "--trainer.default_root_dir", str(tmp_path / "run"),
            "--trainer.ray.temp_dir", str(ray_dir)]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "lppo.run.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert (
        "lppo: error: SettingError: trainer.ray.num_cpus=4 cannot place this run's Ray actors: "
        "RayWorkersEngine's workers take 2 logical CPUs x 2 (model.rollout.max_staleness=1: "
        "ThreadRunner drives a second set), the replay store's services 2: 6 in all"
    ) in proc.stderr
    assert "Raise trainer.ray.num_cpus to 6" in proc.stderr
    assert "or set model.rollout.max_staleness: 0." in proc.stderr
    assert not ray_dir.exists()  # refused before Ray started
