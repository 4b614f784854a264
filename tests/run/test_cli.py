"""The ``lppo`` command line: help, print_config round trip, overrides, outputs, loggers, errors.

Every run shrinks ``configs/tiny.yaml`` (4 prompts x 2 samples, 1-2 iterations) and writes under
``tmp_path``. Runs are in-process (``lppo.run.cli.run``); only ``lppo fit --help`` goes through the
console script.
"""

from __future__ import annotations

import csv
import dataclasses
import inspect
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from _cli import lppo_cli

from lppo.config import PPOConfig
from lppo.iteration.data import ReplayDataModule
from lppo.modules import ActorModule, CriticModule
from lppo.run.cli import run
from lppo.run.digests import write_digest
from lppo.run.system import PPOSystem, RolloutSettings
from lppo.runtime.ray_runtime import RaySettings

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"
SMALL = [
    "--model.rollout.prompts_per_iteration",
    "4",
    "--model.rollout.samples_per_prompt",
    "2",
]
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

# In-process runs pass `args` while pytest's own argv is in sys.argv; that is intended here.
pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter:UserWarning")

#: Metric names that dashboards rely on (``perf/tokens_per_second/<phase>`` checked apart).
STABLE_METRICS = (
    "rollout/reward_mean",
    "rollout/invalid_rows",
    "rollout/dropped_rows",
    "critic/loss",
    "critic/grad_norm",
    "critic/explained_variance",
    "critic/clip_fraction",
    "actor/loss",
    "actor/grad_norm",
    "actor/clip_fraction",
    "actor/approx_kl",
    "actor/entropy",
    "perf/peak_memory_bytes",
)


def fit_args(root: Path, *extra: str, iterations: int = 1) -> list[str]:
    """``fit`` on the shrunk tiny config, writing under ``root``."""
    return [
        "fit",
        "--config",
        str(TINY),
        *SMALL,
        "--trainer.max_epochs",
        str(iterations),
        "--trainer.default_root_dir",
        str(root),
        *extra,
    ]


def init_params(cls: type) -> list[str]:
    """Names of the keyword parameters of ``cls.__init__``."""
    params = inspect.signature(cls.__init__).parameters.values()
    return [p.name for p in params if p.name != "self" and p.kind is p.POSITIONAL_OR_KEYWORD]


def flat(text: str) -> str:
    """``text`` with all whitespace runs collapsed (help output wraps lines)."""
    return " ".join(text.split())


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in OFFLINE_ENV.items():
        monkeypatch.setenv(key, value)


