"""How a model family writes tool calls in its text: parse a policy turn, write a call.

Each format is a small class with :meth:`~ToolCallFormat.parse` (a turn's text to the calls it
holds, and one message per malformed call: nothing raises, the episode goes on) and
:meth:`~ToolCallFormat.format` (one call as the model writes it). ``ToolEnvironment`` picks one
by its ``tool_format`` (``auto``: :func:`detect` reads the chat template), and a user's own
format is any class with those two methods, named by ``class_path``.

- :class:`HermesCalls`: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks
  (Hermes, Qwen 2.5 / 3, SmolLM3, lppo's :data:`~lppo.envs.templates.HERMES_CHATML`).
- :class:`Llama3JsonCalls`: Llama 3.1 / 3.2 / 3.3's JSON tool calling: the turn is
  ``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``; several calls
  separated by ``;``).
- :class:`MistralCalls`: ``[TOOL_CALLS]`` followed by a JSON list of
  ``{"name": ..., "arguments": {...}}`` (Mistral v3 tokenizers), or by ``name[ARGS]{...}``
  per call (v11 and later).
- :class:`ResponseTemplateCalls`: the tokenizer's own response template (transformers'
  ``tokenizer.parse_response``), for models that ship one; ``auto`` prefers it.
"""

from __future__ import annotations

import json
from typing import Any, Protocol, runtime_checkable

from lppo.envs.tools import ToolCall, call_from_json, format_tool_call, parse_tool_calls
from lppo.init_args import RecordsInitArgs
from lppo.validation import SettingError

__all__ = [
    "HermesCalls",
    "Llama3JsonCalls",
    "MistralCalls",
    "ResponseTemplateCalls",
    "ToolCallFormat",
    "detect",
    "for_tokenizer",
]

PYTHON_TAG = "<|python_tag|>"
TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"


@runtime_checkable
class ToolCallFormat(Protocol):
    """A model family's tool-call text."""

    def parse(self, text: str) -> tuple[list[ToolCall], list[str]]:
        """``(calls, errors)`` of a decoded policy turn; never raises.

        The well-formed calls in order, and one human-readable message per malformed one. A
        turn without a call gives two empty lists (the final answer).
        """
        ...

    def format(self, call: ToolCall) -> str:
        """``call`` as the model writes it."""
        ...


def _json_values(text: str) -> tuple[list[Any], str | None]:
    """The JSON values of ``text`` in order (separated by whitespace or ``;``).

    Returns:
        The values, and the error at the first part that is not JSON (``None``: every part is).
    """
    decoder, values, pos = json.JSONDecoder(), [], 0
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
            pos += 1
        if pos == len(text):
            return values, None
        try:
            value, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            return values, f"invalid JSON in a tool call: {e.msg} at char {e.pos}"
        values.append(value)


class HermesCalls(RecordsInitArgs):
    """``<tool_call>{json}</tool_call>`` blocks (:func:`~lppo.envs.tools.parse_tool_calls`)."""

    def parse(self, text: str) -> tuple[list[ToolCall], list[str]]:
        """Every ``<tool_call>`` block of the turn; text outside blocks is ignored."""
        return parse_tool_calls(text)

    def format(self, call: ToolCall) -> str:
        r"""``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>``."""
        return format_tool_call(call)


class Llama3JsonCalls(RecordsInitArgs):
    """Llama 3.x JSON tool calls: the whole turn is the call(s).

    A turn that starts (after whitespace and an optional ``<|python_tag|>``) with ``{`` is a
    call, or several separated by ``;``; any other turn is the final answer.
    """

    def parse(self, text: str) -> tuple[list[ToolCall], list[str]]:
        """The calls of a turn that is JSON, else none."""
        body = text.strip()
        body = body.removeprefix(PYTHON_TAG).strip()
        if not body.startswith("{"):
            return [], []
        values, error = _json_values(body)
        found = [call_from_json(v, "parameters") for v in values]
        errors = [c for c in found if isinstance(c, str)] + ([error] if error else [])
        return [c for c in found if isinstance(c, ToolCall)], errors

    def format(self, call: ToolCall) -> str:
        """``{"name": ..., "parameters": {...}}``."""
        return json.dumps({"name": call.name, "parameters": call.arguments}, ensure_ascii=False)


