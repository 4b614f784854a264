"""``RolloutSamples``: the sampled rows' files, their numbers, multi-turn rows, wandb, the page.

The fits shrink ``configs/tiny.yaml`` and ``configs/multiturn.yaml`` (4 prompts, 2 iterations)
and run in-process (``lppo.run.cli.run``); what the files say is checked against what else
knows it: the task's own reward of the decoded texts, the store's columns read by another
callback before the rows are released, the environment's rules for multi-turn rows.
"""

from __future__ import annotations

import csv
import html.parser
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _cli import lppo_cli
from lppo.callbacks import RolloutSamples
from lppo.callbacks.rollout_samples import PAGE_NAME

from lppo.envs.hidden_digit import QUERY, REVEALED
from lppo.iteration.hooks import IterationContext, PPOCallback
from lppo.run.cli import run
from lppo.run.sample_page import embedded_iterations
from lppo.tasks.base import Prompt
from lppo.types import (
    ADVANTAGES,
    INPUT_IDS,
    RESPONSE_MASK,
    IterationResult,
)
from lppo.validation import SettingError

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"
MULTITURN = ROOT / "configs" / "multiturn.yaml"
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
ITERATIONS = 2

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter:UserWarning")


class StoreRecorder(PPOCallback):
    """Reads every row of each iteration from the store at ``on_iteration_end``.

    Given on the command line, it comes before the built-in callbacks, so it reads the rows
    the samples are read from, before they are released.
    """

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[int, dict[int, dict[str, torch.Tensor]]] = {}

    def on_iteration_end(self, ctx: IterationContext, result: IterationResult) -> None:
        """Record ``input_ids``, ``response_mask`` and ``advantages`` of every row."""
        names = [INPUT_IDS, RESPONSE_MASK, ADVANTAGES]
        read = ctx.store.read(list(ctx.row_ids), names)
        self.rows[ctx.iteration + 1] = {
            row: {name: read[name][k] for name in names} for k, row in enumerate(ctx.row_ids)
        }


def fit_args(
    config: Path, root: Path, *extra: str, samples: int = 2, iterations: int = ITERATIONS
) -> list[str]:
    return [
        "fit",
        "--config",
        str(config),
        "--model.rollout.prompts_per_iteration",
        "4",
        "--model.rollout.samples_per_prompt",
        str(samples),
        "--trainer.max_epochs",
        str(iterations),
        "--trainer.default_root_dir",
        str(root),
        *extra,
    ]


def fit(args: list[str]) -> Any:
    with pytest.MonkeyPatch.context() as mp:
        for key, value in OFFLINE_ENV.items():
            mp.setenv(key, value)
        return run(args)


def records(folder: Path, number: int) -> list[dict[str, Any]]:
    path = folder / f"iteration-{number:04d}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Path]]:
    """Two tiny iterations with the built-in ``RolloutSamples``; yields ``(cli, run dir)``."""
    root = tmp_path_factory.mktemp("samples") / "run"
    recorder = ["--trainer.callbacks+=test_rollout_samples.StoreRecorder"]
    # top-k sampling: μ renormalizes the k kept tokens, so it differs from π_old (mismatch ≠ 0)
    top_k = ["--model.rollout.top_k", "4"]
    yield fit(fit_args(TINY, root, *recorder, *top_k)), root


# ------------------------------------------------------------------ the files of a fit
def test_each_iteration_file_holds_the_first_row_of_each_prompt(
    tiny_run: tuple[Any, Path],
) -> None:
    cli, root = tiny_run
    folder = root / "samples"
    assert sorted(p.name for p in folder.glob("iteration-*.jsonl")) == [
        "iteration-0001.jsonl",
        "iteration-0002.jsonl",
    ]
    recorded = next(cb for cb in cli.trainer.callbacks if isinstance(cb, StoreRecorder)).rows
    for number in (1, 2):
        rows = records(folder, number)
        assert len(rows) == RolloutSamples().rows_per_iteration == 4
        assert [r["prompt_index"] for r in rows] == [0, 1, 2, 3]
        assert all(r["iteration"] == number for r in rows)
        # samples of a prompt are contiguous: the first row of prompt i is the (2i+1)-th row
        ordered = sorted(recorded[number])
        assert [r["row_id"] for r in rows] == ordered[::2]