# --------------------------------------------------------------------------------- help
def test_console_script_help_documents_every_knob() -> None:
    lppo = Path(sys.executable).with_name("lppo")
    proc = subprocess.run(
        [str(lppo), "fit", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **OFFLINE_ENV},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    options = [
        "--config",
        "--print_config",
        "--ckpt_path",
        "--trainer.max_epochs",
        "--trainer.default_root_dir",
        "--trainer.logger",
        "--trainer.callbacks",
        "--model.actor",
        "--model.critic",
        "--model.task",
        "--model.actor.help",
        "--model.critic.help",
        "--model.task.help",
    ]
    options += [f"--data.{name}" for name in init_params(ReplayDataModule)]
    options += [f"--model.{name}" for name in init_params(PPOSystem)]
    options += [f"--model.rollout.{f.name}" for f in dataclasses.fields(RolloutSettings)]
    options += [f"--model.ppo.{f.name}" for f in dataclasses.fields(PPOConfig)]
    options += [f"--trainer.ray.{f.name}" for f in dataclasses.fields(RaySettings)]
    missing = [opt for opt in options if f"{opt} " not in out and f"{opt}\n" not in out]
    assert not missing, f"not documented in `lppo fit --help`: {missing}"
    text = flat(out)
    # Docstrings become the option descriptions; actor / critic / task are picked by class.
    assert "padded-token budget of one chunk" in text
    assert "passes of the critic over the iteration's rows" in text
    assert "prompts drawn from the task per iteration" in text
    assert "known subclasses: lppo.ActorModule" in text  # the top-level export
    assert "known subclasses: lppo.CriticModule" in text
    assert "lppo.tasks.CopyTask" in text
    assert "how lppo gets Ray, for every component that uses it" in text  # trainer.ray


@pytest.mark.parametrize(
    ("option", "cls"),
    [("--model.actor", ActorModule), ("--model.critic", CriticModule)],
)
def test_subclass_help_documents_its_init_args(
    option: str, cls: type, capsys: pytest.CaptureFixture[str]
) -> None:
    class_path = f"lppo.modules.{cls.__name__}"
    with pytest.raises(SystemExit) as exc:
        run(["fit", f"{option}.help", class_path])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert f"lppo.{cls.__name__}" in out  # jsonargparse names the shortest import path
    # A dataclass argument (actor.off_policy) is documented field by field.
    missing = [n for n in init_params(cls) if not any(f"{option}.{n}{c}" in out for c in " .")]
    assert not missing, f"`lppo fit {option}.help {class_path}` misses {missing}"


# ------------------------------------------------------------------------- print_config
def test_print_config_round_trips(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "run"
    overrides = ["--data.max_tokens_per_chunk", "256", "--model.ppo.actor_epochs", "1"]
    with pytest.raises(SystemExit) as exc:
        run([*fit_args(root, *overrides), "--print_config"])
    assert exc.value.code == 0
    printed = capsys.readouterr().out
    config = yaml.safe_load(printed)
    assert config["trainer"]["max_epochs"] == 1
    assert config["trainer"]["default_root_dir"] == str(root)
    assert config["data"]["max_tokens_per_chunk"] == 256
    assert config["model"]["ppo"]["actor_epochs"] == 1
    assert config["model"]["rollout"]["prompts_per_iteration"] == 4
    assert config["model"]["actor"]["class_path"] == "lppo.modules.ActorModule"
    assert config["model"]["task"]["class_path"] == "lppo.tasks.CopyTask"

    path = tmp_path / "printed.yaml"
    path.write_text(printed)
    # Printing the printed config gives the same config (a fixed point) ...
    with pytest.raises(SystemExit):
        run(["fit", "--config", str(path), "--print_config"])
    assert yaml.safe_load(capsys.readouterr().out) == config
    # ... and it trains (1 iteration).
    cli = run(["fit", "--config", str(path)])
    assert cli.trainer.current_epoch == 1
    assert cli.datamodule.settings.max_tokens_per_chunk == 256
    assert json.loads((root / "summary.json").read_text())["iterations"] == 1


# ----------------------------------------------------------- overrides, steps, outputs
ITERATIONS, ACTOR_EPOCHS = 2, 3


@pytest.fixture(scope="module")
def short_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Path]]:
    """Two iterations with command-line overrides; yields ``(cli, run_dir)``."""
    root = tmp_path_factory.mktemp("short") / "run"
    with pytest.MonkeyPatch.context() as mp:
        for key, value in OFFLINE_ENV.items():
            mp.setenv(key, value)
        cli = run(
            fit_args(
                root,
                "--data.max_tokens_per_chunk",
                "256",
                "--model.ppo.actor_epochs",
                str(ACTOR_EPOCHS),
                iterations=ITERATIONS,
            )
        )
    yield cli, root


def read_metrics(cli: Any) -> list[dict[str, str]]:
    path = Path(cli.trainer.logger.log_dir) / "metrics.csv"
    with open(path) as f:
        return list(csv.DictReader(f))


def test_overrides_take_effect(short_run: tuple[Any, Path]) -> None:
    cli, root = short_run
    data, system = cli.trainer.datamodule, cli.trainer.lightning_module
    assert data.settings.max_tokens_per_chunk == 256
    assert data.planner.max_tokens_per_chunk == 256
    assert system.ppo.actor_epochs == ACTOR_EPOCHS
    assert system.ppo.critic_epochs == 2  # from the YAML, untouched
    assert system.rollout.rows_per_iteration == 8
    assert cli.trainer.max_epochs == ITERATIONS
    assert cli.trainer.default_root_dir == str(root)


