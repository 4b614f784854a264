"""Every numeric knob of ``lppo fit`` is validated at setup, enumerated from the CLI's own parser.

The knobs come from parsing each config in ``configs/`` (plus every lppo callback added on the
command line), so a knob added later is found here automatically; it then needs a rule in
``OUT_OF_RANGE`` (a value that must be rejected) or the test fails, telling you to validate it
with :func:`lppo.validation.check_number`.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from jsonargparse import Namespace
from jsonargparse._util import import_object

from lppo.run.cli import PPOCLI
from lppo.validation import SettingError, check_number

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
CALLBACKS = [
    "Evaluation",
    "HFExport",
    "IterationCheckpoint",
    "PPOProgress",
    "RolloutSamples",
    "RunSummary",
]
NUMERIC = (int, float)

#: A value outside each knob's range (by the knob's last name); non-finite values and (for
#: integer knobs) fractions are tried on every knob besides these.
OUT_OF_RANGE: dict[str, str] = {
    "cap": "0.5",
    "coef": "0",
    "max_staleness": "-1",
    "dynamic_sampling_rounds": "-1",
    "call_reward": "nan",
    "max_calls": "-1",
    "max_tokens": "1",
    "max_turns": "0",
    "num_digits": "11",
    "floor": "1.5",
    "gpu_memory_utilization": "0",
    "max_model_len": "1",
    "lr": "0",
    "weight_decay": "-0.1",
    "betas": "[0.9, 1.0]",
    "eps": "0",
    "max_grad_norm": "0",
    "warmup_steps": "-1",
    "clip_low": "1.0",
    "clip_high": "-0.1",
    "dual_clip": "1.0",
    "entropy_coef": "-0.01",
    "value_clip": "0",
    "head_init_std": "-1",
    "head_seed": "-1",
    "hidden_size": "0",
    "num_layers": "0",
    "num_heads": "0",
    "intermediate_size": "0",
    "max_position_embeddings": "0",
    "seed": "-1",
    "min_length": "0",
    "max_length": "1",
    "alphabet_size": "0",
    "length_weight": "1.5",
    "length_tolerance": "0",
    "min_value": "-1",
    "max_value": "-1",
    "partial_weight": "1.0",
    "batch_size": "0",
    "prefill_tokens": "0",
    "gamma": "1.5",
    "lam": "-0.1",
    "lam_returns": "1.5",
    "weight": ".inf",
    "task_weight": ".nan",
    "clip": "0",
    "prompts_per_iteration": "0",
    "samples_per_prompt": "0",
    "max_new_tokens": "0",
    "temperature": "0",
    "top_p": "0",
    "top_k": "-1",
    "prompts_per_block": "0",
    "kl_coef": "-0.1",
    "kl_loss_coef": "-0.1",
    "r": "0",
    "alpha": "0",
    "dropout": "1.0",
    "overlong_buffer": "-1",
    "overlong_penalty": "-0.5",
    "critic_epochs": "0",
    "critic_minibatches": "0",
    "actor_epochs": "0",
    "actor_minibatches": "0",
    "critic_warmup_iterations": "-1",
    "max_abs_reward": "0",
    "reward_timeout_s": "0",
    "max_consecutive_skipped_steps": "-1",
    "max_skipped_steps": "-1",
    "num_threads": "0",
    "max_tokens_per_chunk": "0",
    "drop_budget": "-1",
    "every_n_iterations": "0",
    "rows_per_iteration": "-1",
    "max_tokens_per_row": "-1",
    "page_iterations": "-1",
    "num_prompts": "0",
    "save_top_k": "-2",
    "refresh_seconds": "-1",
    "window": "0",
    "max_restarts": "-1",
    "num_workers": "0",
    "timeout_s": "0",
    "max_tokens_per_score_chunk": "0",
    "min_new_tokens": "-1",
    "max_failed_iterations": "-1",
    "num_cpus": "0",
    "num_storage_units": "0",
    "object_store_memory": "1024",
    "tensor_parallel_size": "0",
    "bucket_size": "0",
    "tolerance": "-1e-3",
    "relative_tolerance": "-0.1",
}


def numeric_type(hint: Any) -> type | None:
    """``int`` / ``float`` for a numeric annotation (``X | None`` and 2-tuples of floats too)."""
    text = hint if isinstance(hint, str) else getattr(hint, "__name__", str(hint))
    if text.startswith("Optional["):
        text = text[len("Optional[") : -1]
    parts = [p.strip() for p in text.split("|")]
    parts = [p for p in parts if p != "None"]
    if parts == ["int"]:
        return int
    if parts == ["float"]:
        return float
    if parts and parts[0].replace(" ", "") in ("tuple[float,float]", "tuple[int,int]"):
        return tuple
    return None


def resolve(cls: type, hint: Any) -> Any:
    """The object an annotation names, looked up in ``cls``'s module (``None`` if unknown)."""
    if not isinstance(hint, str):
        return hint
    try:
        return eval(hint, vars(sys.modules[cls.__module__]))
    except Exception:
        return None


