"""The sanity check's early stop: ends the fit once training accuracy holds at the target."""

from __future__ import annotations

import lightning.pytorch as pl

from lppo.iteration.hooks import IterationContext, PPOCallback
from lppo.types import IterationResult


class StopAtAccuracy(PPOCallback):
    """Stops the fit after ``patience`` iterations in a row whose reward mean reaches ``target``.

    With a task whose reward is 1 for a right answer and 0 otherwise (``partial_weight: 0``)
    an iteration's reward mean is its training accuracy.

    Args:
        target: the accuracy to hold, in ``(0, 1]``.
        patience: consecutive iterations at or above ``target`` before the fit stops.
    """

    def __init__(self, target: float = 0.95, patience: int = 3) -> None:
        super().__init__()
        self.target = target
        self.patience = patience
        self.streak = 0

    def on_iteration_end(self, ctx: IterationContext, result: IterationResult) -> None:
        """Count the iterations in a row at or above the target."""
        reached = not result.failed and result.rollout.reward_mean >= self.target
        self.streak = self.streak + 1 if reached else 0

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Ask the trainer to stop once the streak is long enough."""
        if self.streak >= self.patience:
            trainer.should_stop = True
