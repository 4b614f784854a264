"""Prompts and reference answers read from local JSONL or Parquet files.

:class:`DatasetTask` loads the file(s) once, at construction, through the Hugging Face
``datasets`` library (the optional extra ``[data]``), and walks the rows in
epochs: each epoch visits every row once, in an order shuffled from ``(seed, epoch)`` only, so
the order is reproducible. The position in that walk is the task's state: ``PPOSystem`` saves
it in every iteration-boundary checkpoint, so a resumed run continues where it stopped.
Completions are scored by a :class:`~lppo.tasks.verifiers.Verifier` chosen by ``class_path``.
"""

from __future__ import annotations

import glob
import hashlib
import random
import string
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lppo.tasks.base import Prompt, Task
from lppo.tasks.dataset_rows import (
    NoText,
    RowLocator,
    check_utf8,
    field_error,
    fill_template,
    first_bad_json_line,
    is_blank,
    text_of,
)
from lppo.tasks.verifiers import ExactMatch, Verifier
from lppo.validation import check_number

__all__ = ["FORMATS", "DatasetTask", "load_records"]

#: File extension -> ``datasets`` builder that reads it.
FORMATS: dict[str, str] = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}

#: What a readable file of each format looks like (appended to parse errors).
HINTS: dict[str, str] = {"json": " (JSON lines: one object per line)", "parquet": ""}

#: Prefix of the YAML key of every argument (the messages name the key a user sets).
KEY = "model.task.init_args"


def resolve_paths(path: str | Sequence[str]) -> list[str]:
    """Expand ``path`` (one path, a glob pattern or a list of them) to existing files.

    Args:
        path: a file, a glob pattern (``data/*.jsonl``) or a list of files and patterns.

    Returns:
        The files, patterns expanded in sorted order.

    Raises:
        FileNotFoundError: an entry names no file (or a pattern matches none).
        ValueError: ``path`` is empty.
    """
    entries = [path] if isinstance(path, str) else list(path)
    if not entries:
        raise ValueError(f"{KEY}.path=[] names no file; give a .jsonl or .parquet file.")
    files: list[str] = []
    for entry in entries:
        entry = str(entry)
        matches = sorted(glob.glob(entry)) if glob.has_magic(entry) else [entry]
        found = [m for m in matches if Path(m).is_file()]
        if not found:
            raise FileNotFoundError(
                f"{KEY}.path={entry!r}: no such file (looked in {Path(entry).resolve()}); "
                f"pass an existing .jsonl or .parquet file (relative paths are resolved from "
                f"the working directory, {Path.cwd()})."
            )
        files.extend(found)
    return files


def file_format(files: Sequence[str]) -> str:
    """The ``datasets`` builder reading every one of ``files`` (``"json"`` or ``"parquet"``).

    Raises:
        ValueError: an extension is not supported, or the files mix formats.
    """
    formats = set()
    for f in files:
        suffix = Path(f).suffix.lower()
        if suffix not in FORMATS:
            raise ValueError(
                f"{KEY}.path={f!r}: unsupported extension {suffix!r}; supported: "
                f"{sorted(FORMATS)} (convert the file, or rename a JSON-lines file to .jsonl)."
            )
        formats.add(FORMATS[suffix])
    if len(formats) > 1:
        raise ValueError(
            f"{KEY}.path={list(files)!r} mixes JSON and Parquet files; list files of one format."
        )
    return formats.pop()


def shown(files: Sequence[str]) -> str:
    """``files`` as messages show them: one file as a string, several as a list."""
    return repr(files[0] if len(files) == 1 else list(files))


def root_cause(err: BaseException) -> BaseException:
    """The innermost exception of ``err``'s ``__cause__`` chain."""
    while err.__cause__ is not None:
        err = err.__cause__
    return err


def load_records(files: Sequence[str]) -> Any:
    """Read ``files`` into one ``datasets.Dataset`` (rows concatenated in file order).

    Returns:
        The dataset, or ``None`` if every file is empty.

    Raises:
        ImportError: the ``datasets`` library is not installed.
        ValueError: a file cannot be parsed.
    """
    fmt = file_format(files)
    try:
        import datasets
    except ImportError as err:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "DatasetTask reads files with the Hugging Face `datasets` library; install it with "
            "`pip install -c constraints.txt -e '.[data]'` in the lppo clone."
        ) from err
    files = [f for f in files if not is_blank(f, fmt)]
    if not files:
        return None
    if fmt == "json":  # undecodable bytes would only fail later, deep in a row's text
        for f in files:
            try:
                check_utf8(f)
            except ValueError as err:
                raise ValueError(f"{KEY}.path={shown(files)}: {err}") from None
    bars_were_off = datasets.utils.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        return datasets.load_dataset(fmt, data_files=list(files), split="train")
    except Exception as err:
        cause = root_cause(err)
        # the reader counts rows from 0 and without the file: name the line ourselves
        bad = next(filter(None, map(first_bad_json_line, files)), None) if fmt == "json" else None
        why = bad if bad is not None else f"{type(cause).__name__}: {cause}"
        raise ValueError(
            f"{KEY}.path={shown(files)}: could not read it as {fmt}: {why}; "
            f"fix the file{HINTS[fmt]}."
        ) from err
    finally:
        if not bars_were_off:
            datasets.enable_progress_bars()


