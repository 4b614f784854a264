"""A callback that stops a real ``lppo fit`` at a chosen point, for the SIGKILL tests.

It writes ``marker`` and then sleeps, so the test can kill the process exactly there.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from lppo.hooks import PPOCallback


class PauseAt(PPOCallback):
    """Pause forever at ``point``: ``<phase>:<iteration>`` (``checkpoint:<iteration>`` too).

    Args:
        point: ``critic:1``, ``actor:1``, ``rollout:2`` (after the rows are put) or
            ``checkpoint:1`` (before iteration 1's checkpoint is written).
        marker: file written when the point is reached.
    """

    def __init__(self, point: str, marker: str) -> None:
        super().__init__()
        phase, iteration = point.split(":")
        self.phase, self.iteration, self.marker = phase, int(iteration), marker

    def _pause(self) -> None:
        Path(self.marker).write_text("reached")
        while True:
            time.sleep(1)

    def on_rollout_end(self, ctx: Any) -> None:
        if self.phase == "rollout" and ctx.iteration == self.iteration:
            self._pause()

    def on_chunk_end(self, ctx: Any, result: Any) -> None:
        if ctx.phase == self.phase and ctx.iteration == self.iteration and ctx.epoch == 1:
            self._pause()

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Any) -> None:
        if self.phase == "checkpoint" and trainer.current_epoch == self.iteration:
            self._pause()
