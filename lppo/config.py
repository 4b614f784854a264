"""``PPOConfig``: the algorithm's settings, validated eagerly with actionable messages."""

from __future__ import annotations

from dataclasses import dataclass

from lppo.algorithms.kl import KLKind


@dataclass(frozen=True)
class PPOConfig:
    """Settings of one RL iteration.

    Attributes:
        gamma: discount γ of GAE.
        lam: GAE λ of the actor's advantages.
        lam_returns: GAE λ of the critic's targets (``None``: same as ``lam``).
        kl_coef: β of the KL penalty folded into the per-token reward (0 disables it and the
            reference model).
        kl_kind: KL estimator: ``k1``, ``k2`` or ``k3``.
        whiten_advantages: whiten advantages with mean / std over all valid tokens of the
            iteration.
        critic_epochs: passes of the critic over the iteration's rows (one step each by
            default).
        critic_minibatches: optimizer steps per critic epoch.
        actor_epochs: passes of the actor over the iteration's rows.
        actor_minibatches: shuffled minibatches (= optimizer steps) per actor epoch.
        critic_warmup_iterations: the first N iterations train only the critic.
        mask_truncated: overlong filtering; responses cut at ``max_new_tokens`` become invalid
            rows (never trained, counted against the drop budget).
    """

    gamma: float = 1.0
    lam: float = 0.95
    lam_returns: float | None = None
    kl_coef: float = 0.0
    kl_kind: KLKind = "k1"
    whiten_advantages: bool = True
    critic_epochs: int = 1
    critic_minibatches: int = 1
    actor_epochs: int = 1
    actor_minibatches: int = 1
    critic_warmup_iterations: int = 0
    mask_truncated: bool = False

    def validate(self, prefix: str = "ppo") -> None:
        """Raise ``ValueError`` naming the key, the value and the fix for a bad setting."""
        for key in ("critic_epochs", "critic_minibatches", "actor_epochs", "actor_minibatches"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{prefix}.{key}={value!r} must be an integer >= 1.")
        for key in ("gamma", "lam"):
            value = getattr(self, key)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{prefix}.{key}={value} must lie in [0, 1].")
        if self.lam_returns is not None and not 0.0 <= self.lam_returns <= 1.0:
            raise ValueError(f"{prefix}.lam_returns={self.lam_returns} must lie in [0, 1] or null.")
        if self.kl_coef < 0:
            raise ValueError(f"{prefix}.kl_coef={self.kl_coef} must be >= 0 (0 disables it).")
        if self.kl_kind not in ("k1", "k2", "k3"):
            raise ValueError(f"{prefix}.kl_kind={self.kl_kind!r}; use 'k1', 'k2' or 'k3'.")
        if self.critic_warmup_iterations < 0:
            raise ValueError(
                f"{prefix}.critic_warmup_iterations={self.critic_warmup_iterations} must be >= 0."
            )
