"""``lppo settings``: every setting of a configuration, one line each, in lppo's order.

``lppo fit --help`` lists the top-level settings; the settings of the classes chosen by
``class_path`` (the actor's ``lr`` and ``objective``, the task's, the engine's) live one level
down, where ``--model.actor.help lppo.ActorModule`` prints hundreds of lines. ``lppo settings
--config FILE`` resolves the configuration exactly as ``lppo fit`` would (``--print_config``)
and prints every key it holds, the classes' settings included, with its type, its value and
the first sentence of its documentation::

    model.actor.init_args.lr    float    0.003    learning rate (AdamW).

Docstrings are written for the documentation site (reStructuredText roles such as
``:class:`~lppo.tasks.Task``` and double back-quotes); :func:`rst_to_text` turns them into
plain text here and in ``--help``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import io
import re
import sys
import typing
from collections.abc import Iterator
from typing import Any

import yaml

from lppo.run.rst import rst_to_text

#: Widest type shown (a long ``Literal[...]`` is cut).
_TYPE_WIDTH = 40
#: Top-level sections, in the order ``lppo fit --help`` lists them.
_ORDER = ("model", "data", "ckpt_path", "seed_everything", "trainer")


@dataclasses.dataclass(frozen=True)
class Setting:
    """One line of the listing.

    Attributes:
        key: the dotted key, as ``lppo fit`` takes it (``model.actor.init_args.lr``).
        type: the declared type, as text (``""``: not declared).
        value: the value the configuration gives it, as YAML text.
        doc: the first sentence of its documentation, plain text (``""``: none).
    """

    key: str
    type: str
    value: str
    doc: str


def resolved_config(cli: Any, args: list[str]) -> dict[str, Any]:
    """The configuration ``lppo fit <args>`` would run, every default filled in.

    Args:
        cli: the ``LightningCLI`` class of ``lppo fit`` (:class:`lppo.run.cli.PPOCLI`).
        args: ``lppo fit``'s arguments.
    """
    out, argv = io.StringIO(), sys.argv
    sys.argv = argv[:1]  # the arguments go in as `args` (LightningCLI warns about both)
    try:
        with contextlib.redirect_stdout(out):
            cli(args=["fit", *args, "--print_config"])
    except SystemExit as done:  # --print_config exits 0 once printed; a parse error does not
        if done.code not in (0, None):
            raise
    finally:
        sys.argv = argv
    return yaml.safe_load(out.getvalue()) or {}


def settings(config: dict[str, Any]) -> Iterator[Setting]:
    """Every setting of a resolved configuration (:func:`resolved_config`), in lppo's order."""
    from lppo.iteration.data import ReplayDataModule
    from lppo.run.system import PPOSystem
    from lppo.run.trainer import PPOTrainer

    roots: dict[str, Any] = {"model": PPOSystem, "data": ReplayDataModule, "trainer": PPOTrainer}
    # fit's own arguments (ckpt_path, weights_only) with lppo's, before Lightning's Trainer
    rank = {name: i for i, name in enumerate(_ORDER)}
    for name in sorted(config, key=lambda k: rank.get(k, rank["trainer"] - 0.5)):
        value = config[name]
        if name in roots and isinstance(value, dict):
            yield from _walk(roots[name], value, name)
        else:
            yield Setting(name, "", _text(value), "")


def _walk(cls: Any, values: dict[str, Any], prefix: str) -> Iterator[Setting]:
    params = _parameters(cls)
    for name, value in values.items():
        key = f"{prefix}.{name}"
        kind, doc = params.get(name, ("", ""))
        if isinstance(value, dict) and "class_path" in value:
            yield Setting(key, kind, value["class_path"], doc)
            inner = _import(value["class_path"])
            if inner is not None:
                yield from _walk(inner, value.get("init_args") or {}, f"{key}.init_args")
        elif isinstance(value, dict) and _dataclass(cls, name) is not None:
            yield from _walk(_dataclass(cls, name), value, key)
        else:
            yield Setting(key, kind, _text(value), doc)


