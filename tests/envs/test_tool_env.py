"""``ToolEnvironment``: tool turns rendered by the chat template, errors as observations."""

from __future__ import annotations

from pathlib import Path

import pytest
from _tools import add, fail, sleep
from test_tools import _real_tokenizer, _tiny_tokenizer

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


def test_a_tokenizer_that_loses_the_tool_call_characters_is_refused():
    """The character tokenizer of configs/tiny.yaml: the Hermes system prompt and any
    ``<tool_call>`` would be ``<unk>`` (accepted before, untrainable)."""
    from lppo.modules.tokenizer import build_char_tokenizer
    from lppo.tasks import CopyTask

    env = ToolEnvironment([add], template="hermes")
    lost = r"template='hermes': the tokenizer built in memory .* cannot express a tool call: "
    lost += r"encoded and decoded, the opening .* loses \d+ character\(s\) '<\|im_.*' \(to <unk>\)"
    with pytest.raises(SettingError, match=lost):
        env.setup(build_char_tokenizer(CopyTask().vocabulary()))
    with pytest.raises(RuntimeError, match="before setup"):
        env.start(PROMPT, seed=0)
    # the policy's characters alone are not enough: the call and the tool turn must come back
    ascii_only = build_char_tokenizer("".join(map(chr, range(32, 127))) + "\n")
    lost = r"template='tokenizer': .* the tool turn loses 1 character\(s\) 'é'"
    with pytest.raises(SettingError, match=lost):
        ToolEnvironment([add]).setup(_answering(ascii_only, "é"))
    env.close()


def _answering(tok, text):
    """``tok`` with HERMES_CHATML as its own template, its tool turns adding ``text``."""
    from lppo.envs.templates import HERMES_CHATML

    answer = "message['content'] + '\\n</tool_response>'"
    assert answer in HERMES_CHATML
    tok.chat_template = HERMES_CHATML.replace(answer, answer.replace("'\\n", f"'{text}\\n"))
    return tok


def test_a_template_that_does_not_end_turns_with_the_eos_token_is_refused():
    """The engine ends a turn at the tokenizer's EOS: a template that ends the assistant's turn
    with another token, or re-renders it once a tool answers, failed at the first tool call,
    mid-run."""
    tok = _tiny_tokenizer()
    tok.eos_token = "<|endoftext|>"
    env = ToolEnvironment([add], template="hermes")
    reread = ToolEnvironment([add])
    ending = r"ends the assistant's turn with '<\|im_end\|>\\n', not with the EOS token "
    ending += r"'<\|endoftext\|>'"
    with pytest.raises(SettingError, match=ending):
        env.setup(tok)
    # a template that drops an earlier assistant turn once a tool answers it
    tok = _tiny_tokenizer()
    tok.chat_template = (
        "{% for t in tools or [] %}{{ t['function']['name'] }}\n{% endfor %}{% for m in messages %}"
        "<|im_start|>{{ m['role'] }}\n{% if m['role'] != 'assistant' or loop.last %}"
        "{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(
        SettingError, match=r"template='tokenizer': .* re-renders the earlier turns"
    ):
        reread.setup(tok)
    env.setup(tok)  # lppo's own template (hermes) appends turns
    env.close()
    reread.close()


@pytest.mark.slow
def test_smollm2_s_tokenizer_with_the_hermes_template_is_accepted_and_its_opening_measured(
    monkeypatch,
):
    """The real ChatML tokenizer passes every check; its opening (system prompt and tools'
    schemas, ~240 tokens) is what a multi-turn run's ``max_tokens`` must leave room after."""
    # examples/ is no package of lppo: importable from the repository root, as the guide runs it
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))
    from examples.smollm2.calculator import calculator
    from examples.smollm2.smollm2_task import ChatArithmeticTask
    from lppo.rollout import HFGenerateEngine, MultiTurnEngine, RolloutSettings

    tok = _real_tokenizer()
    env = ToolEnvironment([calculator], template="hermes")
    env.setup(tok)
    opening = env.start(PROMPT, seed=0).opening()
    tokens = len(tok(opening, add_special_tokens=False)["input_ids"])
    assert 200 < tokens < 300, tokens
    task, sampling = ChatArithmeticTask(), RolloutSettings(max_new_tokens=24)
    MultiTurnEngine(HFGenerateEngine(), env, max_tokens=768).check_setup(tok, task, sampling)
    with pytest.raises(SettingError, match=r"max_tokens=200: .*environment's opening"):
        MultiTurnEngine(HFGenerateEngine(), env, max_tokens=200).check_setup(tok, task, sampling)
    env.close()