def hints_of(cls: type) -> dict[str, Any]:
    """Init-argument annotations of ``cls`` and its bases (subclasses forward ``**kwargs``)."""
    hints: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        init = klass.__dict__.get("__init__")
        if init is None or not hasattr(init, "__code__"):
            continue
        for name, param in inspect.signature(init).parameters.items():
            if param.annotation is not inspect.Parameter.empty:
                hints[name] = (klass, param.annotation)
    return hints


def walk(node: Any, hints: dict[str, Any], prefix: str, out: dict[str, tuple[type, Any]]) -> None:
    """Collect ``{cli_key: (numeric type, value)}`` below ``node``."""
    for name, value in vars(node).items():
        key = f"{prefix}{name}"
        owner, hint = hints.get(name, (None, None))
        if isinstance(value, Namespace) and "class_path" in value:
            cls = import_object(value.class_path)
            walk(value.init_args or Namespace(), hints_of(cls), f"{key}.init_args.", out)
        elif isinstance(value, Namespace) and dataclasses.is_dataclass(
            group := resolve(owner, hint)
        ):
            fields = {f.name: (group, f.type) for f in dataclasses.fields(group)}
            walk(value, fields, f"{key}.", out)
        elif isinstance(value, list) and name == "callbacks":
            for entry in value:
                cls = import_object(entry.class_path)
                sub: dict[str, tuple[type, Any]] = {}
                walk(entry.init_args or Namespace(), hints_of(cls), "", sub)
                for leaf, found in sub.items():
                    out[f"trainer.callbacks[{cls.__name__}].init_args.{leaf}"] = found
        elif hint is not None and (kind := numeric_type(hint)) is not None:
            out[key] = (kind, value)


def callback_args() -> list[str]:
    return [f"--trainer.callbacks+=lppo.callbacks.{name}" for name in CALLBACKS]


def base_args(config: Path, tmp: Path) -> list[str]:
    return [
        "--config",
        str(config),
        "--trainer.max_epochs",
        "0",
        "--trainer.default_root_dir",
        str(tmp),
    ]


def build(config: Path, *extra: str, tmp: Path) -> PPOCLI:
    return PPOCLI(args=[*base_args(config, tmp), *extra], run=False)


def instantiate(parser: Any, args: list[str]) -> None:
    """What ``lppo fit`` does up to building the system: parse, then build every class."""
    parser.instantiate_classes(parser.parse_args(args))


def knobs_of(config: Path, tmp: Path) -> tuple[PPOCLI, dict[str, tuple[type, Any]]]:
    cli = build(config, *callback_args(), tmp=tmp)
    out: dict[str, tuple[type, Any]] = {}
    from lppo.iteration.data import ReplayDataModule
    from lppo.run.system import PPOSystem
    from lppo.run.trainer import PPOTrainer

    walk(cli.config.model, hints_of(PPOSystem), "model.", out)
    walk(cli.config.data, hints_of(ReplayDataModule), "data.", out)
    walk(Namespace(callbacks=cli.config.trainer.callbacks), {}, "trainer.", out)
    # lppo's own trainer settings (Lightning's Trainer validates its own knobs)
    ray = {"ray": hints_of(PPOTrainer)["ray"]}
    walk(Namespace(ray=cli.config.trainer.ray), ray, "trainer.", out)
    return cli, out


