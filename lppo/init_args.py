"""Settings of a component as it was built: its init arguments, not what it stores.

A checkpoint records the settings that shaped a run (:mod:`lppo.run.checkpointing`). Reading them
back by attribute name fails for a component that keeps an argument under another name (it
would be recorded as ``None``), so a component inherits :class:`RecordsInitArgs`: its instances
keep the arguments they were constructed with, bound to the signature of ``__init__``.

A component also declares, next to its definition, which of its settings a resumed run may
change (``resume_safe``, a class attribute naming init arguments); everything else recorded
must match on resume.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

import torch

#: Where an instance of :class:`RecordsInitArgs` keeps its recorded settings.
RECORD_ATTR = "_lppo_init_args"
_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


@dataclass(frozen=True)
class Record:
    """The settings of one object, as a checkpoint records them.

    Attributes:
        class_path: ``module.QualName`` of the object's class.
        settings: init argument name -> plain value (``None``, bool, int, float, str, a list of
            them) or the :class:`Record` of a settings object given as that argument (a model
            spec, a policy objective, a verifier, a class or a factory given by
            ``class_path``). Runtime objects (modules, tensors, functions) are not settings and
            are left out.
        resume_safe: names of the settings a resumed run may change.
    """

    class_path: str
    settings: dict[str, Any] = field(default_factory=dict)
    resume_safe: tuple[str, ...] = ()


class RecordsInitArgs:
    """Mixin: each instance records the arguments it was constructed with.

    The record is taken in ``__new__``, before ``__init__`` runs, from the call's arguments
    bound to ``type(self).__init__`` (defaults filled in). Arguments a subclass passes on
    through ``**kwargs`` are recorded under their own names, with the defaults of the
    ``__init__`` they reach (the next ones in the method resolution order). Subclasses
    defined in user code, and objects instantiated from YAML, are recorded the same way.

    Attributes:
        resume_safe: init arguments a resumed run may change (each is applied to the restored
            state); any other recorded difference refuses the resume.
    """

    resume_safe: ClassVar[tuple[str, ...]] = ()

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        """Create the instance and record ``args`` / ``kwargs`` bound to ``__init__``."""
        obj = super().__new__(cls)
        # A copy or unpickling calls __new__ without arguments and then restores __dict__
        # (record included); a call that does not bind fails in __init__ with its own message.
        settings = _bound_settings(cls, args, kwargs)
        if settings is not None:
            obj.__dict__[RECORD_ATTR] = settings
        return obj


def record(obj: Any) -> Record:
    """The :class:`Record` of ``obj``: its recorded init arguments and its ``resume_safe``.

    An object that does not inherit :class:`RecordsInitArgs` is read back by attribute name
    (plain values only), which is right only when it stores every argument under its own name.

    Raises:
        TypeError: ``resume_safe`` names something that is not one of the object's settings.
    """
    recorded = getattr(obj, "__dict__", {}).get(RECORD_ATTR)
    if recorded is None:
        recorded = {}
        for name in _parameter_names(type(obj)):
            value = _recorded(getattr(obj, name, None))
            if value is not _RUNTIME and not isinstance(value, Record):
                recorded[name] = value
    out = Record(class_path(type(obj)), recorded, tuple(getattr(type(obj), "resume_safe", ())))
    check_resume_safe(out)
    return out


def check_resume_safe(rec: Record) -> None:
    """Raise ``TypeError`` when ``rec.resume_safe`` names a setting ``rec`` does not have."""
    unknown = [name for name in rec.resume_safe if name not in rec.settings]
    if unknown:
        raise TypeError(
            f"{rec.class_path}.resume_safe names {unknown}, which are not among its settings "
            f"{sorted(rec.settings)}; name init arguments of the class."
        )


def class_path(klass: type) -> str:
    """``module.QualName`` of ``klass`` (the ``class_path`` a config names it by)."""
    return f"{klass.__module__}.{klass.__qualname__}"


def _bound_settings(
    cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any] | None:
    signature = inspect.signature(cls.__init__)  # type: ignore[misc]
    try:
        bound = signature.bind(None, *args, **kwargs)  # None stands for self
    except TypeError:
        return None
    bound.apply_defaults()
    values: dict[str, Any] = {}
    for name, value in list(bound.arguments.items())[1:]:
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            values.update(value)
        elif kind is not inspect.Parameter.VAR_POSITIONAL:
            values[name] = value
    passes_on = _takes_kwargs(signature)
    for init in list(_inits(cls))[1:]:
        if not passes_on:
            break
        params = inspect.signature(init).parameters
        for name, param in list(params.items())[1:]:
            if param.kind in _NAMED and param.default is not param.empty:
                values.setdefault(name, param.default)
        passes_on = _takes_kwargs(inspect.signature(init))
    return dict(_each_recorded(values))


def _each_recorded(values: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    for name, value in values.items():
        recorded = _recorded(value)
        if recorded is not _RUNTIME:
            yield name, recorded


_RUNTIME = object()  # marks a value that is runtime state, not a setting


def _recorded(value: Any) -> Any:
    if _plain(value):
        return value
    if isinstance(value, tuple | list) and all(_plain(v) for v in value):
        return list(value)
    if isinstance(value, type):  # a factory given by class_path alone (an optimizer class)
        return Record(class_path(value))
    if isinstance(value, functools.partial) and (factory := _partial_class(value)) is not None:
        # A factory given by class_path and init_args: its class and settings.
        return Record(class_path(factory), dict(_each_recorded(value.keywords)))
    if _settings_object(value):
        return record(value)
    return _RUNTIME


def _partial_class(value: functools.partial[Any]) -> type | None:
    """The class a partial builds (``None`` if it builds none).

    ``partial(cls, **settings)``, or jsonargparse's ``partial(instantiate, instantiator, cls,
    **settings)`` of a factory given by ``class_path``.
    """
    built = [a for a in (value.func, *value.args) if isinstance(a, type)]
    return built[-1] if built else None


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, bool | int | float | str)


def _settings_object(value: Any) -> bool:
    # A spec such as HFCausalLM, or a callable built from settings (a policy objective, a
    # verifier): what it computes follows from its settings. Functions, modules, tensors and
    # containers are runtime objects.
    runtime = inspect.isroutine(value) or isinstance(
        value, functools.partial | torch.nn.Module | torch.Tensor | Collection | Mapping | type
    )
    return not runtime and hasattr(value, "__dict__")


def _takes_kwargs(signature: inspect.Signature) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())


def _inits(cls: type) -> Iterator[Any]:
    """The Python ``__init__`` functions along ``cls``'s MRO, the one a call runs first."""
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if inspect.isfunction(init):
            yield init


def _parameter_names(cls: type) -> list[str]:
    names: list[str] = []
    for init in _inits(cls):
        params = list(inspect.signature(init).parameters.values())[1:]
        names += [p.name for p in params if p.kind in _NAMED]
    return list(dict.fromkeys(names))
