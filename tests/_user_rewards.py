"""A copy task whose reward misbehaves, for real ``lppo fit`` runs (importable by class_path)."""

from __future__ import annotations

import time
from pathlib import Path

from lppo.tasks import CopyTask
from lppo.tasks.base import Prompt


class MisbehavingRewardTask(CopyTask):
    """The copy task of ``configs/tiny.yaml`` whose batch reward misbehaves.

    Args:
        mode: ``hang`` (writes ``marker``, then sleeps for good) or ``exit`` (raises
            ``SystemExit(0)``).
        marker: file written when the reward is entered.
    """

    def __init__(self, mode: str, marker: str = "") -> None:
        super().__init__()
        self.mode, self.marker = mode, marker

    def rewards(self, prompts: list[Prompt], completions: list[str]) -> list[float]:
        if self.marker:
            Path(self.marker).write_text("reached")
        if self.mode == "exit":
            raise SystemExit(0)
        while True:  # hang
            time.sleep(1)
