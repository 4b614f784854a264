"""``MultiTurnEngine``: trajectories of several policy turns with an environment between them.

One row is still one sample, now a whole trajectory: the prompt, the policy's first turn,
the environment's observation, the policy's next turn, and so on, until the environment says
the episode is done, ``max_turns`` turns were taken or ``max_tokens`` is reached. The row
keeps the exact token ids (nothing is re-tokenized); ``response_mask`` is true only on the
tokens the policy generated, so observation and template tokens get no loss, KL, entropy or
advantage weight, and ``gen_logprobs`` cover exactly the masked tokens.

Rewards: the task scores the final turn's text (its ``rewards`` get the last turn as the
completion); each turn's own reward from the environment is stored on the turn's last token
(``turn_rewards``), and the row's ``reward`` is the episode's return, the sum of both.
Critic-free estimators (GRPO, RLOO) use that return; GAE and REINFORCE++ place each part on
its own token (:meth:`~lppo.estimators.base.EstimatorInputs.token_rewards`).

Every turn of sample ``r`` of a call with seed ``s`` samples from ``derive_seed(s, r, turn)``
and every episode starts from ``derive_seed(s, r, "episode")``, so trajectories do not
depend on the engine's batch size nor on how many ranks generate the blocks.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

from lppo.envs.base import Environment, Episode, Observation, Turn
from lppo.init_args import RecordsInitArgs
from lppo.reports import EpisodeReport
from lppo.rollout.base import GenerationOutput, RolloutEngine, RolloutSettings
from lppo.rollout.capabilities import EngineCapabilities, capabilities_of
from lppo.rollout.source import derive_seed
from lppo.rollout.turns import TurnEngine, TurnRequest, TurnSample
from lppo.tasks.base import Prompt, Task
from lppo.validation import SettingError, check_number


@dataclass
class _Trajectory:
    """One sample's trajectory while it is generated (packed at the end)."""

    row: int
    prompt_index: int
    episode: Episode
    ids: list[int]
    prompt_length: int
    mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    completion: str = ""
    running: bool = True
    truncated: bool = False

    def extend(self, ids: tuple[int, ...], policy: bool, logprobs: tuple[float, ...] = ()) -> None:
        """Append tokens: the policy's (with their log-probabilities) or an observation's."""
        self.ids += ids
        self.mask += [policy] * len(ids)
        self.logprobs += logprobs if policy else (0.0,) * len(ids)
        self.turn_rewards += [0.0] * len(ids)


