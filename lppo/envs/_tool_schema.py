"""Describing tools for the chat template: the name the policy calls and the JSON schema.

Re-exported by :mod:`lppo.envs.tools` (the public path); kept apart so that module holds the
call format and the worker that runs calls.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from typing import Any

__all__ = ["tool_name", "tool_schema"]


def tool_name(tool: Callable[..., Any]) -> str:
    """The name the policy calls ``tool`` by: a function's ``__name__``, an object's ``name``.

    Raises:
        ValueError: for a callable object without a string ``name`` attribute.
    """
    if inspect.isroutine(tool):
        return tool.__name__
    name = getattr(tool, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(
            f"tool {tool!r} is a callable object without a `name`: give its class a string "
            "attribute `name` (the name the model calls it by)."
        )
    return name


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The JSON schema of a tool, as ``apply_chat_template(tools=[...])`` takes it.

    A function is described by ``transformers.utils.get_json_schema`` (type hints and a
    Google-style docstring with an ``Args:`` section). A callable object gives its own ``schema``
    attribute, or else its ``__call__`` is described under the object's ``name``.

    Args:
        fn: the tool.

    Returns:
        ``{"type": "function", "function": {"name", "description", "parameters", ...}}``.

    Raises:
        ValueError: naming the tool and the fix when it cannot be described.
    """
    name = tool_name(fn)
    own = None if inspect.isroutine(fn) else getattr(fn, "schema", None)
    if own is not None:
        described = own.get("function", {}).get("name") if isinstance(own, dict) else None
        if described != name:
            raise ValueError(
                f"tool {name!r}: its `schema` must be a dict {{'type': 'function', 'function': "
                f"{{'name': {name!r}, ...}}}}; its function name is {described!r}."
            )
        return json.loads(json.dumps(own))  # a copy the caller may edit
    from transformers.utils import get_json_schema  # only here: the worker never needs it

    target = fn if inspect.isroutine(fn) else fn.__call__  # bound: no `self` to describe
    try:
        schema = get_json_schema(target)
    except Exception as e:
        raise ValueError(
            f"cannot describe tool {name!r} for the chat template: {e} Give every argument a "
            "type hint and write a Google-style docstring with a description and an `Args:` "
            "line per argument (what transformers.utils.get_json_schema reads), or give a "
            "callable object a `schema` attribute."
        ) from e
    if not inspect.isroutine(fn):
        schema["function"]["name"] = name
    return schema
