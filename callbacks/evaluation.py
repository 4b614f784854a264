"""Evaluates the policy on a fixed prompt set every N iterations (``eval/*`` metrics)."""

from __future__ import annotations

import copy
import math
import random
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import lightning.pytorch as pl

from lppo.iteration.hooks import PPOCallback
from lppo.rollout.reward_call import RewardError
from lppo.run.log import RunLog
from lppo.tasks.base import Prompt, Task
from lppo.types import iteration_label, iteration_number
from lppo.validation import callback_key, check_number

if TYPE_CHECKING:
    from lppo.rollout.source import RolloutSource
    from lppo.run.system import PPOSystem

#: A sample is correct when its reward reaches this value (tasks give exactly 1.0 to the
#: reference answer; rewards lie in ``[0, 1]``).
CORRECT_REWARD = 1.0

#: The normal quantile of a two-sided 95 % interval.
Z95 = 1.959963984540054


def wilson_interval(p: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a proportion ``p`` observed over ``n`` independent trials.

    ``(c ± z·sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n)`` with centre ``c = p + z²/2n``; unlike
    ``p ± z·sqrt(p(1-p)/n)`` it stays inside ``[0, 1]`` and does not collapse at 0 or 1.

    Args:
        p: the observed proportion, in ``[0, 1]``.
        n: the number of trials, at least 1.
        z: the normal quantile of the interval (95 %: :data:`Z95`).

    Returns:
        ``(low, high)``.
    """
    scale = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / scale
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / scale
    # at p = 0 (or 1) the bound is exactly 0 (or 1); the formula leaves round-off there
    low = 0.0 if p <= 0.0 else max(0.0, centre - half)
    high = 1.0 if p >= 1.0 else min(1.0, centre + half)
    return low, high


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimator of Chen et al. (2021), ``1 - C(n - c, k) / C(n, k)``.

    The probability that at least one of ``k`` samples drawn without replacement from ``n``
    samples, ``c`` of them correct, is correct. With ``k = 1`` it is ``c / n``; with
    ``k = n`` it is 1 when any sample is correct, else 0.

    Args:
        n: samples generated for the prompt.
        c: correct samples among them.
        k: the ``k`` of pass@k.

    Returns:
        The estimate, in ``[0, 1]``.

    Raises:
        ValueError: unless ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 1 <= k <= n, got n={n}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def evaluation_metrics(
    rewards: Sequence[float], response_lengths: Sequence[float], samples_per_prompt: int
) -> dict[str, float]:
    """The evaluation metrics of samples grouped by prompt (``samples_per_prompt`` each).

    Sample ``j`` of prompt ``i`` is at index ``i * samples_per_prompt + j`` (the layout of
    :class:`~lppo.rollout.GenerationOutput`).

    Args:
        rewards: one reward per sample.
        response_lengths: response tokens (EOS included) per sample.
        samples_per_prompt: ``k``, the samples per prompt.

    Returns:
        ``reward_mean`` (over finite rewards; NaN without any), ``accuracy`` (fraction of
        samples with reward >= :data:`CORRECT_REWARD`), ``pass@1`` and ``pass@k`` (unbiased
        estimator averaged over prompts; one key when ``k = 1``), ``pass@1_ci95_low`` and
        ``pass@1_ci95_high`` (the Wilson 95 % interval of pass@1 over the prompts: exact in
        kind for ``k = 1``, e.g. greedy; for ``k > 1`` it treats each prompt's mean as one
        trial, which overstates the spread, so the interval is conservative) and
        ``response_length_mean``.

    Raises:
        ValueError: no sample, lengths that do not match, or a sample count that is not a
            multiple of ``samples_per_prompt``.
    """
    k = samples_per_prompt
    n = len(rewards)
    if n == 0 or k < 1 or n % k or len(response_lengths) != n:
        raise ValueError(
            f"evaluation_metrics needs a positive multiple of samples_per_prompt={k} rewards "
            f"and as many lengths, got {n} rewards and {len(response_lengths)} lengths"
        )
    correct = [float(r) >= CORRECT_REWARD for r in rewards]  # NaN is never correct
    per_prompt = [sum(correct[i : i + k]) for i in range(0, n, k)]
    finite = [float(r) for r in rewards if math.isfinite(float(r))]
    metrics = {
        "reward_mean": sum(finite) / len(finite) if finite else math.nan,
        "accuracy": sum(correct) / n,
        "pass@1": sum(pass_at_k(k, c, 1) for c in per_prompt) / len(per_prompt),
    }
    metrics[f"pass@{k}"] = sum(pass_at_k(k, c, k) for c in per_prompt) / len(per_prompt)
    low, high = wilson_interval(metrics["pass@1"], len(per_prompt))
    metrics["pass@1_ci95_low"], metrics["pass@1_ci95_high"] = low, high
    metrics["response_length_mean"] = sum(float(x) for x in response_lengths) / n
    return metrics


class Evaluation(PPOCallback):
    """Evaluates the policy during training on a fixed set of prompts drawn apart from training.

    The prompts are drawn **once**, at setup, with ``task.sample_prompts(num_prompts,
    random.Random(seed))`` (a stateful task, e.g. a prompt file, is put back to its state
    afterwards, so training draws what it would have drawn). Training draws each iteration's
    prompts from generators seeded from ``(model.seed, iteration)``, a different stream, but
    a procedurally generated task may still produce some of the same prompts by chance (the
    copy task of ``configs/tiny.yaml`` has only 4672 distinct prompts). For a file of prompts
    pass a ``task`` reading a held-out file: by default the prompts are the first
    ``num_prompts`` of the training task's walk.

    With ``at_start``, the initial policy is evaluated before the first iteration (logged as
    iteration 0: the "before" of a before/after comparison; a resumed run does not repeat it).
    After every ``every_n_iterations``-th iteration and after the last one (``max_epochs``,
    ``max_steps`` or a requested stop; any other stop evaluates at the end of fit), global rank
    zero generates ``samples_per_prompt`` responses per prompt through the run's rollout source
    (``pl_module.rollout_source.evaluate``: the engine on the actor's current weights, the run's
    ``model.rollout`` settings and a fixed ``seed``, or greedy decoding), scores them with one
    ``task.rewards`` call and logs ``<prefix>/reward_mean``, ``<prefix>/accuracy`` (samples with
    reward 1.0, the reference answer), ``<prefix>/pass@1`` and ``<prefix>/pass@<k>`` (Chen et
    al.'s unbiased estimator averaged over prompts), ``<prefix>/response_length_mean`` and
    ``<prefix>/seconds``, with ``iteration``, to every logger; other ranks skip. Multi-turn
    engines add their episodes' metrics (:meth:`~lppo.reports.EpisodeReport.metrics`:
    ``<prefix>/tool_calls_per_episode``, ``<prefix>/tool_errors_per_episode``,
    ``<prefix>/turns_per_episode``, ...), so a tool-use run shows whether its calls got better,
    not only its answers. Rows take the next step of the run log's axis (``pl_module.run_log``,
    after the iteration's own rows). Generation runs without gradients under forked RNGs and the
    actor's train/eval modes are restored, so training is bitwise what it is without this
    callback. The entries are recorded in the run log (saved with the run, so a resumed run
    keeps the earlier evaluations; the reward curve and the run summary read them there);
    :attr:`history` is this prefix's.

    From YAML / the command line: ``--trainer.callbacks+=lppo.callbacks.Evaluation
    --trainer.callbacks.every_n_iterations=10``.

    Args:
        every_n_iterations: evaluate after every N-th iteration (and after the last).
        num_prompts: held-out prompts.
        samples_per_prompt: responses per prompt, the ``k`` of pass@k.
        seed: seed of the held-out prompts and of their sampling.
        greedy: decode greedily (argmax) instead of sampling (every rollout engine can); needs
            ``samples_per_prompt: 1`` (greedy samples of a prompt are identical).
        task: the task to draw prompts from and reward with (it must use the training task's
            vocabulary); ``None``: the trained task (``model.task``).
        prefix: metric prefix; give each of several ``Evaluation`` callbacks its own.
        at_start: also evaluate the initial policy, before the first iteration (iteration 0).
    """

    def __init__(
        self,
        every_n_iterations: int = 10,
        num_prompts: int = 32,
        samples_per_prompt: int = 4,
        seed: int = 1234,
        greedy: bool = False,
        task: Task | None = None,
        prefix: str = "eval",
        at_start: bool = False,
    ) -> None:
        super().__init__()
        for key, value in (
            ("every_n_iterations", every_n_iterations),
            ("num_prompts", num_prompts),
            ("samples_per_prompt", samples_per_prompt),
        ):
            check_number(callback_key(self, key), value, integer=True, low=1)
        check_number(callback_key(self, "seed"), seed, integer=True, low=0)
        if greedy and samples_per_prompt != 1:
            raise ValueError(
                f"Evaluation.greedy=true gives {samples_per_prompt} identical samples per "
                "prompt; set Evaluation.samples_per_prompt=1 (or greedy=false)."
            )
        if not prefix or "/" in prefix:
            raise ValueError(f"Evaluation.prefix={prefix!r} must be a non-empty name without '/'.")
        self.every_n_iterations = every_n_iterations
        self.num_prompts = num_prompts
        self.samples_per_prompt = samples_per_prompt
        self.seed = seed
        self.greedy = greedy
        self.task = task
        self.prefix = prefix
        self.at_start = at_start
        self.prompts: list[Prompt] | None = None
        self.run_log = RunLog()  # the run's, from the module at setup / evaluate

    @property
    def history(self) -> list[dict[str, float]]:
        """This prefix's evaluations in the run log, in iteration order."""
        return self.run_log.evaluations.get(self.prefix, [])

    @property
    def state_key(self) -> str:
        """Checkpoint key; distinct per ``prefix``, so several evaluations can coexist."""
        return self._generate_state_key(prefix=self.prefix)

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Check the settings against the other callbacks and draw the held-out prompts.

        Raises:
            ValueError: another ``Evaluation`` uses the same ``prefix``.
        """
        others = [cb for cb in trainer.callbacks if isinstance(cb, Evaluation) and cb is not self]
        if any(cb.prefix == self.prefix for cb in others):
            raise ValueError(
                f"two Evaluation callbacks log under Evaluation.prefix={self.prefix!r}; "
                "give each its own prefix."
            )
        self.run_log = pl_module.run_log
        if self.prompts is None:
            # Lightning sets callbacks up before the module builds its rollout source
            # (configure_model), so the trained task is read from the module (model.task):
            # drawing later would see a task restored from a checkpoint or advanced by training.
            trained = cast("PPOSystem", pl_module).task
            self.prompts = self.draw_prompts(self.task if self.task is not None else trained)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Evaluate the initial policy (``at_start``) when the fit starts from iteration 1."""
        if self.at_start and trainer.current_epoch == 0:
            self.evaluate(trainer, pl_module, -1)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Evaluate after every ``every_n_iterations``-th iteration and after the last one."""
        iteration = trainer.current_epoch
        if (iteration + 1) % self.every_n_iterations == 0 or self.is_last(trainer):
            self.evaluate(trainer, pl_module, iteration)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Evaluate the last iteration if an unforeseen stop (e.g. ``max_time``) skipped it."""
        if trainer.current_epoch > 0:
            self.evaluate(trainer, pl_module, trainer.current_epoch - 1)

    @staticmethod
    def is_last(trainer: pl.Trainer) -> bool:
        """Whether the iteration that just ended is the last of the fit."""
        done = trainer.current_epoch + 1
        max_epochs = trainer.max_epochs
        if max_epochs is not None and max_epochs >= 0 and done >= max_epochs:
            return True
        max_steps = trainer.max_steps
        if max_steps is not None and max_steps >= 0 and trainer.global_step >= max_steps:
            return True
        return bool(trainer.should_stop)

    # ------------------------------------------------------------------ evaluation
    def draw_prompts(self, task: Task) -> list[Prompt]:
        """Draw the held-out prompts from ``task``, leaving the task's state as it was."""
        state = copy.deepcopy(task.state_dict())
        try:
            prompts = task.sample_prompts(self.num_prompts, random.Random(self.seed))
        finally:
            task.load_state_dict(state)
        if len(prompts) != self.num_prompts:
            raise ValueError(
                f"{type(task).__name__}.sample_prompts returned {len(prompts)} prompts for "
                f"Evaluation.num_prompts={self.num_prompts}."
            )
        return prompts

    def evaluate(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, iteration: int
    ) -> dict[str, float] | None:
        """Evaluate the current policy as of ``iteration`` on global rank zero and log it.

        Returns:
            The history entry, or ``None`` on other ranks and for an iteration already
            evaluated.

        Raises:
            RewardError: the task's ``rewards`` failed (the message names the evaluation).
        """
        self.run_log = pl_module.run_log
        number = iteration_number(iteration)
        if not trainer.is_global_zero or any(h["iteration"] == number for h in self.history):
            return None
        source = self._source(pl_module)
        task = self.task if self.task is not None else source.task
        prompts = self.prompts if self.prompts is not None else self.draw_prompts(task)
        self.prompts = prompts
        clock = time.perf_counter()
        k = self.samples_per_prompt
        try:
            samples = source.evaluate(prompts, k, self.seed, greedy=self.greedy, task=task)
        except RewardError as error:
            raise RewardError(
                f"{self.prefix} after {iteration_label(iteration)}: {error}"
            ) from error
        lengths = [float(m.sum()) for m in samples.output.response_mask]
        metrics = evaluation_metrics(samples.rewards, lengths, k)
        if samples.output.episodes is not None:
            metrics.update(samples.output.episodes.metrics())
        metrics["seconds"] = time.perf_counter() - clock
        row: dict[str, float] = {"iteration": number}
        row.update({f"{self.prefix}/{name}": v for name, v in metrics.items()})
        step = self.run_log.log(trainer.loggers, row)
        for logger in trainer.loggers:
            logger.save()
        entry = {"iteration": number, "step": step, **metrics}
        self.run_log.add_evaluation(self.prefix, entry)
        return entry

    @staticmethod
    def _source(pl_module: pl.LightningModule) -> RolloutSource:
        """The run's rollout source, which generates and rewards the evaluation samples.

        Raises:
            RuntimeError: the module has not built it yet (``PPOSystem.configure_model``).
        """
        source = cast("PPOSystem", pl_module).rollout_source
        if source is None:
            raise RuntimeError(
                "Evaluation needs the module's rollout source, which PPOSystem.configure_model "
                "builds; evaluate after the fit has set the module up."
            )
        return source

    def points(self, metric: str = "reward_mean") -> list[tuple[int, float]]:
        """``(iteration, value)`` of ``metric`` for every evaluation so far, in order."""
        return [(int(h["iteration"]), float(h.get(metric, math.nan))) for h in self.history]