def test_rewards_are_the_tasks_rewards_of_the_logged_texts(tiny_run: tuple[Any, Path]) -> None:
    cli, root = tiny_run
    system = cli.trainer.lightning_module
    task, bos = system.task, system.tokenizer.bos_token
    for number in (1, 2):
        for row in records(root / "samples", number):
            source = row["prompt"].removeprefix(bos).removesuffix("=")
            expected = task.reward(task.make_prompt(source), row["completion"])
            assert row["reward"] == pytest.approx(expected, rel=1e-5, abs=1e-6), row


def test_token_records_hold_the_stores_advantages(tiny_run: tuple[Any, Path]) -> None:
    cli, root = tiny_run
    recorded = next(cb for cb in cli.trainer.callbacks if isinstance(cb, StoreRecorder)).rows
    tokenizer = cli.trainer.lightning_module.tokenizer
    for number in (1, 2):
        for row in records(root / "samples", number):
            stored = recorded[number][row["row_id"]]
            mask = stored[RESPONSE_MASK]
            start = int(mask.nonzero()[0, 0])
            tokens = row["tokens"]
            assert [t["position"] for t in tokens] == list(range(start, len(mask)))
            assert [t["id"] for t in tokens] == stored[INPUT_IDS][start:].tolist()
            assert "".join(t["text"] for t in tokens) == tokenizer.decode(
                stored[INPUT_IDS][start:].tolist()
            )
            assert row["trained_tokens"] == int(mask.sum()) == len(tokens)
            logged = torch.tensor([t["advantage"] for t in tokens], dtype=torch.float64)
            expected = stored[ADVANTAGES][start:].double()
            torch.testing.assert_close(logged, expected, rtol=1e-5, atol=1e-6)
            assert row["advantage_mean"] == pytest.approx(float(expected.mean()), rel=1e-5)
            assert all(t["gen_logprob"] < 0 and t["old_logprob"] < 0 for t in tokens)


def test_mismatch_is_at_most_the_iterations_logged_maximum(tiny_run: tuple[Any, Path]) -> None:
    cli, root = tiny_run
    with open(Path(cli.trainer.logger.log_dir) / "metrics.csv") as f:
        logged = [r for r in csv.DictReader(f) if r["rollout/mismatch_max_abs_log_ratio"]]
    assert [int(r["iteration"]) for r in logged] == [1, 2]
    for number, metrics in zip((1, 2), logged, strict=True):
        limit = float(metrics["rollout/mismatch_max_abs_log_ratio"])
        for row in records(root / "samples", number):
            # π_old − μ: μ = π / Z on the kept tokens with Z < 1, so it is negative
            assert all(t["mismatch"] < 0 for t in row["tokens"])
            mismatch = [abs(t["old_logprob"] - t["gen_logprob"]) for t in row["tokens"]]
            assert [abs(t["mismatch"]) for t in row["tokens"]] == pytest.approx(mismatch, abs=2e-5)
            assert row["max_abs_mismatch"] == pytest.approx(max(mismatch), abs=2e-5)
            assert row["max_abs_mismatch"] <= limit + 1e-5


def test_the_summary_names_the_samples_folder(tiny_run: tuple[Any, Path]) -> None:
    _, root = tiny_run
    summary = json.loads((root / "summary.json").read_text())
    assert summary["samples"] == str(root / "samples")


