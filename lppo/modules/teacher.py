"""``Teacher``: the frozen model whose log-probabilities guide on-policy distillation."""

from __future__ import annotations

from typing import Any

from torch import nn

from lppo.layouts.base import ParallelContext
from lppo.modules.actor import ActorModule
from lppo.modules.models import HFCausalLM
from lppo.modules.tail import TrimSetting
from lppo.modules.vocab import VocabChunk
from lppo.validation import SettingError

#: Where the teacher's model sits in a ``lppo fit`` configuration (messages).
MODEL_KEY = "model.teacher.init_args.model"


class Teacher(ActorModule):
    """A frozen causal LM that scores the student's sampled tokens (``model.teacher``).

    The score phase writes its log-probabilities of every row's tokens (``teacher_logprobs``,
    at the sampling temperature, as π_old's) in the same streamed pass as the reference's;
    :class:`~lppo.estimators.Distill` turns them into advantages. It computes them exactly as
    the actor computes π_old (the same ``trim_prompt``, ``vocab_chunk`` and shared-prompt
    paths), and is never trained: no optimizer, no gradients, eval mode. Its weights travel in
    the run's checkpoints, so a resumed run distils from the same teacher.

    The teacher must read the student's token ids as the same tokens: a checkpoint that ships
    another tokenizer, or a model with fewer token embeddings than the run's tokenizer has
    tokens, is refused at setup (:meth:`check_tokenizer`).

    Args:
        model: any causal LM lppo can load: an :class:`~lppo.modules.models.HFCausalLM` spec
            (``pretrained_path``: a Hugging Face directory, such as an ``HFExport`` of an
            earlier run) or a built ``nn.Module``.
        trim_prompt: as :class:`~lppo.modules.ActorModule`'s.
        vocab_chunk: as :class:`~lppo.modules.ActorModule`'s.
    """

    role = "teacher"

    def __init__(
        self,
        model: HFCausalLM | nn.Module,
        trim_prompt: TrimSetting = "auto",
        vocab_chunk: VocabChunk = "auto",
    ) -> None:
        super().__init__(model=model, trim_prompt=trim_prompt, vocab_chunk=vocab_chunk)

    def prepare(self, tokenizer: Any, parallel: ParallelContext, temperature: float) -> None:
        """Check the tokenizer, build the model in the run's layout, and freeze it.

        It then scores at ``temperature``: the sampling temperature, as π_old.
        """
        self.check_tokenizer(tokenizer)
        self.parallel = parallel
        ids = tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id
        self.configure_model(len(tokenizer), *ids)
        self.requires_grad_(False)
        self.eval()
        self.temperature = temperature

    def check_tokenizer(self, tokenizer: Any) -> None:
        """Refuse a checkpoint whose vocabulary is not the run's tokenizer's.

        Raises:
            SettingError: naming the checkpoint and how the vocabularies differ.
        """
        fix = (
            "A teacher scores the student's token ids, so it must share the student's "
            "tokenizer: distil from a teacher trained with it."
        )
        if isinstance(self.spec, HFCausalLM):
            self.spec.check_vocabulary(MODEL_KEY, tokenizer, resize=False, fix=fix)
            return
        embeddings = self.model.get_input_embeddings() if self.model is not None else None
        rows = getattr(embeddings, "num_embeddings", None)
        if rows is not None and rows < len(tokenizer):
            raise SettingError(
                f"{MODEL_KEY}: the given model has {rows} token embeddings but the run's "
                f"tokenizer has {len(tokenizer)} tokens. {fix}"
            )
