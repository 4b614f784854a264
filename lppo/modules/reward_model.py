"""``RewardModel``: a learned scalar reward, scored chunk by chunk in the score phase."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from lppo.init_args import RecordsInitArgs
from lppo.modules.tail import TrimSetting, resolve_trim, trimmed
from lppo.parallel import SINGLE, ProcessGroup
from lppo.stats import Moments
from lppo.types import Chunk
from lppo.validation import check_number

if TYPE_CHECKING:
    from lppo.modules.models import HFCausalLM


class RewardModel(RecordsInitArgs, nn.Module):
    """A frozen sequence classifier whose score joins (or replaces) the task's reward.

    Each row is scored once, in the streamed score phase, from the classifier's ``score`` head
    applied to the hidden state of the row's last real token (right padding). The row's reward
    becomes ``task_weight · r_task + weight · ŝ`` where ``ŝ`` is the score, normalized with a
    running mean and standard deviation over every row scored so far when ``normalize`` is on
    (updated with the iteration's scores first, as OpenRLHF does); the running moments are
    buffers, so checkpoints keep them.

    Args:
        model: a Hugging Face sequence classifier (its ``base_model`` and ``score`` head are
            used), or an :class:`~lppo.modules.models.HFCausalLM` spec built with
            ``build_classifier``.
        weight: weight of the (normalized) model score.
        task_weight: weight of the task's verifiable reward (0: the model's score alone).
        normalize: normalize scores with running moments across iterations.
        clip: clip the normalized score to ``[−clip, clip]`` (``null``: no clip).
        trim_prompt: run the classifier's last block only from the chunk's earliest last real
            token on (:mod:`lppo.modules.tail`; Llama / Mistral / Qwen2 models): the same scores to
            round-off, less work per chunk. ``auto`` (the default): on wherever it applies,
            off with a log line for other models (:func:`~lppo.modules.tail.resolve_trim`).
    """

    def __init__(
        self,
        model: HFCausalLM | nn.Module,
        weight: float = 1.0,
        task_weight: float = 1.0,
        normalize: bool = True,
        clip: float | None = None,
        trim_prompt: TrimSetting = "auto",
    ) -> None:
        super().__init__()
        key = "model.reward_model.init_args"
        check_number(f"{key}.weight", weight, fix="It scales the reward model's score.")
        check_number(f"{key}.task_weight", task_weight, fix="It scales the task's reward.")
        check_number(f"{key}.clip", clip, low=0, low_open=True, optional=True)
        if not isinstance(model, nn.Module):  # a spec, built in configure_model
            model.validate(f"{key}.model.init_args")
        self.weight = weight
        self.task_weight = task_weight
        self.normalize = normalize
        self.clip = clip
        #: The ``trim_prompt`` argument; :attr:`trim_prompt` is what it resolved to at setup.
        self.trim_prompt_setting: TrimSetting = trim_prompt
        self.trim_prompt = False
        given = isinstance(model, nn.Module)
        self.spec: HFCausalLM | None = None if given else model  # type: ignore[assignment]
        self.classifier: nn.Module | None = model if given else None  # type: ignore[assignment]
        # count, mean, M2 of every score seen (float64, checkpointed with the module).
        self.register_buffer("running", torch.zeros(3, dtype=torch.float64))

    def configure_model(
        self,
        vocab_size: int | None = None,
        pad_token_id: int | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
    ) -> None:
        """Build the classifier from its spec (no-op when a module was given); freeze it."""
        if self.classifier is None:
            if self.spec is None or vocab_size is None:
                raise RuntimeError("reward model spec needs the vocabulary to be built.")
            self.classifier = self.spec.build_classifier(
                vocab_size, pad_token_id, bos_token_id, eos_token_id
            )
        key = "model.reward_model.init_args.trim_prompt"
        self.trim_prompt = resolve_trim(self.trim_prompt_setting, self.classifier.base_model, key)
        self.classifier.requires_grad_(False)
        self.classifier.eval()

    @torch.no_grad()
    def score(self, chunk: Chunk) -> torch.Tensor:
        """Raw scores ``float64[B]`` of the chunk's rows (last real token's hidden state)."""
        if self.classifier is None:
            raise RuntimeError("reward model not built: call configure_model() first.")
        device = next(self.classifier.parameters()).device
        chunk = chunk.to(device)
        last = chunk.attention_mask.sum(dim=1) - 1
        start = int(last.min()) if self.trim_prompt and len(last) else 0
        body = self.classifier.base_model
        with trimmed(body, start):
            out = body(input_ids=chunk.input_ids, attention_mask=chunk.attention_mask.long())
        hidden = out.last_hidden_state[torch.arange(len(last), device=device), last - start]
        return self.classifier.score(hidden).squeeze(-1).to(torch.float64).cpu()

    def combine(
        self, task_rewards: torch.Tensor, scores: torch.Tensor, group: ProcessGroup = SINGLE
    ) -> torch.Tensor:
        """The rows' rewards ``task_weight·r + weight·ŝ`` (``float64[n]``); updates the moments.

        Args:
            task_rewards: ``float[n]`` verifiable rewards of this rank's valid rows.
            scores: ``float64[n]`` raw model scores of the same rows.
            group: the ranks holding the iteration's other rows (the running moments take
                every rank's scores, so every rank normalizes alike).
        """
        shaped = scores.to(torch.float64)
        if self.normalize:
            moments = Moments(*(float(v) for v in self.running))
            iteration = Moments()
            iteration.update(shaped)
            iteration.all_reduce(group)
            moments.merge(iteration)
            self.running.copy_(
                torch.tensor([moments.count, moments.mu, moments.m2], dtype=torch.float64)
            )
            shaped = (shaped - moments.mean) / math.sqrt(moments.var + 1e-8)
        if self.clip is not None:
            shaped = shaped.clamp(-self.clip, self.clip)
        return self.task_weight * task_rewards.to(torch.float64) + self.weight * shaped
