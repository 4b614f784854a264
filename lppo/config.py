"""``PPOConfig``: the algorithm's settings, validated when built, with actionable messages."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Literal

from lppo.algorithms.kl import KLKind
from lppo.decisions import note
from lppo.iteration.columns import PI_OLD
from lppo.replay.rollout_rows import RowRules
from lppo.validation import SettingError, check_number


@dataclass(frozen=True)
class PPOConfig:
    """Settings of one RL iteration (advantage settings live in ``model.estimator``).

    Attributes:
        kl_coef: β of the KL penalty folded into the per-token reward (0 disables it and the
            reference model).
        kl_kind: KL estimator: ``k1``, ``k2`` or ``k3``.
        critic_epochs: passes of the critic over the iteration's rows (one step each by
            default).
        critic_minibatches: optimizer steps per critic epoch.
        actor_epochs: passes of the actor over the iteration's rows.
        actor_minibatches: shuffled minibatches (= optimizer steps) per actor epoch.
        critic_warmup_iterations: the first N iterations train only the critic.
        mask_truncated: overlong filtering; responses cut at ``max_new_tokens`` become invalid
            rows (never trained, counted against the drop budget).
        overlong_buffer: DAPO's soft overlong punishment: a response in the last
            ``overlong_buffer`` tokens before ``model.rollout.max_new_tokens`` loses reward
            linearly, down to ``overlong_penalty`` at the limit (0: off;
            :func:`~lppo.replay.rollout_rows.overlong_penalty`). Combine with or instead of
            ``mask_truncated``.
        overlong_penalty: the reward lost by a response of ``max_new_tokens`` tokens.
        max_abs_reward: rewards with a larger magnitude (like non-finite ones) make their row
            invalid: counted, never trained on (``null``: only non-finite rewards do).
        reward_timeout_s: seconds one ``Task.rewards`` call may take; a call still running
            then is stopped and its iteration fails (``RewardError``, then the failure
            policy) naming the limit (``null``: no limit; the default). Whatever the limit, a
            reward cannot block ``SIGTERM`` / ``SIGINT``, and anything it raises
            (``SystemExit``, ``KeyboardInterrupt`` too) fails the iteration, never the process.
        max_consecutive_skipped_steps: optimizer steps of one module skipped in a row (non-finite
            gradient norm) before the run stops with an error; every skip is warned about.
        max_skipped_steps: skipped steps over the whole run (actor and critic together) before
            the run stops (``null``: no total limit).
        transactional: an iteration commits actor and critic together or not at all: their
            parameters, optimizer and scheduler state are copied at the iteration's start and
            restored when a later phase fails (costs one copy of both modules' parameters and
            optimizer state, 3x their parameters with AdamW, for the whole run).
        max_failed_iterations: failure policy. ``0`` (default): a failed iteration stops the
            run. ``N > 0``: up to N failed iterations over the run are skipped (rows released,
            a warning and ``iteration/failed`` logged) and training goes on; the N+1-th stops
            it. Combine with ``transactional`` so a skipped iteration leaves no partial step.
        disable_dropout: set every dropout probability of the actor, critic and reference to
            0 at setup (as TRL and verl do for RL): old log-probabilities are scored without
            dropout, so with dropout left on in training the first ratio would not be 1.
        old_logprobs: where π_old log-probabilities come from: ``recompute`` (a forward pass
            of the actor over every row in the score phase), ``actor`` (the actor's first
            training epoch computes them, chunk by chunk: one forward pass fewer per
            iteration, the same numbers up to round-off; it needs no KL penalty in the
            reward, ``actor_minibatches: 1``, ``disable_dropout: true`` and no critic
            warmup, :func:`~lppo.iteration.old_logprobs.actor_epoch_obstacles`), ``engine`` (the
            rollout engine computes them while it samples: π's logits at the sampling temperature,
            before top-p / top-k, at each sampled token; one forward pass fewer, the same
            numbers up to round-off where the engine samples from the actor's own module on
            the live weights, as the default ``HFGenerateEngine`` does,
            :func:`~lppo.iteration.old_logprobs.engine_obstacles`), ``auto`` (the default: ``actor``
            where it is exact, else ``engine`` where it is exact, else ``recompute``, logged
            at setup) or ``rollout`` (the engine's sampling log-probabilities,
            ``gen_logprobs``: never exact; they equal π_old only up to the engine's round-off,
            its KV-cached pass in float32 (2e-5 in a float32 run; float32 rounding in a
            float64 one), and only with no top-p / top-k / min-new-tokens truncation;
            otherwise the PPO ratio is off-policy).
        old_values: where the critic's old values come from: ``score`` (a forward pass of the
            critic over every row in the score phase) or ``critic`` (the critic's first
            training epoch computes them, and the advantages and returns, chunk by chunk: one
            forward pass fewer per iteration, the same values up to round-off). ``critic``
            needs ``critic_minibatches: 1`` (so no step changes the critic before every row
            is valued), ``disable_dropout: true`` and an estimator with per-row targets
            (``GAE``). ``auto`` (the default): ``critic`` where those hold, else ``score``
            (logged at setup; :func:`~lppo.iteration.critic_targets.resolve_old_values`).
    """

    #: Settings a resumed run may change (budgets and the failure policy, read afresh).
    resume_safe: ClassVar[tuple[str, ...]] = (
        "max_consecutive_skipped_steps",
        "max_skipped_steps",
        "max_failed_iterations",
        "transactional",
        "reward_timeout_s",
    )

    kl_coef: float = 0.0
    kl_kind: KLKind = "k1"
    critic_epochs: int = 1
    critic_minibatches: int = 1
    actor_epochs: int = 1
    actor_minibatches: int = 1
    critic_warmup_iterations: int = 0
    mask_truncated: bool = False
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    max_abs_reward: float | None = None
    reward_timeout_s: float | None = None
    max_consecutive_skipped_steps: int = 3
    max_skipped_steps: int | None = None
    transactional: bool = False
    max_failed_iterations: int = 0
    disable_dropout: bool = True
    old_logprobs: Literal["auto", "recompute", "actor", "engine", "rollout"] = "auto"
    old_values: Literal["auto", "score", "critic"] = "auto"

    def __post_init__(self) -> None:
        """Raise ``SettingError`` naming the key, the value and the fix for a bad setting."""
        for key in ("critic_epochs", "critic_minibatches", "actor_epochs", "actor_minibatches"):
            check_number(f"model.ppo.{key}", getattr(self, key), integer=True, low=1)
        check_number(
            "model.ppo.max_consecutive_skipped_steps",
            self.max_consecutive_skipped_steps,
            integer=True,
            low=0,
        )
        check_number(
            "model.ppo.max_abs_reward",
            self.max_abs_reward,
            low=0,
            low_open=True,
            optional=True,
            fix="null: only non-finite rewards make rows invalid.",
        )
        check_number(
            "model.ppo.reward_timeout_s",
            self.reward_timeout_s,
            low=0,
            low_open=True,
            optional=True,
            fix="null: no limit on a reward call.",
        )
        check_number(
            "model.ppo.max_skipped_steps",
            self.max_skipped_steps,
            integer=True,
            low=0,
            optional=True,
            fix="null: no limit over the run.",
        )
        check_number(
            "model.ppo.max_failed_iterations",
            self.max_failed_iterations,
            integer=True,
            low=0,
            fix="0 stops the run at the first failed iteration.",
        )
        check_number("model.ppo.kl_coef", self.kl_coef, low=0, fix="0 disables the KL penalty.")
        check_number(
            "model.ppo.overlong_buffer",
            self.overlong_buffer,
            integer=True,
            low=0,
            fix="0: no overlong punishment; DAPO uses 4096 of 20480 new tokens.",
        )
        check_number("model.ppo.overlong_penalty", self.overlong_penalty, low=0)
        if self.kl_kind not in ("k1", "k2", "k3"):
            raise SettingError(f"model.ppo.kl_kind={self.kl_kind!r}; use 'k1', 'k2' or 'k3'.")
        self._check_producers()
        check_number(
            "model.ppo.critic_warmup_iterations",
            self.critic_warmup_iterations,
            integer=True,
            low=0,
        )

    def _check_producers(self) -> None:
        # Whether a producer is exact here depends on the modules too: lppo.run.plan decides.
        if self.old_logprobs != "auto" and self.old_logprobs not in PI_OLD:
            names = ", ".join(repr(n) for n in ("auto", *PI_OLD))
            raise SettingError(f"model.ppo.old_logprobs={self.old_logprobs!r}; use one of {names}.")
        if self.old_values not in ("auto", "score", "critic"):
            raise SettingError(
                f"model.ppo.old_values={self.old_values!r}; use 'auto', 'score' or 'critic'."
            )

    def resolved(
        self, key: str, exact: str, fallback: str, obstacles: list[str], why: str = ""
    ) -> PPOConfig:
        """This config with ``model.ppo.<key>: auto`` made ``exact`` or ``fallback``.

        ``exact`` (a shortcut that gives the same numbers to round-off) where ``obstacles``
        (why it would not, here) is empty, else ``fallback`` with a log line naming them. The
        choice is reported to the run plan (:func:`lppo.decisions.note`; ``why``: the reason
        for ``exact``, logged when the plan is not being built).

        Raises:
            SettingError: ``key`` set to ``exact`` explicitly despite ``obstacles``.
        """
        value = getattr(self, key)
        if value == exact and obstacles:
            raise SettingError(
                f"model.ppo.{key}={exact} would not be exact here: {'; '.join(obstacles)}. "
                f"Change those, or set {key}: {fallback} (or auto)."
            )
        if value != "auto":
            note(f"model.ppo.{key}", value, setting=value)
            return self
        chosen = fallback if obstacles else exact
        note(f"model.ppo.{key}", chosen, "; ".join(obstacles) if obstacles else why)
        return dataclasses.replace(self, **{key: chosen})

    def row_rules(self, max_new_tokens: int) -> RowRules:
        """What happens to rows when they are put: invalid rows, the overlong punishment.

        Raises:
            SettingError: ``overlong_buffer`` exceeds ``max_new_tokens``.
        """
        if self.overlong_buffer > max_new_tokens:
            raise SettingError(
                f"model.ppo.overlong_buffer={self.overlong_buffer} exceeds "
                f"model.rollout.max_new_tokens={max_new_tokens}: the buffer is the last part "
                "of the response length; lower it (DAPO: a fifth of max_new_tokens)."
            )
        return RowRules(
            self.max_abs_reward,
            self.mask_truncated,
            self.overlong_buffer,
            self.overlong_penalty,
            max_new_tokens,
        )
