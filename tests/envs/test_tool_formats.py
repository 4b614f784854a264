"""Tool-call formats of the model families: round trips, malformed calls, detection, episodes."""

from __future__ import annotations

import json

import pytest
from _tools import add
from test_tools import _real_tokenizer, _tiny_tokenizer

from lppo.envs import (
    HERMES_CHATML,
    HermesCalls,
    Llama3JsonCalls,
    MistralCalls,
    ResponseTemplateCalls,
    ToolCall,
    ToolEnvironment,
    Turn,
)
from lppo.envs.tool_formats import detect
from lppo.tasks.base import Prompt
from lppo.validation import SettingError

FORMATS = {
    "hermes": HermesCalls(),
    "llama3_json": Llama3JsonCalls(),
    "mistral_list": MistralCalls("list"),
    "mistral_args": MistralCalls("args"),
}
CALLS = [
    ToolCall("add", {"a": 2, "b": 3}),
    ToolCall("search", {"query": 'Zürich „quoted" ; [x]', "k": [1, 2], "deep": {"x": None}}),
    ToolCall("now", {}),
]


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("call", CALLS, ids=lambda c: c.name)
def test_a_formatted_call_parses_back(name, call):
    fmt = FORMATS[name]
    assert fmt.parse(fmt.format(call)) == ([call], [])


@pytest.mark.parametrize("name", FORMATS)
def test_several_calls_in_one_turn_parse_in_order(name):
    fmt = FORMATS[name]
    if name == "mistral_list":  # one list holds every call
        body = [{"name": c.name, "arguments": c.arguments} for c in CALLS]
        joined = f"[TOOL_CALLS]{json.dumps(body, ensure_ascii=False)}"
    else:
        separator = {"hermes": "\n", "llama3_json": "; ", "mistral_args": ""}[name]
        joined = separator.join(fmt.format(c) for c in CALLS)
        joined = ("<|python_tag|>" if name == "llama3_json" else "I call two tools.\n") + joined
    assert fmt.parse(joined) == (CALLS, [])


@pytest.mark.parametrize("name", FORMATS)
def test_a_plain_answer_holds_no_call(name):
    assert FORMATS[name].parse("The answer is 5.") == ([], [])


@pytest.mark.parametrize(
    ("name", "text", "error"),
    [
        ("llama3_json", '{"name": "add", "parameters": {"a": 1', "invalid JSON"),
        ("llama3_json", '{"parameters": {}}', 'non-empty string "name"'),
        ("llama3_json", '{"name": "add", "parameters": [1]}', "must be a JSON object"),
        ("llama3_json", '{"name": "add", "parameters": "{bad"}', "not JSON"),
        ("mistral_list", '[TOOL_CALLS]{"name": "add"}', "one JSON list of calls"),
        ("mistral_list", '[TOOL_CALLS][{"name": "add", "arguments": {', "invalid JSON"),
        ("mistral_list", '[TOOL_CALLS][{"name": 3, "arguments": {}}]', 'non-empty string "name"'),
        ("mistral_args", "[TOOL_CALLS]add[ARGS]{oops}", "invalid JSON after [ARGS]"),
        ("mistral_args", "[TOOL_CALLS][ARGS]{}", 'non-empty string "name"'),
    ],
)
def test_a_malformed_call_is_an_error_message_never_an_exception(name, text, error):
    calls, errors = FORMATS[name].parse(text)
    assert calls == [] and len(errors) == 1 and error in errors[0], errors


def test_well_formed_calls_survive_a_malformed_neighbour():
    fmt = Llama3JsonCalls()
    text = fmt.format(CALLS[0]) + '; {"name": ""}'
    calls, errors = fmt.parse(text)
    assert calls == [CALLS[0]] and len(errors) == 1


def test_the_format_is_read_from_the_chat_template():
    assert isinstance(detect(HERMES_CHATML), HermesCalls)
    assert isinstance(detect(None), HermesCalls)
    assert isinstance(detect("{{ '<|python_tag|>' }}{{ message.content }}"), Llama3JsonCalls)
    mistral = detect("{{ '[TOOL_CALLS]' }}{{ tool_calls | tojson }}")
    assert isinstance(mistral, MistralCalls) and mistral.style == "list"
    assert detect("{{ '[TOOL_CALLS]' + name + '[ARGS]' + args }}").style == "args"


@pytest.mark.slow
def test_smollm2_s_own_template_reads_as_hermes():
    assert isinstance(detect(_real_tokenizer().chat_template), HermesCalls)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama3_json", "mistral_args"])
def test_an_episode_answers_calls_in_the_chosen_format(name):
    fmt = FORMATS[name]
    env = ToolEnvironment([add], template="hermes", tool_format=fmt, timeout_s=3)
    try:
        env.setup(_tiny_tokenizer())  # the probe writes its call in this format
        assert env.format is fmt
        episode = env.start(Prompt("What is 2 + 3?", "5"), seed=0)
        obs = episode.step(Turn(fmt.format(ToolCall("add", {"a": 2, "b": 3})), (), True))
        assert (obs.done, obs.tool_calls, obs.tool_errors) == (False, 1, 0)
        assert "<tool_response>\n5\n</tool_response>" in obs.text
        assert episode.step(Turn("It is 5.", (), True)).done
    finally:
        env.close()


def test_auto_with_lppo_s_template_is_hermes_and_a_bad_format_is_refused():
    env = ToolEnvironment([add], template="hermes")
    try:
        env.setup(_tiny_tokenizer())
        assert isinstance(env.format, HermesCalls)
    finally:
        env.close()
    with pytest.raises(SettingError, match=r"tool_format='xml'"):
        ToolEnvironment([add], tool_format="xml")
    with pytest.raises(SettingError, match=r"style='json'"):
        MistralCalls("json")


#: A response template (transformers' parse_response) for Hermes blocks, as a model would ship.
HERMES_RESPONSE = {
    "version": 1,
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "content": {},
        "tool_calls": {
            "open": "<tool_call>",
            "close": "</tool_call>",
            "content": "json",
            "repeats": True,
        },
    },
}


def test_the_tokenizer_s_response_template_parses_where_it_ships_one():
    tok = _tiny_tokenizer()
    tok.response_template = HERMES_RESPONSE
    fmt = ResponseTemplateCalls()
    fmt.bind(tok)
    text = "Let me add.\n" + "\n".join(HermesCalls().format(c) for c in CALLS)
    assert fmt.parse(text) == HermesCalls().parse(text) == (CALLS, [])
    assert fmt.parse("The answer is 5.") == ([], [])
    calls, errors = fmt.parse("<tool_call>{bad</tool_call>")
    assert calls == [] and "could not parse" in errors[0]
    assert isinstance(fmt.writer, HermesCalls) and fmt.format(CALLS[0]) == HermesCalls().format(
        CALLS[0]
    )
    with pytest.raises(SettingError, match="no response_template"):
        ResponseTemplateCalls().bind(_tiny_tokenizer())


@pytest.mark.slow
def test_auto_prefers_the_response_template():
    tok = _tiny_tokenizer()
    tok.response_template = HERMES_RESPONSE
    env = ToolEnvironment([add], template="hermes", timeout_s=3)
    try:
        env.setup(tok)
        assert isinstance(env.format, ResponseTemplateCalls)
        episode = env.start(Prompt("What is 2 + 3?", "5"), seed=0)
        obs = episode.step(Turn(HermesCalls().format(ToolCall("add", {"a": 2, "b": 3})), (), True))
        assert (obs.tool_calls, obs.tool_errors) == (1, 0) and "5" in obs.text
    finally:
        env.close()
