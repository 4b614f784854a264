"""``DatasetTask``: prompts from JSONL / Parquet files, epochs, state, verifiers, errors, CLI."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lppo.run.cli import run
from lppo.tasks import DatasetTask, Prompt
from lppo.tasks.verifiers import ExactMatch, NumericAnswer, Verifier, extract_number

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "dataset.yaml"
ARITH = ROOT / "examples" / "data" / "arith.jsonl"
ROWS = [{"question": f"{a}+{a + 1}", "answer": str(2 * a + 1), "id": a} for a in range(7)]

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter:UserWarning")


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture
def jsonl(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "rows.jsonl", ROWS)


def make(path: Path | str | list[str], **kwargs: Any) -> DatasetTask:
    kwargs.setdefault("prompt_field", "question")
    return DatasetTask(path=path if isinstance(path, list) else str(path), **kwargs)


def texts(prompts: list[Prompt]) -> list[str]:
    return [p.text for p in prompts]


# ---------------------------------------------------------------------------- loading
def test_jsonl_loads_prompts_and_answers(jsonl: Path) -> None:
    task = make(jsonl, shuffle=False)
    assert len(task) == len(ROWS)
    prompts = task.sample_prompts(3, random.Random(0))
    assert prompts[0] == Prompt("0+1", "1", {"row": 0, "epoch": 0})
    assert texts(prompts) == ["0+1", "1+2", "2+3"]
    # Numbers become text; the template fills any field.
    task = make(jsonl, answer_field="id", template="Q: {question} (#{id})\n", shuffle=False)
    assert task.sample_prompts(2, random.Random(0))[1] == Prompt(
        "Q: 1+2 (#1)\n", "1", {"row": 1, "epoch": 0}
    )


def test_parquet_loads_the_same_prompts(tmp_path: Path, jsonl: Path) -> None:
    parquet = write_parquet(tmp_path / "rows.parquet", ROWS)
    a, b = make(jsonl, seed=3), make(parquet, seed=3)
    assert (a.texts, a.answers) == (b.texts, b.answers)
    assert a.sample_prompts(10, random.Random(0)) == b.sample_prompts(10, random.Random(1))


def test_globs_and_lists_concatenate_in_order(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "part-0.jsonl", ROWS[:3])
    write_jsonl(tmp_path / "part-1.jsonl", ROWS[3:])
    by_glob = make(str(tmp_path / "part-*.jsonl"))
    by_list = make([str(tmp_path / "part-0.jsonl"), str(tmp_path / "part-1.jsonl")])
    assert by_glob.texts == by_list.texts == [r["question"] for r in ROWS]


def test_vocabulary_and_max_prompt_length_come_from_the_data(jsonl: Path) -> None:
    task = make(jsonl, template="{question}=")
    chars = {c for r in ROWS for c in r["question"] + r["answer"]} | {"="}
    assert task.vocabulary() == "".join(sorted(chars)) == "+012345679="
    assert task.max_prompt_length() == max(len(r["question"]) + 1 for r in ROWS) == 4
    assert task.state_dict()["position"] == 0  # neither call advances the walk
    for p in task.sample_prompts(20, random.Random(0)):
        assert set(p.text + p.answer) <= set(task.vocabulary())


def test_the_longest_prompt_is_the_data_s_longest_row(tmp_path: Path) -> None:
    """A multi-turn run measures its opening at setup (not a sample of the walk)."""
    rows = [*ROWS[:5], {"question": "12345+54321", "answer": "66666", "id": 9}, *ROWS[5:]]
    task = make(write_jsonl(tmp_path / "rows.jsonl", rows), template="{question}=")
    task.sample_prompts(2, random.Random(0))
    before = task.state_dict()
    assert task.longest_prompt() == Prompt("12345+54321=", "66666", {"row": 5, "epoch": 0})
    assert len(task.longest_prompt().text) == task.max_prompt_length()
    assert task.state_dict() == before


# ---------------------------------------------------------------------- epochs, state
def test_epochs_cover_every_row_wrap_and_reshuffle(jsonl: Path) -> None:
    task = make(jsonl, seed=1)
    walk = task.sample_prompts(3 * len(ROWS) + 2, random.Random(0))
    epochs = [walk[i * len(ROWS) : (i + 1) * len(ROWS)] for i in range(3)]
    for e, epoch in enumerate(epochs):
        assert sorted(p.metadata["row"] for p in epoch) == list(range(len(ROWS)))
        assert {p.metadata["epoch"] for p in epoch} == {e}
    assert len({tuple(texts(e)) for e in epochs}) == 3  # each epoch has its own order
    assert [p.metadata["epoch"] for p in walk[-2:]] == [3, 3]
    assert task.state_dict() == {"epoch": 3, "position": 2, "rows": len(ROWS)}
    unshuffled = make(jsonl, shuffle=False).sample_prompts(2 * len(ROWS), random.Random(0))
    assert texts(unshuffled) == 2 * [r["question"] for r in ROWS]


def test_order_is_reproducible_from_the_seed_not_the_generator(jsonl: Path) -> None:
    a = make(jsonl, seed=5).sample_prompts(20, random.Random(0))
    b = make(jsonl, seed=5).sample_prompts(20, random.Random(123))
    assert a == b
    c = make(jsonl, seed=6).sample_prompts(20, random.Random(0))
    assert texts(a) != texts(c)
    # Drawing in pieces walks the same sequence as drawing at once.
    task = make(jsonl, seed=5)
    pieces = [p for n in (3, 8, 1, 8) for p in task.sample_prompts(n, random.Random(n))]
    assert pieces == a


def test_state_dict_round_trip_continues_at_the_same_prompt(jsonl: Path, tmp_path: Path) -> None:
    task = make(jsonl, seed=2)
    task.sample_prompts(9, random.Random(0))
    path = tmp_path / "state.pt"
    torch.save(task.state_dict(), path)
    expected = task.sample_prompts(12, random.Random(0))

    resumed = make(jsonl, seed=2)
    resumed.load_state_dict(torch.load(path, weights_only=True))
    assert resumed.sample_prompts(12, random.Random(99)) == expected
    resumed.load_state_dict({})  # an old checkpoint without task state: from the start
    assert resumed.sample_prompts(3, random.Random(0)) == make(jsonl, seed=2).sample_prompts(
        3, random.Random(0)
    )


def test_load_state_dict_rejects_foreign_state(jsonl: Path) -> None:
    task = make(jsonl)
    with pytest.raises(ValueError, match=r"dataset of 99 rows .* holds 7; resume with the same"):
        task.load_state_dict({"epoch": 0, "position": 1, "rows": 99})
    with pytest.raises(ValueError, match=r"must have keys \['epoch', 'position', 'rows'\]"):
        task.load_state_dict({"cursor": 3})
    with pytest.raises(ValueError, match="out of range"):
        task.load_state_dict({"epoch": 0, "position": 8, "rows": 7})


# -------------------------------------------------------------------------- verifiers
@pytest.mark.parametrize(
    ("verifier", "completion", "answer", "score"),
    [
        (ExactMatch(), " 7\n", "7", 1.0),
        (ExactMatch(), "7 ", "70", 0.0),
        (ExactMatch(strip=False), " 7", "7", 0.0),
        (ExactMatch(ignore_case=True), "Paris", "paris", 1.0),
        (ExactMatch(), "Paris", "paris", 0.0),
        (ExactMatch(collapse_whitespace=True), " a \n\t b ", "a b", 1.0),
        (ExactMatch(), "a  b", "a b", 0.0),
        (NumericAnswer(), "so 3 + 4 is 7", "7", 1.0),
        (NumericAnswer(), "7.0", "7", 1.0),
        (NumericAnswer(), "the answer is 1,234", "1234", 1.0),
        (NumericAnswer(), "x = -3", "-3", 1.0),
        (NumericAnswer(), "4-3=1", "1", 1.0),
        (NumericAnswer(), "... #### 42 (I think 41)", "She has 6*7 = 42.\n#### 42", 1.0),
        (NumericAnswer(), "41", "#### 42", 0.0),
        (NumericAnswer(), "no number", "7", 0.0),
        (NumericAnswer(last_number=False), "7", "#### 7", 0.0),
        (NumericAnswer(marker=""), "#### 7 then 8", "8", 1.0),
        (NumericAnswer(tolerance=0.01), "3.141", "3.14159", 1.0),
        (NumericAnswer(), "3.141", "3.14159", 0.0),
        (NumericAnswer(tolerance=0.0, relative_tolerance=0.01), "101", "100", 1.0),
    ],
)
def test_verifiers(verifier: Verifier, completion: str, answer: str, score: float) -> None:
    assert verifier(completion, answer) == score
    assert verifier.batch([completion, answer], [answer, answer]) == [score, 1.0]


def test_extract_number() -> None:
    assert extract_number("Natalia sold 48/2 = 24 clips.\n#### 72") == 72.0
    assert extract_number("#### ") is None
    assert extract_number("-.5") == -0.5
    assert extract_number("10-20") == 20.0


def test_numeric_answer_rejects_bad_tolerance_and_answers_without_number() -> None:
    with pytest.raises(ValueError, match=r"verifier\.init_args\.tolerance=-1\.0 is out of range"):
        NumericAnswer(tolerance=-1.0)
    with pytest.raises(ValueError, match="holds no number"):
        NumericAnswer()("7", "seven")


def test_task_rewards_score_the_batch_with_one_verifier_call(jsonl: Path) -> None:
    from _dataset_helpers import LengthVerifier

    verifier = LengthVerifier(partial=0.25)
    task = make(jsonl, verifier=verifier, shuffle=False)
    prompts = task.sample_prompts(3, random.Random(0))  # answers "1", "3", "5"
    assert task.rewards(prompts, ["9", "33", " 5 "]) == [1.0, 0.25, 1.0]
    assert verifier.batch_calls == 1
    assert task.reward(prompts[0], "1") == 1.0
    with pytest.raises(ValueError, match="3 prompts but 2 completions"):
        task.rewards(prompts, ["1", "2"])


@pytest.mark.parametrize("verifier", [ExactMatch(), NumericAnswer()])
def test_reference_answer_scores_one(verifier: Verifier) -> None:
    task = DatasetTask(str(ARITH), prompt_field="question", verifier=verifier)
    for p in task.sample_prompts(len(task), random.Random(0)):
        assert task.reward(p, p.answer) == 1.0


# ----------------------------------------------------------------------------- errors
def test_error_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"path='.*nope\.jsonl': no such file"):
        make(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match=r"part-\*\.jsonl'.*pass an existing"):
        make(str(tmp_path / "part-*.jsonl"))
    with pytest.raises(ValueError, match=r"path=\[\] names no file"):
        make([])


def test_error_unsupported_extension_and_mixed_formats(tmp_path: Path, jsonl: Path) -> None:
    csv = tmp_path / "rows.csv"
    csv.write_text("question,answer\n1+1,2\n")
    with pytest.raises(ValueError, match=r"rows\.csv'.*unsupported extension '\.csv'.*\.parquet"):
        make(csv)
    parquet = write_parquet(tmp_path / "rows.parquet", ROWS)
    with pytest.raises(ValueError, match="mixes JSON and Parquet"):
        make([str(jsonl), str(parquet)])


def test_error_missing_field_lists_the_fields_present(jsonl: Path) -> None:
    with pytest.raises(ValueError) as info:
        make(jsonl, answer_field="solution")
    message = str(info.value)
    assert "model.task.init_args.answer_field='solution' is not a field of" in message
    assert "fields present: ['question', 'answer', 'id']" in message
    with pytest.raises(ValueError, match=r"prompt_field='prompt' is not a field"):
        make(jsonl, prompt_field="prompt")
    with pytest.raises(ValueError, match=r"template='\{problem\}=' uses \['problem'\]"):
        make(jsonl, template="{problem}=")


@pytest.mark.parametrize(
    ("template", "match"),
    [("{}=", "positional field"), ("{0}=", "positional field"), ("{question=", "not a valid")],
)
def test_error_bad_template(jsonl: Path, template: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make(jsonl, template=template)


def test_error_empty_dataset(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match=r"empty\.jsonl' holds no rows"):
        make(empty)
    empty_parquet = tmp_path / "empty.parquet"
    pa = pytest.importorskip("pyarrow")
    pytest.importorskip("pyarrow.parquet").write_table(
        pa.table({"question": pa.array([], pa.string()), "answer": pa.array([], pa.string())}),
        empty_parquet,
    )
    with pytest.raises(ValueError, match=r"empty\.parquet' holds no rows"):
        make(empty_parquet)


def test_error_null_value_unreadable_file_unscorable_answer(tmp_path: Path) -> None:
    rows = [{"question": "1+1", "answer": "2"}, {"question": None, "answer": "3"}]
    null = r"line 2 of '.*null\.jsonl' \(model\.task\.init_args\.path\) has no value \(null\)"
    with pytest.raises(ValueError, match=rf"{null} in field 'question'"):
        make(write_jsonl(tmp_path / "null.jsonl", rows))
    with pytest.raises(ValueError, match=r"line 2 of .* no value \(null\) in field 'question'"):
        make(write_jsonl(tmp_path / "null2.jsonl", rows), template="{question}=")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1+1", "answer": "2"}\n\n{"question": "1+2", "answer": "3"\n')
    match = r"bad\.jsonl': could not read it as json: line 3 of '.*bad\.jsonl': .*fix the"
    with pytest.raises(ValueError, match=match):
        make(bad)
    words = write_jsonl(tmp_path / "words.jsonl", [{"question": "1+1", "answer": "two"}])
    with pytest.raises(ValueError, match=r"line 1 of .*'two' holds no number.*verifier"):
        make(words, verifier=NumericAnswer())


def test_errors_name_the_file_and_its_1_based_line_or_row(tmp_path: Path) -> None:
    # Rows of the second file, after a blank line: the line is the file's own, counted from 1.
    first = write_jsonl(tmp_path / "a.jsonl", ROWS[:2])
    second = tmp_path / "b.jsonl"
    second.write_text('{"question": "1+1", "answer": "2"}\n\n{"question": null, "answer": "3"}\n')
    with pytest.raises(ValueError, match=r"line 3 of '.*b\.jsonl' .* field 'question'"):
        make([str(first), str(second)])
    rows = [{"question": "1+1", "answer": "2"}, {"question": None, "answer": "3"}]
    with pytest.raises(ValueError, match=r"row 2 of '.*rows\.parquet' .* field 'question'"):
        make(write_parquet(tmp_path / "rows.parquet", rows))


def test_bytes_that_are_not_utf8_name_the_file_and_line(tmp_path: Path) -> None:
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(
        b'{"question": "1+1", "answer": "2"}\n{"question": "caf\xe9", "answer": "3"}\n'
    )
    match = r"latin1\.jsonl' is not UTF-8 text \(byte 0xe9 at column 18\); save the file as UTF-8"
    for template in (None, "Q: {question}"):
        with pytest.raises(ValueError, match=rf"line 2 of '.*{match}"):
            make(latin1, template=template)


@pytest.mark.parametrize(
    ("value", "shown"),
    [({"x": 1}, r'dict \(\{"x": 1\}\)'), (["q"], r'list \(\["q"\]\)'), (True, r"bool \(true\)")],
)
@pytest.mark.parametrize("template", [None, "Q: {question}"])
def test_a_field_that_is_not_text_names_the_file_line_and_field(
    tmp_path: Path, value: object, shown: str, template: str | None
) -> None:
    rows = [{"question": "1+1", "answer": "2"}, {"question": value, "answer": "3"}]
    path = write_jsonl(tmp_path / "typed.jsonl", rows)
    match = rf"line 2 of '.*typed\.jsonl' .* holds a {shown} in field 'question', not a string"
    with pytest.raises(ValueError, match=match):
        make(path, template=template)
    answers = [{"question": "1+1", "answer": "2"}, {"question": "1+2", "answer": value}]
    with pytest.raises(ValueError, match=r"line 2 of .* in field 'answer', not a string"):
        make(write_jsonl(tmp_path / "answers.jsonl", answers))


def test_a_template_may_reach_into_a_structured_field(tmp_path: Path) -> None:
    rows = [{"meta": {"q": "1+1", "n": 3}, "answer": "2"}]
    task = make(write_jsonl(tmp_path / "meta.jsonl", rows), template="{meta[q]} ({meta[n]})=")
    assert task.texts == ["1+1 (3)="]


# -------------------------------------------------------------------------------- CLI
def fit(root: Path, *extra: str, iterations: int = 2) -> Any:
    return run(
        [
            "fit",
            "--config",
            str(CONFIG),
            "--trainer.max_epochs",
            str(iterations),
            "--trainer.default_root_dir",
            str(root),
            *extra,
        ]
    )


@pytest.fixture
def in_root(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run from the repository root, as the README's command does (the config's path)."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.parametrize(
    ("verifier", "cls"),
    [
        ({"class_path": "lppo.tasks.verifiers.ExactMatch"}, ExactMatch),
        (None, NumericAnswer),  # the config's own
        (
            {"class_path": "_dataset_helpers.LengthVerifier", "init_args": {"partial": 0.5}},
            None,
        ),
    ],
    ids=["exact", "numeric", "user"],
)
@pytest.mark.usefixtures("in_root")
def test_cli_fit_with_each_verifier(
    tmp_path: Path, verifier: dict[str, Any] | None, cls: type | None
) -> None:
    extra = [] if verifier is None else ["--model.task.init_args.verifier", json.dumps(verifier)]
    cli = fit(tmp_path, *extra)
    task = cli.model.task
    assert isinstance(task, DatasetTask)
    if cls is None:  # the user's class, with its init_args, scored every iteration
        assert type(task.verifier).__name__ == "LengthVerifier"
        assert task.verifier.partial == 0.5 and task.verifier.batch_calls == 2
    else:
        assert type(task.verifier) is cls
    prompts = cli.model.rollout.prompts_per_iteration
    assert task.state_dict() == {"epoch": 0, "position": 2 * prompts, "rows": 50}
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["iterations"] == 2
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["lppo_task"] == task.state_dict()


@pytest.mark.slow
@pytest.mark.usefixtures("in_root")
@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")
def test_resume_continues_the_dataset_where_it_stopped(tmp_path: Path) -> None:
    # 20 prompts per iteration over 50 rows: the third iteration crosses into epoch 1.
    extra = [
        "--model.task.class_path",
        "_dataset_helpers.RecordingDatasetTask",
        "--model.rollout.prompts_per_iteration",
        "20",
    ]
    straight = fit(tmp_path / "straight", *extra, iterations=3)
    fit(tmp_path / "split", *extra, iterations=2)
    resumed = fit(tmp_path / "split", *extra, "--ckpt_path", "last", iterations=3)
    a, b = straight.model.task, resumed.model.task
    assert len(a.sampled) == 3 and len(b.sampled) == 1  # the resumed launch sampled only one
    assert b.sampled[0] == a.sampled[2]
    assert a.state_dict() == b.state_dict() == {"epoch": 1, "position": 10, "rows": 50}
    params_a, params_b = straight.model.state_dict(), resumed.model.state_dict()
    assert params_a.keys() == params_b.keys()
    assert all(torch.equal(params_a[k], params_b[k]) for k in params_a)


def test_a_json_array_file_names_the_1_based_row(tmp_path: Path) -> None:
    path = tmp_path / "rows.json"
    path.write_text(
        json.dumps(
            [{"question": "1+1", "answer": "2"}, {"question": None, "answer": "3"}], indent=2
        )
    )
    with pytest.raises(ValueError, match=r"row 2 of '.*rows\.json' .* field 'question'"):
        make(path)


def test_the_numeric_verifier_keeps_its_gsm8k_marker_through_lppo_fit() -> None:
    """jsonargparse read the default ``"####"`` of ``marker: str | None`` as ``null``."""
    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-m", "lppo.run.cli", "fit", "--config", "configs/dataset.yaml"]
    done = subprocess.run(
        [*command, "--print_config"], cwd=root, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "marker: '####'" in done.stdout
