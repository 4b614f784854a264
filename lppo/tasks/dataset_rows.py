"""Where a row of a :class:`~lppo.tasks.DatasetTask`'s files is, and what its fields may hold.

Every error about a row names its file and its 1-based line (JSON lines; blank lines count as
lines but hold no row) or row (Parquet), and the field. A field that becomes prompt text must
hold a string or a number: anything else (null, true / false, a list, an object, bytes) would
reach the prompt as a Python repr.
"""

from __future__ import annotations

import json
import numbers
import string
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "NoText",
    "RowLocator",
    "check_utf8",
    "field_error",
    "fill_template",
    "first_bad_json_line",
    "is_blank",
    "text_of",
]


class RowLocator:
    """Names the place of a row (0-based over the files, in order) in its file.

    Args:
        files: the dataset's files, in the order their rows are concatenated.
        fmt: ``"json"`` or ``"parquet"``.
    """

    def __init__(self, files: Sequence[str], fmt: str) -> None:
        self.files, self.fmt = list(files), fmt
        self._counts: list[int] | None = None  # rows per file, counted at the first error

    def __call__(self, row: int) -> str:
        """``"line 21 of 'data.jsonl'"`` (``"row 21 of 'data.parquet'"``) for row ``row``."""
        if self._counts is None:
            self._counts = [self._rows(f) for f in self.files]
        for file, count in zip(self.files, self._counts, strict=True):
            if row < count:
                if self.fmt == "parquet" or _is_json_array(file):
                    return f"row {row + 1} of {file!r}"
                return f"line {_line_of_row(file, row)} of {file!r}"
            row -= count
        return f"row {row + 1} past the end of {self.files!r}"  # pragma: no cover - defensive

    def _rows(self, file: str) -> int:
        if self.fmt == "parquet":
            import pyarrow.parquet as pq  # a dependency of `datasets`

            return pq.ParquetFile(file).metadata.num_rows
        if _is_json_array(file):  # a .json file holding one array of rows
            with open(file, encoding="utf-8") as f:
                return len(json.load(f))
        with open(file, "rb") as lines:
            return sum(1 for line in lines if line.strip())


def _is_json_array(file: str) -> bool:
    """Whether a JSON file holds one array of rows rather than JSON lines."""
    with open(file, "rb") as f:
        return f.read(4096).lstrip()[:1] == b"["


def _line_of_row(file: str, row: int) -> int:
    """The 1-based line of a JSON-lines file holding its ``row``-th (0-based) row."""
    with open(file, "rb") as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                if row == 0:
                    return number
                row -= 1
    raise ValueError(f"{file!r} has fewer than {row + 1} rows")  # pragma: no cover


def is_blank(file: str, fmt: str) -> bool:
    """Whether ``file`` holds no rows (``datasets`` fails on such a file instead of reading 0).

    Args:
        file: a file of format ``fmt``.
        fmt: ``"json"`` (blank: empty or whitespace only) or ``"parquet"`` (zero rows).
    """
    if fmt == "parquet":
        import pyarrow.parquet as pq  # a dependency of `datasets`

        return pq.ParquetFile(file).metadata.num_rows == 0
    size = Path(file).stat().st_size
    return size == 0 or (size < 1 << 16 and not Path(file).read_bytes().strip())


def check_utf8(file: str) -> None:
    """Raise ``ValueError`` naming the first line of ``file`` that is not UTF-8 text."""
    with open(file, "rb") as lines:
        for number, line in enumerate(lines, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(
                    f"line {number} of {file!r} is not UTF-8 text (byte "
                    f"0x{line[err.start]:02x} at column {err.start + 1}); save the file as UTF-8 "
                    "(e.g. `iconv -f latin1 -t utf-8`)."
                ) from None


def first_bad_json_line(file: str) -> str | None:
    """``"line 21 of 'f.jsonl': <why>"`` for the first line that is not a JSON object."""
    with open(file, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as err:
                return f"line {number} of {file!r}: {err.msg} at column {err.colno}"
            if not isinstance(value, dict):
                kind = type(value).__name__
                return f"line {number} of {file!r} holds a JSON {kind}, not an object"
    return None


def text_of(value: object) -> str | None:
    """``value`` as prompt text: a string as is, a number as text; ``None`` for anything else."""
    if isinstance(value, str):
        return value
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return str(value)
    return None


def field_error(place: str, field: str, value: object) -> ValueError:
    """The error for ``value`` of ``field`` at ``place``, which has no text form."""
    if value is None:
        return ValueError(
            f"{place} has no value (null) in field {field!r}; fill it in or drop the row."
        )
    shown = json.dumps(value, default=repr)[:80] if not isinstance(value, bytes) else "bytes"
    return ValueError(
        f"{place} holds a {type(value).__name__} ({shown}) in field {field!r}, not a string or "
        "a number; give the field text, or choose another field / template."
    )


class NoText(Exception):
    """A substituted template field holds no text (null, a bool, a list, an object, ...).

    Attributes:
        field: the field as the template names it (``question``, ``meta[q]``).
        value: what it holds.
    """

    def __init__(self, field: str, value: object) -> None:
        super().__init__(field)
        self.field, self.value = field, value


class _Filler(string.Formatter):
    """``str.format_map`` that refuses a substituted value without a text form."""

    def __init__(self) -> None:
        self.field = ""

    def get_field(self, field_name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        self.field = field_name  # for the error: the field as the template names it
        return super().get_field(field_name, args, kwargs)

    def format_field(self, value: Any, format_spec: str) -> Any:
        if text_of(value) is None:
            raise NoText(self.field, value)
        return super().format_field(value, format_spec)


def fill_template(template: str, row: Mapping[str, Any]) -> str:
    """``template`` filled with ``row``'s fields (``{question}``, ``{meta[q]}``, ...).

    Raises:
        NoText: a substituted value is null or not a string or a number.
    """
    return _Filler().vformat(template, (), row)
