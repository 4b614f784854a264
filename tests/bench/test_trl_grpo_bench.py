"""The GRPO side-by-side bench builds the same work on both sides (no TRL venv needed)."""

from __future__ import annotations

import os
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "bench")
sys.path.insert(0, BENCH)

import trl_grpo_side_by_side as bench  # noqa: E402


def test_tuned_settings_drop_the_critic_ones() -> None:
    """The tuned lppo variant gets the PPO bench's settings that apply without a critic."""
    assert not any(o.startswith("old_values") for o in bench.TUNED_GRPO)
    assert "old_logprobs=rollout" in bench.TUNED_GRPO


def test_commands_ask_for_the_same_work() -> None:
    """Both sides get the same prompts, samples per prompt and iterations."""
    args = bench.parse_args(["--samples", "4", "--iterations", "2"])
    trl = bench.command("trl", args, "python", "equal", 16)
    lppo = bench.command("lppo-default", args, "python", "equal", 16)
    assert trl[-1] == "4" and "samples=4" in lppo and "estimator=grpo" in lppo
    assert trl[2:6] == lppo[2:6]
    assert not set(bench.TUNED_GRPO) & set(lppo)
