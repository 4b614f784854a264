"""``bench/real_vocab.py`` measures both modes on the same rows and reports them side by side."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "real_vocab.py")
SMALL = ["--vocab", "640", "--prompt", "6", "--prompts", "2", "--samples", "3"]
SMALL += ["--response", "5", "--chunk-tokens", "24", "--threads", "1"]
MODES = ["materialized", "sliced", "sliced ×4", "shared"]


def test_each_mode_and_phase_runs_the_same_chunks_and_lands_in_the_table(tmp_path) -> None:
    out = tmp_path / "real_vocab.json"
    run = subprocess.run(
        [sys.executable, SCRIPT, *SMALL, "--mode", *MODES, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    assert {(r["mode"], r["phase"]) for r in results} == {
        (mode, phase) for mode in ("materialized", "sliced") for phase in ("actor", "score")
    } | {(mode, phase) for mode in ("sliced ×4", "shared") for phase in ("actor", "score")}
    by = {(r["mode"], r["phase"]): r for r in results}
    for phase in ("actor", "score"):  # the same plan: 6 rows of 11 tokens, 2 per chunk
        assert by[("materialized", phase)]["chunks"] == by[("sliced", phase)]["chunks"] >= 3
        assert by[("sliced ×4", phase)]["chunks"] < by[("sliced", phase)]["chunks"]
        assert by[("shared", phase)]["chunks"] >= 3
    assert all(r["seconds"] > 0 and r["peak_mib"] >= 0 for r in results)
    table = [line for line in run.stdout.splitlines() if line.startswith("| 640 ")]
    assert [line.split("|")[3].strip() for line in table] == MODES