def leaf(key: str) -> str:
    return key.rsplit(".", 1)[-1]


def bad_values(kind: type, value: Any, name: str) -> list[str]:
    values = [".nan", "-.inf"]
    if kind is tuple:
        values = [f"[.nan, {value[1]}]"]
    if kind is int:
        values = ["1.5"]
    return [*values, OUT_OF_RANGE[name]]


def cli_override(key: str, value: str) -> list[str]:
    """The command line that sets ``key`` (a callback's knob goes to the callback added last)."""
    if key.startswith("trainer.callbacks["):
        name = key[len("trainer.callbacks[") : key.index("]")]
        rest = key[key.index("].") + 2 :]
        return [
            f"--trainer.callbacks+=lppo.callbacks.{name}",
            f"--trainer.callbacks.{rest}={value}",
        ]
    return [f"--{key}={value}"]


@pytest.fixture(scope="module", autouse=True)
def megatron_on_cpu():
    """configs/megatron.yaml builds megatron-core pieces, which need the CPU shims here."""
    from _megatron_cpu import install, uninstall

    install()
    yield
    uninstall()


@pytest.fixture(scope="module")
def all_knobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, type, Any]]:
    """Every numeric knob once: ``{key: (args of the first config that has it, type, value)}``."""
    found: dict[str, tuple[Any, type, Any]] = {}
    for config in CONFIGS:
        tmp = tmp_path_factory.mktemp("knobs")
        cli, knobs = knobs_of(config, tmp)
        for key, (kind, value) in knobs.items():
            found.setdefault(key, ((cli.parser, base_args(config, tmp)), kind, value))
    return found


def test_the_parser_exposes_the_knobs_we_know(all_knobs: dict[str, Any]) -> None:
    """Sanity of the enumeration itself: knobs from every group are found."""
    for key in (
        "model.actor.init_args.lr",
        "model.actor.init_args.betas",
        "model.critic.init_args.backbone.init_args.hidden_size",
        "model.rollout.temperature",
        "model.ppo.kl_coef",
        "model.estimator.init_args.lam",
        "data.drop_budget",
        "trainer.callbacks[Evaluation].init_args.num_prompts",
        "trainer.ray.num_cpus",
        "trainer.ray.object_store_memory",
    ):
        assert key in all_knobs, sorted(all_knobs)
    assert len(all_knobs) > 50


def test_every_numeric_knob_has_a_rule(all_knobs: dict[str, Any]) -> None:
    missing = sorted({leaf(k) for k in all_knobs} - set(OUT_OF_RANGE))
    assert not missing, (
        f"numeric knobs {missing} have no out-of-range rule: validate them at setup with "
        "lppo.validation.check_number and add a value that must be rejected to OUT_OF_RANGE."
    )