class MistralCalls(RecordsInitArgs):
    """Mistral's ``[TOOL_CALLS]``: a JSON list of calls, or ``name[ARGS]{...}`` per call.

    Args:
        style: how :meth:`format` writes a call: ``list`` (v3 tokenizers) or ``args`` (v11
            and later); :meth:`parse` reads both.
    """

    def __init__(self, style: str = "list") -> None:
        if style not in ("list", "args"):
            raise SettingError(f"tool_format.init_args.style={style!r}: use 'list' or 'args'.")
        self.style = style

    def parse(self, text: str) -> tuple[list[ToolCall], list[str]]:
        """The calls after each ``[TOOL_CALLS]`` of the turn; a turn without one has none."""
        calls: list[ToolCall] = []
        errors: list[str] = []
        for part in text.split(TOOL_CALLS)[1:]:
            found, wrong = self._part(part.strip())
            calls += found
            errors += wrong
        return calls, errors

    def _part(self, part: str) -> tuple[list[ToolCall], list[str]]:
        """The calls of the text after one ``[TOOL_CALLS]``."""
        if ARGS in part:  # v11+: name[ARGS]{json}
            name, rest = part.split(ARGS, 1)
            try:
                arguments, _ = json.JSONDecoder().raw_decode(rest.lstrip())
            except json.JSONDecodeError as e:
                return [], [f"invalid JSON after {ARGS}: {e.msg} at char {e.pos}"]
            parsed = call_from_json({"name": name.strip(), "arguments": arguments}, "arguments")
        else:  # v3: one JSON list of calls
            values, error = _json_values(part)
            if error or len(values) != 1 or not isinstance(values[0], list):
                return [], [error or f"{TOOL_CALLS} must be followed by one JSON list of calls"]
            found = [call_from_json(v, "arguments") for v in values[0]]
            calls = [c for c in found if isinstance(c, ToolCall)]
            return calls, [c for c in found if isinstance(c, str)]
        return ([parsed], []) if isinstance(parsed, ToolCall) else ([], [parsed])

    def format(self, call: ToolCall) -> str:
        """``[TOOL_CALLS][{"name": ..., "arguments": {...}}]`` (or ``name[ARGS]{...}``)."""
        if self.style == "args":
            return f"{TOOL_CALLS}{call.name}{ARGS}{json.dumps(call.arguments, ensure_ascii=False)}"
        body = [{"name": call.name, "arguments": call.arguments}]
        return f"{TOOL_CALLS}{json.dumps(body, ensure_ascii=False)}"


def detect(chat_template: str | None) -> ToolCallFormat:
    """The format a chat template writes tool calls in (Hermes when it says nothing else).

    ``<tool_call>`` in the template: Hermes; ``[TOOL_CALLS]``: Mistral (the ``[ARGS]`` style
    when it has ``[ARGS]``); ``<|python_tag|>`` or a call written with ``"parameters"``:
    Llama 3.x JSON; otherwise Hermes ``<tool_call>`` blocks.
    """
    template = chat_template or ""
    if "<tool_call>" in template:
        return HermesCalls()
    if TOOL_CALLS in template:
        return MistralCalls("args" if ARGS in template else "list")
    if PYTHON_TAG in template or '"parameters": ' in template:
        return Llama3JsonCalls()
    return HermesCalls()


class ResponseTemplateCalls(RecordsInitArgs):
    """The calls the tokenizer's own response template reads (``tokenizer.parse_response``).

    For models whose tokenizer ships a ``response_template`` (transformers 5.13 and later):
    the model's own parser, so every family it covers is read as its authors intended. The
    template parses; it does not write, so a call's text (the setup probe's) is ``writer``'s.

    Args:
        writer: the format that writes a call (``null``: the one :func:`detect` reads from the
            chat template).
    """

    def __init__(self, writer: ToolCallFormat | None = None) -> None:
        self.writer = writer
        self._tokenizer: Any = None

    def bind(self, tokenizer: Any) -> None:
        """Parse with ``tokenizer``'s response template from now on.

        Raises:
            SettingError: the tokenizer has no response template.
        """
        if getattr(tokenizer, "response_template", None) is None:
            raise SettingError(
                "tool_format=ResponseTemplateCalls but the tokenizer has no response_template; "
                "use auto, or the family's format (lppo.envs.HermesCalls, Llama3JsonCalls, "
                "MistralCalls)."
            )
        self._tokenizer = tokenizer
        if self.writer is None:
            self.writer = detect(getattr(tokenizer, "chat_template", None))

    def parse(self, text: str) -> tuple[list[ToolCall], list[str]]:
        """The ``tool_calls`` of the message the template parses out of the turn."""
        if self._tokenizer is None:
            raise RuntimeError("ResponseTemplateCalls.parse before bind(tokenizer)")
        try:
            message = self._tokenizer.parse_response(text, prefix="")
        except Exception as error:  # the template's parser names what it could not read
            return [], [f"the response template could not parse the turn: {error}"[:400]]
        found = [call_from_json(c, "arguments") for c in message.get("tool_calls") or []]
        return [c for c in found if isinstance(c, ToolCall)], [
            c for c in found if isinstance(c, str)
        ]

    def format(self, call: ToolCall) -> str:
        """``call`` as :attr:`writer` writes it."""
        if self.writer is None:
            raise RuntimeError("ResponseTemplateCalls.format before bind(tokenizer)")
        return self.writer.format(call)


def for_tokenizer(tokenizer: Any, chat_template: str | None) -> ToolCallFormat:
    """``auto``: the tokenizer's response template where it ships one, else :func:`detect`."""
    if getattr(tokenizer, "response_template", None) is not None:
        found = ResponseTemplateCalls(detect(chat_template))
        found.bind(tokenizer)
        return found
    return detect(chat_template)
