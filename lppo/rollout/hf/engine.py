"""Rollout engine on top of Hugging Face ``generate`` (in-process, shares the actor's model)."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from functools import partial
from typing import Literal

import torch
import transformers

from lppo.decisions import note
from lppo.init_args import RecordsInitArgs
from lppo.modules.models import cache_keyword
from lppo.rollout.base import GenerationOutput, RolloutSettings
from lppo.rollout.capabilities import EngineCapabilities
from lppo.rollout.encoding import check_setup, check_tokenizer, encode_prompt, prompt_text
from lppo.rollout.hf.attention import filled_part_decode
from lppo.rollout.hf.prefill import (
    other_cache_layer,
    prefilled_cache,
    resolve_cache,
    shared_prefill_pieces,
)
from lppo.rollout.hf.sampler import GumbelSampler, gumbel_obstacles
from lppo.rollout.hf.samples import Sample, as_output, cut_samples, picked_logprobs
from lppo.rollout.hf.turns import continue_turns
from lppo.rollout.turns import TurnRequest, TurnSample
from lppo.tasks.base import Prompt
from lppo.validation import SettingError, check_number


class HFGenerateEngine(RecordsInitArgs):
    """Samples responses with ``model.generate`` (left-padded batches, KV cache).

    The engine holds the actor's model by reference, so after an optimizer step it already
    samples from the new weights; :meth:`sync_from` only records the version (or copies the
    weights when handed a different model). Sampling is reproducible: every call runs
    ``generate`` under a forked global RNG seeded with the call's ``seed``, so the caller's RNG
    is never disturbed.

    Tokens are drawn by :class:`~lppo.rollout.hf.sampler.GumbelSampler` inside ``generate``
    (its distribution, from vectorized noise instead of ``torch.multinomial``), unless the
    model's generation config asks for a warper it does not apply. Generation log-probabilities
    are those of the *processed* scores the tokens are drawn from (temperature, top-p, top-k
    and any processor of the model's generation config applied).
    Sampling settings come from :class:`~lppo.rollout.RolloutSettings` (``model.rollout``).

    Args:
        batch_size: most samples per ``generate`` call (``null``: all in one call). Results
            depend on it, as they do on the seed.
        sort_by_length: fill the ``generate`` calls with prompts sorted by token count, so each
            left-padded batch is as narrow as possible (less prefill and attention over
            padding when prompt lengths vary); samples come back in the original order.
            Results depend on it. Only matters with a ``batch_size`` below the row count.
        prepend_bos: put the tokenizer's BOS token in front of prompts that do not start with
            it (ignored when the tokenizer has no BOS token).
        chat_template: wrap each prompt as a single user turn with the tokenizer's chat
            template (``tokenizer.apply_chat_template([{"role": "user", "content": text}],
            add_generation_prompt=True)``) before encoding, for instruction-tuned models. The
            templated text is encoded without the tokenizer's own special tokens (the template
            writes those it wants), and ``prepend_bos`` then adds BOS only when the template
            did not start with it, so BOS is never doubled. Completions are decoded as before
            (special tokens skipped); the end-of-turn token must be the tokenizer's EOS.
        prefill_tokens: prefill each ``generate`` batch in length-sorted pieces of at most
            this many left-padded prompt tokens, then decode the whole batch together
            (:mod:`lppo.rollout.hf.prefill`): with prompt lengths that vary, most of the
            prefill's padding goes away, and the samples of one prompt share its prefill.
            ``null``: ``generate``'s own one-pass prefill.
            Results equal the one-pass prefill's up to float round-off (a sampled token can
            differ where two tokens' probabilities tie within it). Full-attention models only.
            ``auto`` (the default): :data:`~lppo.rollout.hf.prefill.AUTO_PREFILL_TOKENS` for a
            full-attention model, else ``null`` (logged at setup).
        cache: the KV cache ``generate`` decodes with. ``dynamic``: Hugging Face's default,
            grown by concatenation (each new token copies the whole cache); ``static``: one
            ``StaticCache`` of prompt + ``max_new_tokens`` positions, written in place, which
            is much faster for large batches and holds that full size from the start (the
            size a dynamic cache reaches when any row runs to ``max_new_tokens``; the same
            samples). With ``sdpa`` attention each decode step reads only the cache's filled
            part (:mod:`lppo.rollout.hf.attention`). Full-attention models only. ``auto``
            (the default): ``static`` for a full-attention model, else ``dynamic`` (logged
            at setup).
    """

    resume_safe = ("batch_size",)  # a resumed run may regroup its generate calls

    def __init__(
        self,
        batch_size: int | None = None,
        prepend_bos: bool = True,
        chat_template: bool = False,
        sort_by_length: bool = False,
        prefill_tokens: int | Literal["auto"] | None = "auto",
        cache: Literal["auto", "dynamic", "static"] = "auto",
    ) -> None:
        check_number(
            "model.engine.init_args.batch_size",
            batch_size,
            integer=True,
            low=1,
            optional=True,
            fix="null generates all of an iteration's prompts in one batch.",
        )
        if prefill_tokens != "auto":
            check_number(
                "model.engine.init_args.prefill_tokens",
                prefill_tokens,
                integer=True,
                low=1,
                optional=True,
                fix="null prefills each generate batch in one pass; auto picks for the model.",
            )
        if cache not in ("auto", "dynamic", "static"):
            raise SettingError(
                f"model.engine.init_args.cache={cache!r} is not a KV cache kind; "
                "use 'auto', 'dynamic' or 'static'"
            )
        self.batch_size = batch_size
        self.prefill_tokens = prefill_tokens
        self.prefill_budget: int | None = None  # prefill_tokens resolved at setup
        self.cache = cache
        self.cache_kind: Literal["auto", "dynamic", "static"] = cache  # resolved at setup
        self.prepend_bos = prepend_bos
        self.chat_template = chat_template
        self.sort_by_length = sort_by_length
        self.weights_version = 0
        #: Return π's own log-probs with every sample (``GenerationOutput.policy_logprobs``);
        #: set through :meth:`capabilities` when the run plan picks ``old_logprobs: engine``.
        self.return_policy_logprobs = False
        self._model: transformers.PreTrainedModel | None = None
        self._tokenizer: transformers.PreTrainedTokenizerBase | None = None
        self.sampling = RolloutSettings()
        #: Sample with :class:`~lppo.rollout.hf.sampler.GumbelSampler` (resolved at setup).
        self.gumbel = True

    @property
    def model(self) -> transformers.PreTrainedModel:
        """The causal LM the engine samples from."""
        if self._model is None:
            raise RuntimeError("HFGenerateEngine used before setup(policy, tokenizer, sampling).")
        return self._model

    @property
    def tokenizer(self) -> transformers.PreTrainedTokenizerBase:
        """The policy's tokenizer."""
        if self._tokenizer is None:
            raise RuntimeError("HFGenerateEngine used before setup(policy, tokenizer, sampling).")
        return self._tokenizer

    def setup(
        self,
        policy: torch.nn.Module,
        tokenizer: transformers.PreTrainedTokenizerBase,
        sampling: RolloutSettings,
    ) -> None:
        """Share ``policy`` (not a copy) and take the sampling settings.

        Raises:
            ValueError: the tokenizer has no EOS token, ``chat_template`` is set and the
                tokenizer has no chat template, or ``prefill_tokens`` / ``cache: static`` is
                set for a model with a layer that is not full attention.
        """
        check_tokenizer(tokenizer, self.chat_template)
        self.cache_kind, self.prefill_budget = resolve_cache(
            policy, self.cache, self.prefill_tokens
        )
        self._model = policy  # type: ignore[assignment]
        self._tokenizer = tokenizer
        self.sampling = sampling
        obstacles = gumbel_obstacles(policy.generation_config)  # type: ignore[arg-type]
        self.gumbel = not obstacles
        reason = f"the model's generation config sets {', '.join(obstacles)}"
        note(
            "HFGenerateEngine sampler",
            "torch.multinomial" if obstacles else "gumbel",
            reason if obstacles else "",
            text=f"HFGenerateEngine samples with generate's torch.multinomial: {reason} "
            "(lppo.rollout.hf.sampler)"
            if obstacles
            else "",
        )
        self.eos_token_id = int(tokenizer.eos_token_id)
        pad = tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else self.eos_token_id)

    def capabilities(self) -> EngineCapabilities:
        """π's own log-probs with every sample (``model.ppo.old_logprobs: engine``); encoding.

        How it encodes prompts is known before setup: a multi-turn run measures its openings.
        """
        return EngineCapabilities(
            policy_logprob_obstacles=self.policy_logprob_obstacles,
            enable_policy_logprobs=self._enable_policy_logprobs,
            encode_prompt=partial(
                encode_prompt, prepend_bos=self.prepend_bos, chat_template=self.chat_template
            ),
            check_setup=partial(check_setup, self.chat_template),
        )

    def _enable_policy_logprobs(self) -> None:
        self.return_policy_logprobs = True

    def policy_logprob_obstacles(
        self, policy: torch.nn.Module, dtype: torch.dtype | None = None
    ) -> list[str]:
        """Why this engine's log-probs of π would not be ``policy``'s π_old (empty: they are).

        The engine samples from ``policy`` itself (the same module, so the same weights), and
        ``generate``'s raw logits at the sampling temperature, before top-p, top-k or any other
        processor, are the log-probabilities the actor scores, up to float round-off. That
        holds for full-attention models (a sliding-window layer counts its window over the
        left-padded batch, which the trainer does not pad) computing in at most float32
        (``generate`` takes each step's logits in float32), whether ``policy`` is float64 now or
        the run's precision (``dtype``) will make it so.
        """
        reasons = []
        if (layer := other_cache_layer(policy)) is not None:
            reasons.append(f"the policy has a {layer} layer (only full attention is exact)")
        # dtype: what the trainer converts the policy to (64-true), known before it does.
        if dtype == torch.float64 or any(p.dtype == torch.float64 for p in policy.parameters()):
            reasons.append("generate rounds the float64 policy's logits to float32")
        return reasons

    def sync_from(self, policy: torch.nn.Module, version: int) -> None:
        """Sample from ``policy``'s weights (copied in when it is not the engine's model)."""
        if policy is not self.model:
            self.model.load_state_dict(policy.state_dict())
        self.weights_version = version

    def close(self) -> None:
        """Nothing to release: the engine started nothing and samples from the actor's model.

        The model stays bound, so the policy can still be sampled (evaluated) after the run.
        """

    # -- generation ------------------------------------------------------------------------

    def prompt_text(self, text: str) -> str:
        """The text that is encoded for a prompt (chat-templated when ``chat_template``)."""
        return prompt_text(self.tokenizer, text, self.chat_template)

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a prompt (see :func:`encode_prompt`)."""
        return encode_prompt(self.tokenizer, text, self.prepend_bos, self.chat_template)

    def generation_config(self, greedy: bool = False) -> transformers.GenerationConfig:
        """The ``GenerationConfig`` passed to ``generate``.

        ``generate`` samples only when the engine cannot (:attr:`gumbel` off); otherwise it
        runs greedy, and :class:`~lppo.rollout.hf.sampler.GumbelSampler` makes its argmax the
        sample.
        """
        kwargs: dict[str, object] = {}
        sampling = self.sampling
        multinomial = not greedy and not self.gumbel
        if multinomial:
            kwargs = {
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "top_k": sampling.top_k,
            }
        if sampling.min_new_tokens > 0:
            kwargs["min_new_tokens"] = sampling.min_new_tokens
        return transformers.GenerationConfig(
            do_sample=multinomial,
            max_new_tokens=sampling.max_new_tokens,
            num_beams=1,
            # ignore_eos: no stop token, so every row runs to max_new_tokens. An empty list,
            # not None: generate fills a None from the model's generation_config (its EOS).
            eos_token_id=[] if sampling.ignore_eos else self.eos_token_id,
            pad_token_id=self.pad_token_id,
            return_dict_in_generate=True,
            output_scores=greedy or multinomial,  # a GumbelSampler records its draws itself
            output_logits=self.return_policy_logprobs,
            use_cache=True,
            **kwargs,
        )

    def continue_turns(
        self, requests: Sequence[TurnRequest], greedy: bool = False
    ) -> list[TurnSample]:
        """One turn per request, each from its own seed.

        See :func:`~lppo.rollout.hf.turns.continue_turns`: ``batch_size`` and
        ``sort_by_length`` apply; ``prefill_tokens`` and ``cache`` do not.
        """
        return continue_turns(
            self.model,
            requests,
            self.sampling,
            (self.eos_token_id, self.pad_token_id),
            self.batch_size,
            self.sort_by_length,
            greedy,
        )

    @torch.no_grad()
    def generate(
        self,
        prompts: list[Prompt],
        samples_per_prompt: int = 1,
        seed: int = 0,
        greedy: bool = False,
    ) -> GenerationOutput:
        """Sample ``samples_per_prompt`` responses to each prompt.

        Args:
            prompts: the prompts to answer.
            samples_per_prompt: responses per prompt (rows of a prompt are contiguous).
            seed: seed of this call (the same seed gives the same samples).
            greedy: take the argmax instead of sampling; ``gen_logprobs`` are then those of
                the model's unscaled distribution.

        Returns:
            The samples (on CPU).
        """
        if samples_per_prompt < 1:
            raise ValueError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}")
        encoded = [self.encode_prompt(p.text) for p in prompts]
        rows = [(i, ids) for i, ids in enumerate(encoded) for _ in range(samples_per_prompt)]
        order = list(range(len(rows)))
        if self.sort_by_length:  # stable: rows of one prompt stay together
            order.sort(key=lambda r: len(rows[r][1]))
        step = self.batch_size or max(len(rows), 1)
        device = self.model.device
        config = self.generation_config(greedy)
        samples: list[Sample] = []
        was_training = self.model.training
        self.model.eval()
        rng_devices = [device] if device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=rng_devices):
                torch.manual_seed(seed)
                for start in range(0, len(rows), step):
                    batch = [rows[r][1] for r in order[start : start + step]]
                    sampler = None if greedy or not self.gumbel else GumbelSampler(self.sampling)
                    samples += self._generate_batch(batch, config, device, sampler)
        finally:
            self.model.train(was_training)
        placed: list[Sample | None] = [None] * len(rows)
        for r, sample in zip(order, samples, strict=True):
            placed[r] = sample
        return as_output([x for x in placed if x is not None], rows)

    def _generate_batch(
        self,
        batch: list[list[int]],
        config: transformers.GenerationConfig,
        device: torch.device,
        sampler: GumbelSampler | None,
    ) -> list[Sample]:
        """Generate for one left-padded batch of prompt ids (one row per sample).

        ``sampler``: draws the tokens (``config`` is then greedy); ``None``: ``config`` says.
        """
        width = max(len(ids) for ids in batch)
        input_ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.int64)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.int64)
        for r, ids in enumerate(batch):
            input_ids[r, width - len(ids) :] = torch.tensor(ids, dtype=torch.int64)
            attention_mask[r, width - len(ids) :] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        kwargs = {}
        static = self.cache_kind == "static"
        if self.prefill_budget is not None or static:
            pieces, sources = shared_prefill_pieces(batch, self.prefill_budget)
            length = width + config.max_new_tokens if static else None
            cache = prefilled_cache(self.model, input_ids, attention_mask, pieces, length, sources)
            kwargs[cache_keyword(self.model)] = cache
        if sampler is not None:
            kwargs["logits_processor"] = transformers.LogitsProcessorList([sampler])
        with filled_part_decode(self.model) if static else nullcontext():
            result = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                generation_config=config,
                # Each rank generates its own rows with full weights (under FSDP, inside the
                # layout's gathered()); HF would otherwise sync ranks per token for FSDP modules.
                synced_gpus=False,
                **kwargs,
            )
        tokens = result.sequences[:, width:].cpu()
        # generate may run a step past the last token and drop it (a deferred stop check)
        eos, ignore_eos = self.eos_token_id, self.sampling.ignore_eos
        if sampler is None:
            if len(result.scores) != tokens.shape[1]:
                raise RuntimeError(f"{len(result.scores)} score steps for {tokens.shape[1]} tokens")
            sampled = picked_logprobs(result.scores, tokens)
        else:
            sampled = sampler.picked(tokens, None if ignore_eos else eos)
        policy = None
        if self.return_policy_logprobs:  # π at the temperature the actor scores with
            policy = picked_logprobs(result.logits, tokens, self.sampling.temperature)
        logprobs = (sampled, policy)
        return cut_samples(batch, tokens, logprobs, self.tokenizer, eos, ignore_eos)
