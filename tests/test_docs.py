"""Checks on the shell blocks of the documentation.

Convention: in ``README.md`` and every ``docs/**/*.md``, a fenced block whose info
string is ``bash``, ``sh``, ``shell`` or ``console`` is preceded, on the line right
before its opening fence, by ``<!-- check: run -->`` (the slow test runs it) or
``<!-- check: skip: <reason> -->`` (it is never run, e.g. a long benchmark).

README.md's first block, the two commands, is exempt: ``.ci/run`` runs its second line,
and the first is the default run (``tests/test_configs.py`` runs that config unshrunk).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHELL_LANGS = frozenset({"bash", "sh", "shell", "console"})
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
MARKER = re.compile(r"^\s*<!--\s*check:\s*(?P<kind>run|skip)\s*(?::\s*(?P<reason>.*?))?\s*-->\s*$")
TIMEOUT_S = 240


@dataclass(frozen=True)
class ShellBlock:
    """One fenced shell block of a markdown file.

    Attributes:
        path: The file, relative to the repository root.
        line: The 1-based line of the opening fence.
        marker: ``"run"``, ``"skip"``, or ``None`` when the block is unmarked.
        code: The block's body.
    """

    path: str
    line: int
    marker: str | None
    code: str

    @property
    def id(self) -> str:
        """The block's ``path:line`` identifier."""
        return f"{self.path}:{self.line}"


def _marker_of(line: str) -> str | None:
    """The marker kind on ``line``, or ``None`` if the line is not a marker."""
    match = MARKER.match(line)
    return match.group("kind") if match else None


def parse_blocks(text: str, path: str) -> list[ShellBlock]:
    """Find the fenced shell blocks of a markdown text.

    A fence closes only on a line of the same character, at least as long as the
    opening one, with no info string, so 4-backtick fences may hold 3-backtick ones.

    Args:
        text: The markdown source.
        path: The name to record in each block.

    Returns:
        The shell blocks (info string ``bash``, ``sh``, ``shell`` or ``console``), in order.
    """
    lines = text.splitlines()
    blocks: list[ShellBlock] = []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if match is None:
            i += 1
            continue
        fence, start = match.group("fence"), i
        info = match.group("info").strip().lstrip("{").split()
        lang = info[0].lstrip(".").rstrip("}").lower() if info else ""
        body: list[str] = []
        i += 1
        while i < len(lines):
            close = FENCE.match(lines[i])
            if (
                close
                and close.group("fence")[0] == fence[0]
                and len(close.group("fence")) >= len(fence)
                and not close.group("info").strip()
            ):
                break
            body.append(lines[i])
            i += 1
        i += 1
        if lang in SHELL_LANGS:
            marker = _marker_of(lines[start - 1]) if start > 0 else None
            blocks.append(ShellBlock(path, start + 1, marker, "\n".join(body) + "\n"))
    return blocks


def all_blocks() -> list[ShellBlock]:
    """Every shell block of ``docs/**/*.md`` and of README.md but its first (the two commands)."""
    readme = parse_blocks((ROOT / "README.md").read_text(encoding="utf-8"), "README.md")
    assert readme and readme[0].line == 3, "README.md must open with the two commands' block"
    blocks = readme[1:]
    for file in sorted((ROOT / "docs").rglob("*.md")):
        rel = file.relative_to(ROOT).as_posix()
        blocks.extend(parse_blocks(file.read_text(encoding="utf-8"), rel))
    return blocks


def test_every_shell_block_is_marked() -> None:
    """Every shell fence is preceded by a ``check: run`` or ``check: skip`` marker."""
    unmarked = [block.id for block in all_blocks() if block.marker is None]
    assert not unmarked, "shell blocks without <!-- check: run|skip: reason -->:\n" + "\n".join(
        unmarked
    )


def test_readme_is_a_front_door() -> None:
    """README.md stays short (at most 250 lines) and every relative link in it resolves."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250, "README.md is over 250 lines: move detail to docs/"
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [t for t in targets if not re.match(r"[a-z]+:", t)]
    assert local, "README.md links to no page of docs/"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


SYNTHETIC = """\
# Title

<!-- check: run -->
```bash
echo ran
```

```sh
echo unmarked
```

<!-- check: skip: long benchmark -->
```console
$ lppo fit
```

```python
print("not shell")
```

````markdown
```bash
echo nested, not a block
```
````
"""


def test_parser_on_synthetic_markdown() -> None:
    """The parser reads markers, finds unmarked fences, ignores others and nesting."""
    blocks = parse_blocks(SYNTHETIC, "x.md")
    assert [(b.line, b.marker) for b in blocks] == [(4, "run"), (8, None), (13, "skip")]
    assert blocks[0].code == "echo ran\n"
    assert blocks[0].id == "x.md:4"
    assert _marker_of("<!-- check: skip -->") == "skip"
    assert _marker_of("<!-- long -->") is None


#: ``$TMPDIR`` without a default: empty on most Linux shells, so ``"$TMPDIR/x"`` is ``/x``.
BARE_TMPDIR = re.compile(r"\$TMPDIR\b|\$\{TMPDIR\}")
#: An option or redirection followed by the path it writes to.
WRITTEN = re.compile(r"(?:default_root_dir[ =]|--out[ =]|-w |>>? ?)\"?(?P<path>/[^\s\"']*)")


def test_no_shell_block_writes_outside_a_temporary_or_the_working_directory() -> None:
    """Pasted as is, with ``TMPDIR`` unset, no doc command writes to ``/`` or another root."""
    unsafe = []
    for block in all_blocks():
        if BARE_TMPDIR.search(block.code):
            unsafe.append(f"{block.id}: $TMPDIR without a default (use ${{TMPDIR:-/tmp}})")
        for match in WRITTEN.finditer(block.code):
            if not match.group("path").startswith(("/tmp/", "/dev/null")):
                unsafe.append(f"{block.id}: writes to {match.group('path')}")
    assert not unsafe, "\n".join(unsafe)


RUN_BLOCKS = [block for block in all_blocks() if block.marker == "run"]


@pytest.mark.slow
@pytest.mark.parametrize("block", RUN_BLOCKS, ids=[block.id for block in RUN_BLOCKS])
def test_run_block(block: ShellBlock, tmp_path: Path) -> None:
    """A ``check: run`` block exits 0 under ``bash -euo pipefail``, files under ``$TMPDIR``."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(
        TMPDIR=str(tmp_path),
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
    )
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, f"{block.id} exited {proc.returncode}:\n{tail}"
