"""The step lifecycle shared by actor and critic: ``begin → train_chunk* → finish | abort``.

One optimizer step is built from any number of chunks. Each chunk's loss is its exact share of
the step's loss (masked sum over the step's *global* normalizer), so the accumulated gradient
equals that of one merged batch, whatever the chunking and the data-parallel size. Gradients
are summed across data-parallel ranks once, in ``finish``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from lppo.algorithms.losses import LOSS_AGGREGATIONS, LossAggregation, token_weights
from lppo.init_args import RecordsInitArgs
from lppo.layouts.base import ParallelContext
from lppo.modules.snapshot import TrainingState, parameters_finite
from lppo.stats import SumStats
from lppo.types import Chunk, ChunkResult, StepPlan, StepStats
from lppo.validation import SettingError, check_number

if TYPE_CHECKING:
    from lppo.iteration.columns import OwnColumns

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]


class StepStateError(RuntimeError):
    """A lifecycle method was called out of order."""


class NonFiniteParameters(RuntimeError):
    """An optimizer step left a non-finite parameter and could not be undone."""


class PPOModule(RecordsInitArgs, nn.Module):
    """Base of :class:`~lppo.modules.ActorModule` and :class:`~lppo.modules.CriticModule`.

    Subclasses implement :meth:`chunk_loss` (per-token loss plus diagnostic sums) and
    :meth:`trainable_parameters`; :meth:`metrics` turns the step's global sums into ratios.
    The optimizer settings below are declared here once; subclasses take them as
    ``**kwargs`` (jsonargparse still lists each of them under the subclass in ``--help``).

    Attributes:
        parallel: the process groups gradients and diagnostics are summed over (set by the
            controller; single-process by default).
        weights_version: increases whenever the parameters change (a step taken, a state
            loaded); rollout engines holding a copy of the weights compare against it.
        max_response_tokens: the constant ``L`` of ``loss_aggregation:
            seq_mean_token_sum_norm``. Not an init argument: :class:`~lppo.run.system.PPOSystem`
            sets it from ``model.rollout.max_new_tokens`` (the one source of the response
            length), so the two can never disagree.

    Args:
        lr: learning rate of the default AdamW optimizer, in ``(0, 1]`` (typical: 1e-6 to
            1e-3; a step moves each weight by about ``lr``, so a larger one is refused).
        weight_decay: AdamW weight decay.
        betas: AdamW betas.
        eps: AdamW epsilon.
        max_grad_norm: clip the total grad norm to this (``None``: no clipping; the norm is
            still computed and checked for non-finite values).
        loss_aggregation: how per-token losses make the step's loss
            (:func:`~lppo.algorithms.losses.token_weights`): ``token_mean`` (mean over the
            step's valid tokens), ``seq_mean_token_mean`` (token mean per row, then mean over
            rows), ``seq_mean_token_sum`` (token sum per row, mean over rows) or
            ``seq_mean_token_sum_norm`` (token sum per row over ``model.rollout.max_new_tokens``,
            mean over rows: Dr. GRPO). Each is exact under any chunking and data-parallel size.
        warmup_steps: linear learning-rate warmup over this many optimizer steps.
        rollback_non_finite: after every optimizer step, check the parameters; when one is
            not finite, undo the step (parameters, optimizer and scheduler as before it) and
            report it as skipped. Costs a transient copy of the parameters and optimizer
            state per step (3x the parameters with AdamW). ``false`` skips the copy: a
            non-finite parameter then stops the run with :class:`NonFiniteParameters`.
        optimizer: factory ``params -> Optimizer`` replacing the default AdamW.
        lr_scheduler: factory ``optimizer -> LRScheduler`` replacing the warmup schedule.
    """

    role = "module"
    #: A new learning rate is given to the restored optimizer; the rollback check is per step.
    resume_safe: ClassVar[tuple[str, ...]] = ("lr", "rollback_non_finite")

    def __init__(
        self,
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        max_grad_norm: float | None = 1.0,
        loss_aggregation: LossAggregation = "token_mean",
        warmup_steps: int = 0,
        rollback_non_finite: bool = True,
        optimizer: OptimizerFactory | None = None,
        lr_scheduler: SchedulerFactory | None = None,
    ) -> None:
        super().__init__()
        key = self.config_key
        fix = "Typical: 1e-6 to 1e-3 (an AdamW step moves each weight by about lr)."
        check_number(f"{key}.lr", lr, low=0, low_open=True, high=1, fix=fix)
        check_number(f"{key}.weight_decay", weight_decay, low=0)
        if not isinstance(betas, tuple | list) or len(betas) != 2:
            raise SettingError(f"{key}.betas={betas!r} must be two numbers, e.g. [0.9, 0.999].")
        for i, beta in enumerate(betas):
            check_number(f"{key}.betas[{i}]", beta, low=0, high=1, high_open=True)
        check_number(f"{key}.eps", eps, low=0, low_open=True, fix="Typical: 1e-8.")
        check_number(f"{key}.max_grad_norm", max_grad_norm, low=0, low_open=True, optional=True)
        check_number(f"{key}.warmup_steps", warmup_steps, integer=True, low=0)
        if loss_aggregation not in LOSS_AGGREGATIONS:
            raise SettingError(
                f"{key}.loss_aggregation={loss_aggregation!r}; use one of "
                f"{', '.join(repr(m) for m in LOSS_AGGREGATIONS)}."
            )
        self.lr = lr
        self.weight_decay = weight_decay
        self.betas = tuple(betas)
        self.eps = eps
        self.max_grad_norm = max_grad_norm
        self.loss_aggregation: LossAggregation = loss_aggregation
        self.warmup_steps = warmup_steps
        self.rollback_non_finite = rollback_non_finite
        self._optimizer_factory = optimizer
        self._scheduler_factory = lr_scheduler
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self._plan: StepPlan | None = None
        self._own: OwnColumns | None = None
        self._sums = SumStats()
        self._chunks_trained = 0
        self._chunks_skipped = 0
        self._tokens = 0
        #: Number of forward passes run in training (skipped chunks run none).
        self.forward_count = 0
        self.parallel = ParallelContext()
        self.weights_version = 0
        self.max_response_tokens: int | None = None
        self.register_load_state_dict_post_hook(_bump_weights_version)

    @property
    def config_key(self) -> str:
        """Where this module's settings live in a ``lppo fit`` config (used in messages)."""
        return f"model.{self.role}.init_args"

    # ----------------------------------------------------------- subclass API
    def trainable_parameters(self) -> list[nn.Parameter]:
        """Parameters the optimizer updates."""
        return [p for p in self.parameters() if p.requires_grad]

    def reads(self) -> list[str]:
        """The columns (:mod:`lppo.types`) a training chunk of this module needs."""
        raise NotImplementedError

    def chunk_loss(self, chunk: Chunk, sums: SumStats) -> torch.Tensor:
        """Per-token loss of ``chunk`` (``float[B, T]``, with grad); add diagnostics to ``sums``.

        Diagnostic sums must be sums over valid tokens (or rows) of this chunk only; the base
        class reduces them over chunks and ranks and :meth:`metrics` divides them.
        """
        raise NotImplementedError

    def metrics(self, sums: SumStats) -> dict[str, float]:
        """Turn the step's global sums into reported diagnostics."""
        return {}

    @property
    def produces_columns(self) -> bool:
        """Whether the open step's chunks lack columns that :meth:`complete` fills in."""
        return self._own is not None

    def complete(self, chunk: Chunk, output: torch.Tensor) -> Chunk:
        """``chunk`` with the columns the open step takes from ``output`` (detached, ``[B, T]``)."""
        assert self._own is not None, "complete() outside a step that produces columns"
        return self._own.complete(chunk, output)

    def on_before_step(self, grad_norm: float) -> None:
        """Hook: gradients are complete (summed over ranks, not yet clipped); override freely."""

    # ------------------------------------------------------------- optimizer
    def configure_optimizer(self) -> torch.optim.Optimizer:
        """Build the optimizer and scheduler on first use (parameters must exist by then)."""
        if self.optimizer is None:
            params = self.trainable_parameters()
            if self._optimizer_factory is not None:
                self.optimizer = self._optimizer_factory(params)
            else:
                self.optimizer = torch.optim.AdamW(
                    params,
                    lr=self.lr,
                    betas=self.betas,
                    eps=self.eps,
                    weight_decay=self.weight_decay,
                )
            if self._scheduler_factory is not None:
                self.scheduler = self._scheduler_factory(self.optimizer)
            elif self.warmup_steps > 0:
                warm = self.warmup_steps
                self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                    self.optimizer, lambda step: min(1.0, (step + 1) / warm)
                )
        return self.optimizer

    # ------------------------------------------------------------- lifecycle
    @property
    def step_open(self) -> bool:
        """Whether a step has begun and not yet finished or aborted."""
        return self._plan is not None

    def begin(self, plan: StepPlan, own: OwnColumns | None = None) -> None:
        """Open a step: zero gradients and take the step's global normalizers from ``plan``.

        ``own``: in a first epoch that produces columns, what completes each chunk from this
        module's forward pass (:meth:`complete`).

        Raises:
            StepStateError: a step is already open.
            ValueError: the plan has no valid token.
        """
        if self._plan is not None:
            raise StepStateError(
                f"{self.role}.begin() called while step (epoch {self._plan.epoch}, minibatch "
                f"{self._plan.minibatch}) is open; call finish() or abort() first."
            )
        if plan.normalizers.valid_tokens < 1:
            raise ValueError(f"{self.role}.begin(): the step plan has no valid token.")
        if self.loss_aggregation == "seq_mean_token_sum_norm" and not self.max_response_tokens:
            raise ValueError(
                f"{self.config_key}.loss_aggregation=seq_mean_token_sum_norm needs "
                f"{self.role}.max_response_tokens (PPOSystem sets it from "
                "model.rollout.max_new_tokens); set it when using the module on its own."
            )
        self.configure_optimizer()
        self.train()
        self._zero_grad()
        self._plan, self._own = plan, own
        self._sums = SumStats()
        self._chunks_trained = self._chunks_skipped = self._tokens = 0

    def train_chunk(self, chunk: Chunk) -> ChunkResult:
        """Accumulate one chunk's gradient into the open step.

        A padding chunk contributes nothing; a chunk with no valid token is skipped without a
        forward pass and counted.

        Raises:
            StepStateError: no step is open.
        """
        plan = self._require_open("train_chunk")
        if chunk.is_padding:
            self.parallel.layout.idle_chunk(self)
            self._chunks_trained += 1
            return ChunkResult(trained=False, skipped=False, loss=0.0, tokens=0)
        if chunk.num_valid_tokens == 0:
            self.parallel.layout.idle_chunk(self)
            self._chunks_skipped += 1
            return ChunkResult(trained=False, skipped=True, loss=0.0, tokens=chunk.num_tokens)
        chunk = chunk.to(self.device)
        self.forward_count += 1
        per_token = self.chunk_loss(chunk, self._sums)
        weights = token_weights(
            chunk.response_mask, plan.normalizers, self.loss_aggregation, self.max_response_tokens
        )
        loss = (per_token.to(torch.float64) * weights).sum()
        loss.backward()
        value = float(loss.detach())
        self._sums.add("loss", value)
        self._sums.add("valid_tokens", chunk.num_valid_tokens)
        self._chunks_trained += 1
        self._tokens += chunk.num_tokens
        return ChunkResult(trained=True, skipped=False, loss=value, tokens=chunk.num_tokens)

    def finish(self) -> StepStats:
        """Close the step: sync grads across ranks, clip, and take exactly one optimizer step.

        A non-finite gradient norm takes no step (parameters and optimizer state untouched),
        and a step that leaves a non-finite parameter is undone; both are reported with
        ``stepped=False`` and a ``skip_reason``.

        Raises:
            StepStateError: no step is open, or no chunk was trained.
        """
        plan = self._require_open("finish")
        if self._chunks_trained == 0:
            raise StepStateError(
                f"{self.role}.finish() with no chunk trained in this step "
                f"({self._chunks_skipped} skipped); call abort() instead."
            )
        assert self.optimizer is not None
        self._sums.all_reduce(self.parallel.data)
        lr = float(self.optimizer.param_groups[0]["lr"])
        # A copy to undo a step that leaves a non-finite parameter (rollback_non_finite).
        backup = TrainingState.capture(self) if self.rollback_non_finite else None
        grad_norm, stepped = self._apply_gradients()
        reason = "" if stepped else f"gradient norm {grad_norm} is not finite"
        if stepped and not parameters_finite(self):
            reason = self._undo_non_finite(backup, grad_norm)
            stepped = False
        if stepped:
            self.weights_version += 1
            if self.scheduler is not None:
                self.scheduler.step()
        self._zero_grad()
        stats = StepStats(
            role=self.role,
            epoch=plan.epoch,
            minibatch=plan.minibatch,
            stepped=stepped,
            grad_norm=grad_norm,
            lr=lr,
            chunks_trained=self._chunks_trained,
            chunks_skipped=self._chunks_skipped,
            valid_tokens=plan.normalizers.valid_tokens,
            valid_rows=plan.normalizers.valid_rows,
            tokens=self._tokens,
            metrics={"loss": self._sums.get("loss"), **self.metrics(self._sums)},
            skip_reason=reason,
        )
        self._plan = self._own = None
        return stats

    def _undo_non_finite(self, backup: TrainingState | None, norm: float) -> str:
        """Restore the state before a step that left a non-finite parameter; say why.

        Raises:
            NonFiniteParameters: no copy was taken (``rollback_non_finite=False``).
        """
        assert self.optimizer is not None
        if backup is None:
            raise NonFiniteParameters(
                f"{self.role}: a parameter is not finite after the optimizer step "
                f"(gradient norm {norm}, lr {self.optimizer.param_groups[0]['lr']}); "
                f"lower {self.config_key}.lr, or set {self.config_key}.rollback_non_finite="
                "true to undo such steps."
            )
        backup.restore(self)
        return "a parameter was not finite after the step (step undone)"

    def abort(self) -> None:
        """Drop the open step: no optimizer step, gradients and step state discarded.

        Parameters and optimizer state are exactly as they were at :meth:`begin` (chunks only
        touch gradients). Calling ``abort`` with no open step is a no-op, so cleanup paths can
        call it unconditionally.
        """
        self.parallel.layout.abort(self)
        self._zero_grad()
        self._plan = self._own = None
        self._sums = SumStats()

    # --------------------------------------------------------------- helpers
    @property
    def device(self) -> torch.device:
        """Device of the module's parameters."""
        return next(self.parameters()).device

    def _require_open(self, method: str) -> StepPlan:
        if self._plan is None:
            raise StepStateError(f"{self.role}.{method}() called with no open step; call begin().")
        return self._plan

    def _zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    def _apply_gradients(self) -> tuple[float, bool]:
        """Reduce gradients over ranks, call :meth:`on_before_step`, clip, step the optimizer.

        The layout (``self.parallel.layout``) reduces the gradients and takes their global
        norm, and clips them.

        Returns:
            ``(grad_norm, stepped)``: the total norm before clipping, and whether a step was
            taken (not when the norm is non-finite: parameters and optimizer state untouched).
        """
        assert self.optimizer is not None
        layout = self.parallel.layout
        params = self.trainable_parameters()
        grad_norm = layout.reduce_gradients(self, params, self.parallel.data) if params else 0.0
        stepped = math.isfinite(grad_norm)
        self.on_before_step(grad_norm)
        if stepped:
            if self.max_grad_norm is not None:
                layout.clip_gradients(params, self.max_grad_norm, grad_norm)
            self.optimizer.step()
        return grad_norm, stepped


def _bump_weights_version(module: nn.Module, incompatible_keys: object) -> None:
    """``load_state_dict`` post-hook: loaded parameters are new weights."""
    module.weights_version += 1


def disable_dropout(module: nn.Module) -> None:
    """Set the probability of every ``nn.Dropout`` (and subclass) inside ``module`` to 0."""
    for m in module.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
