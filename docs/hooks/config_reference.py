"""MkDocs hook: the configuration reference, generated from the parser ``lppo fit`` builds.

``docs/reference/configuration.md`` holds the marker :data:`MARKER`; at build time this hook
replaces it with

1. every key of ``lppo fit`` (the parser :class:`lppo.run.cli.PPOCLI` builds, with lppo's help
   texts, hidden options and all), grouped as ``lppo fit --help`` groups them, with its type,
   default and meaning;
2. the Trainer options lppo refuses (:data:`lppo.run.cli_parser.NOT_APPLICABLE`) and what to use
   instead;
3. the init arguments of every lppo class a ``class_path`` key can name, found by walking the
   type hints from the keys down (``model.actor`` -> ``ActorModule`` -> its ``model`` ->
   ``HFCausalLM`` ...), each read by jsonargparse exactly as the CLI reads it.

Nothing on the page is written by hand, so it cannot drift from the code.
"""

from __future__ import annotations

import argparse
import dataclasses
import html
import importlib
import inspect
import types
import typing
from collections.abc import Iterable, Iterator
from typing import Any

from lppo.run.rst import rewrite_roles

MARKER = "<!-- lppo:config-reference -->"

#: Packages and modules whose public classes a ``class_path`` may name (the first one that
#: exports a class gives its documented name).
PUBLIC_MODULES = (
    "lppo",
    "lppo.modules",
    "lppo.modules.lora",
    "lppo.modules.megatron",
    "lppo.modules.models",
    "lppo.algorithms",
    "lppo.estimators",
    "lppo.rollout",
    "lppo.envs",
    "lppo.tasks",
    "lppo.tasks.verifiers",
    "lppo.replay",
    "lppo.layouts",
    "lppo.runtime.strategy",
    "lppo.callbacks",
    "lppo.runtime.ray_runtime",
)

#: ``lppo fit --help``'s group of each key prefix, in the order the page shows them.
GROUPS = (
    ("model", "`model`: the system (actor, critic, task, engine, estimator, ...)"),
    ("model.rollout", "`model.rollout`: sampling settings"),
    ("model.ppo", "`model.ppo`: algorithm settings"),
    ("data", "`data`: the replay-backed DataModule"),
    ("trainer.ray", "`trainer.ray`: the run's Ray"),
    ("", "`fit` arguments"),
    ("trainer", "`trainer`: the Trainer"),
)


class _Captured(Exception):
    """Carries the CLI object out of its ``__init__`` once the parser is built."""


def fit_parser() -> argparse.ArgumentParser:
    """The ``fit`` parser of ``lppo`` (built as ``lppo fit`` builds it, nothing parsed).

    Returns:
        The jsonargparse parser of the ``fit`` subcommand.
    """
    from lppo.run.cli import PPOCLI

    class _Capture(PPOCLI):
        def parse_arguments(self, parser: Any, args: Any) -> None:
            raise _Captured(self)

    try:
        _Capture(args=["fit"])
    except _Captured as captured:
        return captured.args[0].fit_parser
    raise RuntimeError("PPOCLI parsed its arguments without calling parse_arguments")


def public_classes() -> dict[type, str]:
    """Every public class of :data:`PUBLIC_MODULES`, mapped to its documented dotted name."""
    found: dict[type, str] = {}
    for name in PUBLIC_MODULES:
        module = importlib.import_module(name)
        names = getattr(module, "__all__", None)
        if names is None:
            names = [n for n, v in vars(module).items() if getattr(v, "__module__", "") == name]
        for attr in names:
            value = getattr(module, attr, None)
            if inspect.isclass(value) and not attr.startswith("_"):
                found.setdefault(value, f"{name}.{attr}")
    return found


def anchor(name: str) -> str:
    """The page anchor of the class documented as ``name``."""
    return "cls-" + name.replace(".", "-").lower()


def md_text(text: str | None) -> str:
    """A help text as one Markdown table cell (reST roles and literals made Markdown)."""
    if not text or text == argparse.SUPPRESS:
        return ""
    flat = rewrite_roles(" ".join(text.split()), lambda title, _: f"`{title}`", lambda c: f"`{c}`")
    parts = flat.split("`")
    for i in range(0, len(parts), 2):  # outside code spans: no HTML, no table breaks
        parts[i] = html.escape(parts[i], quote=False)
    return "`".join(parts).replace("|", "\\|")