def test_every_numeric_knob_rejects_bad_values(
    all_knobs: dict[str, tuple[Any, type, Any]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Each bad value stops the CLI at setup, with a message naming the knob."""
    escaped = []
    for key, ((parser, args), kind, value) in sorted(all_knobs.items()):
        name = leaf(key)
        if name not in OUT_OF_RANGE:
            continue  # reported by test_every_numeric_knob_has_a_rule
        for bad in bad_values(kind, value, name):
            try:
                instantiate(parser, [*args, *cli_override(key, bad)])
            except ValueError as error:  # SettingError, maybe wrapped by jsonargparse (unions)
                # An engine inside another engine (RayWorkersEngine.engine) names its keys
                # under model.engine.init_args, where it sits when used alone.
                own = key.replace(
                    "model.engine.init_args.engine.init_args.", "model.engine.init_args."
                )
                if (
                    f"{key}=" not in str(error)
                    and f"{own}=" not in str(error)
                    and f"{key}[" not in str(error)
                ):
                    escaped.append(f"{key}={bad}: message does not name the key: {error}")
            except SystemExit:  # a parse error (wrong type): jsonargparse names the key
                err = capsys.readouterr().err
                if name not in err:
                    escaped.append(f"{key}={bad}: parse error does not name it: {err[-300:]}")
            except Exception as error:
                escaped.append(f"{key}={bad}: {type(error).__name__}: {error}")
            else:
                escaped.append(f"{key}={bad}: accepted")
    assert not escaped, "\n".join(escaped)


@pytest.mark.parametrize(
    ("spelling", "expected"),
    [
        (".nan", "is not finite"),
        (".NaN", "is not finite"),
        (".inf", "is not finite"),
        ("-.Inf", "is not finite"),
        ('"1e400"', "is not finite"),
        ("-1e-3", "out of range"),
    ],
)
def test_yaml_spellings_reach_the_check(tmp_path: Path, spelling: str, expected: str) -> None:
    """YAML has many spellings of a float; every one of them is checked."""
    config = tmp_path / "bad.yaml"
    config.write_text(f"model:\n  actor:\n    init_args:\n      lr: {spelling}\n")
    with pytest.raises(SettingError, match=rf"model\.actor\.init_args\.lr=.*{expected}"):
        build(ROOT / "configs" / "tiny.yaml", "--config", str(config), tmp=tmp_path)


@pytest.mark.parametrize(
    ("key", "value"),
    [("model.actor.init_args.lr", "1e300"), ("model.critic.init_args.lr", "1e30")],
)
def test_a_learning_rate_above_1_is_refused_at_setup(tmp_path: Path, key: str, value: str) -> None:
    """Finite but absurd: one AdamW step would wreck the weights (the first iteration then
    failed with a float overflow or NaN gradients, naming neither the key nor the fix)."""
    pattern = rf"{re.escape(key)}=1e\+{value[2:]} is out of range; .* in \(0, 1\]\. Typical: 1e-6"
    with pytest.raises(ValueError, match=pattern):  # a SettingError (the critic's in a Union's)
        build(ROOT / "configs" / "tiny.yaml", f"--{key}", value, tmp=tmp_path)
    cli = build(ROOT / "configs" / "tiny.yaml", f"--{key}", "1", tmp=tmp_path)  # the bound
    assert (cli.model.actor if "actor" in key else cli.model.critic).lr == 1


def test_yaml_scientific_notation_without_a_dot_is_a_number(tmp_path: Path) -> None:
    """``1e-3`` is a string in YAML 1.1; lppo still reads it as the number the user meant."""
    config = tmp_path / "ok.yaml"
    config.write_text("model:\n  actor:\n    init_args:\n      lr: 1e-3\n")
    cli = build(ROOT / "configs" / "tiny.yaml", "--config", str(config), tmp=tmp_path)
    assert cli.model.actor.lr == pytest.approx(1e-3)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"value": math.nan}, "k=nan is not finite"),
        ({"value": "0.1"}, "k='0.1' (str) must be a finite number"),
        ({"value": True}, "k=True (bool)"),
        ({"value": 2.5, "integer": True}, "not a fraction"),
        ({"value": 0, "low": 0, "low_open": True, "fix": "Try 1."}, "> 0. Try 1."),
        ({"value": 1, "low": 0, "high": 1, "high_open": True}, "in [0, 1)"),
        ({"value": None}, "(NoneType)"),
    ],
)
def test_check_number_messages(kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(SettingError) as info:
        check_number("k", **kwargs)
    assert fragment in str(info.value)


def test_python_construction_is_checked_too() -> None:
    from lppo.modules import ActorModule
    from lppo.modules.models import HFCausalLM

    with pytest.raises(SettingError, match=r"model\.actor\.init_args\.model\.init_args\.num_heads"):
        ActorModule(HFCausalLM(hidden_size=64, num_heads=0))
    with pytest.raises(SettingError, match=r"hidden_size=30 is not divisible"):
        ActorModule(HFCausalLM(hidden_size=30, num_heads=4))
