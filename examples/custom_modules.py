"""User code extending lppo by subclassing: a custom actor loss, task and critic head.

Nothing here touches lppo's internals: each class overrides the documented extension points
and is selected from ``custom.yaml`` by ``class_path`` (see ``README.md``).

* :class:`TrustRegionActor` adds a penalty on the KL from the rollout (old) policy to the
  clipped PPO loss and reports it as the extra diagnostic ``actor/trust_kl``.
* :class:`MaxDigitTask` is a task written from scratch: answer the largest digit of a string.
* :class:`MLPHeadCritic` replaces the critic's linear value head by a two-layer MLP.
"""

from __future__ import annotations

import random
from typing import Any

import torch
from torch import nn

from lppo.modules import ActorModule, CriticModule, shifted_logprobs
from lppo.stats import SumStats
from lppo.tasks import Prompt, Task
from lppo.types import Chunk


class TrustRegionActor(ActorModule):
    """PPO-clip plus ``trust_coef · KL(old ‖ new)`` per token (the k3 estimator).

    The penalty is zero on the first minibatch of an iteration (new = old) and pulls later
    epochs back towards the policy that sampled the rollout.

    Args:
        trust_coef: weight of the KL penalty (0 gives plain PPO, still logging the KL).
        **kwargs: every :class:`~lppo.modules.ActorModule` argument (``model``, ``lr``, ...).
    """

    def __init__(self, trust_coef: float = 0.1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if trust_coef < 0:
            raise ValueError(f"actor.trust_coef={trust_coef} must be >= 0.")
        self.trust_coef = trust_coef
        self._last_logits: torch.Tensor | None = None

    def logits(self, chunk: Chunk) -> torch.Tensor:
        """The base logits, remembered so :meth:`chunk_loss` needs no second forward pass."""
        out = super().logits(chunk)
        if torch.is_grad_enabled():  # training forward (not the no-grad scoring pass)
            self._last_logits = out
        return out

    def chunk_loss(self, chunk: Chunk, sums: SumStats) -> torch.Tensor:
        """The base per-token loss plus the KL penalty; adds the ``trust_kl_sum`` diagnostic."""
        loss = super().chunk_loss(chunk, sums)  # calls self.logits(chunk) once
        assert self._last_logits is not None and chunk.old_logprobs is not None
        logprobs, _ = shifted_logprobs(self._last_logits, chunk.input_ids)
        self._last_logits = None
        log_ratio = logprobs - chunk.old_logprobs.to(logprobs.dtype)
        kl = torch.expm1(log_ratio) - log_ratio  # k3 estimate of KL(old || new), >= 0
        mask = chunk.response_mask
        kl = torch.where(mask, kl, torch.zeros_like(kl))
        # Diagnostics are sums over this chunk's valid tokens; metrics() divides the global sum.
        sums.add("trust_kl_sum", (kl.detach() * mask).sum())
        return loss + self.trust_coef * kl

    def metrics(self, sums: SumStats) -> dict[str, float]:
        """The base diagnostics plus ``trust_kl`` (token mean), logged as ``actor/trust_kl``."""
        out = super().metrics(sums)
        out["trust_kl"] = sums.get("trust_kl_sum") / max(sums.get("valid_tokens"), 1.0)
        return out


class MaxDigitTask(Task):
    """Answer the largest digit of a random digit string: ``"3172="`` -> ``"7"``.

    Reward: 1.0 for the exact answer; otherwise, when the completion starts with a digit,
    ``partial_weight * (1 - |digit - answer| / 9) / len(completion)`` (closer digits and
    shorter answers earn more); anything else 0.

    Args:
        min_length: shortest digit string.
        max_length: longest digit string.
        partial_weight: the largest score a wrong digit can earn, in ``[0, 1)``.
    """

    name = "max_digit"

    def __init__(self, min_length: int = 2, max_length: int = 4, partial_weight: float = 0.5):
        if not 1 <= min_length <= max_length:
            raise ValueError(f"need 1 <= min_length <= max_length, got {min_length}, {max_length}")
        if not 0.0 <= partial_weight < 1.0:
            raise ValueError(f"partial_weight must be in [0, 1), got {partial_weight}")
        self.min_length = min_length
        self.max_length = max_length
        self.partial_weight = partial_weight

    def sample_prompts(self, n: int, generator: random.Random) -> list[Prompt]:
        """Draw ``n`` digit strings and their largest digit."""
        prompts = []
        for _ in range(n):
            length = generator.randint(self.min_length, self.max_length)
            digits = "".join(generator.choice("0123456789") for _ in range(length))
            prompts.append(Prompt(text=digits + "=", answer=max(digits)))
        return prompts

    def reward(self, prompt: Prompt, completion: str) -> float:
        """Exact match, or partial credit by digit distance and length (see the class)."""
        if completion == prompt.answer:
            return 1.0
        if not completion or not completion[0].isdigit():
            return 0.0
        distance = abs(int(completion[0]) - int(prompt.answer))
        return self.partial_weight * (1.0 - distance / 9.0) / len(completion)

    def vocabulary(self) -> str:
        """Digits and the separator."""
        return "0123456789="

    def max_prompt_length(self) -> int:
        """Longest prompt: ``max_length`` digits plus ``=``."""
        return self.max_length + 1


class MLPHeadCritic(CriticModule):
    """A critic whose value head is ``Linear → Tanh → Linear`` instead of one ``Linear``.

    Args:
        head_hidden: width of the MLP head's hidden layer.
        **kwargs: every :class:`~lppo.modules.CriticModule` argument (``backbone``, ``lr``, ...).
    """

    def __init__(self, head_hidden: int = 32, **kwargs: Any) -> None:
        # Set before super().__init__: given a backbone module, the base builds the head there.
        self.head_hidden = head_hidden
        super().__init__(**kwargs)

    def make_value_head(self, hidden_size: int) -> nn.Module:
        """``Linear(hidden, head_hidden) → Tanh → Linear(head_hidden, 1)``, seeded."""
        first = nn.Linear(hidden_size, self.head_hidden)
        last = nn.Linear(self.head_hidden, 1)
        gen = torch.Generator().manual_seed(self.head_seed)
        with torch.no_grad():
            first.weight.copy_(torch.randn(first.weight.shape, generator=gen) / hidden_size**0.5)
            first.bias.zero_()
            last.weight.copy_(torch.randn(last.weight.shape, generator=gen) * self.head_init_std)
            last.bias.zero_()
        return nn.Sequential(first, nn.Tanh(), last)
