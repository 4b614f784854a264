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


def test_a_real_vocabulary_setting_builds_its_own_assets(tmp_path) -> None:
    """``--vocab`` gives both sides a tokenizer, models and prompts of that many entries, in
    their own directory; a directory of another vocabulary is refused, not silently reused."""
    import json

    import _trl_assets
    import pytest
    import transformers

    args = bench.parse_args(["--vocab", "49152"])
    assert args.root == "/tmp/lppo-trl-bench-v49152"
    assert bench.parse_args([]).root == "/tmp/lppo-trl-bench"
    root = str(tmp_path / "assets")
    _trl_assets.build(root, [3], ["equal"], vocab_size=300)
    tok = transformers.AutoTokenizer.from_pretrained(os.path.join(root, "tokenizer"))
    assert len(tok) == 300
    for name in ("policy", "reward"):
        with open(os.path.join(root, name, "config.json")) as f:
            assert json.load(f)["vocab_size"] == 300
    prompts = _trl_assets.load_prompts(root, "equal", 3)
    assert max(max(p) for p in prompts) < 300 and tok.decode(prompts[0]).split()[0][0] == "w"
    with pytest.raises(ValueError, match="vocabulary 300, not 1024"):
        _trl_assets.build(root, [3], ["equal"])
