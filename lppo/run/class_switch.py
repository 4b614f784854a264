"""A ``class_path`` given later replaces the earlier class: the new one starts from its defaults.

jsonargparse carries the earlier class's ``init_args`` over to a new ``class_path`` whenever the
new class accepts them, and says so only in a debug log: ``--model.actor.init_args.objective
lppo.algorithms.GSPO`` on a config with ``ClippedPPO`` (``clip_low 0.2``) gave GSPO a clip range
about 700x its own. lppo's rule, applied wherever jsonargparse meets a changed ``class_path`` (a
``--KEY`` on the command line, a later ``--config``, at any depth):

- a new class that is the old one or a subclass of it keeps the old ``init_args`` it accepts
  (the same parameter, inherited, means the same thing); the others are dropped;
- any other class drops every old ``init_arg``: only those given with the new ``class_path`` or
  after it apply, the rest are the new class's own defaults.

Each change that drops or keeps something prints one line to stderr when parsing ends, e.g.
``lppo: model.actor.init_args.objective: class changed ClippedPPO -> GSPO; dropped clip_low=0.2,
clip_high=0.28 (GSPO's own defaults apply)``.

jsonargparse has no public hook for this, so :func:`install` wraps three of its internals (the
only place lppo touches them); outside :func:`recording` (any parser but lppo's) they behave as
jsonargparse's own. ``tests/run/test_class_switch.py`` pins the behaviour, so a jsonargparse that
renames them fails there.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from jsonargparse import Namespace

#: The lines of the changes seen by the parse in progress (``None``: not lppo's parse).
_CHANGES: ContextVar[dict[tuple[str, str, str], str] | None] = ContextVar(
    "lppo_class_changes", default=None
)
#: The keys of the typed arguments being checked, outermost first (``model.actor``,
#: ``objective``): the full key of a nested class is ``model.actor.init_args.objective``.
_KEYS: ContextVar[tuple[str, ...]] = ContextVar("lppo_class_keys", default=())
#: jsonargparse's own functions, called outside lppo's parse and for a subclass.
_ORIGINAL: dict[str, Any] = {}
#: The longest value shown for a dropped argument.
_SHOWN = 40


def _import(class_path: str) -> type | None:
    """The class ``class_path`` names, or ``None`` when it cannot be imported."""
    module, _, name = str(class_path).rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None
    return found if isinstance(found, type) else None


def _short(value: Any) -> str:
    """``value`` as one short piece of a line (a nested class by its name)."""
    if isinstance(value, Namespace | dict) and "class_path" in value:
        text = f"{str(value['class_path']).rpartition('.')[2]}(...)"
    elif isinstance(value, Namespace):
        text = repr(value.as_dict())
    else:
        text = repr(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def _spec(value: Any) -> Any:
    """A subclass spec as a :class:`Namespace` (jsonargparse also passes a bare class path)."""
    return Namespace(class_path=value) if isinstance(value, str) else value


def _set_args(init_args: Any) -> dict[str, Any]:
    """The top-level ``init_args`` that set something (an empty nested group sets nothing)."""
    if not isinstance(init_args, Namespace | dict):
        return {}
    if isinstance(init_args, Namespace):
        items = init_args.items(branches=True, nested=False)
    else:
        items = init_args.items()
    return {k: v for k, v in items if not (isinstance(v, Namespace | dict) and not v)}


def _apply(parser_or_action: Any, prev_val: Any, value: Any, key: str) -> None:
    """Apply lppo's rule to ``prev_val``'s ``init_args`` (in place, as jsonargparse does).

    Args:
        parser_or_action: what jsonargparse passed (for its own check of a subclass's args).
        prev_val: the earlier subclass spec; its ``init_args`` are what the new class inherits.
        value: the new subclass spec; its ``init_args`` were given with it and always apply.
        key: the full key of the class (``model.actor.init_args.objective``).
    """
    prev_val, value = _spec(prev_val), _spec(value)
    if not prev_val or not value or not isinstance(prev_val.get("init_args"), Namespace | dict):
        return
    old_path, new_path = str(prev_val["class_path"]), str(value["class_path"])
    old, new = _import(old_path), _import(new_path)
    if old_path == new_path or (old is not None and old is new):
        return  # the same class (maybe by another import path): nothing changed
    given = set(_set_args(value.get("init_args")))
    before = _set_args(prev_val["init_args"])
    if old is not None and new is not None and issubclass(new, old):
        _ORIGINAL["discard"](parser_or_action, prev_val, value)  # drops what ``new`` refuses
        after = _set_args(prev_val.get("init_args"))
        kept = [k for k in after if k not in given]
    else:
        prev_val["init_args"] = type(prev_val["init_args"])()
        after, kept = {}, []
    dropped = {k: v for k, v in before.items() if k not in after and k not in given}
    _record(key, old_path, new_path, kept, dropped)


def _record(
    key: str, old_path: str, new_path: str, kept: list[str], dropped: dict[str, Any]
) -> None:
    """Note one change of class at ``key`` (once, however many times jsonargparse meets it)."""
    changes = _CHANGES.get()
    if changes is None or not (kept or dropped) or (key, old_path, new_path) in changes:
        return
    old, new = old_path.rpartition(".")[2], new_path.rpartition(".")[2]
    parts = [f"lppo: {key}: class changed {old} -> {new}"]
    if kept:
        parts.append(f"kept {', '.join(kept)} ({new} is a subclass of {old})")
    if dropped:
        shown = ", ".join(f"{k}={_short(v)}" for k, v in dropped.items())
        parts.append(f"dropped {shown} ({new}'s own defaults apply)")
    changes[(key, old_path, new_path)] = "; ".join(parts)


def _discard(parser_or_action: Any, prev_val: Any, value: Any) -> None:
    """Replaces jsonargparse's per-class check (where a new ``class_path`` is parsed)."""
    if _CHANGES.get() is None:
        _ORIGINAL["discard"](parser_or_action, prev_val, value)
        return
    _apply(parser_or_action, prev_val, value, ".init_args.".join(_KEYS.get()))


def _walk(parser_or_action: Any, prev_cfg: Any, cfg: Any, prefix: str | None = None) -> None:
    """Replaces jsonargparse's walk over a config about to be merged over an earlier one.

    Every key where both hold a class is checked by lppo's rule before the merge, which would
    otherwise copy the old class's arguments leaf by leaf under the new class.
    """
    from jsonargparse._typehints import ActionTypeHint, find_action, is_subclass_spec

    if _CHANGES.get() is None:
        _ORIGINAL["walk"](parser_or_action, prev_cfg, cfg)
        return
    if not isinstance(prev_cfg, Namespace):
        return
    if prefix is None:
        outer = list(_KEYS.get())
        if isinstance(parser_or_action, ActionTypeHint):
            outer.append(parser_or_action.dest)  # called with the action whose value changed
        prefix = "".join(f"{k}.init_args." for k in outer)
    keys = list(prev_cfg.keys(branches=True))  # a branch comes before its leaves
    while keys:
        key = keys.pop(0)
        prev_val, val = prev_cfg.get(key), cfg.get(key) if cfg is not None else None
        if not (is_subclass_spec(prev_val) and is_subclass_spec(val)):
            continue
        action = parser_or_action
        if not isinstance(action, ActionTypeHint):
            action = find_action(parser_or_action, key)
        if not isinstance(action, ActionTypeHint):
            continue
        _apply(action, prev_val, val, prefix + key)
        keys = [k for k in keys if not k.startswith(f"{key}.")]  # the nested walk's
        if prev_val.get("init_args"):
            sub_kwargs = getattr(action, "sub_add_kwargs", {})
            sub = ActionTypeHint.get_class_parser(val["class_path"], sub_kwargs)
            inner = val.get("init_args", Namespace())
            _walk(sub, prev_val["init_args"], inner, f"{prefix}{key}.init_args.")


def install() -> None:
    """Wrap jsonargparse's class-change checks with lppo's rule (once; see the module doc)."""
    from jsonargparse import _typehints

    if _ORIGINAL:
        return
    hint = _typehints.ActionTypeHint
    _ORIGINAL["discard"] = _typehints.discard_init_args_on_class_path_change
    _ORIGINAL["walk"] = hint.discard_init_args_on_class_path_change
    check_type = hint._check_type

    # jsonargparse filters the keyword arguments by this signature: ``wraps`` keeps it
    @functools.wraps(check_type)
    def keyed_check_type(self: Any, *args: Any, **kwargs: Any) -> Any:
        token = _KEYS.set((*_KEYS.get(), self.dest))
        try:
            return check_type(self, *args, **kwargs)
        finally:
            _KEYS.reset(token)

    _typehints.discard_init_args_on_class_path_change = _discard
    hint.discard_init_args_on_class_path_change = staticmethod(_walk)
    hint._check_type = keyed_check_type


def flush() -> None:
    """Print the changes noted so far (one line each) and forget them."""
    changes = _CHANGES.get()
    if changes:
        sys.stderr.write("".join(f"{line}\n" for line in changes.values()))
        changes.clear()


@contextmanager
def recording() -> Iterator[None]:
    """Apply lppo's rule during the (outermost) parse; print the changes when it ends."""
    if _CHANGES.get() is not None:  # a nested parse (a class's own parser): the outer one prints
        yield
        return
    token = _CHANGES.set({})
    try:
        yield
    finally:
        flush()
        _CHANGES.reset(token)


__all__ = ["flush", "install", "recording"]
