"""``lppo`` run in a fresh process, as a person runs it (this checkout's lppo first on the path)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def lppo_cli(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m lppo.run.cli *args``; ``LPPO_DEBUG`` / ``JSONARGPARSE_DEBUG`` only from
    ``env``."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    full = {**os.environ, **OFFLINE_ENV, "PYTHONPATH": path}
    for key in ("LPPO_DEBUG", "JSONARGPARSE_DEBUG"):
        full.pop(key, None)
    return subprocess.run(
        [sys.executable, "-m", "lppo.run.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**full, **(env or {})},
        cwd=cwd,
    )
