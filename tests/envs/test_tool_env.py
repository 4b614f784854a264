"""``ToolEnvironment``: tool turns rendered by the chat template, errors as observations."""

from __future__ import annotations

import pytest
from _tools import add, fail, sleep
from test_tools import _tiny_tokenizer

from lppo.envs import PythonTool, ToolCall, ToolEnvironment, Turn, format_tool_call
from lppo.envs.tools import parse_tool_calls
from lppo.tasks.base import Prompt
from lppo.validation import SettingError

PROMPT = Prompt("What is 2 + 3?", "5")


@pytest.fixture(scope="module")
def env():
    tok = _tiny_tokenizer()
    env = ToolEnvironment(
        [add, fail, sleep, PythonTool(timeout_s=2)], template="hermes", timeout_s=3
    )
    env.setup(tok)
    yield env
    env.close()


def turn(text: str, ended: bool = True) -> Turn:
    return Turn(text, (), ended)


@pytest.mark.slow
def test_the_trajectory_text_is_the_template_s_rendering_of_the_conversation(env):
    episode = env.start(PROMPT, seed=0)
    opening = episode.opening()
    assert "<tools>" in opening and '"name": "add"' in opening
    assert opening.endswith("<|im_start|>assistant\n")
    call = format_tool_call(ToolCall("add", {"a": 2, "b": 3}))
    obs = episode.step(turn(call))
    assert (obs.done, obs.tool_calls, obs.tool_errors, obs.reward) == (False, 1, 0, 0.0)
    assert "<tool_response>\n5\n</tool_response>" in obs.text
    assert obs.text.endswith("<|im_start|>assistant\n")
    final = episode.step(turn("The answer is 5."))
    assert final.done
    # what the trajectory holds (turns end with the EOS token) is the template's own text
    trajectory = opening + call + "<|im_end|>" + obs.text + "The answer is 5.<|im_end|>"
    messages = [
        *episode.messages,
        {"role": "assistant", "content": "The answer is 5."},
    ]
    assert trajectory == env.render(messages).rstrip("\n")


@pytest.mark.slow
def test_failures_are_observations_and_the_episode_goes_on(env):
    episode = env.start(PROMPT, seed=0)
    text = (
        format_tool_call(ToolCall("nope", {}))
        + format_tool_call(ToolCall("fail", {"message": "boom"}))
        + format_tool_call(ToolCall("add", {"a": 1}))
        + "<tool_call>{not json</tool_call>"
    )
    obs = episode.step(turn(text))
    assert not obs.done and obs.tool_calls == 4 and obs.tool_errors == 4
    assert "no tool named 'nope'" in obs.text and "boom" in obs.text and "invalid JSON" in obs.text
    hung = episode.step(turn(format_tool_call(ToolCall("sleep", {"seconds": 30}))))
    assert (hung.tool_errors, hung.tool_timeouts) == (1, 1)
    code = "print(sum(range(10)))\nbytearray(2 * 1024**3)"
    ran = episode.step(turn(format_tool_call(ToolCall("python", {"code": code}))))
    assert "45" in ran.text and "memory" in ran.text.lower()
    assert episode.step(turn(format_tool_call(ToolCall("add", {"a": 1, "b": 1})))).tool_errors == 0


@pytest.mark.slow
def test_a_turn_cut_short_is_closed_by_the_observation(env):
    episode = env.start(PROMPT, seed=0)
    call = format_tool_call(ToolCall("add", {"a": 2, "b": 3}))
    obs = episode.step(turn(call, ended=False))
    assert obs.text.startswith("<|im_end|>")


def test_a_template_that_ignores_tools_is_refused():
    tok = _tiny_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}"
    )
    env = ToolEnvironment([add])
    with pytest.raises(SettingError, match="template: hermes"):
        env.setup(tok)
    env.close()


def test_the_parser_reads_what_the_template_renders():
    tok = _tiny_tokenizer()
    env = ToolEnvironment([add], template="hermes")
    env.setup(tok)
    call = ToolCall("add", {"a": 2, "b": 3})
    text = env.render(
        [
            {"role": "user", "content": "2+3?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"name": "add", "arguments": call.arguments}],
            },
        ]
    )
    assistant = text.rsplit("<|im_start|>assistant\n", 1)[1]
    assert parse_tool_calls(assistant) == ([call], [])
    env.close()


def test_few_shot_messages_and_an_assistant_prefix_open_the_conversation():
    tok = _tiny_tokenizer()
    prefix = '<tool_call>\n{"name": "add", "arguments": {"a": '
    shot = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]
    env = ToolEnvironment([add], template="hermes", few_shot=shot, assistant_prefix=prefix)
    env.setup(tok)
    episode = env.start(PROMPT, seed=0)
    opening = episode.opening()
    assert opening.endswith("<|im_start|>assistant\n" + prefix)
    assert opening.index("1+1?") < opening.index("2<|im_end|>") < opening.index(PROMPT.text)
    # the prefix is read as the start of the first turn (only): the call completes it
    obs = episode.step(turn('2, "b": 3}}\n</tool_call>'))
    assert obs.tool_calls == 1 and obs.tool_errors == 0, obs
    assert episode.step(turn("5")).done
    env.close()
    with pytest.raises(SettingError, match=r"few_shot\[0\]"):
        ToolEnvironment([add], few_shot=[{"content": "no role"}])
