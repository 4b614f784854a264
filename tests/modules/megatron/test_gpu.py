"""GPU checks of the megatron backend (marked ``gpu``; skipped without CUDA, never run in CI).

Not yet run on a GPU: no device was available when they were written.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def bench():
    path = ROOT / "bench" / "megatron_gpu.py"
    spec = importlib.util.spec_from_file_location("megatron_gpu", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SMALL = [
    "--hidden",
    "256",
    "--layers",
    "2",
    "--heads",
    "4",
    "--ffn",
    "512",
    "--vocab",
    "1024",
    "--rows",
    "16",
    "--min-len",
    "32",
    "--max-len",
    "64",
    "--chunk-tokens",
    "256",
    "--micro-batch",
    "4",
    "--repeats",
    "1",
]


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_streamed_equals_merged_with_the_distributed_optimizer(role):
    b = bench()
    args = b.parse([*SMALL, "--dtype", "float32"])
    store = b.make_store(args)
    norms = []
    for budget in (args.chunk_tokens, 10**9):
        module = b.build(role, args)  # same seed: same weights for both
        assert type(module.optimizer.inner).__name__ == "DistributedOptimizer"
        norms.append(b.lppo_step(module, store, budget, role))
        assert module.weights_version == 1
    assert abs(norms[0] - norms[1]) <= 1e-4 * norms[1], norms


def test_bench_runs_every_variant():
    b = bench()
    args = b.parse(SMALL)
    rows = b.run(args)
    assert [(r["role"], r["variant"]) for r in rows] == [
        (role, v) for role in ("critic", "actor") for v in ("streamed", "merged", "megatron")
    ]
    assert all(r["tokens_per_s"] > 0 and r["peak_gib"] > 0 for r in rows)
    assert "| actor | megatron |" in b.report(rows, args)


def test_megatron_config_fits_on_the_gpu(tmp_path):
    from lppo.run.cli import run

    run(
        [
            "fit",
            "--config",
            str(ROOT / "configs" / "megatron.yaml"),
            "--trainer.max_epochs",
            "2",
            "--trainer.accelerator",
            "gpu",
            "--trainer.default_root_dir",
            str(tmp_path),
        ]
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["iterations"] == 2