# ------------------------------------------------------------------ the page
def test_the_page_embeds_every_iteration_file_and_fetches_nothing(
    tiny_run: tuple[Any, Path],
) -> None:
    _, root = tiny_run
    page = (root / "samples" / PAGE_NAME).read_text()
    embedded = embedded_iterations(page)
    assert sorted(embedded) == [1, 2]
    for number, data in embedded.items():
        assert json.loads(data) == records(root / "samples", number)
    shell = re.sub(r'<script type="application/json".*?</script>', "", page, flags=re.S)
    assert not re.search(r"https?:|//[a-z]|\bsrc=|<link|@import|fetch\(", shell, re.I)


class _Tokens(html.parser.HTMLParser):
    """The token spans, iteration links and mode buttons of a rendered page."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens: list[dict[str, str]] = []
        self.iterations: list[str] = []
        self.modes: dict[str, str] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = {k: v or "" for k, v in attrs}
        if tag == "span" and "tok" in found.get("class", "").split():
            self.tokens.append(found)
        elif tag == "a" and "data-iteration" in found:
            self.iterations.append(found["data-iteration"])
        elif tag == "button" and "data-mode" in found:
            self.modes[found["data-mode"]] = found.get("class", "")


def browser() -> str | None:
    """A Chromium-family browser on the path, if any."""
    names = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
    return next((path for name in names if (path := shutil.which(name))), None)


def rendered(page: Path, fragment: str) -> _Tokens:
    """The page after its script ran in a headless browser, opened at ``#fragment``."""
    exe = browser()
    if exe is None:
        pytest.skip("no headless browser: install Debian's chromium (apt-get install chromium)")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--dump-dom"]
    proc = subprocess.run(
        [exe, *flags, f"{page.as_uri()}#{fragment}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    parser = _Tokens()
    parser.feed(proc.stdout)
    return parser


@pytest.mark.parametrize("mode", ["advantage", "mismatch"])
def test_a_browser_shows_the_tokens_coloured_by_the_logged_numbers(
    tiny_run: tuple[Any, Path], mode: str
) -> None:
    _, root = tiny_run
    shown = rendered(root / "samples" / PAGE_NAME, f"iteration=1&mode={mode}")
    assert shown.iterations == ["1", "2"]
    assert shown.modes[mode] == "on"
    tokens = [t for row in records(root / "samples", 1) for t in row["tokens"]]
    assert [int(s["data-position"]) for s in shown.tokens] == [t["position"] for t in tokens]
    scale = max(abs(t[mode]) for t in tokens)
    for span, token in zip(shown.tokens, tokens, strict=True):
        value = token[mode]
        assert float(span["data-value"]) == pytest.approx(value)
        if scale and abs(value) / scale > 0.01:  # coloured: blue above 0, red below
            colour = "rgba(37, 99, 235" if value > 0 else "rgba(220, 38, 38"
            style = span.get("style", "").replace("rgb(", "rgba(")
            assert colour in style, (span, token)


# ------------------------------------------------------------------ settings
def test_rows_per_iteration_0_writes_nothing(tmp_path: Path) -> None:
    off = ["--trainer.callbacks+=lppo.callbacks.RolloutSamples"]
    off += ["--trainer.callbacks.rows_per_iteration", "0"]
    cli = fit(fit_args(TINY, tmp_path / "run", *off))
    assert not (tmp_path / "run" / "samples").exists()
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["samples"] is None
    assert [type(cb) for cb in cli.trainer.callbacks].count(RolloutSamples) == 1


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("rows_per_iteration", -1),
        ("every_n_iterations", 0),
        ("max_tokens_per_row", -1),
        ("page_iterations", 1.5),
        ("wandb_table", "yes"),
    ],
)
def test_settings_are_checked_at_construction(setting: str, value: Any) -> None:
    with pytest.raises(SettingError) as error:
        RolloutSamples(**{setting: value})
    assert f"trainer.callbacks[RolloutSamples].init_args.{setting}={value!r}" in str(error.value)


