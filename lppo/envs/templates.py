"""A ChatML chat template that renders tools in the Hermes convention.

SmolLM2-Instruct's own template (ChatML) ignores ``tools=``. :data:`HERMES_CHATML` renders
plain conversations byte for byte like it (default system prompt included), and adds, as
Qwen2.5's template does: the tools' JSON schemas in the system turn between ``<tools>`` tags,
assistant ``tool_calls`` as ``<tool_call>`` blocks (exactly :func:`~lppo.envs.tools.
format_tool_call`), and ``role: tool`` messages as one user turn of ``<tool_response>`` blocks.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

DEFAULT_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# Every tag trims the whitespace before it ({%- / {{-), so the layout below renders nothing.
HERMES_CHATML = (
    """{%- set default_system = '"""
    + DEFAULT_SYSTEM_PROMPT
    + """' %}
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages and messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- default_system }}
    {%- endif %}
    {{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.'
        + '\\n\\nYou are provided with function signatures within <tools></tools> XML tags:'
        + '\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and'
        + ' arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'
        + '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>'
        + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if loop.first and message['role'] != 'system' and not tools %}
        {{- '<|im_start|>system\\n' + default_system + '<|im_end|>\\n' }}
    {%- endif %}
    {%- if message['role'] == 'system' and loop.first and tools %}
    {%- elif message['role'] == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' and message['tool_calls'] is defined
        and message['tool_calls'] %}
        {{- '<|im_start|>assistant\\n' + (message['content'] or '') }}
        {%- for call in message['tool_calls'] %}
            {%- set call = call['function'] if call['function'] is defined else call %}
            {%- if message['content'] or not loop.first %}
                {{- '\\n' }}
            {%- endif %}
            {{- '<tool_call>\\n{"name": ' + (call['name'] | tojson) + ', "arguments": ' }}
            {%- if call['arguments'] is string %}
                {{- call['arguments'] }}
            {%- else %}
                {{- call['arguments'] | tojson }}
            {%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}"""
)

_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "lppo_probe_tool",
        "description": "Probe whether a chat template renders tools.",
        "parameters": {"type": "object", "properties": {}},
    },
}


def renders_tools(tokenizer: Any) -> bool:
    """Whether ``tokenizer``'s chat template shows the model the ``tools=`` it is given.

    Args:
        tokenizer: a ``transformers`` tokenizer.

    Returns:
        ``True`` if rendering with a probe tool differs from rendering without and names the
        tool; ``False`` for a template that ignores tools (SmolLM2's) or no template at all.
    """
    if not getattr(tokenizer, "chat_template", None):
        return False
    messages = [{"role": "user", "content": "hi"}]
    plain = tokenizer.apply_chat_template(messages, tokenize=False)
    with_tools = tokenizer.apply_chat_template(messages, tools=[_PROBE_TOOL], tokenize=False)
    return with_tools != plain and "lppo_probe_tool" in with_tools


def lost_characters(tokenizer: Any, text: str) -> str:
    """Characters of ``text`` that do not come back from ``tokenizer`` (encode, then decode).

    Compared as counts of each character, whitespace aside (a tokenizer may normalize it) and
    the tokenizer's special tokens aside (decoding skips them, ``<unk>`` included).

    Args:
        tokenizer: a ``transformers`` tokenizer.
        text: what a chat template rendered.

    Returns:
        The lost characters, each once, in the order they occur in ``text`` (empty: none).
    """
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    back = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    for special in tokenizer.all_special_tokens:
        text = text.replace(special, "")
    lost = Counter(c for c in text if not c.isspace()) - Counter(back)
    return "".join(c for c in dict.fromkeys(text) if c in lost)
