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
    """Warps the scores like ``generate``'s sampling, keeps them, and adds Gumbel noise.

    Args:
        sampling: temperature, top-k and top-p (``model.rollout``).

    Attributes:
        scores: the warped scores of every step, ``float32[B, V]`` each: the distribution the
            step's token was drawn from.
    """

    def __init__(self, sampling: RolloutSettings) -> None:
        self.warpers = warpers(sampling)
        self.scores: list[torch.Tensor] = []

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
        self.scores.append(warped)
        uniform = torch.rand(warped.shape, device=warped.device)
        return warped - torch.log(-torch.log(uniform))  # type: ignore[return-value]


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
