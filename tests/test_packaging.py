"""lppo as a wheel and under the import paths it had before its modules were grouped."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from lppo._moved import MOVED, canonical_path

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("old", "new"), sorted(MOVED.items()))
def test_an_old_module_path_is_the_moved_module(old: str, new: str) -> None:
    moved = importlib.import_module(old)
    assert moved is importlib.import_module(new)
    assert moved.__name__ == new and moved.__spec__ is not None and moved.__spec__.name == new


def test_class_paths_of_old_configs_and_checkpoints_still_resolve() -> None:
    assert canonical_path("lppo.models.HFCausalLM") == "lppo.modules.models.HFCausalLM"
    assert canonical_path("lppo.rollout.hf_prefill") == "lppo.rollout.hf.prefill"
    assert canonical_path("lppo.rollout.HFGenerateEngine") == "lppo.rollout.HFGenerateEngine"
    from lppo.models import HFCausalLM  # type: ignore[import-not-found]

    assert HFCausalLM.__module__ == "lppo.modules.models"


def _packages(root: Path) -> set[str]:
    found = {".".join(p.parent.relative_to(root).parts) for p in (root / "lppo").rglob("*.py")}
    return {p for p in found if (root / p.replace(".", "/") / "__init__.py").exists()}


@pytest.mark.slow
def test_the_wheel_holds_every_package_and_imports(tmp_path: Path) -> None:
    """Packages are discovered (setup.py), so a new subpackage cannot be left out of the wheel."""
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".*", "runs", "site", "*.egg-info"))
    wheels = tmp_path / "wheels"
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*cmd, "-w", str(wheels), str(src)], check=True, capture_output=True)
    (wheel,) = wheels.glob("lppo-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    in_wheel = {n.rsplit("/", 1)[0].replace("/", ".") for n in names if n.endswith("__init__.py")}
    assert _packages(ROOT) | {"lppo.callbacks"} <= in_wheel
    unpacked = tmp_path / "unpacked"
    zipfile.ZipFile(wheel).extractall(unpacked)
    probe = (
        "import lppo, lppo.callbacks, lppo.layouts, lppo.run.cli, lppo.rollout.hf; "
        "from lppo.models import HFCausalLM; print(lppo.__file__)"
    )
    env = {**os.environ, "PYTHONPATH": str(unpacked)}
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().startswith(str(unpacked))
    for module in ("lppo.run.export", "lppo.export"):  # the old -m path runs the moved module
        cmd = [sys.executable, "-m", module, "--help"]
        out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.startswith("usage: python -m lppo.run.export"), out.stdout


def test_the_layout_seam_is_still_importable_from_the_parallel_module() -> None:
    import lppo.layouts.base as base
    import lppo.parallel as parallel

    for name in base.__all__:
        assert getattr(parallel, name) is getattr(base, name)
    assert not hasattr(parallel, "not_a_name")
