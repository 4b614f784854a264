import random

import pytest
import transformers

from lppo.modules.tokenizer import (
    SPECIAL_TOKENS,
    build_char_tokenizer,
    check_coverage,
    check_task_coverage,
)
from lppo.tasks import ArithmeticTask, CopyTask
from lppo.validation import SettingError


@pytest.mark.parametrize(
    "task", [CopyTask(alphabet_size=36, transform="copy"), ArithmeticTask(operators="+-")]
)
def test_round_trip_task_strings(task):
    tok = build_char_tokenizer(task.vocabulary())
    for p in task.sample_prompts(100, random.Random(0)):
        for s in (p.text, p.answer, p.text + p.answer):
            ids = tok(s)["input_ids"]
            assert ids[0] == tok.bos_token_id
            assert len(ids) == len(s) + 1
            assert tok.decode(ids, skip_special_tokens=True) == s
            assert tok.decode(ids[1:]) == s


def test_special_tokens_and_deterministic_ids():
    a = build_char_tokenizer("cba=")
    b = build_char_tokenizer("=abcab")
    assert a.get_vocab() == b.get_vocab()
    assert (a.pad_token_id, a.bos_token_id, a.eos_token_id) == (0, 1, 2)
    assert len(a) == len(SPECIAL_TOKENS) + 4
    assert a.convert_ids_to_tokens(a("abc")["input_ids"]) == ["<bos>", "a", "b", "c"]


def test_decode_has_no_spaces_and_skips_specials():
    tok = build_char_tokenizer("ab c")
    ids = tok("a b", add_special_tokens=False)["input_ids"]
    assert len(ids) == 3
    assert tok.decode([*ids, tok.eos_token_id, tok.pad_token_id], skip_special_tokens=True) == "a b"
    assert tok.decode(tok("abc")["input_ids"], skip_special_tokens=True) == "abc"


def test_unknown_chars_map_to_unk():
    tok = build_char_tokenizer("ab")
    ids = tok("aZb", add_special_tokens=False)["input_ids"]
    assert ids[1] == tok.unk_token_id


def test_left_padding_batch():
    tok = build_char_tokenizer("ab")
    enc = tok(["a", "abb"], padding=True)
    assert enc["input_ids"][0][:2] == [tok.pad_token_id] * 2
    assert enc["attention_mask"][0] == [0, 0, 1, 1]


def test_save_and_reload(tmp_path):
    tok = build_char_tokenizer("0123456789+=")
    tok.save_pretrained(tmp_path)
    again = transformers.AutoTokenizer.from_pretrained(tmp_path)
    s = "12+7=19"
    assert again(s)["input_ids"] == tok(s)["input_ids"]
    assert again.decode(again(s)["input_ids"], skip_special_tokens=True) == s


def test_empty_vocabulary_rejected():
    with pytest.raises(ValueError):
        build_char_tokenizer("")


def test_characters_the_tokenizer_does_not_know_fail_with_the_characters_and_the_fix():
    tok = build_char_tokenizer("0123456789+=")
    check_coverage(tok, ["12+3=", "15"], "fix it.")  # every character known: passes
    with pytest.raises(SettingError, match=r"maps 2 character\(s\) .* to <unk>: 'x÷' \(first in "):
        check_coverage(tok, ["12+3=", "1x2÷3=", "7x"], "fix it.")


class _ShortVocabulary(CopyTask):
    """A copy task whose vocabulary() forgets a letter its prompts use."""

    def vocabulary(self) -> str:
        return super().vocabulary().replace("c", "")


def test_the_task_s_text_is_checked_without_touching_its_state_or_any_rng():
    task = _ShortVocabulary()
    tok = build_char_tokenizer(task.vocabulary())
    rng, state = random.getstate(), task.state_dict()
    with pytest.raises(SettingError, match=r"'c' .*add them to _ShortVocabulary\.vocabulary\(\)"):
        check_task_coverage(tok, task, None)
    with pytest.raises(SettingError, match=r"'c' .*model\.tokenizer_path='tok/'"):
        check_task_coverage(tok, task, "tok/")
    assert random.getstate() == rng and task.state_dict() == state
    check_task_coverage(build_char_tokenizer(CopyTask().vocabulary()), CopyTask(), None)
