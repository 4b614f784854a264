"""``RolloutSettings``: how each iteration's samples are generated (``model.rollout``)."""

from __future__ import annotations

from dataclasses import dataclass

from lppo.validation import SettingError, check_number

__all__ = ["RolloutSettings"]


@dataclass(frozen=True)
class RolloutSettings:
    """How each iteration's samples are generated: the one source of sampling settings.

    The engine samples with them and the actor scores with the same temperature (set from
    here at setup), so sampling and training can never silently disagree.

    Attributes:
        prompts_per_iteration: prompts drawn from the task per iteration.
        samples_per_prompt: responses sampled per prompt.
        max_new_tokens: longest response (EOS included).
        temperature: sampling temperature (the actor scores with the same one).
        top_p: nucleus-sampling mass; 1 disables it.
        top_k: keep the ``top_k`` most likely tokens; 0 disables it.
        prompts_per_block: prompts generated together, from one seed, by one ``generate``
            call: the unit of rollout work that data-parallel ranks split (whole blocks,
            contiguous, so every prompt's samples stay on one rank). Block ``b`` of iteration
            ``i`` samples from a seed derived from ``(model.seed, i, b)``, so with a fixed value
            the samples do not depend on how many ranks generate them. ``null``: one block per
            data-parallel rank (one block in a single process); set it to compare runs across
            rank counts.
        min_new_tokens: the end-of-sequence token is suppressed (probability 0) before this
            many response tokens; the sampling distribution then differs from the policy's
            for those tokens, so ``gen_logprobs`` are no longer the trainer's.
        ignore_eos: keep sampling after an end-of-sequence token: every response has exactly
            ``max_new_tokens`` tokens (EOS tokens stay in it as ordinary tokens) and none is
            truncated; the distribution is unchanged (benchmarks, fixed-length workloads).
        max_staleness: the fixed lag ``s`` of asynchronous rollouts. Iteration ``t`` trains on
            samples drawn from exactly the policy published after iteration ``t - s - 1``'s
            actor phase (the initial policy for the first ones), generated while iterations
            ``t - s .. t - 1`` train. ``0``: the synchronous run. With ``s > 0`` the actor's
            off-policy correction (``model.actor.init_args.off_policy``, ``auto``: truncated
            importance sampling) reweights the stale rows.
        allow_uncorrected_staleness: with ``max_staleness > 0`` and the off-policy correction
            off (``off_policy.mode: none``), train on stale rows as if they were on-policy.
            That biases the gradient (the PPO ratio is then taken against a policy that did
            not sample the rows); an explicit opt-in.
        dynamic_sampling_rounds: DAPO's dynamic sampling (:mod:`lppo.rollout.dynamic_sampling`).
            ``0``: off. ``N > 0``: prompt groups whose samples all got the same reward are
            dropped, and each block refills itself from up to ``N`` extra blocks of fresh
            prompts until it holds as many informative groups as prompts (then the iteration
            trains on what there is). The refills' prompts are drawn when the iteration is
            admitted, so a task with a position (a dataset) advances by
            ``(N + 1) × prompts_per_iteration`` prompts per iteration. Refills are whole
            blocks: a small ``prompts_per_block`` wastes fewer samples. An iteration left with
            fewer valid rows than ``*_minibatches`` takes one step per row; one left with none
            trains nothing, and its samples count as lost against ``data.drop_budget``: past
            it the iteration fails (``model.ppo.max_failed_iterations`` may skip it), within
            it it is warned about and logged (``rollout/untrained``).
    """

    prompts_per_iteration: int = 32
    samples_per_prompt: int = 4
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    prompts_per_block: int | None = None
    min_new_tokens: int = 0
    ignore_eos: bool = False
    max_staleness: int = 0
    allow_uncorrected_staleness: bool = False
    dynamic_sampling_rounds: int = 0

    def __post_init__(self) -> None:
        """Raise ``ValueError`` naming the key, the value and the fix for a bad setting."""
        for key in ("prompts_per_iteration", "samples_per_prompt", "max_new_tokens"):
            check_number(f"model.rollout.{key}", getattr(self, key), integer=True, low=1)
        check_number(
            "model.rollout.temperature",
            self.temperature,
            low=0,
            low_open=True,
            fix="1.0 samples from the policy itself.",
        )
        check_number(
            "model.rollout.top_p",
            self.top_p,
            low=0,
            high=1,
            low_open=True,
            fix="1.0 disables nucleus sampling.",
        )
        check_number("model.rollout.top_k", self.top_k, integer=True, low=0, fix="0 disables it.")
        check_number(
            "model.rollout.prompts_per_block",
            self.prompts_per_block,
            integer=True,
            low=1,
            optional=True,
            fix="null: one block per rank.",
        )
        check_number(
            "model.rollout.min_new_tokens",
            self.min_new_tokens,
            integer=True,
            low=0,
            high=self.max_new_tokens,
            fix="It must lie in [0, model.rollout.max_new_tokens].",
        )
        check_number(
            "model.rollout.max_staleness",
            self.max_staleness,
            integer=True,
            low=0,
            fix="0 is the synchronous run; 1 overlaps generation with one training iteration.",
        )
        check_number(
            "model.rollout.dynamic_sampling_rounds",
            self.dynamic_sampling_rounds,
            integer=True,
            low=0,
            fix="0 turns dynamic sampling off; DAPO allows a few extra generation rounds.",
        )
        if self.dynamic_sampling_rounds and self.samples_per_prompt < 2:
            raise SettingError(
                f"model.rollout.dynamic_sampling_rounds={self.dynamic_sampling_rounds} with "
                f"model.rollout.samples_per_prompt={self.samples_per_prompt}: a group of one "
                "sample always has a single reward, so every group would be dropped; sample at "
                "least 2 per prompt, or set dynamic_sampling_rounds: 0."
            )

    @property
    def rows_per_iteration(self) -> int:
        """Rows each iteration puts into the replay store."""
        return self.prompts_per_iteration * self.samples_per_prompt
