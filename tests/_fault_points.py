"""Fault points that stop a real ``lppo fit`` at a chosen place, for the SIGKILL tests.

Each writes a ``marker`` file and then sleeps forever, so the test can kill the process exactly
there: :class:`PauseAt` in the trainer's iteration and checkpoint hooks,
:class:`PausingDatasetTask` inside the rollout scheduler's publication (the trainer draws the
prompts of the iteration it admits) or inside the background rollout process's generation (the
reward of an admitted iteration's samples), and :class:`PausingCopyTask` inside a Ray rollout
worker's reward (the trainer then waits in ``ray.get``).
"""

from __future__ import annotations

import collections
import multiprocessing
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

from lppo.iteration.hooks import PPOCallback
from lppo.tasks import CopyTask, DatasetTask
from lppo.tasks.verifiers import Verifier


def pause_forever(marker: str, seconds: float | None = None) -> None:
    """Write ``marker`` and sleep until the process is killed (or for ``seconds``)."""
    Path(marker).write_text("reached")
    end = None if seconds is None else time.monotonic() + seconds
    while end is None or time.monotonic() < end:
        time.sleep(0.1)


class _PauseWhenPickled:
    """An entry of a checkpoint that pauses while ``torch.save`` writes the checkpoint."""

    def __init__(self, marker: str, seconds: float | None = None) -> None:
        self.marker, self.seconds = marker, seconds

    def __reduce__(self) -> Any:
        pause_forever(self.marker, self.seconds)
        # A bounded pause: the write goes on, with an entry a weights-only load accepts.
        return (collections.OrderedDict, ())


class PauseAt(PPOCallback):
    """Pause forever at ``point``: ``<phase>:<iteration>`` (0-based iteration).

    Args:
        point: ``critic:1``, ``actor:1`` (in the phase's second epoch), ``rollout:2`` (after
            the rows are put), ``published:1`` (iteration 1 ended and its policy was published,
            its checkpoint not yet taken), ``checkpoint:1`` (before iteration 1's checkpoint is
            built) or ``write:1`` (while iteration 1's first checkpoint file is written).
        marker: file written when the point is reached.
        seconds: pause that long, then go on (``None``: until killed).
    """

    def __init__(self, point: str, marker: str, seconds: float | None = None) -> None:
        super().__init__()
        phase, iteration = point.split(":")
        self.phase, self.iteration, self.marker = phase, int(iteration), marker
        self.seconds = seconds

    def _pause(self) -> None:
        pause_forever(self.marker, self.seconds)

    def on_rollout_end(self, ctx: Any) -> None:
        if self.phase == "rollout" and ctx.iteration == self.iteration:
            self._pause()

    def on_chunk_end(self, ctx: Any, result: Any) -> None:
        if ctx.phase == self.phase and ctx.iteration == self.iteration and ctx.epoch == 1:
            self._pause()

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        # Runs after PPOSystem.run_iteration (which publishes) and before the checkpoint
        # callbacks (Lightning calls them last).
        if self.phase == "published" and trainer.current_epoch == self.iteration:
            self._pause()

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Any) -> None:
        if trainer.current_epoch != self.iteration:
            return
        if self.phase == "checkpoint":
            self._pause()
        if self.phase == "write":
            checkpoint["lppo_test_pause"] = _PauseWhenPickled(self.marker, self.seconds)


class PausingDatasetTask(DatasetTask):
    """A :class:`~lppo.tasks.DatasetTask` that pauses forever at one point of a fresh run.

    Args:
        path: see :class:`~lppo.tasks.DatasetTask` (as are the next six).
        prompt_field: the prompt's field.
        answer_field: the answer's field.
        template: the prompt's template.
        verifier: the reward function.
        seed: the shuffle seed.
        shuffle: shuffle each epoch.
        pause: ``admit:<k>``: the trainer pauses after drawing iteration ``k``'s prompts (its
            ``k``-th draw; past the first ``s + 1``, inside ``RolloutPipeline.publish``);
            ``generate:<k>``: the background rollout process pauses before rewarding
            iteration ``k``'s samples (its ``k``-th job); ``""``: never.
        marker: file written when the point is reached.
    """

    #: The pause is no setting of the run: a resumed run drops it.
    resume_safe: ClassVar[tuple[str, ...]] = ("pause", "marker")

    def __init__(
        self,
        path: str | list[str],
        prompt_field: str = "prompt",
        answer_field: str = "answer",
        template: str | None = None,
        verifier: Verifier | None = None,
        seed: int = 0,
        shuffle: bool = True,
        pause: str = "",
        marker: str = "",
    ) -> None:
        super().__init__(path, prompt_field, answer_field, template, verifier, seed, shuffle)
        where, _, at = pause.partition(":")
        self.pause_where, self.pause_at, self.marker = where, int(at or -1), marker
        self.draws = self.rewarded = 0

    def sample_prompts(self, n: int, generator: Any) -> list[Any]:
        """Draw as the dataset task does; pause after the ``admit`` draw."""
        prompts = super().sample_prompts(n, generator)
        if self.pause_where == "admit" and self.draws == self.pause_at:
            pause_forever(self.marker)
        self.draws += 1
        return prompts

    def rewards(self, prompts: list[Any], completions: list[str]) -> list[float]:
        """Reward as the dataset task does; the rollout process pauses at its ``generate`` job."""
        in_child = multiprocessing.current_process().name == "lppo-rollout"
        if in_child and self.pause_where == "generate" and self.rewarded == self.pause_at:
            pause_forever(self.marker)
        self.rewarded += 1
        return super().rewards(prompts, completions)


class PausingCopyTask(CopyTask):
    """The copy task whose reward pauses forever inside Ray rollout workers.

    Every reward call made in a Ray actor appends a line to ``<marker>.calls`` (the workers
    get a fresh copy of the task each rollout, so the count lives in that file); from the
    call that finds more than ``pause_at`` lines there on, the worker pauses. With 2 workers
    and one block, iteration ``k``'s parts are calls ``2k`` and ``2k + 1``.

    Args:
        marker: file written when the point is reached (``""``: never pause).
        pause_at: calls that go through before the workers pause.
        **kwargs: see :class:`~lppo.tasks.CopyTask`.
    """

    #: The pause is no setting of the run: a resumed run drops it.
    resume_safe: ClassVar[tuple[str, ...]] = ("pause_at", "marker")

    def __init__(self, marker: str = "", pause_at: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.marker, self.pause_at = marker, pause_at

    def rewards(self, prompts: list[Any], completions: list[str]) -> list[float]:
        """Reward as the copy task does; a Ray worker pauses from the ``pause_at``-th call."""
        ray = sys.modules.get("ray")
        if self.marker and ray is not None and ray.get_runtime_context().get_actor_id():
            calls = Path(f"{self.marker}.calls")
            with calls.open("a") as f:
                f.write("call\n")
            if len(calls.read_text().splitlines()) > self.pause_at:
                pause_forever(self.marker)
        return super().rewards(prompts, completions)
