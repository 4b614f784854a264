import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lppo.tasks import TASKS, ArithmeticTask, CopyTask, Prompt, Task, get_task

TASK_FACTORIES = [
    CopyTask,
    lambda: CopyTask(min_length=1, max_length=5, alphabet_size=36, transform="reverse"),
    lambda: CopyTask(transform="copy", length_weight=0.0),
    ArithmeticTask,
    lambda: ArithmeticTask(min_value=0, max_value=999, operators="+-"),
]


@pytest.fixture(params=range(len(TASK_FACTORIES)), ids=lambda i: f"task{i}")
def task(request) -> Task:
    return TASK_FACTORIES[request.param]()


def test_correct_answer_scores_one(task):
    for p in task.sample_prompts(50, random.Random(0)):
        assert task.reward(p, p.answer) == 1.0


def test_deterministic_by_seed(task):
    a = task.sample_prompts(20, random.Random(7))
    b = task.sample_prompts(20, random.Random(7))
    c = task.sample_prompts(20, random.Random(8))
    assert a == b
    assert a != c


def test_vocabulary_covers_prompts_and_answers(task):
    vocab = set(task.vocabulary())
    for p in task.sample_prompts(200, random.Random(1)):
        assert set(p.text) <= vocab
        assert set(p.answer) <= vocab
        assert p.answer


def test_the_longest_prompt_is_as_long_as_the_bound(task):
    """The default samples (as ``max_prompt_length``): these tasks reach their bound."""
    assert len(task.longest_prompt().text) == task.max_prompt_length()


@given(st.integers(0, 10_000), st.text(max_size=20))
def test_rewards_in_unit_interval(seed, completion):
    for make in TASK_FACTORIES:
        task = make()
        (p,) = task.sample_prompts(1, random.Random(seed))
        r = task.reward(p, completion)
        assert 0.0 <= r <= 1.0
        if completion != p.answer:
            assert r < 1.0


def test_random_completions_get_partial_reward():
    task = CopyTask()
    rng = random.Random(0)
    prompts = task.sample_prompts(200, rng)
    alphabet = task.vocabulary()
    completions = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8))) for _ in prompts]
    rewards = task.rewards(prompts, completions)
    assert 0.0 < sum(rewards) / len(rewards) < 0.7


def test_copy_reward_shape():
    task = CopyTask(transform="reverse", length_weight=0.3, length_tolerance=4)
    p = task.make_prompt("abc")
    assert p.text == "abc=" and p.answer == "cba"
    assert task.reward(p, "cba") == 1.0
    assert task.reward(p, "cbx") == pytest.approx(0.7 * 2 / 3 + 0.3)
    assert task.reward(p, "cbaa") == pytest.approx(0.7 + 0.3 * 0.75)
    assert task.reward(p, "") == pytest.approx(0.3 * 0.25)
    assert task.reward(p, "cbaxxxx") == pytest.approx(0.7)
    assert CopyTask(transform="first").make_prompt("ab7c").answer == "a"
    assert CopyTask(transform="repeat_first").make_prompt("xy").answer == "xx"


def test_arithmetic_reward_shape():
    task = ArithmeticTask(partial_weight=0.5)
    p = task.make_prompt(12, "+", 7)
    assert p.text == "12+7=" and p.answer == "19"
    assert task.reward(p, "19") == 1.0
    assert task.reward(p, "18") == pytest.approx(0.25)
    assert task.reward(p, "9") == pytest.approx(0.25)
    assert task.reward(p, "119") == pytest.approx(0.5 * 2 / 3)
    assert task.reward(p, "") == 0.0
    assert task.reward(p, "ab") == 0.0
    neg = ArithmeticTask(operators="-").make_prompt(3, "-", 10)
    assert neg.answer == "-7"
    assert ArithmeticTask(max_value=99, operators="+-").max_answer_length() == 3
    times = ArithmeticTask(max_value=99, operators="*")
    assert times.make_prompt(12, "*", 7).answer == "84" and times.max_answer_length() == 4