def _parameters(cls: Any) -> dict[str, tuple[str, str]]:
    """``name -> (type, first sentence of its doc)`` of ``cls``'s init (and its bases')."""
    from docstring_parser import parse

    found: dict[str, tuple[str, str]] = {}
    for klass in reversed(inspect.getmro(cls) if inspect.isclass(cls) else (cls,)):
        if klass is object:
            continue
        docs: dict[str, str] = {}
        for text in (klass.__doc__, getattr(klass.__init__, "__doc__", None)):
            for param in parse(text or "").params:
                docs[param.arg_name] = _first_sentence(param.description or "")
        try:
            signature = inspect.signature(klass.__init__)
        except (TypeError, ValueError):
            continue
        hints = _hints(klass.__init__)
        for name, param in signature.parameters.items():
            if name == "self" or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                continue
            kind = _type_text(hints.get(name, param.annotation))
            found[name] = (kind, docs.get(name, found.get(name, ("", ""))[1]))
    return found


def _hints(function: Any) -> dict[str, Any]:
    """``function``'s annotations resolved one by one (one that cannot be stays a string)."""
    try:
        return typing.get_type_hints(function)
    except Exception:  # a name only imported for type checking: resolve the others
        pass
    module = sys.modules.get(getattr(function, "__module__", ""), None)
    names = dict(vars(module)) if module is not None else {}
    hints = {}
    for name, annotation in getattr(function, "__annotations__", {}).items():
        try:
            hints[name] = eval(annotation, names) if isinstance(annotation, str) else annotation
        except Exception:
            hints[name] = annotation
    return hints


def _dataclass(cls: Any, name: str) -> Any:
    """The dataclass that ``cls``'s init declares ``name`` as (``None``: not one)."""
    hint = _hints(cls.__init__).get(name) if inspect.isclass(cls) else None
    for candidate in (hint, *typing.get_args(hint)):
        if inspect.isclass(candidate) and dataclasses.is_dataclass(candidate):
            return candidate
    return None


def _type_text(annotation: Any) -> str:
    if annotation is inspect.Parameter.empty:
        return ""
    if inspect.isclass(annotation) and not typing.get_args(annotation):
        return annotation.__name__
    text = str(annotation).replace("typing.", "").replace("NoneType", "None")
    return re.sub(r"(?:[a-z_][\w]*\.)+([A-Z]\w*)", r"\1", text).replace("<class '", "")


def _first_sentence(text: str, limit: int = 120) -> str:
    """The first sentence of ``text`` as plain text, cut at a word before ``limit`` chars."""
    text = " ".join(rst_to_text(text).split())
    match = re.match(r"(.+?\.)(\s|$)", text)
    sentence = match.group(1) if match else text
    if len(sentence) <= limit:
        return sentence
    return sentence[:limit].rsplit(" ", 1)[0] + " …"


def _import(path: str) -> Any:
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def _text(value: Any) -> str:
    return (
        yaml.safe_dump(value, default_flow_style=True, width=10**6)
        .strip()
        .removesuffix("\n...")
        .removesuffix("...")
        .strip()
    )


def main(cli: Any, args: list[str]) -> None:
    """Print the listing of ``lppo settings <args>`` (``lppo fit``'s arguments, ``cli``'s)."""
    rows = list(settings(resolved_config(cli, args)))
    key_width = max((len(r.key) for r in rows), default=0)
    type_width = min(_TYPE_WIDTH, max((len(r.type) for r in rows), default=0))
    for row in rows:
        kind = row.type if len(row.type) <= _TYPE_WIDTH else row.type[: _TYPE_WIDTH - 1] + "…"
        line = f"{row.key:<{key_width}}  {kind:<{type_width}}  {row.value}"
        sys.stdout.write(f"{line}  # {row.doc}\n" if row.doc else f"{line}\n")
