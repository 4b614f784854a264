"""``Distill``: on-policy distillation from a teacher, alone or added to a task estimator's."""

from __future__ import annotations

import torch

from lppo.algorithms import distill_advantages, kl_penalty
from lppo.estimators.base import AdvantageEstimator, EstimatorInputs
from lppo.init_args import RecordsInitArgs
from lppo.stats import Moments
from lppo.types import ADVANTAGES, OLD_LOGPROBS, TEACHER_LOGPROBS
from lppo.validation import SettingError, check_number

KEY = "model.estimator.init_args"


class Distill(RecordsInitArgs):
    """Advantages from a teacher's log-probabilities of the student's own samples.

    ``A_t = A^task_t − coef · (log π_old(a_t) − log π_T(a_t))`` on every valid token
    (:func:`~lppo.algorithms.distill_advantages`): the teacher (``model.teacher``, scored in
    the score phase like the reference policy) rewards each sampled token by how much likelier
    it finds it than the student does, so the student's expected advantage is minus the
    reverse KL to the teacher. ``A^task`` is what ``task`` writes from the task's reward
    (``null``: 0, distillation alone). Both terms are streamed chunk by chunk, so the result
    does not depend on the chunking or the number of ranks.

    Args:
        task: a critic-free estimator of the task's reward (``lppo.estimators.GRPO``,
            ``RLOO``, ``ReinforcePP``) whose advantages the distillation term is added to;
            ``null``: the term alone.
        coef: weight of the distillation term.
    """

    uses_critic = False

    def __init__(self, task: AdvantageEstimator | None = None, coef: float = 1.0) -> None:
        check_number(f"{KEY}.coef", coef, low=0, low_open=True, fix="Typical: 1.0.")
        if task is not None and task.uses_critic:
            raise SettingError(
                f"{KEY}.task={type(task).__name__}: distillation adds to a critic-free "
                "estimator's advantages (lppo.estimators.GRPO, RLOO, ReinforcePP), or to none "
                "(null: the teacher's signal alone)."
            )
        self.task = task
        self.coef = coef

    def reads(self) -> list[str]:
        """π_old and the teacher's log-probs, and what ``task`` reads."""
        own = [OLD_LOGPROBS, TEACHER_LOGPROBS]
        return [*(self.task.reads() if self.task is not None else []), *own]

    def writes(self) -> list[str]:
        """The advantages."""
        return [ADVANTAGES]

    @torch.no_grad()
    def estimate(self, inputs: EstimatorInputs) -> dict[str, float]:
        """Write the advantages; report ``task``'s metrics and the mean per-token reverse KL."""
        stats = self.task.estimate(inputs) if self.task is not None else {}
        names = [OLD_LOGPROBS, TEACHER_LOGPROBS] + ([ADVANTAGES] if self.task else [])
        reverse_kl = Moments()
        for chunk in inputs.chunks(names):
            assert chunk.old_logprobs is not None
            teacher = chunk.extras[TEACHER_LOGPROBS]
            term = distill_advantages(chunk.old_logprobs, teacher, chunk.response_mask, self.coef)
            reverse_kl.update(kl_penalty(chunk.old_logprobs, teacher, "k1"), chunk.response_mask)
            if chunk.advantages is not None:
                term = chunk.advantages + term.to(chunk.advantages.dtype)
            inputs.write(chunk, {ADVANTAGES: term})
        reverse_kl.all_reduce(inputs.group)
        return {**stats, "distill_reverse_kl": reverse_kl.mean if reverse_kl.count else 0.0}