def type_name(hint: Any) -> str:
    """A short readable spelling of a type hint (``int | null``, ``"k1" | "k2"``)."""
    if hint is None or hint is type(None):
        return "null"
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is typing.Literal:
        return " | ".join(f'"{a}"' if isinstance(a, str) else repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is not None and args:
        base = getattr(origin, "__name__", str(origin))
        if base == "Callable":
            return "callable"
        return f"{base}[{', '.join(type_name(a) for a in args if a is not Ellipsis)}]"
    if inspect.isclass(hint):
        return hint.__name__
    return str(hint).replace("typing.", "")


def default_text(action: argparse.Action) -> str:
    """The default of ``action`` as YAML would spell it."""
    if getattr(action, "required", False):
        return "required"
    value = action.default
    if value is None:
        return "`null`"
    if value == argparse.SUPPRESS:
        return ""
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if dataclasses.is_dataclass(value) or hasattr(value, "class_path"):
        return "(see the class)"
    return "`" + str(value).replace("|", "\\|").replace("`", "'") + "`"


def classes_in(hint: Any) -> Iterator[type]:
    """The classes a type hint mentions, outermost first (``list[X] | None`` gives ``X``)."""
    if inspect.isclass(hint) and hint is not type(None):
        yield hint
    for arg in typing.get_args(hint):
        if arg is not Ellipsis and not isinstance(arg, (str, int, float, list)):
            yield from classes_in(arg)


def is_protocol(cls: type) -> bool:
    """Whether ``cls`` is a ``typing.Protocol`` (implemented by shape, not by subclassing)."""
    return bool(getattr(cls, "_is_protocol", False))


def protocol_methods(proto: type) -> set[str]:
    """The public methods and properties ``proto`` and its protocol bases declare."""
    names: set[str] = set()
    for base in proto.__mro__:
        if base is object or not is_protocol(base) or base is typing.Protocol:
            continue
        for name, value in vars(base).items():
            public = not name.startswith("_") or name == "__call__"
            if public and (callable(value) or isinstance(value, property)):
                names.add(name)
    return names


def parameter_names(value: Any) -> set[str]:
    """The parameter names of a function (or a property's getter), ``self`` left out."""
    function = value.fget if isinstance(value, property) else value
    try:
        return set(inspect.signature(function).parameters) - {"self"}
    except (TypeError, ValueError):
        return set()


def defines(cls: type, proto: type, name: str) -> bool:
    """Whether ``cls`` (or a base other than ``object``) defines ``proto``'s method ``name``.

    The method must take at least the protocol's parameter names, so a bare
    ``__call__(*args, **kwargs)`` (every ``torch.nn.Module``'s) does not count.
    """
    owner = next((b for b in cls.__mro__ if b is not object and name in vars(b)), None)
    if owner is None:
        return False
    return parameter_names(getattr(proto, name)) <= parameter_names(vars(owner)[name])


def implementations(base: type, classes: dict[type, str]) -> list[type]:
    """The documented lppo classes a key typed ``base`` may name, in a stable order.

    Args:
        base: a class from a key's type hint.
        classes: :func:`public_classes`.

    Returns:
        ``base`` itself when it is a concrete lppo class, then its lppo subclasses (or, for a
        protocol, the lppo classes that have all its methods); nothing for other libraries'
        types except Lightning's callbacks and strategies (lppo's own are listed).
    """
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import Strategy

    if not base.__module__.startswith("lppo") and base not in (Callback, Strategy):
        return []
    methods = protocol_methods(base) if is_protocol(base) else set()
    found = []
    for cls in sorted(classes, key=lambda c: classes[c]):
        if is_protocol(cls) or inspect.isabstract(cls):
            continue
        if cls is base:
            found.insert(0, cls)
        elif methods and all(defines(cls, base, m) for m in methods):
            found.append(cls)
        elif not is_protocol(base) and issubclass(cls, base):
            found.append(cls)
    return found


def choices(hint: Any, classes: dict[type, str]) -> list[type]:
    """Every documented class a key with type hint ``hint`` may name (no duplicates)."""
    found: list[type] = []
    for base in classes_in(hint):
        for cls in implementations(base, classes):
            if cls not in found:
                found.append(cls)
    return found


def documented_actions(parser: argparse.ArgumentParser) -> Iterable[argparse.Action]:
    """The parser's settable keys: no help, ``--config`` or ``.help`` actions, none hidden."""
    for action in parser._actions:
        kind = type(action).__name__
        if kind in ("_HelpAction", "ActionConfigFile", "_ActionPrintConfig", "_ActionConfigLoad"):
            continue
        if kind == "_ActionHelpClassPath" or action.help == argparse.SUPPRESS:
            continue
        yield action


def key_table(
    actions: Iterable[argparse.Action], prefix: str, classes: dict[type, str], found: list[type]
) -> list[str]:
    """A Markdown table of ``actions``, their keys shown without ``prefix``.

    Args:
        actions: the keys to list.
        prefix: the dotted prefix the keys share (``""``: none), dropped from the key column.
        classes: :func:`public_classes`.
        found: the classes linked so far; those these keys may name are appended.

    Returns:
        The table's lines.
    """
    lines = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for action in actions:
        key = action.dest.removeprefix(prefix + ".") if prefix else action.dest
        hint = getattr(action, "_typehint", None) or action.type
        meaning = md_text(action.help)
        picks = choices(hint, classes)
        if picks:
            links = ", ".join(f"[`{classes[c]}`](#{anchor(classes[c])})" for c in picks)
            meaning += f" Classes: {links}."
            found.extend(c for c in picks if c not in found)
        type_cell = md_text(type_name(hint)) if hint is not None else ""
        lines.append(f"| `{key}` | {type_cell} | {default_text(action)} | {meaning} |")
    return lines


def group_of(dest: str) -> str:
    """The prefix of :data:`GROUPS` a key belongs to (the longest that matches)."""
    best = ""
    for prefix, _ in GROUPS:
        if prefix and dest.startswith(prefix + ".") and len(prefix) > len(best):
            best = prefix
    return best


def keys_section(
    parser: argparse.ArgumentParser, classes: dict[type, str], found: list[type]
) -> list[str]:
    """Every key of ``lppo fit``, one table per group of :data:`GROUPS`."""
    actions = list(documented_actions(parser))
    lines = ["## Keys of `lppo fit`", ""]
    for prefix, title in GROUPS:
        members = [a for a in actions if group_of(a.dest) == prefix]
        if not members:
            continue
        lines += [f"### {title}", ""]
        lines += key_table(members, prefix, classes, found)
        lines.append("")
    return lines


def refused_section() -> list[str]:
    """The Trainer options lppo hides and refuses, with what to use instead."""
    from lppo.run.cli_parser import NOT_APPLICABLE

    lines = [
        "## Trainer options lppo refuses",
        "",
        "Hidden from `lppo fit --help`; any value but the default (or one listed) stops at "
        "parse time with the replacement below (`lppo.run.cli_parser.NOT_APPLICABLE`).",
        "",
        "| key | also accepted | use instead |",
        "| --- | --- | --- |",
    ]
    for key, (accepted, replacement) in NOT_APPLICABLE.items():
        also = ", ".join(f"`{v!r}`" for v in accepted) or "–"
        lines.append(f"| `trainer.{key}` | {also} | {md_text(replacement)} |")
    return [*lines, ""]


def strategies_section(classes: dict[type, str]) -> list[str]:
    """The ``--trainer.strategy`` names lppo registers (:data:`lppo.layouts.LAYOUTS`)."""
    from lppo.layouts import LAYOUTS

    lines = [
        "## `trainer.strategy` names",
        "",
        "Registered in Lightning's strategy registry when `lppo.run.trainer` is imported; each is "
        "`lppo.runtime.strategy.PPOStrategy` with that layout.",
        "",
        "| name | layout | what it does |",
        "| --- | --- | --- |",
    ]
    for name, (layout, description) in LAYOUTS.items():
        path = classes[layout]
        link = f"[`{path}`](#{anchor(path)})"
        lines.append(f"| `{name}` | {link} | {md_text(description)} |")
    return [*lines, ""]


def class_parser(cls: type) -> argparse.ArgumentParser:
    """A jsonargparse parser of ``cls``'s init arguments, under ``init_args``."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    if dataclasses.is_dataclass(cls):
        parser.add_dataclass_arguments(cls, "init_args")
    else:
        parser.add_class_arguments(cls, "init_args", sub_configs=True)
    return parser


def summary(cls: type) -> str:
    """The first paragraph of ``cls``'s docstring, as Markdown."""
    doc = inspect.getdoc(cls) or ""
    return md_text(doc.split("\n\n")[0]).replace("\\|", "|")


def classes_section(classes: dict[type, str], found: list[type]) -> list[str]:
    """One table of init arguments per class in ``found`` (grown while walking it)."""
    lines = [
        "## Classes a `class_path` can name",
        "",
        "Give them as `class_path: NAME` with these keys under `init_args:` (on the command "
        "line: `--model.actor.init_args.lr 1e-4`).",
        "",
    ]
    index = 0
    while index < len(found):
        cls = found[index]
        index += 1
        name = classes[cls]
        lines += [f"### `{name}` {{#{anchor(name)}}}", "", summary(cls), ""]
        actions = list(documented_actions(class_parser(cls)))
        if actions:
            lines += key_table(actions, "init_args", classes, found)
        else:
            lines.append("No init arguments.")
        lines.append("")
    return lines


def render() -> str:
    """The whole generated reference, as Markdown."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        classes = public_classes()
        parser = fit_parser()
        found: list[type] = []
        lines = keys_section(parser, classes, found)
        lines += strategies_section(classes)
        lines += refused_section()
        lines += classes_section(classes, found)
    return "\n".join(lines)


_RENDERED: dict[str, str] = {}


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """MkDocs hook: replace :data:`MARKER` with :func:`render`'s reference.

    Args:
        markdown: the page's Markdown source.
        page: the page (unused).
        config: the MkDocs configuration (unused).
        files: the site's files (unused).

    Returns:
        The page's Markdown, generated reference included.
    """
    if MARKER not in markdown:
        return markdown
    if "text" not in _RENDERED:
        _RENDERED["text"] = render()
    return markdown.replace(MARKER, _RENDERED["text"])
