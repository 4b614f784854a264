"""``ToolEnvironment``: the policy calls Python tools through its chat template.

The episode opens with the prompt as a user turn, rendered by the chat template with the
tools' JSON schemas (``apply_chat_template(messages, tools=...)``). A policy turn holding tool
calls, in the model family's format (:mod:`lppo.envs.tool_formats`: Hermes / Qwen
``<tool_call>`` blocks, Llama 3.x JSON, Mistral ``[TOOL_CALLS]``), is answered with the
tools' results as one templated tool turn, followed by the next assistant header; a turn
without a call is the final answer, which the task scores. A call to a missing tool,
malformed JSON, bad arguments or a tool that raises gives the model an error message to read
(the episode goes on); a tool that hangs is stopped at ``timeout_s``. Tools run in a
separate worker process (:class:`~lppo.envs.tools.ToolBox`).

The observation's text is the chat template's own rendering of the tool turn: what the
template writes after the assistant's end-of-turn token when the tool messages are appended
(so it starts with the template's separator and ends with the next assistant header).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

from lppo.decisions import note
from lppo.envs.base import Episode, Observation, Turn
from lppo.envs.templates import HERMES_CHATML, lost_characters, renders_tools
from lppo.envs.tool_formats import ResponseTemplateCalls, ToolCallFormat, detect, for_tokenizer
from lppo.envs.tools import ToolBox, ToolCall, ToolResult
from lppo.tasks.base import Prompt
from lppo.validation import SettingError

_KEY = "model.engine.init_args.environment.init_args"
#: An argument of the probe call (:meth:`ToolEnvironment.setup`), by JSON schema type.
_EXAMPLE_VALUES: dict[str, Any] = {"integer": 1, "number": 1.5, "boolean": True, "array": [1]}


def _named(tokenizer: Any) -> str:
    """The tokenizer as a message names it: its path, else the one a run builds in memory."""
    path = getattr(tokenizer, "name_or_path", "")
    return repr(path) if path else "built in memory (model.tokenizer_path: null: the character one)"


class _ToolEpisode:
    """One conversation: the messages so far, rendered by the environment's template."""

    def __init__(self, env: ToolEnvironment, prompt: Prompt) -> None:
        self.env = env
        system = [{"role": "system", "content": env.system_prompt}] if env.system_prompt else []
        user = {"role": "user", "content": prompt.text}
        self.messages: list[dict[str, Any]] = [*system, *env.few_shot, user]
        self.prefix = env.assistant_prefix  # opens the first turn only

    def opening(self) -> str | None:
        return self.env.render(self.messages, generation_prompt=True) + self.prefix

    def step(self, turn: Turn) -> Observation:
        text, self.prefix = self.prefix + turn.text, ""
        calls, errors = self.env.format.parse(text)
        if not calls and not errors:
            return Observation(done=True)
        results = [self.env.tools.call(c) for c in calls[: self.env.max_calls_per_turn]]
        results += [ToolResult("", f"error: {e}", error=True) for e in errors]
        before = [*self.messages, {"role": "assistant", "content": text}]
        self.messages = before + [
            {"role": "tool", "name": r.name, "content": r.content} for r in results
        ]
        text = self.env.tool_turn(before, self.messages, turn.ended)
        return Observation(
            text=text,
            tool_calls=len(calls) + len(errors),
            tool_errors=sum(r.error for r in results),
            tool_timeouts=sum(r.timed_out for r in results),
        )