class MultiTurnEngine(RecordsInitArgs):
    """Multi-turn rollouts: a :class:`~lppo.rollout.turns.TurnEngine` and an environment.

    Select it with ``model.engine.class_path: lppo.rollout.MultiTurnEngine``; under Ray
    rollout workers it goes inside (``RayWorkersEngine`` ``engine:``), so each worker runs
    its own episodes. ``model.rollout.max_new_tokens`` bounds each turn.

    Args:
        engine: what samples the policy's turns: ``HFGenerateEngine`` or ``VLLMEngine`` (any
            engine with ``continue_turns`` and ``encode_prompt``).
        environment: answers the policy between turns (``lppo.envs``).
        max_turns: most policy turns per trajectory.
        max_tokens: most tokens per row, prompt included; the longest row the data settings
            must hold. A trajectory that reaches it stops (truncated).
    """

    resume_safe = ()

    def __init__(
        self,
        engine: RolloutEngine,
        environment: Environment,
        max_turns: int = 4,
        max_tokens: int = 256,
    ) -> None:
        key = "model.engine.init_args"
        check_number(f"{key}.max_turns", max_turns, integer=True, low=1)
        check_number(f"{key}.max_tokens", max_tokens, integer=True, low=2)
        self.engine = engine
        self.environment = environment
        self.max_turns = max_turns
        self.max_tokens = max_tokens
        self.sampling = RolloutSettings()
        self._tokenizer: Any = None

    def capabilities(self) -> EngineCapabilities:
        """Rows of several turns, bounded by ``max_tokens``; checked at setup (:meth:`check_setup`).

        ``max_tokens`` counts the prompt and every turn.
        """
        return EngineCapabilities(
            max_row_tokens=self.max_tokens, multi_turn=True, check_setup=self.check_setup
        )

    @property
    def weights_version(self) -> int:
        """The inner engine's weights version."""
        return int(self.engine.weights_version)

    @property
    def turns(self) -> TurnEngine:
        """The inner engine, as the turn-by-turn API it must offer."""
        if not isinstance(self.engine, TurnEngine):
            raise SettingError(
                f"model.engine.init_args.engine: {type(self.engine).__name__} cannot continue "
                "a trajectory turn by turn (no continue_turns / encode_prompt); use "
                "lppo.rollout.HFGenerateEngine or lppo.rollout.VLLMEngine, and put Ray workers "
                "outside: RayWorkersEngine with engine: MultiTurnEngine."
            )
        return self.engine

    def check_setup(self, tokenizer: Any, task: Task, sampling: RolloutSettings) -> None:
        """Refuse, before anything starts, what the first episodes would fail on.

        The run plan calls it. Checked: the inner engine and the sampling settings (as
        :meth:`setup`); the environment's own setup checks (a tool environment's template, EOS
        and vocabulary), on a copy set up and closed here; and the opening of the task's
        longest prompt (:meth:`~lppo.tasks.Task.longest_prompt`), tokenized as the episodes
        will be, which must leave room for a turn under ``max_tokens``. An opening of ``None``
        is encoded as the inner engine encodes prompts; an inner engine that cannot tell (no
        ``encode_prompt`` capability) leaves that to the first episode, which refuses alike.

        Raises:
            SettingError: naming the key, the value and the fix.
        """
        self._check_turns(sampling)
        inner = capabilities_of(self.engine).check_setup  # its tokenizer checks
        if inner is not None:
            inner(tokenizer, task, sampling)
        # A copy: environments pickle before setup (runners copy the engine after this).
        environment = copy.deepcopy(self.environment)
        try:
            environment.setup(tokenizer)
            prompt = task.longest_prompt()
            opening = environment.start(prompt, 0).opening()
        finally:
            environment.close()
        if opening is not None:
            ids = tokenizer(opening, add_special_tokens=False)["input_ids"]
        elif (encode := capabilities_of(self.engine).encode_prompt) is not None:
            ids = encode(tokenizer, prompt.text)
        else:
            return
        self._check_opening(prompt, len(ids), opening is not None, sampling.max_new_tokens)

    def _check_turns(self, sampling: RolloutSettings) -> None:
        """The inner engine continues turns; the sampling settings apply to turns."""
        self.turns  # noqa: B018 (checks the inner engine before anything starts)
        if sampling.min_new_tokens or sampling.ignore_eos:
            raise SettingError(
                "model.rollout.min_new_tokens / ignore_eos do not apply to multi-turn rollouts "
                "(a turn ends at its end-of-turn token); set them to 0 / false."
            )

    def _check_opening(self, prompt: Prompt, tokens: int, rendered: bool, turn: int) -> None:
        """Refuse an opening of ``tokens`` that leaves no room for a turn under ``max_tokens``."""
        if tokens < self.max_tokens:
            return
        what = "as the engine encodes prompts"
        if rendered:
            what = "the environment's opening: chat template, system prompt, tools"
        text = prompt.text if len(prompt.text) <= 60 else prompt.text[:57] + "..."
        raise SettingError(
            f"model.engine.init_args.max_tokens={self.max_tokens}: the prompt {text!r} "
            f"({len(prompt.text)} characters) opens its episode with {tokens} tokens ({what}), "
            "which leaves no room for a turn; raise max_tokens to at least "
            f"{tokens + turn} (the opening and one turn of model.rollout.max_new_tokens={turn}), "
            "or shorten the task's prompts" + (" or the system prompt." if rendered else ".")
        )

    def setup(self, policy: torch.nn.Module, tokenizer: Any, sampling: RolloutSettings) -> None:
        """Set the inner engine and the environment up.

        Raises:
            SettingError: an inner engine without turn-by-turn generation, or sampling
                settings that do not apply to turns (``min_new_tokens``, ``ignore_eos``).
        """
        self._check_turns(sampling)
        self.engine.setup(policy, tokenizer, sampling)
        self.environment.setup(tokenizer)
        self.sampling = sampling
        self._tokenizer = tokenizer
        self.eos_token_id = int(tokenizer.eos_token_id)

    def sync_from(self, policy: torch.nn.Module, version: int) -> None:
        """Sample turns from ``policy``'s weights (the inner engine's sync)."""
        self.engine.sync_from(policy, version)

    def close(self) -> None:
        """Close the inner engine and the environment; idempotent."""
        self.engine.close()
        self.environment.close()

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompts: list[Prompt],
        samples_per_prompt: int = 1,
        seed: int = 0,
        greedy: bool = False,
    ) -> GenerationOutput:
        """Run one episode per sample, all turns batched across the running episodes.

        Args:
            prompts: the prompts to answer.
            samples_per_prompt: trajectories per prompt (rows of a prompt are contiguous).
            seed: seed of this call (the same seed gives the same trajectories).
            greedy: argmax turns (evaluation).

        Returns:
            The trajectories, with ``turn_rewards`` and the :class:`EpisodeReport`.
        """
        if samples_per_prompt < 1:
            raise ValueError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}")
        report = EpisodeReport()
        trajectories = [
            self._start(r, i, prompt, seed)
            for r, (i, prompt) in enumerate(
                (i, p) for i, p in enumerate(prompts) for _ in range(samples_per_prompt)
            )
        ]
        for turn in range(self.max_turns):
            running = [t for t in trajectories if t.running]
            if not running:
                break
            requests = [
                TurnRequest(
                    tuple(t.ids),
                    derive_seed(seed, t.row, turn),
                    min(self.sampling.max_new_tokens, self.max_tokens - len(t.ids)),
                )
                for t in running
            ]
            for t, sample in zip(running, self.turns.continue_turns(requests, greedy), strict=True):
                self._answer(t, sample, report)
        for t in trajectories:
            if t.running:  # still going after max_turns
                t.running, t.truncated = False, True
                report.truncated_by_turns += 1
        report.episodes = len(trajectories)
        return _pack(trajectories, report)

    def _start(self, row: int, prompt_index: int, prompt: Prompt, seed: int) -> _Trajectory:
        episode = self.environment.start(prompt, derive_seed(seed, row, "episode"))
        opening = episode.opening()
        if opening is None:
            ids = self.turns.encode_prompt(prompt.text)
        else:
            ids = list(self._tokenizer(opening, add_special_tokens=False)["input_ids"])
        # a prompt longer than the task's longest (check_setup measured that one)
        self._check_opening(prompt, len(ids), opening is not None, self.sampling.max_new_tokens)
        return _Trajectory(row, prompt_index, episode, list(ids), len(ids))

    def _answer(self, t: _Trajectory, sample: TurnSample, report: EpisodeReport) -> None:
        """Append the policy's turn, let the environment answer, append its observation."""
        t.extend(sample.token_ids, True, sample.logprobs)
        report.turns += 1
        report.policy_tokens += len(sample.token_ids)
        text_ids = sample.token_ids[:-1] if sample.ended else sample.token_ids
        text = self._tokenizer.decode(list(text_ids), skip_special_tokens=True)
        observation: Observation = t.episode.step(Turn(text, sample.token_ids, sample.ended))
        if sample.token_ids:
            t.turn_rewards[-1] += float(observation.reward)
        report.tool_calls += observation.tool_calls
        report.tool_errors += observation.tool_errors
        report.tool_timeouts += observation.tool_timeouts
        t.completion = text
        if observation.done:
            t.running, t.truncated = False, not sample.ended
            return
        ids = tuple(self._tokenizer(observation.text, add_special_tokens=False)["input_ids"])
        if len(t.ids) + len(ids) >= self.max_tokens:  # no room for the observation and a turn
            t.running, t.truncated = False, True
            report.truncated_by_tokens += 1
            return
        t.extend(ids, False)
        report.observation_tokens += len(ids)


def _pack(trajectories: list[_Trajectory], report: EpisodeReport) -> GenerationOutput:
    """The trajectories as a :class:`GenerationOutput` (one packed row each)."""
    return GenerationOutput(
        input_ids=[torch.tensor(t.ids, dtype=torch.int64) for t in trajectories],
        response_mask=[
            torch.tensor([False] * t.prompt_length + t.mask, dtype=torch.bool) for t in trajectories
        ],
        gen_logprobs=[
            torch.tensor([0.0] * t.prompt_length + t.logprobs, dtype=torch.float32)
            for t in trajectories
        ],
        completions=[t.completion for t in trajectories],
        truncated=torch.tensor([t.truncated for t in trajectories], dtype=torch.bool),
        prompt_index=torch.tensor([t.prompt_index for t in trajectories], dtype=torch.int64),
        prompt_lengths=torch.tensor([t.prompt_length for t in trajectories], dtype=torch.int64),
        turn_rewards=[
            torch.tensor([0.0] * t.prompt_length + t.turn_rewards, dtype=torch.float64)
            for t in trajectories
        ],
        episodes=report,
    )