def test_arithmetic_draws_from_a_fixed_list_of_problems():
    task = ArithmeticTask(max_value=99, operators="+-*", problems=["47-18", " 3 * 12 "])
    drawn = task.sample_prompts(40, random.Random(0))
    assert {(p.text, p.answer) for p in drawn} == {("47-18=", "29"), ("3*12=", "36")}
    again = task.sample_prompts(40, random.Random(0))
    assert [p.text for p in again] == [p.text for p in drawn]
    train = ArithmeticTask(max_value=99, operators="+-*", split="train")
    a, b = next((a, b) for a in range(100) for b in range(100) if not train.in_split(a, "+", b))
    with pytest.raises(ValueError, match="split 'train'"):
        ArithmeticTask(max_value=99, operators="+-*", split="train", problems=[f"{a}+{b}"])


def test_arithmetic_splits_are_disjoint_and_cover_every_problem():
    kwargs = {"max_value": 99, "operators": "+-*", "heldout_fraction": 0.1}
    train = ArithmeticTask(split="train", **kwargs)
    heldout = ArithmeticTask(split="heldout", **kwargs)

    def problems(task: ArithmeticTask, n: int, seed: int) -> set[tuple[int, str, int]]:
        drawn = task.sample_prompts(n, random.Random(seed))
        return {(p.metadata["a"], p.metadata["op"], p.metadata["b"]) for p in drawn}

    # the same seed on both sides still never gives a shared problem
    seen_train, seen_heldout = problems(train, 20_000, 0), problems(heldout, 2_000, 0)
    assert not seen_train & seen_heldout
    every = [(a, op, b) for a in range(100) for op in "+-*" for b in range(100)]
    share = sum(heldout.in_split(*p) for p in every) / len(every)
    assert 0.09 < share < 0.11
    assert all(train.in_split(*p) != heldout.in_split(*p) for p in every)
    # "all" draws exactly what the task drew before splits existed: no rejection
    before = ArithmeticTask(max_value=99, operators="+-*").sample_prompts(50, random.Random(3))
    generator = random.Random(3)
    by_hand = [
        (generator.randint(0, 99), generator.randint(0, 99), generator.choice("+-*"))
        for _ in range(50)
    ]
    assert [(p.metadata["a"], p.metadata["b"], p.metadata["op"]) for p in before] == by_hand
    narrow = ArithmeticTask(max_value=0, operators="+", split="heldout", heldout_fraction=0.01)
    assert not narrow.in_split(0, "+", 0)  # the only problem is on the training side
    with pytest.raises(ValueError, match="split='heldout'"):
        narrow.sample_prompts(1, random.Random(0))


def test_rewards_batch_length_mismatch():
    task = CopyTask()
    with pytest.raises(ValueError):
        task.rewards([Prompt("a=", "a")], [])


def test_registry():
    assert get_task("copy") is CopyTask
    assert get_task("arithmetic") is ArithmeticTask
    assert set(TASKS) == {"copy", "arithmetic"}
    with pytest.raises(ValueError, match="arithmetic") as info:
        get_task("nope")
    assert "copy" in str(info.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_length": 0},
        {"min_length": 3, "max_length": 2},
        {"alphabet_size": 0},
        {"alphabet_size": 37},
        {"transform": "bogus"},
        {"length_weight": 1.5},
    ],
)
def test_copy_rejects_bad_args(kwargs):
    with pytest.raises(ValueError):
        CopyTask(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_value": -1},
        {"max_value": -1},
        {"operators": ""},
        {"operators": "/"},
        {"partial_weight": 1.0},
        {"split": "test"},
        {"heldout_fraction": 0.0},
        {"heldout_fraction": 1.0},
        {"problems": []},
        {"problems": ["4/2"]},
        {"problems": ["4*2"]},  # "+" only
        {"problems": ["21+1"]},  # past max_value
    ],
)
def test_arithmetic_rejects_bad_args(kwargs):
    with pytest.raises(ValueError):
        ArithmeticTask(**kwargs)
