"""``ppo_fsdp`` (:class:`lppo.layouts.FSDPLayout`): FSDP2 shards, one process's results.

Two gloo ranks with sharded models equal one process to float64 round-off: one optimizer
step of the actor (also sliced over the vocabulary, against the materialized log-softmax) and
of the critic (``tests/modules/dp_parity_worker.py``), and whole fits
(``tests/ddp_fit_worker.py``) with a critic and critic-free, under another chunk budget than
the single process's; an aborted step leaves nothing behind (bitwise); a fit killed with
SIGKILL and resumed from its last checkpoint ends bitwise where the uninterrupted fit ends;
the exported policy gives the trained weights' logits; LoRA adapters train like one process.
The layout's options: bf16 mixed precision computes in bf16 and keeps float32 shards and
optimizer state; CPU offload gives bitwise the fit without it.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from test_ddp import WORKER, finish_all, read_metrics, start

from lppo.layouts import FSDPLayout
from lppo.modules.shared import decide
from lppo.validation import SettingError

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

_PARITY = Path(__file__).resolve().parents[1] / "modules" / "test_data_parallel.py"
_spec = importlib.util.spec_from_file_location("_dp_parity", _PARITY)
assert _spec is not None and _spec.loader is not None
parity = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(parity)

ITERATIONS = 3
#: The sharded fits' chunk budget; the single process keeps the worker's default (24).
FSDP_BUDGET = 12


# ----------------------------------------------------------------------------- one step
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_one_sharded_step_equals_one_process(role, tmp_path):
    dp = parity.launch(role, tmp_path, "--layout=fsdp")
    single = parity.worker.run_step(role, world_size=1, rank=0)
    assert dp["sharded"] > 0  # the Hugging Face model's parameters are DTensor shards
    assert dp["stats"]["stepped"]
    assert parity.rel_close(dp["stats"]["grad_norm"], single["stats"]["grad_norm"])
    assert dp["grad_names"] == single["grad_names"]  # `unused` stays gradient-free
    for key, want in single["metrics"].items():
        assert parity.rel_close(dp["metrics"][key], want), key
    for name, want in single["after"].items():
        parity.assert_tensors_close(dp["after"][name], want, name)


def test_a_sharded_step_sliced_over_the_vocabulary_equals_one_materialized_process(tmp_path):
    """``vocab_chunk`` under FSDP2 (the tied output projection gathered inside the model's
    forward, 5 of 23 entries per slice) against one process's materialized log-softmax."""
    dp = parity.launch("actor", tmp_path, "--layout=fsdp", "--vocab-chunk=5")
    single = parity.worker.run_step("actor", world_size=1, rank=0, vocab_chunk=0)
    assert dp["sharded"] > 0
    assert parity.rel_close(dp["stats"]["grad_norm"], single["stats"]["grad_norm"])
    for key, want in single["metrics"].items():
        assert parity.rel_close(dp["metrics"][key], want), key
    for name, want in single["after"].items():
        parity.assert_tensors_close(dp["after"][name], want, name)


