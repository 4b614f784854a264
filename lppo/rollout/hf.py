"""Rollout engine on top of Hugging Face ``generate`` (in-process, shares the actor's model)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import transformers

from lppo.rollout.base import GenerationOutput
from lppo.tasks.base import Prompt


@dataclass
class _Sample:
    """One generated sample (see :class:`GenerationOutput` for the fields)."""

    input_ids: torch.Tensor
    response_mask: torch.Tensor
    gen_logprobs: torch.Tensor
    completion: str
    truncated: bool


class HFGenerateEngine:
    """Samples responses with ``model.generate`` (left-padded batches, KV cache).

    The engine holds the actor's model by reference, so after an optimizer step it already
    samples from the new weights (:meth:`sync_from` / :meth:`update_weights` exist for engines
    that hold a copy). Sampling is reproducible: every call draws its seed from a
    ``torch.Generator`` seeded with ``seed`` (or uses the ``seed`` given to the call), and runs
    ``generate`` under a forked global RNG, so the caller's RNG is never disturbed.

    Generation log-probabilities are those of the *processed* scores ``generate`` samples from
    (temperature, top-p, top-k and any processor of the model's generation config applied).

    Args:
        model: the causal LM to sample from (shared, not copied).
        tokenizer: tokenizer of ``model``; must define ``eos_token_id``.
        max_new_tokens: longest response, EOS included.
        temperature: sampling temperature (> 0).
        top_p: nucleus-sampling mass in ``(0, 1]``; 1 disables it.
        top_k: keep the ``top_k`` most likely tokens; 0 disables it.
        seed: seed of the engine's generator of per-call seeds.
        batch_size: most samples per ``generate`` call (``None``: all in one call). Results
            depend on it, as they do on the seed.
        prepend_bos: put ``tokenizer.bos_token_id`` in front of prompts that do not start with
            it (ignored when the tokenizer has no BOS token).
    """

    def __init__(
        self,
        model: transformers.PreTrainedModel,
        tokenizer: transformers.PreTrainedTokenizerBase,
        max_new_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        batch_size: int | None = None,
        prepend_bos: bool = True,
    ) -> None:
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer must define an eos token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.batch_size = batch_size
        self.prepend_bos = prepend_bos
        self.eos_token_id = int(tokenizer.eos_token_id)
        pad = tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else self.eos_token_id)
        self.generator = torch.Generator().manual_seed(seed)

    # -- weights ---------------------------------------------------------------------------

    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy ``state_dict`` into the engine's model (strict)."""
        self.model.load_state_dict(dict(state_dict))

    def sync_from(self, model: torch.nn.Module) -> None:
        """Sample from ``model``'s weights from now on (no-op when it is the engine's model)."""
        if model is not self.model:
            self.update_weights(model.state_dict())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Sampler state to checkpoint (the generator of per-call seeds)."""
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.generator.set_state(state["generator"])

    # -- generation ------------------------------------------------------------------------

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a prompt (with BOS in front when the tokenizer has one).

        Raises:
            ValueError: if the prompt encodes to no token at all.
        """
        ids = list(self.tokenizer(text, add_special_tokens=True)["input_ids"])
        bos = self.tokenizer.bos_token_id
        if self.prepend_bos and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, int(bos))
        if not ids:
            raise ValueError(f"prompt {text!r} encodes to no token")
        return ids

    def generation_config(self, greedy: bool = False) -> transformers.GenerationConfig:
        """The ``GenerationConfig`` passed to ``generate``."""
        kwargs: dict[str, object] = {}
        if not greedy:
            kwargs = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}
        return transformers.GenerationConfig(
            do_sample=not greedy,
            max_new_tokens=self.max_new_tokens,
            num_beams=1,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            return_dict_in_generate=True,
            output_scores=True,
            use_cache=True,
            **kwargs,
        )

    @torch.no_grad()
    def generate(
        self,
        prompts: list[Prompt],
        samples_per_prompt: int = 1,
        seed: int | None = None,
        greedy: bool = False,
    ) -> GenerationOutput:
        """Sample ``samples_per_prompt`` responses to each prompt.

        Args:
            prompts: the prompts to answer.
            samples_per_prompt: responses per prompt (rows of a prompt are contiguous).
            seed: seed of this call; ``None`` draws one from the engine's generator.
            greedy: take the argmax instead of sampling; ``gen_logprobs`` are then those of
                the model's unscaled distribution.

        Returns:
            The samples (on CPU).
        """
        if samples_per_prompt < 1:
            raise ValueError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}")
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self.generator))
        encoded = [self.encode_prompt(p.text) for p in prompts]
        rows = [(i, ids) for i, ids in enumerate(encoded) for _ in range(samples_per_prompt)]
        step = self.batch_size or max(len(rows), 1)
        device = self.model.device
        config = self.generation_config(greedy)
        samples: list[_Sample] = []
        was_training = self.model.training
        self.model.eval()
        rng_devices = [device] if device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=rng_devices):
                torch.manual_seed(seed)
                for start in range(0, len(rows), step):
                    batch = [ids for _, ids in rows[start : start + step]]
                    samples += self._generate_batch(batch, config, device)
        finally:
            self.model.train(was_training)
        return GenerationOutput(
            input_ids=[x.input_ids for x in samples],
            response_mask=[x.response_mask for x in samples],
            gen_logprobs=[x.gen_logprobs for x in samples],
            completions=[x.completion for x in samples],
            truncated=torch.tensor([x.truncated for x in samples], dtype=torch.bool),
            prompt_index=torch.tensor([i for i, _ in rows], dtype=torch.int64),
            prompt_lengths=torch.tensor([len(ids) for _, ids in rows], dtype=torch.int64),
        )

    def _generate_batch(
        self,
        batch: list[list[int]],
        config: transformers.GenerationConfig,
        device: torch.device,
    ) -> list[_Sample]:
        """Generate for one left-padded batch of prompt ids (one row per sample)."""
        width = max(len(ids) for ids in batch)
        input_ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.int64)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.int64)
        for r, ids in enumerate(batch):
            input_ids[r, width - len(ids) :] = torch.tensor(ids, dtype=torch.int64)
            attention_mask[r, width - len(ids) :] = 1
        result = self.model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            generation_config=config,
        )
        tokens = result.sequences[:, width:].cpu()
        if len(result.scores) != tokens.shape[1]:
            raise RuntimeError(f"{len(result.scores)} score steps for {tokens.shape[1]} tokens")
        # Log-probability of each sampled token under the processed (sampling) distribution.
        logprobs = (
            torch.stack(
                [
                    torch.log_softmax(s.float(), dim=-1).gather(1, tokens[:, j, None].to(s.device))
                    for j, s in enumerate(result.scores)
                ],
                dim=1,
            )
            .squeeze(-1)
            .cpu()
        )
        samples = []
        for r, ids in enumerate(batch):
            is_eos = (tokens[r] == self.eos_token_id).nonzero()
            done = is_eos.numel() > 0
            n = int(is_eos[0, 0]) + 1 if done else tokens.shape[1]
            response = tokens[r, :n]
            p = len(ids)
            mask = torch.zeros(p + n, dtype=torch.bool)
            mask[p:] = True
            lp = torch.zeros(p + n, dtype=torch.float32)
            lp[p:] = logprobs[r, :n]
            text_ids = response[:-1] if done else response
            samples.append(
                _Sample(
                    input_ids=torch.cat([torch.tensor(ids, dtype=torch.int64), response]),
                    response_mask=mask,
                    gen_logprobs=lp,
                    completion=self.tokenizer.decode(text_ids.tolist(), skip_special_tokens=True),
                    truncated=not done,
                )
            )
        return samples
