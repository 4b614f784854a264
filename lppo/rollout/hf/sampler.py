"""Sampling inside ``generate`` by the Gumbel-max trick (``HFGenerateEngine``).

``generate`` samples each token with ``torch.multinomial``, whose one-sample path draws one
exponential variate per vocabulary entry, one element after another on a CPU: 6-7 ms a step
at 256 rows of a 1,024-token vocabulary, as long as the step's attention, and 49 times that
for a 49,152-token vocabulary. The Gumbel-max trick draws the same distribution from
vectorized operations: with ``U`` uniform on (0, 1), ``argmax(scores - log(-log U))`` is a
sample of ``softmax(scores)``.

:class:`GumbelSampler` is the last logits processor of a ``generate`` call run in its greedy
mode (``do_sample=False``), so ``generate``'s argmax takes the sample. It applies the sampling
warpers itself, in ``generate``'s order (temperature, top-k, top-p), after ``generate``'s own
processors (minimum length, repetition penalty, ...), and keeps the warped scores: the
distribution each token is drawn from, whose log-probabilities the engine reports. The samples
follow ``generate``'s sampling distribution exactly; they come from another random stream
(``torch.rand`` under the engine's seeded RNG), so a seed gives other samples than
``torch.multinomial`` would, and the same ones on every run.

A model whose generation config asks for another warper (min-p, typical-p, top-h, epsilon or
eta cutoffs, watermarking, renormalized logits) keeps ``generate``'s own sampling
(:func:`gumbel_obstacles`).
"""

from __future__ import annotations

import torch
import transformers
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from lppo.rollout.base import RolloutSettings


def warpers(sampling: RolloutSettings) -> LogitsProcessorList:
    """The sampling warpers of ``model.rollout``, in ``generate``'s order and with its rules.

    Temperature (unless 1), top-k (unless 0), top-p (unless 1): ``transformers``' own warper
    classes, each keeping at least one token.
    """
    out = LogitsProcessorList()
    if sampling.temperature != 1.0:
        out.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k > 0:
        out.append(TopKLogitsWarper(top_k=sampling.top_k, min_tokens_to_keep=1))
    if sampling.top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=sampling.top_p, min_tokens_to_keep=1))
    return out


class GumbelSampler(LogitsProcessor):
    """Warps the scores like ``generate``'s sampling, adds Gumbel noise, keeps each draw.

    ``generate`` runs greedy over the scores this returns, so each step's token is their
    argmax: the sampler records that token and its log-probability under the warped
    distribution (``float32[B]`` per step), never the step's ``[B, V]`` scores (256 rows ×
    64 steps × 49,152 entries would be 3.2 GB).

    Args:
        sampling: temperature, top-k and top-p (``model.rollout``).

    Attributes:
        tokens: each step's drawn tokens, ``int64[B]``.
        logprobs: their log-probabilities under the warped scores, ``float32[B]``.
    """

    def __init__(self, sampling: RolloutSettings) -> None:
        self.warpers = warpers(sampling)
        self.tokens: list[torch.Tensor] = []
        self.logprobs: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """Scores whose argmax is a sample of ``softmax(warped scores)``.

        Args:
            input_ids: ``int64[B, T]``, the sequences so far.
            scores: ``float32[B, V]``, the step's scores after ``generate``'s processors.

        Returns:
            ``float32[B, V]``: the warped scores plus standard Gumbel noise. A uniform draw of
            exactly 0 gives ``-inf`` (that token is not drawn, probability ``2**-24``); a
            token the warpers removed stays at ``-inf``.
        """
        warped = self.warpers(input_ids, scores)
        uniform = torch.rand(warped.shape, device=warped.device)
        noised = warped - torch.log(-torch.log(uniform))
        token = noised.argmax(dim=-1)
        logp = torch.log_softmax(warped.float(), dim=-1).gather(1, token[:, None]).squeeze(1)
        self.tokens.append(token)
        self.logprobs.append(logp)
        return noised  # type: ignore[return-value]

    def picked(self, tokens: torch.Tensor, eos_token_id: int | None) -> torch.Tensor:
        """The recorded log-probabilities of ``generate``'s tokens, ``float32[B, T]`` on CPU.

        Args:
            tokens: ``int64[B, T]``, the tokens ``generate`` returned.
            eos_token_id: the stop token (``None``: rows never stop early).

        Raises:
            RuntimeError: a token before its row's first EOS is not the step's draw (a
                processor ran after the sampler); after it, ``generate`` pads finished rows.
        """
        t = tokens.shape[1]
        if len(self.tokens) < t:
            raise RuntimeError(f"{len(self.tokens)} sampler steps for {t} tokens")
        drawn = torch.stack(self.tokens[:t], dim=1).cpu()
        logprobs = torch.stack(self.logprobs[:t], dim=1).cpu()
        tokens = tokens.cpu()
        differ = drawn != tokens
        if eos_token_id is not None:
            stopped = (tokens == eos_token_id).int().cumsum(dim=1)
            differ &= (stopped - (tokens == eos_token_id).int()) == 0  # up to the first EOS
        if bool(differ.any()):
            raise RuntimeError(
                "generate's tokens are not the GumbelSampler's draws: a logits processor ran "
                "after it"
            )
        return logprobs


def gumbel_obstacles(config: transformers.GenerationConfig) -> list[str]:
    """The settings of a model's generation config that :class:`GumbelSampler` does not apply.

    ``generate`` fills every field its caller leaves unset from the model's generation config,
    so a warper set there would shape the samples; with one of these, the engine samples with
    ``generate``'s own ``torch.multinomial``.

    Args:
        config: the model's ``generation_config``.

    Returns:
        ``key=value`` of each such setting (empty: the sampler applies).
    """
    found = []
    for key, inert in (("min_p", None), ("top_h", None), ("watermarking_config", None)):
        if getattr(config, key, None) is not inert:
            found.append(f"{key}={getattr(config, key)!r}")
    for key in ("typical_p", "epsilon_cutoff", "eta_cutoff"):
        value = getattr(config, key, None)
        if value is not None and 0.0 < value < 1.0:
            found.append(f"{key}={value!r}")
    if getattr(config, "renormalize_logits", None) is True:
        found.append("renormalize_logits=True")
    return found