def test_sharing_prompts_is_off_under_fsdp_and_true_is_refused():
    """A chunk that shares runs two forwards: ranks would disagree on their all-gathers."""
    module, _ = parity.worker.build_module("actor")
    module.parallel = FSDPLayout().context(1, 0)
    assert decide("auto", [module]) is False
    with pytest.raises(SettingError, match=r"share_prompts=true: trainer\.strategy: under FSDP"):
        decide(True, [module])


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_an_aborted_sharded_step_leaves_nothing_behind(role, tmp_path):
    """Chunks trained and aborted (FSDP holding unsharded partial gradients), then the step:
    bitwise the step alone (the worker also checks the parameters right after abort)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain = parity.launch(role, tmp_path / "a", "--layout=fsdp")
    aborted = parity.launch(role, tmp_path / "b", "--layout=fsdp", "--abort-first")
    assert aborted["stats"] == plain["stats"]
    for name, want in plain["after"].items():
        assert torch.equal(aborted["after"][name], want), name


# ----------------------------------------------------------------------------- whole fits
def _job(out: Path, *extra: str) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    return [str(WORKER), f"--out={out}", "--dtype=float64", f"--iterations={ITERATIONS}", *extra]


def _sharded(out: Path, *extra: str) -> list[str]:
    budget = f"--max-tokens-per-chunk={FSDP_BUDGET}"
    return _job(out, "--devices=2", "--layout=fsdp", budget, *extra)


@pytest.fixture(scope="module")
def fits(tmp_path_factory) -> Path:
    """Sharded and single-process fits, with a critic and critic-free, run concurrently."""
    root = tmp_path_factory.mktemp("fsdp")
    jobs = [
        _sharded(root / "fsdp", "--export"),
        _job(root / "single", "--devices=1", "--export"),
        _sharded(root / "fsdp-chunk", "--layout=fsdp_chunk"),
        _sharded(root / "fsdp-grpo", "--critic-free"),
        _job(root / "single-grpo", "--devices=1", "--critic-free"),
        _sharded(root / "killed", f"--kill-at={ITERATIONS - 1}"),
        _sharded(root / "fsdp-lora", "--lora"),
        _job(root / "single-lora", "--devices=1", "--lora"),
    ]
    procs = [start(args, root) for args in jobs[:3]]
    finish_all(procs, jobs[:3])
    procs = [start(args, root) for args in jobs[3:6]]
    finish_all(procs[:2], jobs[3:5])
    assert procs[2].wait(timeout=240) != 0  # SIGKILLed at the start of its last iteration
    procs = [start(args, root) for args in [_sharded(root / "killed", "--resume"), *jobs[6:]]]
    finish_all(procs, [["--resume"], *jobs[6:]])
    # float32-built models in a 64-true run, every auto at its default (old_logprobs: auto)
    in64 = ("--precision=64-true", "--dtype=float32")
    jobs = [
        _sharded(root / "fsdp-64-true", *in64),
        _job(root / "single-64-true", "--devices=1", *in64),
    ]
    finish_all([start(args, root) for args in jobs], jobs)
    return root


def _state(run: Path, rank: int = 0) -> dict[str, torch.Tensor]:
    return torch.load(run / f"state{rank}.pt")


@pytest.mark.parametrize("name", ["fsdp", "fsdp-grpo", "fsdp-chunk", "fsdp-lora"])
def test_sharded_fit_equals_one_process_under_another_chunk_budget(fits, name):
    """``fsdp-chunk``: ``reduce_every_chunk`` (each chunk reduce-scatters its own gradients);
    ``fsdp-lora``: LoRA adapters on actor and critic, sharded with their base weights."""
    single = {"fsdp-grpo": "single-grpo", "fsdp-lora": "single-lora"}.get(name, "single")
    want = _state(fits / single)
    ranks = [json.loads((fits / name / f"rank{r}.json").read_text()) for r in range(2)]
    one = json.loads((fits / single / "rank0.json").read_text())
    assert one["trim_prompt"][0] is (name != "fsdp-lora")  # auto: on for one plain process
    for record in ranks:
        assert record["layout"] == "FSDPLayout"
        assert True not in record["trim_prompt"]  # auto: off under a layout that shards
        assert 0 < record["sharded_parameters"] <= record["parameters"]
        assert record["global_step"] == one["global_step"] == 2 * ITERATIONS
        assert record["rows_left"] == 0
    got = [_state(fits / name, r) for r in range(2)]
    assert got[0].keys() == got[1].keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[0][key], got[1][key]), key
        scale = value.abs().max().clamp_min(1e-300)
        assert (got[0][key] - value).abs().max() <= 1e-10 * scale, key


def test_a_64_true_run_with_default_settings_equals_one_process(fits):
    """``trainer.precision 64-true`` on float32-built models: π_old is never the float32
    engine's (the run plan decides at the final dtype), so 2 sharded ranks equal 1 process."""
    want = _state(fits / "single-64-true")
    assert {v.dtype for v in want.values() if v.is_floating_point()} == {torch.float64}
    got = _state(fits / "fsdp-64-true")
    for key, value in want.items():
        scale = value.abs().max().clamp_min(1e-300)
        assert (got[key] - value).abs().max() <= 1e-10 * scale, key


def test_killed_and_resumed_sharded_fit_ends_bitwise_like_the_uninterrupted_one(fits):
    for rank in range(2):
        want, got = _state(fits / "fsdp", rank), _state(fits / "killed", rank)
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert torch.equal(got[key], value), key