class ToolEnvironment:
    """Tool calling with the Hugging Face chat template, in the model family's call format.

    Args:
        tools: the tools, Python functions with type hints and Google-style docstrings (their
            import paths in YAML, e.g. ``examples.smollm2.calculator.calculator``) or callable
            objects with a ``name`` and a ``schema`` (``lppo.envs.PythonTool``). They run in a
            worker process, so they must be importable (module-level).
        template: ``tokenizer``: the tokenizer's own chat template, which must render
            ``tools=``; ``hermes``: lppo's ChatML template with Hermes tools
            (:data:`~lppo.envs.templates.HERMES_CHATML`), for ChatML models whose template
            ignores tools (SmolLM2-Instruct).
        system_prompt: a system message opening every conversation (``null``: the
            template's default).
        few_shot: messages placed before the prompt's user turn in every conversation (a
            worked exchange: ``user``, ``assistant`` with a tool call, ``tool``,
            ``assistant``), which small models need to see the call format used once.
        assistant_prefix: text that opens the first assistant turn, in the prompt (never
            trained on), read as the start of that turn: e.g. ``<tool_call>`` and the start of
            a call's JSON, so a model that never calls on its own starts with a call and
            learns to complete it.
        timeout_s: longest a tool call may run before it is stopped (an error observation).
        max_output_chars: a tool's answer is cut to this many characters.
        max_calls_per_turn: calls of one turn that are run; the rest are ignored.
        tool_format: how the model writes a call (:mod:`lppo.envs.tool_formats`), e.g.
            ``{class_path: lppo.envs.tool_formats.Llama3JsonCalls}``; ``auto``: the tokenizer's
            response template where it ships one, else read from the chat template
            (:func:`~lppo.envs.tool_formats.for_tokenizer`; Hermes ``<tool_call>`` blocks with
            ``template: hermes`` and wherever the template shows no other).
    """

    def __init__(
        self,
        tools: Sequence[Callable[..., Any]],
        template: Literal["tokenizer", "hermes"] = "tokenizer",
        system_prompt: str | None = None,
        few_shot: list[dict[str, str]] | None = None,
        assistant_prefix: str = "",
        timeout_s: float = 10.0,
        max_output_chars: int = 2000,
        max_calls_per_turn: int = 4,
        tool_format: ToolCallFormat | Literal["auto"] = "auto",
    ) -> None:
        if template not in ("tokenizer", "hermes"):
            raise SettingError(f"{_KEY}.template={template!r}: use 'tokenizer' or 'hermes'.")
        if max_calls_per_turn < 1:
            raise SettingError(f"{_KEY}.max_calls_per_turn={max_calls_per_turn}: must be >= 1.")
        if not tools:
            raise SettingError(f"{_KEY}.tools=[]: give the environment at least one tool.")
        self.tools = ToolBox(tools, timeout_s, max_output_chars, key_prefix=_KEY)
        self.template = template
        self.system_prompt = system_prompt
        self.few_shot = [dict(m) for m in few_shot or []]
        for i, message in enumerate(self.few_shot):
            if set(message) - {"role", "content", "name"} or "role" not in message:
                raise SettingError(
                    f"{_KEY}.few_shot[{i}]={message!r}: a message has a 'role' and a 'content'."
                )
        if tool_format != "auto" and not isinstance(tool_format, ToolCallFormat):
            raise SettingError(
                f"{_KEY}.tool_format={tool_format!r}: use auto or a class with parse and format "
                "(lppo.envs.tool_formats.HermesCalls, Llama3JsonCalls, MistralCalls)."
            )
        self.tool_format = tool_format
        #: The format in use: ``tool_format``, or what ``auto`` read at :meth:`setup`.
        self.format: ToolCallFormat = detect(None) if tool_format == "auto" else tool_format
        self.max_calls_per_turn = max_calls_per_turn
        self.assistant_prefix = assistant_prefix
        self._tokenizer: Any = None
        self._chat_template: str | None = None

    def setup(self, tokenizer: Any) -> None:
        """Bind the tokenizer and check, on a probe conversation, that it can call the tools.

        The probe is rendered as every episode is: the opening (system turn with the tools'
        schemas, few-shot messages, a user turn, the assistant header and prefix), a call of the
        first tool (as :attr:`format` writes it) and its tool turn. Checked:

        1. ``template: tokenizer``: the tokenizer's template renders ``tools=``;
        2. vocabulary: each part comes back from the tokenizer (encode, then decode) with every
           character (whitespace aside): a character lost to ``<unk>`` could be neither read
           nor written, so the policy could not call a tool;
        3. end of turn: the template ends the assistant's turn right after the call with the
           tokenizer's EOS token, one token, the one at which the engine ends a turn, and
           appends the tool turn without re-rendering the earlier turns.

        Raises:
            SettingError: naming the template, the tokenizer, what is lost or how the turn ends,
                and the fix.
        """
        if self.template == "hermes":
            self._chat_template = HERMES_CHATML
        elif not getattr(tokenizer, "chat_template", None) or not renders_tools(tokenizer):
            raise SettingError(
                f"{_KEY}.template=tokenizer but the tokenizer's chat template does not render "
                "tools=; use template: hermes (ChatML models) or a tokenizer whose template "
                "renders tools."
            )
        if tokenizer.eos_token is None:
            raise SettingError("ToolEnvironment needs a tokenizer with an end-of-turn (EOS) token")
        if self.tool_format == "auto":
            template = HERMES_CHATML if self.template == "hermes" else tokenizer.chat_template
            self.format = for_tokenizer(tokenizer, template)
            shipped = isinstance(self.format, ResponseTemplateCalls)
            why = "the tokenizer's response template" if shipped else "the chat template"
            note(f"{_KEY}.tool_format", type(self.format).__name__, why)
        elif callable(bind := getattr(self.format, "bind", None)):
            bind(tokenizer)
        self._tokenizer = tokenizer
        try:
            self._check_probe(tokenizer)
        except SettingError:
            self._tokenizer = None  # not usable: start() keeps refusing
            raise

    def _probe(self) -> tuple[str, str, str, str]:
        """A probe conversation's renderings: ``(opening, call, with the call, with its answer)``.

        The opening as :meth:`_ToolEpisode.opening` renders it (without the assistant prefix),
        a call of the first tool as :attr:`format` writes it, the conversation ending with that
        call as the assistant's turn, then with the tool's answer and the next assistant header.
        """
        function = self.tools.schemas[0]["function"]
        properties = function.get("parameters", {}).get("properties", {})
        arguments = {k: _EXAMPLE_VALUES.get(v.get("type"), "1") for k, v in properties.items()}
        call = self.format.format(ToolCall(function["name"], arguments))
        messages = _ToolEpisode(self, Prompt("", "")).messages
        before = [*messages, {"role": "assistant", "content": call}]
        tool = {"role": "tool", "name": function["name"], "content": "1"}
        return (
            self.render(messages, generation_prompt=True),
            call,
            self.render(before),
            self.render([*before, tool], generation_prompt=True),
        )

    def _check_probe(self, tokenizer: Any) -> None:
        """Checks 2 and 3 of :meth:`setup` on the :meth:`_probe` conversation."""
        head, call, base, full = self._probe()
        if not full.startswith(head + call):
            raise SettingError(
                f"{_KEY}.template={self.template!r}: the chat template re-renders the earlier "
                "turns when a tool message is appended; multi-turn tool calls need a template "
                "that appends turns (template: hermes for ChatML models)."
            )
        parts = {
            "the opening (system turn with the tools' schemas, user turn, assistant header)": head
            + self.assistant_prefix,
            "a tool call": call,
            "the tool turn": full[len(head + call) :],
        }
        for where, text in parts.items():
            if lost := lost_characters(tokenizer, text):
                raise SettingError(
                    f"{_KEY}.template={self.template!r}: the tokenizer {_named(tokenizer)} cannot "
                    f"express a tool call: encoded and decoded, {where} loses {len(lost)} "
                    f"character(s) {lost[:40]!r} (to {tokenizer.unk_token or 'other text'}), so "
                    "the policy could neither read its tools nor write a tool call; set "
                    "model.tokenizer_path to a chat model's tokenizer that has them (e.g. "
                    "SmolLM2-Instruct's, with template: hermes)."
                )
        eos = str(tokenizer.eos_token)
        ids = list(tokenizer(eos, add_special_tokens=False)["input_ids"])
        ending = base[len(head + call) :]
        if not ending.startswith(eos) or ids != [tokenizer.eos_token_id]:
            raise SettingError(
                f"{_KEY}.template={self.template!r}: the chat template ends the assistant's turn "
                f"with {ending[:24]!r}, not with the EOS token {eos!r} of the tokenizer "
                f"{_named(tokenizer)} as one token (ids {ids}), where the engine ends a turn, so "
                "no tool call could be answered. Use a tokenizer whose EOS ends the template's "
                "turns (a ChatML model's <|im_end|>, with template: hermes), or a template that "
                f"ends turns with {eos!r}."
            )

    def start(self, prompt: Prompt, seed: int) -> Episode:
        """A conversation opened by ``prompt`` (tools are deterministic: the seed is unused)."""
        if self._tokenizer is None:
            raise RuntimeError("ToolEnvironment.start before setup(tokenizer)")
        return _ToolEpisode(self, prompt)

    def close(self) -> None:
        """Stop the tools' worker process; idempotent."""
        self.tools.close()

    # ------------------------------------------------------------------ rendering
    def render(self, messages: list[dict[str, Any]], generation_prompt: bool = False) -> str:
        """``messages`` as the chat template writes them, with the tools' schemas."""
        return str(
            self._tokenizer.apply_chat_template(
                messages,
                tools=self.tools.schemas,
                tokenize=False,
                add_generation_prompt=generation_prompt,
                chat_template=self._chat_template,
            )
        )

    def tool_turn(
        self, before: list[dict[str, Any]], after: list[dict[str, Any]], ended: bool
    ) -> str:
        """What the template writes after the assistant turn of ``before`` to reach ``after``.

        The policy's turn ended at its end-of-turn token (``ended``), which the trajectory
        already holds; a turn cut short gets that token from the observation instead.
        """
        base, full = self.render(before), self.render(after, generation_prompt=True)
        eos = str(self._tokenizer.eos_token)
        cut = base.rfind(eos)
        if cut < 0 or not full.startswith(base[:cut]):  # setup's probe passed: a rare template
            raise SettingError(
                f"{_KEY}.template={self.template!r}: the chat template does not render the "
                f"assistant turn with the tokenizer's EOS token {eos!r} as its end, or re-renders "
                "earlier turns when tool messages are appended; multi-turn tool calls need a "
                "template that appends turns."
            )
        return full[cut + len(eos) if ended else cut :]