def test_global_step_counts_actor_optimizer_steps(short_run: tuple[Any, Path]) -> None:
    cli, _ = short_run
    ppo = cli.trainer.lightning_module.ppo
    expected = ITERATIONS * ACTOR_EPOCHS * ppo.actor_minibatches
    assert expected == 12
    assert cli.trainer.global_step == expected
    rows = read_metrics(cli)
    actor = [r for r in rows if r["actor/stepped"]]
    critic = [r for r in rows if r["critic/stepped"]]
    assert len(actor) == expected and all(float(r["actor/stepped"]) == 1.0 for r in actor)
    assert len(critic) == ITERATIONS * ppo.critic_epochs * ppo.critic_minibatches


def test_run_writes_metrics_plot_summary_checkpoint(short_run: tuple[Any, Path]) -> None:
    cli, root = short_run
    rows = read_metrics(cli)
    columns = set(rows[0])
    missing = [name for name in STABLE_METRICS if name not in columns]
    assert not missing, f"metrics.csv lacks {missing}"
    for phase in ("rollout", "critic", "actor"):
        assert f"perf/tokens_per_second/{phase}" in columns
    per_iteration = [r for r in rows if r["rollout/reward_mean"]]
    # iterations numbered from 1, written as integers (as on the console)
    assert [r["iteration"] for r in per_iteration] == [str(i + 1) for i in range(ITERATIONS)]
    for r in per_iteration:
        assert 0.0 <= float(r["rollout/reward_mean"]) <= 1.0
        assert float(r["rollout/invalid_rows"]) == 0.0
        assert float(r["rollout/dropped_rows"]) == 0.0
        assert float(r["perf/peak_memory_bytes"]) > 0
        assert float(r["perf/tokens_per_second/actor"]) > 0
    for name in ("critic/loss", "critic/grad_norm", "actor/loss", "actor/grad_norm"):
        values = [float(r[name]) for r in rows if r[name]]
        assert values and all(v == v for v in values), name  # present and not NaN

    assert (root / "reward_curve.png").read_bytes().startswith(b"\x89PNG")
    summary = json.loads((root / "summary.json").read_text())
    assert summary["iterations"] == ITERATIONS
    assert summary["run_dir"] == str(root)
    assert Path(summary["metrics_csv"]) == Path(cli.trainer.logger.log_dir) / "metrics.csv"
    assert Path(summary["metrics_csv"]).is_relative_to(root)
    assert Path(summary["reward_curve"]) == root / "reward_curve.png"
    last = root / "checkpoints" / "last.ckpt"
    assert Path(summary["checkpoints"]["last"]).resolve() == last.resolve()
    ckpt = torch.load(last, map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == cli.trainer.global_step
    assert ckpt["epoch"] == ITERATIONS - 1


# ------------------------------------------------------------------------------ loggers
def test_trainer_logger_is_parsed_as_a_class(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logger = ["--trainer.logger", "lightning.pytorch.loggers.CSVLogger"]
    logger += ["--trainer.logger.save_dir", str(tmp_path / "csv")]
    with pytest.raises(SystemExit):
        run([*fit_args(tmp_path / "run", *logger), "--print_config"])
    config = yaml.safe_load(capsys.readouterr().out)["trainer"]["logger"]
    assert config["class_path"] == "lightning.pytorch.loggers.CSVLogger"
    assert config["init_args"]["save_dir"] == str(tmp_path / "csv")


def test_trainer_strategy_is_parsed_as_a_class(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """PPOTrainer reads ``strategy`` from its kwargs without a default, which would hide
    Lightning's type from jsonargparse (``str | Untyped``) and drop the class form."""
    strategy = ["--trainer.strategy", "lppo.runtime.strategy.PPOStrategy", "--trainer.devices", "2"]
    strategy += ["--trainer.strategy.start_method", "spawn"]
    with pytest.raises(SystemExit):
        run([*fit_args(tmp_path / "run", *strategy), "--print_config"])
    config = yaml.safe_load(capsys.readouterr().out)["trainer"]["strategy"]
    assert config["class_path"] == "lppo.runtime.strategy.PPOStrategy"
    assert config["init_args"]["start_method"] == "spawn"


# --------------------------------------------------------------------------------- wandb
def test_wandb_offline_run_records_the_config_inside_the_run_dir(tmp_path: Path) -> None:
    """A plain ``--trainer.logger WandbLogger``: files in the run dir, config recorded, CSV kept."""
    pytest.importorskip("wandb")
    cwd, root = tmp_path / "cwd", tmp_path / "run"
    cwd.mkdir()
    home = str(tmp_path / "wandb_home")  # wandb's own settings and cache, not the run's files
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": home}
    env |= {"WANDB_CACHE_DIR": home, "WANDB_DATA_DIR": home}
    logger = ["--trainer.logger", "lightning.pytorch.loggers.WandbLogger"]
    args = fit_args(root, *logger, "--model.ppo.kl_coef", "0.0123")
    proc = lppo_cli(*args, env=env, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(cwd.iterdir()) == []  # no ./wandb, no ./config.yaml
    runs = list(root.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(runs) == 1, list(root.rglob("*"))
    # wandb's service process writes the records; on a loaded machine it may still be
    # writing when lppo has exited, so wait (bounded) for them.
    deadline = time.monotonic() + 120
    while b"actor/loss" not in (content := runs[0].read_bytes()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert b"rollout/reward_mean" in content and b"actor/loss" in content
    found = re.search(rb'"ppo":\{"kl_coef":([0-9.e+-]+)', content)
    assert found and float(found.group(1)) == 0.0123  # model.ppo.kl_coef in the run's config
    assert yaml.safe_load((root / "config.yaml").read_text())["model"]["ppo"]["kl_coef"] == 0.0123
    metrics = root / "version_0" / "metrics.csv"
    assert "rollout/reward_mean" in metrics.read_text().splitlines()[0]
    summary = json.loads((root / "summary.json").read_text())
    assert [entry["type"] for entry in summary["loggers"]] == ["WandbLogger", "CSVLogger"]
    assert Path(summary["metrics_csv"]) == metrics


# ------------------------------------------------------------------ bad configurations
@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        pytest.param(
            ["--data.max_tokens_per_chunk", "4"],
            ["data.max_tokens_per_chunk=4", "longest possible row", "at least 12"],
            id="token-budget-below-longest-row",
        ),
        pytest.param(
            ["--model.ppo.critic_epochs", "0"],
            ["model.ppo.critic_epochs=0", ">= 1"],
            id="critic-epochs-zero",
        ),
        pytest.param(
            ["--model.ppo.actor_epochs", "0"],
            ["model.ppo.actor_epochs=0", ">= 1"],
            id="actor-epochs-zero",
        ),
        pytest.param(
            ["--data.fixed_rows_per_rank", "true", "--model.ppo.actor_minibatches", "3"],
            [
                "model.rollout.samples_per_prompt = 8 is not divisible",
                "1 x 3 = 3",
                "data.fixed_rows_per_rank=true",
                "set data.fixed_rows_per_rank=false",
            ],
            id="fixed-rows-not-divisible",
        ),
        pytest.param(
            ["--data.fixed_rows_per_rank", "true", "--data.drop_budget", "2"],
            ["data.drop_budget=2", "data.fixed_rows_per_rank=true", "Set data.drop_budget=0"],
            id="fixed-rows-with-drop-budget",
        ),
    ],
)
def test_bad_configuration_fails_at_setup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: list[str], expected: list[str]
) -> None:
    def no_training(self: PPOSystem, iteration: int) -> None:
        raise AssertionError("bad configuration reached training")

    monkeypatch.setattr(PPOSystem, "run_iteration", no_training)
    with pytest.raises(ValueError) as exc:
        run(fit_args(tmp_path / "run", *extra))
    message = str(exc.value)
    for fragment in expected:
        assert fragment in message, message
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_unknown_task_class_is_a_parse_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        run(fit_args(tmp_path / "run", "--model.task.class_path", "lppo.tasks.NoSuchTask"))
    assert exc.value.code not in (0, None)
    err = capsys.readouterr().err
    assert "model.task" in err and "lppo.tasks.NoSuchTask" in err
    assert not (tmp_path / "run").exists()


def test_load_from_checkpoint_rebuilds_the_system(tmp_path):
    """Under the CLI the hparams are the parsed config, so a checkpoint alone rebuilds it."""
    root = ["--trainer.default_root_dir", str(tmp_path), "--trainer.max_epochs", "1"]
    cli = run(["fit", "--config", str(TINY), *SMALL, *root])
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    loaded = PPOSystem.load_from_checkpoint(ckpt)
    assert loaded.rollout.prompts_per_iteration == 4
    assert type(loaded.task) is type(cli.model.task)
    trained = cli.model.state_dict()
    assert trained.keys() == loaded.state_dict().keys()
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, trained[k]), k


# ------------------------------------------------------------ resume from a named file
@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``last.ckpt`` of one iteration of the shrunk tiny config (hidden 64, 2 layers)."""
    root = tmp_path_factory.mktemp("named") / "run"
    with pytest.MonkeyPatch.context() as mp:
        for key, value in OFFLINE_ENV.items():
            mp.setenv(key, value)
        run(fit_args(root))
    return root / "checkpoints" / "last.ckpt"


def lppo_fit(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lppo.run.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **OFFLINE_ENV},
    )


def test_a_named_checkpoint_resumes_with_a_changed_learning_rate(
    tmp_path: Path, tiny_checkpoint: Path
) -> None:
    lr = "--model.actor.init_args.lr"
    proc = lppo_fit(
        *fit_args(tmp_path, lr, "0.001", iterations=2), "--ckpt_path", str(tiny_checkpoint)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    applied = "resuming with changed settings (applied): model.actor.init_args.lr: 0.003 -> 0.001"
    assert applied in proc.stdout + proc.stderr
    resumed = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert resumed["epoch"] == 1  # restored from iteration 0, trained iteration 1
    assert resumed["lppo_settings"]["model.actor.init_args.lr"] == 0.001
    assert resumed["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(0.001)


def test_a_named_checkpoint_of_another_architecture_is_refused(
    tmp_path: Path, tiny_checkpoint: Path
) -> None:
    model = "--model.actor.init_args.model.init_args"
    changed = [f"{model}.hidden_size", "32", f"{model}.num_layers", "3"]
    proc = lppo_fit(
        *fit_args(tmp_path, *changed, iterations=2), "--ckpt_path", str(tiny_checkpoint)
    )
    assert proc.returncode != 0
    assert "resuming with settings that differ from the checkpoint's" in proc.stderr
    assert "model.actor.init_args.model.init_args.hidden_size: 64 -> 32" in proc.stderr
    assert "model.actor.init_args.model.init_args.num_layers: 2 -> 3" in proc.stderr
    assert not (tmp_path / "checkpoints" / "last.ckpt").exists()


def test_a_named_checkpoint_whose_hyperparameters_no_longer_parse_resumes(
    tmp_path: Path, tiny_checkpoint: Path
) -> None:
    """Its hyperparameters are not read: an init argument an older lppo had does not matter."""
    checkpoint = torch.load(tiny_checkpoint, map_location="cpu", weights_only=True)
    checkpoint["hyper_parameters"]["actor"]["init_args"]["retired_knob"] = 1
    older = tmp_path / "older.ckpt"
    torch.save(checkpoint, older)
    write_digest(older)  # lppo's checkpoint, edited to hold an older lppo's hyperparameters
    proc = lppo_fit(*fit_args(tmp_path / "run", iterations=2), "--ckpt_path", str(older))
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert resumed["epoch"] == 1