def template_fields(template: str) -> list[str]:
    r"""The field names ``template`` substitutes (``"{question}\n"`` -> ``["question"]``).

    Raises:
        ValueError: the template is malformed or uses a positional ``{}``.
    """
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as err:
        raise ValueError(
            f"{KEY}.template={template!r} is not a valid format string ({err}); write field "
            "names in braces, e.g. '{question}\\n', and double literal braces ('{{')."
        ) from None
    fields = []
    for _, name, _, _ in parsed:
        if name is None:
            continue
        base = name.split(".")[0].split("[")[0]
        if not base or base.isdigit():
            raise ValueError(
                f"{KEY}.template={template!r} has a positional field {{{name}}}; name a field "
                "of the dataset instead, e.g. '{question}'."
            )
        fields.append(base)
    return fields


def epoch_seed(seed: int, epoch: int) -> int:
    """A stable seed for the shuffle of ``epoch`` (independent of Python's hash seed)."""
    digest = hashlib.sha256(f"lppo.DatasetTask:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


class DatasetTask(Task):
    r"""Prompts and reference answers from local JSONL or Parquet files, scored by a verifier.

    Each row gives one prompt: its text is ``template`` filled with the row's fields (or the
    ``prompt_field`` value as is) and its answer the ``answer_field`` value (as text). Rows are
    walked in epochs, shuffled per epoch from ``(seed, epoch)``; the ``generator`` passed to
    :meth:`sample_prompts` is ignored, so the order depends only on ``seed`` and the position,
    which :meth:`state_dict` checkpoints.

    Args:
        path: a ``.jsonl`` / ``.json`` (JSON lines) or ``.parquet`` file, a glob pattern
            (``data/train-*.parquet``) or a list of them; relative to the working directory.
        prompt_field: the field holding the prompt text (used when ``template`` is ``null``).
        answer_field: the field holding the reference answer (numbers are turned into text).
        template: a format string filled with the row's fields, e.g. ``"{question}\n"`` or
            ``"Q: {question}\nA:"``; ``null`` uses the ``prompt_field`` value verbatim.
        verifier: the reward function, a :class:`~lppo.tasks.verifiers.Verifier` chosen by
            ``class_path`` (``lppo.tasks.verifiers.ExactMatch``,
            ``lppo.tasks.verifiers.NumericAnswer`` or your own); ``null``: ``ExactMatch()``.
        seed: seed of the per-epoch shuffles.
        shuffle: shuffle each epoch (``false``: file order every epoch).
    """

    name = "dataset"

    def __init__(
        self,
        path: str | list[str],
        prompt_field: str = "prompt",
        answer_field: str = "answer",
        template: str | None = None,
        verifier: Verifier | None = None,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        self.files = resolve_paths(path)
        self.prompt_field = prompt_field
        self.answer_field = answer_field
        self.template = template
        self.verifier: Verifier = verifier if verifier is not None else ExactMatch()
        check_number(f"{KEY}.seed", seed, integer=True, low=0)
        self.seed = seed
        self.shuffle = shuffle
        self.locate = RowLocator(self.files, file_format(self.files))
        self.texts, self.answers = self._read(load_records(self.files))
        self.epoch = 0
        self.position = 0
        self._order: list[int] | None = None

    # ------------------------------------------------------------------ loading
    def _read(self, records: Any) -> tuple[list[str], list[str]]:
        """Prompt texts and answers of every row, validated (see the class docstring)."""
        where = f"{KEY}.path={shown(self.files)}"
        if records is None or len(records) == 0:
            raise ValueError(f"{where} holds no rows; give a file with at least one row.")
        present = list(records.column_names)
        fields = template_fields(self.template) if self.template is not None else []
        needed = [("answer_field", self.answer_field)]
        if self.template is None:
            needed.append(("prompt_field", self.prompt_field))
        for key, name in needed:
            if name not in present:
                raise ValueError(
                    f"{KEY}.{key}={name!r} is not a field of {where}; fields present: "
                    f"{present}. Set {KEY}.{key} to one of them."
                )
        missing = sorted(set(fields) - set(present))
        if missing:
            raise ValueError(
                f"{KEY}.template={self.template!r} uses {missing}, not fields of {where}; "
                f"fields present: {present}."
            )
        answers = [
            self._text(v, i, self.answer_field) for i, v in enumerate(records[self.answer_field])
        ]
        if self.template is None:
            column = records[self.prompt_field]
            texts = [self._text(v, i, self.prompt_field) for i, v in enumerate(column)]
        else:
            texts = self._fill_template(records.select_columns(sorted(set(fields))))
        for i, answer in enumerate(answers):
            try:
                self.verifier.validate_answer(answer)
            except ValueError as err:
                raise ValueError(
                    f"{self.locate(i)} ({KEY}.path): {err}; fix the row, or choose another "
                    f"{KEY}.answer_field or {KEY}.verifier."
                ) from None
        return texts, answers

    def _fill_template(self, records: Any) -> list[str]:
        assert self.template is not None
        texts = []
        for i, row in enumerate(records):
            try:
                texts.append(fill_template(self.template, row))
            except NoText as err:
                raise self._field_error(i, err.field, err.value) from None
        return texts

    def _text(self, value: Any, row: int, field: str) -> str:
        text = text_of(value)
        if text is None:
            raise self._field_error(row, field, value)
        return text

    def _field_error(self, row: int, field: str, value: object) -> ValueError:
        return field_error(f"{self.locate(row)} ({KEY}.path)", field, value)

    def __len__(self) -> int:
        """Number of rows (prompts) in the dataset."""
        return len(self.texts)

    # ---------------------------------------------------------------- sampling
    def order(self, epoch: int) -> list[int]:
        """Row indices in the order ``epoch`` visits them (a pure function of seed and epoch)."""
        rows = list(range(len(self.texts)))
        if self.shuffle:
            random.Random(epoch_seed(self.seed, epoch)).shuffle(rows)
        return rows

    def sample_prompts(self, n: int, generator: random.Random) -> list[Prompt]:
        """The next ``n`` rows of the walk, wrapping into the next epoch at the end.

        Args:
            n: number of prompts.
            generator: ignored (the order depends on ``seed`` and the position only).

        Returns:
            ``n`` prompts; ``metadata`` holds the ``row`` index and the ``epoch``.
        """
        del generator
        prompts = []
        for _ in range(n):
            if self.position == len(self.texts):
                self.epoch, self.position, self._order = self.epoch + 1, 0, None
            if self._order is None:
                self._order = self.order(self.epoch)
            row = self._order[self.position]
            self.position += 1
            prompts.append(
                Prompt(self.texts[row], self.answers[row], {"row": row, "epoch": self.epoch})
            )
        return prompts

    # ----------------------------------------------------------------- rewards
    def reward(self, prompt: Prompt, completion: str) -> float:
        """The verifier's score of ``completion`` against ``prompt.answer``."""
        return float(self.verifier(completion, prompt.answer))

    def rewards(self, prompts: list[Prompt], completions: list[str]) -> list[float]:
        """Score the batch with one :meth:`Verifier.batch` call (see :meth:`Task.rewards`)."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        scores = self.verifier.batch(completions, [p.answer for p in prompts])
        if len(scores) != len(completions):
            raise ValueError(
                f"{type(self.verifier).__name__}.batch returned {len(scores)} scores for "
                f"{len(completions)} completions."
            )
        return [float(s) for s in scores]

    # ------------------------------------------------------- data-derived bounds
    def vocabulary(self) -> str:
        """Every character of every prompt text and answer, sorted."""
        chars: set[str] = set()
        for text in (*self.texts, *self.answers):
            chars.update(text)
        return "".join(sorted(chars))

    def sample_texts(self) -> list[str]:
        """Prompt texts and answers of up to 2048 rows spread over the file(s); the walk stays."""
        rows = range(0, len(self.texts), max(1, len(self.texts) // 2048))
        return [text for r in rows for text in (self.texts[r], self.answers[r])]

    def max_prompt_length(self) -> int:
        """Longest prompt text of the dataset, in characters (never advances the walk)."""
        return max(len(t) for t in self.texts)

    def longest_prompt(self) -> Prompt:
        """The row with the longest prompt text (never advances the walk)."""
        row = max(range(len(self.texts)), key=lambda r: len(self.texts[r]))
        return Prompt(self.texts[row], self.answers[row], {"row": row, "epoch": self.epoch})

    # -------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """The position of the walk: ``epoch``, ``position`` in it, and the dataset's ``rows``."""
        return {"epoch": self.epoch, "position": self.position, "rows": len(self.texts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the walk at a checkpointed position (``{}``: from the start).

        Raises:
            ValueError: the state has other keys or was taken on a dataset of another size.
        """
        if not state:
            self.epoch, self.position, self._order = 0, 0, None
            return
        if set(state) != {"epoch", "position", "rows"}:
            raise ValueError(
                f"DatasetTask state must have keys ['epoch', 'position', 'rows'], got "
                f"{sorted(state)}: the checkpoint was not written by a DatasetTask."
            )
        if int(state["rows"]) != len(self.texts):
            raise ValueError(
                f"the checkpoint walked a dataset of {state['rows']} rows but "
                f"{KEY}.path={shown(self.files)} holds {len(self.texts)}; resume with the "
                "same file(s), or start a fresh run (without --ckpt_path)."
            )
        if not 0 <= int(state["position"]) <= len(self.texts) or int(state["epoch"]) < 0:
            raise ValueError(f"DatasetTask state {state} is out of range")
        self.epoch, self.position, self._order = int(state["epoch"]), int(state["position"]), None