def test_a_resume_keeps_earlier_files_and_deletes_those_the_checkpoint_lacks(
    tmp_path: Path,
) -> None:
    root = tmp_path / "run"
    fit(fit_args(TINY, root, iterations=1))
    first = (root / "samples" / "iteration-0001.jsonl").read_text()
    (root / "samples" / "iteration-0007.jsonl").write_text("{}\n")  # an attempt not kept
    fit(fit_args(TINY, root, "--ckpt_path", "last"))
    folder = root / "samples"
    assert sorted(p.name for p in folder.glob("iteration-*")) == [
        "iteration-0001.jsonl",
        "iteration-0002.jsonl",
    ]
    assert (folder / "iteration-0001.jsonl").read_text() == first
    assert sorted(embedded_iterations((folder / PAGE_NAME).read_text())) == [1, 2]


# ------------------------------------------------------------------ multi-turn rows
def test_multi_turn_rows_mark_observations_and_score_the_last_turn(tmp_path: Path) -> None:
    root = tmp_path / "run"
    every_row = ["--trainer.callbacks+=lppo.callbacks.RolloutSamples"]
    every_row += ["--trainer.callbacks.rows_per_iteration", "16"]
    cli = fit(fit_args(MULTITURN, root, *every_row, samples=4))
    system = cli.trainer.lightning_module
    tokenizer, task = system.tokenizer, system.task
    call_reward = system.engine.environment.call_reward
    rows = [r for n in (1, 2) for r in records(root / "samples", n)]
    assert len(rows) == 32
    asked = [r for r in rows if r["observation_tokens"]]
    assert asked, "no row called the environment"
    for row in asked:
        call, seen, answer = row["turns"]
        assert (call["kind"], seen["kind"], answer["kind"]) == ("policy", "observation", "policy")
        assert QUERY in call["text"] and call["reward"] == pytest.approx(call_reward)
        digit = seen["text"].removesuffix(REVEALED)
        assert seen["text"].endswith(REVEALED) and digit.isdigit()
        observed = [t for t in row["tokens"] if not t["policy"]]
        assert [t["position"] for t in observed] == list(range(seen["start"], seen["end"]))
        assert all(not t["trained"] and t["advantage"] is None for t in observed)
        assert all(t["gen_logprob"] is None for t in observed)
        said = [t["id"] for t in row["tokens"] if t["position"] >= answer["start"]]
        text = tokenizer.decode(said, skip_special_tokens=True)
        expected = call_reward + task.reward(Prompt(task.prompt, digit), text)
        assert row["reward"] == pytest.approx(expected), row
    for row in rows:
        assert sum(t["policy"] for t in row["tokens"]) == row["response_tokens"]


# ------------------------------------------------------------------ wandb
def test_wandb_gets_a_samples_table_each_iteration(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    root = tmp_path / "run"
    home = str(tmp_path / "wandb_home")
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": home}
    env |= {"WANDB_CACHE_DIR": home, "WANDB_DATA_DIR": home}
    logger = ["--trainer.logger", "lightning.pytorch.loggers.WandbLogger"]
    proc = lppo_cli(*fit_args(TINY, root, *logger), env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = list(root.glob("wandb/offline-run-*"))
    assert len(runs) == 1
    # wandb's service process writes the files; it may finish after lppo exits
    deadline = time.monotonic() + 120
    while len(tables := sorted(runs[0].rglob("*.table.json"))) < ITERATIONS:
        assert time.monotonic() < deadline, list(runs[0].rglob("*"))
        time.sleep(0.5)
    assert all(
        os.path.dirname(t).endswith(os.path.join("media", "table", "samples")) for t in tables
    )
    for table in tables:
        content = json.loads(table.read_text())
        assert content["columns"] == [
            "iteration",
            "row",
            "prompt",
            "completion",
            "reward",
            "mean advantage",
            "max |mismatch|",
        ]
        number = content["data"][0][0]
        logged = records(root / "samples", number)
        assert [d[1:5] for d in content["data"]] == [
            [r["row_id"], r["prompt"], r["completion"], r["reward"]] for r in logged
        ]
