"""A ``class_path`` that cannot be used, as lppo's short block instead of jsonargparse's dump.

jsonargparse reports an unknown class (``lppo.estimators.GRPo``), a missing one
(``lppo.algorithms.DAPO``) or an own module that is not importable as 10-14 lines of Union and
NoneType detail. :func:`class_path_block` turns that error into the key, the value, why, and the
fix: the nearest class lppo ships (did you mean), the classes lppo ships for that key, or for an
own module the ``PYTHONPATH`` hint.

The classes lppo ships for a key are found from the key's declared type, for every key alike:
the concrete classes exported (``__all__``) by lppo's public packages that subclass it or
implement it (a protocol), as jsonargparse would accept them.
"""

from __future__ import annotations

import difflib
import inspect
import re
import sys
import types
import typing
from typing import Any

from lppo.errors import exception_chain, short_block

#: The head of jsonargparse's message for one key.
_KEY = re.compile(r'^Parser key "([^"]+)"')
#: The heads of its messages for a class given to a key that cannot be used: one that does not
#: import (the reason follows on the next lines), a bare name, a class of another kind.
_GIVEN = (
    re.compile(r"^Problem with given class_path '(?P<value>[^']+)':"),
    re.compile(r"^Expected a dot import path string: (?P<value>\S+)"),
    re.compile(r"^Import path (?P<value>\S+) does not"),
    re.compile(r"^Expected an instantiatable class, but (?P<value>\S+) is"),
)
#: What an own module needs (the fix for "No module named ...").
IMPORTABLE = "an own module must be importable: run from its folder or set PYTHONPATH=<its folder>"


def _steps(exc: BaseException) -> tuple[list[tuple[str, str]], BaseException | None]:
    """``(key, class_path)`` from the outermost key to the failing one, and the error about it.

    jsonargparse raises each nested key's error from the next: ``model.task`` given
    ``lppo.tasks.DatasetTask``, whose ``verifier`` was given ``mymod.MyVerifier``, which raised
    ``ModuleNotFoundError``.
    """
    steps: list[list[str]] = []
    failing: BaseException | None = None
    for err in exception_chain(exc):
        head = str(err).strip().partition("\n")[0]
        given = next((m for m in (p.match(head) for p in _GIVEN) if m), None)
        if (key := _KEY.match(head)) and (not steps or len(steps[-1]) == 2):
            steps.append([key.group(1)])
        elif given and steps and len(steps[-1]) == 1:
            steps[-1].append(given.group("value"))
            failing = err
    if not steps or len(steps[-1]) != 2:
        return [], None  # the last key failed for another reason than its class
    return [(key, value) for key, value in steps], failing


def _typehint(parser: Any, steps: list[tuple[str, str]]) -> Any:
    """The declared type of the last key: its parser's argument, in the class that holds it."""
    from jsonargparse._typehints import ActionTypeHint

    if len(steps) > 1:
        holder = _loaded(steps[-2][1])
        if holder is None:
            return None
        parser = ActionTypeHint.get_class_parser(holder)
    key = steps[-1][0]
    action = next((a for a in parser._actions if a.dest == key), None)
    return getattr(action, "_typehint", None)


def _loaded(class_path: str) -> Any:
    """What ``class_path`` names among the modules already imported, else ``None``."""
    module, _, name = class_path.rpartition(".")
    return getattr(sys.modules.get(module), name, None)


def _bases(typehint: Any) -> list[type]:
    """The classes a type names (``X | None`` -> ``[X]``; lists and unions looked into)."""
    if isinstance(typehint, type) and typehint is not types.NoneType:
        return [typehint]
    return [base for arg in typing.get_args(typehint) for base in _bases(arg)]


def shipped_classes(typehint: Any) -> list[str]:
    """The import paths of the concrete classes lppo exports that a value of ``typehint`` may be.

    Each class by its shortest path in a package below ``lppo`` (``lppo.estimators.GRPO``, as
    the configs write it), else in ``lppo`` itself.
    """
    from jsonargparse._typehints import is_subclass_or_implements_protocol

    bases = _bases(typehint)
    paths: dict[type, str] = {}
    for name in sorted(sys.modules):
        module = sys.modules[name]
        if not (name == "lppo" or name.startswith("lppo.")) or "._" in f".{name}":
            continue
        for attr in getattr(module, "__all__", ()):
            cls = getattr(module, attr, None)
            if not inspect.isclass(cls) or inspect.isabstract(cls):
                continue
            if getattr(cls, "_is_protocol", False):
                continue
            if not any(is_subclass_or_implements_protocol(cls, base) for base in bases):
                continue
            path = f"{name}.{attr}"
            if cls not in paths or _rank(path) < _rank(paths[cls]):
                paths[cls] = path
    return sorted(paths.values())


def _rank(path: str) -> tuple[bool, int]:
    """Shorter paths first, ``lppo``'s top-level names (``lppo.GAE``) last."""
    return path.count(".") == 1, len(path)


def _nearest(value: str, shipped: list[str]) -> str | None:
    """The shipped class whose name is closest to the one in ``value`` (case aside)."""
    names = {path.rpartition(".")[2].lower(): path for path in shipped}
    wanted = value.rpartition(".")[2].lower()
    close = difflib.get_close_matches(wanted, list(names), n=1, cutoff=0.7)
    return names[close[0]] if close and names[close[0]] != value else None


def _fix(value: str, failure: BaseException | None, typehint: Any) -> str:
    """What to do: import an own module, or pick one of lppo's classes (the nearest first)."""
    shipped = shipped_classes(typehint)
    kind = " / ".join(dict.fromkeys(b.__name__ for b in _bases(typehint))) or "matching"
    offer = f"lppo's {kind} classes: {', '.join(shipped)}" if shipped else ""
    missing = getattr(failure, "name", None) if isinstance(failure, ImportError) else None
    if missing and (value == missing or value.startswith(f"{missing}.")):
        return "; ".join(p for p in (IMPORTABLE, offer) if p)
    # a class that exists but is of another kind is not a typo of one of lppo's
    nearest = _nearest(value, shipped) if _loaded(value) is None else None
    own = "an own class goes by its full import path (module.Class)"
    choices = "; ".join(p for p in (offer, own) if p)
    return f"did you mean {nearest}? {choices}" if nearest else choices


def class_path_block(parser: Any, exc: BaseException) -> str | None:
    """The short block for a parse error about a ``class_path``, else ``None``.

    Args:
        parser: the parser whose arguments the error's outermost key names.
        exc: the error jsonargparse raised (its chain holds every nested key and the failure).
    """
    steps, given = _steps(exc)
    if not steps or given is None:
        return None
    key = ".init_args.".join(k for k, _ in steps)
    value = steps[-1][1]
    head, _, tail = str(given).strip().partition("\n")
    reason = " ".join(tail.split()) or head  # "Problem with ...:" has the reason below its head
    failure = given.__cause__ or given.__context__
    typehint = _typehint(parser, steps)
    return short_block(f"{key}={value}: {reason}", key, _fix(value, failure, typehint))


__all__ = ["IMPORTABLE", "class_path_block", "shipped_classes"]
