"""The real-model race hands both sides the same work and scores them alike (no TRL needed)."""

from __future__ import annotations

import json
import os
import random
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "examples", "smollm2"))

import _race_common as common  # noqa: E402
import _race_report as report  # noqa: E402
import real_model_race as race  # noqa: E402
from smollm2_task import ChatArithmeticTask  # noqa: E402

from lppo.tasks import Prompt  # noqa: E402

MODEL = os.path.join(ROOT, "examples", "smollm2", "SmolLM2-135M-Instruct")
SMALL = ["--prompts-per-iteration", "2", "--samples-per-prompt", "4"]
SMALL += ["--samples-budget", "16", "--eval-every", "8", "--heldout", "16"]


def test_reward_is_the_tasks_verifier() -> None:
    """TRL's reward (no lppo in its venv) scores every completion as ChatArithmeticTask does."""
    task = ChatArithmeticTask(max_value=99, operators="+-*")
    prompt = task.make_prompt(47, "-", 58)
    completions = ["-11", "47 - 58 = -11.", "The answer is 11", "", "1,011", "-11 or 12", "x"]
    for text in completions:
        assert common.reward(prompt.answer, text) == task.reward(prompt, text), text


def test_prompt_digest_is_a_multiset_of_rows() -> None:
    """Row order does not change a digest; content and multiplicity do; runs keep order."""
    rows = [[1, 2, 3], [1, 2, 3], [4, 5]]
    assert common.prompt_digest(rows) == common.prompt_digest(rows[::-1])
    assert common.prompt_digest(rows) != common.prompt_digest(rows[:2])
    assert common.prompt_digest(rows) != common.prompt_digest([[1, 2, 3], [4, 5], [4, 5]])
    assert common.run_digest(["a", "b"]) != common.run_digest(["b", "a"])


def test_clock_leaves_pauses_out() -> None:
    """Paused time is not counted."""
    clock = common.Clock()
    clock.pause()
    time.sleep(0.05)
    paused = clock.elapsed()
    clock.resume()
    assert clock.elapsed() < paused + 0.04


def test_spec_gives_both_sides_the_same_problems(tmp_path) -> None:
    """One spec file, disjoint train / held-out problems, every worker reads the same path."""
    args = race.parse_args([*SMALL, "--root", str(tmp_path)])
    path, spec = race.write_spec(args)
    assert spec["iterations"] == 2 and len(spec["train"]) == 4 and len(spec["heldout"]) == 16
    train = {(p["a"], p["op"], p["b"]) for p in spec["train"]}
    assert not train & {(p["a"], p["op"], p["b"]) for p in spec["heldout"]}
    with open(path) as f:
        assert json.load(f)["train"] == spec["train"]
    cmds = {v: race.command(v, args, path, "trl-python") for v in args.variants}
    assert all(cmd[2:4] == [path, os.path.join(str(tmp_path), v)] for v, cmd in cmds.items())
    assert cmds["lppo"][4:] == race.LEAN and cmds["lppo-default"][4:] == []


def test_budget_must_be_whole_iterations(tmp_path) -> None:
    """A sample budget that is not a whole number of iterations is refused."""
    args = race.parse_args([*SMALL, "--samples-budget", "12", "--root", str(tmp_path)])
    with pytest.raises(SystemExit, match="multiple of 8"):
        race.write_spec(args)


def test_lppo_task_serves_the_spec_in_order(tmp_path) -> None:
    """lppo's task hands out the spec's problems in order; setup checks do not move it."""
    import _race_lppo

    _, spec = race.write_spec(race.parse_args([*SMALL, "--root", str(tmp_path)]))
    task = _race_lppo.spec_task(spec)
    assert len(task.sample_texts()) == 8
    first = task.sample_prompts(2, random.Random(5))
    state = task.state_dict()
    second = task.sample_prompts(2, random.Random(5))
    task.load_state_dict(state)
    assert [p.text for p in task.sample_prompts(2, random.Random(0))] == [p.text for p in second]
    assert [p.text for p in first + second] == [p["text"] for p in spec["train"]]
    assert all(isinstance(p, Prompt) and p.answer for p in first)


def test_summary_goals() -> None:
    """Time to TRL's final accuracy ignores the untrained start; goals compare with TRL."""
    base = {"accuracy": 0.5, "n": 100}

    def run(seconds: list[float], acc: list[float], peak: float) -> dict:
        points = [
            {"samples": 8 * (i + 1), "seconds": s, "accuracy": a, "n": 100}
            for i, (s, a) in enumerate(zip(seconds, acc, strict=True))
        ]
        return {"points": points, "peak_rss_mb": peak, "run_digest": "d"}

    trl = run([10.0, 20.0], [0.4, 0.6], 3000.0)
    fast = report.summary("lppo", run([6.0, 12.0], [0.6, 0.7], 2900.0), base, trl)
    assert fast["reach_s"] == 6.0 and fast["reach_ratio"] == pytest.approx(0.3)
    assert fast["goal_time"] and fast["goal_accuracy"] and fast["goal_memory"]
    assert fast["same_work"]
    slow = report.summary("lppo", run([15.0, 30.0], [0.5, 0.55], 3100.0), base, trl)
    assert slow["reach_s"] is None and not slow["goal_accuracy"] and not slow["goal_memory"]
    assert "| lppo |" in report.table([report.summary("trl", trl, base, trl), fast, slow])


@pytest.mark.skipif(not os.path.isdir(MODEL), reason="examples/smollm2/convert.py not run")
def test_evaluation_encodes_prompts_as_lppo_does() -> None:
    """The evaluation's prompt ids are those lppo's chat engines (and TRL's template) produce."""
    import _race_eval
    import transformers

    from lppo.rollout.encoding import encode_prompt

    tok = transformers.AutoTokenizer.from_pretrained(MODEL)
    text = "What is 47 minus 18? Answer with just the number."
    assert _race_eval.encode(tok, text) == encode_prompt(tok, text, True, True)
