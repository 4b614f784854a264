"""A two-turn environment small enough for the default tiny random model to learn on 2 cores.

The prompt (``"d:"``) hides a digit the model cannot guess better than 1 in 10. A turn that
contains the query character (``?``) is a call: the environment answers with the digit
(observation ``"7>"``) and the episode goes on. Any other turn, and every turn once the calls
are used up, is the answer, and the task scores it: 1 for exactly the digit, 0.5 when it
starts with the digit, else 0. The best policy therefore asks first (turn 1: ``?``), then
copies the digit it was told (turn 2: ``7``).
"""

from __future__ import annotations

import random
from typing import Any

from lppo.envs.base import Episode, Observation, Turn
from lppo.tasks.base import Prompt, Task
from lppo.validation import check_number

#: The character a call must contain.
QUERY = "?"
#: Ends the observation that reveals the digit.
REVEALED = ">"
DIGITS = "0123456789"


class HiddenDigitTask(Task):
    """Answer the hidden digit of the prompt (prompts and the final answer's score).

    Args:
        prompt: the prompt text (the same for every episode; only the digit differs).
        num_digits: the digit is drawn from ``0 … num_digits - 1`` (a guess is right with
            probability ``1 / num_digits``).
    """

    name = "hidden_digit"

    def __init__(self, prompt: str = "d:", num_digits: int = 10) -> None:
        if not prompt:
            raise ValueError("model.task.init_args.prompt must not be empty")
        check_number("model.task.init_args.num_digits", num_digits, integer=True, low=2, high=10)
        self.prompt = prompt
        self.digits = DIGITS[:num_digits]

    def sample_prompts(self, n: int, generator: random.Random) -> list[Prompt]:
        """``n`` prompts, each hiding a uniformly drawn digit (its ``answer``)."""
        return [Prompt(self.prompt, generator.choice(self.digits)) for _ in range(n)]

    def reward(self, prompt: Prompt, completion: str) -> float:
        """1 for exactly the digit, 0.5 for an answer that starts with it, else 0."""
        if completion == prompt.answer:
            return 1.0
        return 0.5 if completion.startswith(prompt.answer) else 0.0

    def vocabulary(self) -> str:
        """Digits, the prompt's characters, the query and the observation's end."""
        return "".join(sorted(set(DIGITS + self.prompt + QUERY + REVEALED)))

    def max_prompt_length(self) -> int:
        """Every prompt is the same text."""
        return len(self.prompt)


class _Episode:
    """One hidden-digit episode (the digit is the prompt's answer)."""

    def __init__(self, digit: str, call_reward: float, max_calls: int) -> None:
        self.digit = digit
        self.call_reward = call_reward
        self.calls_left = max_calls

    def opening(self) -> str | None:
        return None  # the engine encodes the prompt as in a single-turn run

    def step(self, turn: Turn) -> Observation:
        if QUERY not in turn.text or not self.calls_left:
            return Observation(done=True)
        self.calls_left -= 1
        return Observation(text=self.digit + REVEALED, reward=self.call_reward, tool_calls=1)


class HiddenDigitEnvironment:
    """Reveals the prompt's hidden digit to a turn that asks for it (``?``).

    Args:
        call_reward: the reward of a call (a per-turn reward, placed on the call's last token).
        max_calls: calls an episode may make; the turn after the last one is the answer.
    """

    def __init__(self, call_reward: float = 0.0, max_calls: int = 1) -> None:
        key = "model.engine.init_args.environment.init_args"
        check_number(f"{key}.call_reward", call_reward)
        check_number(f"{key}.max_calls", max_calls, integer=True, low=0)
        self.call_reward = call_reward
        self.max_calls = max_calls

    def setup(self, tokenizer: Any) -> None:
        """Nothing to bind: observations are plain text in the task's vocabulary."""

    def start(self, prompt: Prompt, seed: int) -> Episode:
        """An episode hiding ``prompt.answer`` (nothing is drawn: the seed is unused)."""
        return _Episode(prompt.answer, self.call_reward, self.max_calls)

    def close(self) -> None:
        """Nothing was started."""
