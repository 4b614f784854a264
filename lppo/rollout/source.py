"""``RolloutSource``: where each iteration's rollout comes from.

Prompts from the task → the engine's samples → one batch call of ``Task.rewards`` → a packed
:class:`~lppo.types.Rollout`. Today rank 0 of the data-parallel group generates and the rollout
is broadcast, so every rank holds bit-identical rows; a source that generates on every rank
or in other processes replaces this object without touching the system or the controller.
"""

from __future__ import annotations

import hashlib
import random

from lppo.controller import IterationError
from lppo.modules import ActorModule
from lppo.parallel import SINGLE, ProcessGroup
from lppo.rollout.base import RewardError, RolloutEngine, RolloutSettings, score, to_rollout
from lppo.tasks import Task
from lppo.types import Rollout


class StaleWeightsError(RuntimeError):
    """A rollout engine would sample from weights older than the policy's."""


def derive_seed(*parts: object) -> int:
    """A stable 63-bit seed from any parts (independent of Python's hash randomization)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


class RolloutSource:
    """Generates and rewards each iteration's samples, keeping the engine on fresh weights.

    Args:
        task: prompt source and reward.
        engine: the rollout engine (already :meth:`~lppo.rollout.RolloutEngine.setup`).
        actor: the policy whose weights the engine must sample from.
        settings: sampling settings.
        seed: base seed; iteration ``i`` samples prompts and responses from seeds derived from
            ``(seed, i)``, so a resumed run samples exactly what the uninterrupted run would.
        group: the data-parallel group (rank 0 generates, the others receive its rollout).
    """

    def __init__(
        self,
        task: Task,
        engine: RolloutEngine,
        actor: ActorModule,
        settings: RolloutSettings,
        seed: int = 0,
        group: ProcessGroup = SINGLE,
    ) -> None:
        self.task = task
        self.engine = engine
        self.actor = actor
        self.settings = settings
        self.seed = seed
        self.group = group

    def sync(self) -> None:
        """Bring the engine to the actor's current weights (lppo calls it after each actor phase).

        Raises:
            StaleWeightsError: the engine did not report the actor's weights version after
                :meth:`~lppo.rollout.RolloutEngine.sync_from`.
        """
        version = self.actor.weights_version
        if self.engine.weights_version == version:
            return
        self.engine.sync_from(self.actor.model, version)
        if self.engine.weights_version != version:
            raise StaleWeightsError(
                f"{type(self.engine).__name__}.sync_from(policy, version={version}) left "
                f"weights_version={self.engine.weights_version}: the engine would sample from "
                "stale weights. An engine must set weights_version to the version it loaded."
            )

    def collect(self, iteration: int) -> Rollout:
        """The rewarded samples of ``iteration`` (generated on rank 0, identical on every rank)."""
        rollout = None
        if self.group.rank == 0:
            self.sync()  # never sample from weights older than the actor's
            s = self.settings
            prompts = self.task.sample_prompts(
                s.prompts_per_iteration, random.Random(derive_seed(self.seed, "prompts", iteration))
            )
            output = self.engine.generate(
                prompts, s.samples_per_prompt, seed=derive_seed(self.seed, "generate", iteration)
            )
            try:
                rewards = score(self.task, prompts, output)
            except RewardError as error:
                raise IterationError(f"iteration {iteration}, phase rollout: {error}") from error
            rollout = to_rollout(output, rewards)
        # Rank 0's rows everywhere, even where generation is not reproducible across devices.
        return self.group.broadcast_object(rollout, src=0)