def test_exported_policy_gives_the_trained_logits(fits):
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[1, 5, 3, 4, 2, 6]])
    logits = []
    for name in ("fsdp", "single"):
        model = AutoModelForCausalLM.from_pretrained(fits / name / "hf" / "policy", dtype="auto")
        state = {k.removeprefix("actor.model."): v for k, v in _state(fits / name).items()}
        trained = {k: v for k, v in state.items() if k in model.state_dict()}
        assert trained.keys() == model.state_dict().keys()
        for key, value in model.state_dict().items():
            assert torch.equal(value, trained[key]), key  # the export holds the final weights
        logits.append(model(input_ids=ids).logits)
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------ the layout's options
#: Adam moves a weight by about lr = 3e-3 per step: fits from the same start that differ only
#: in rounding stay within a few steps' moves of each other.
BF16_MAX_DRIFT = 2e-2


@pytest.fixture(scope="module")
def option_fits(tmp_path_factory) -> Path:
    """One-iteration float32 sharded fits: plain, bf16 mixed precision, CPU offload."""
    root = tmp_path_factory.mktemp("fsdp-options")
    options = {"f32": (), "bf16": ("--param-dtype=bfloat16",), "offload": ("--cpu-offload",)}
    base = [str(WORKER), "--devices=2", "--layout=fsdp", "--iterations=1"]
    jobs = [[*base, f"--out={root / name}", *extra] for name, extra in options.items()]
    for name in options:
        (root / name).mkdir()
    finish_all([start(args, root) for args in jobs], jobs)
    return root


def _records(run: Path) -> list[dict]:
    return [json.loads((run / f"rank{r}.json").read_text()) for r in range(2)]


def _losses(run: Path) -> list[float]:
    rows = read_metrics(run / "run" / "version_0" / "metrics.csv")
    return [float(r[k]) for r in rows for k in ("actor/loss", "critic/loss") if r.get(k)]


def test_bf16_mixed_precision_computes_in_bf16_and_keeps_float32_state(option_fits):
    """Forwards see bf16 weights; shards and Adam state stay float32; results drift a little."""
    for record in _records(option_fits / "bf16"):
        assert record["global_step"] == 2 and record["rows_left"] == 0
        assert record["forward_dtypes"] == ["torch.bfloat16"]
        assert record["parameter_dtypes"] == record["optimizer_dtypes"] == ["torch.float32"]
    for record in _records(option_fits / "f32"):
        assert record["forward_dtypes"] == ["torch.float32"]
    losses, want = _losses(option_fits / "bf16"), _losses(option_fits / "f32")
    assert len(losses) == len(want) > 0 and all(math.isfinite(x) for x in losses)
    assert losses != want  # bf16 rounding reached the losses
    # bf16 keeps ~3 significant digits; a loss is a sum of terms ~10x larger than itself
    assert losses == pytest.approx(want, rel=2e-2, abs=2e-3)
    got, ref = _state(option_fits / "bf16"), _state(option_fits / "f32")
    assert got.keys() == ref.keys()
    drift = max((got[k] - ref[k]).abs().max().item() for k in ref)
    assert 0 < drift <= BF16_MAX_DRIFT
    assert all(got[k].dtype == torch.float32 for k in got)


def test_cpu_offload_fit_equals_the_fit_without_it(option_fits):
    """On CPU, offloading the shards moves nothing: the fit is bitwise the plain one."""
    for record in _records(option_fits / "offload"):
        assert record["offloaded"] and record["global_step"] == 2
    assert not any(record["offloaded"] for record in _records(option_fits / "f32"))
    assert _losses(option_fits / "offload") == _losses(option_fits / "f32")
    for rank in range(2):
        got, want = _state(option_fits / "offload", rank), _state(option_fits / "f32", rank)
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert torch.equal(got[key], value), key


# ------------------------------------------------------------------ which modules are sharded
def test_hf_models_are_the_outermost_models_the_root_itself_included():
    """A policy handed over alone (an engine's sync) is its own one model; a module holding
    models yields each of them once, none of their insides."""
    from lppo.layouts.fsdp import hf_models
    from lppo.modules.models import HFCausalLM

    spec = HFCausalLM(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)
    first, second = spec.build(16, 0, 1, 2), spec.build(16, 0, 1, 2)
    assert hf_models(first) == [first]
    assert hf_models(torch.nn.ModuleDict({"a": first, "b": second})) == [first, second]
