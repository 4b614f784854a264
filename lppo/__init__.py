"""lppo: streamed PPO post-training for language models, built on Lightning.

The main entry points, importable from the top level::

    from lppo import ActorModule, CriticModule, PPOSystem, PPOTrainer, ReplayDataModule
"""

from lppo import _moved
from lppo.config import PPOConfig
from lppo.errors import IterationError
from lppo.estimators import GAE, AdvantageEstimator
from lppo.iteration.controller import PPOController
from lppo.iteration.data import ReplayDataModule
from lppo.iteration.hooks import IterationContext, PPOCallback
from lppo.layouts.base import ParallelContext
from lppo.modules import ActorModule, CriticModule, PPOModule, StepStateError
from lppo.modules.models import HFCausalLM
from lppo.parallel import ProcessGroup
from lppo.replay import MemoryReplayStore, ReplayStore
from lppo.rollout import HFGenerateEngine, RolloutEngine, RolloutSettings
from lppo.run.system import PPOSystem
from lppo.run.trainer import PPOTrainer
from lppo.types import IterationResult

_moved.install()  # old module paths (lppo.system, lppo.models, ...) keep importing

__version__ = "0.1.0"

__all__ = [
    "GAE",
    "ActorModule",
    "AdvantageEstimator",
    "CriticModule",
    "HFCausalLM",
    "HFGenerateEngine",
    "IterationContext",
    "IterationError",
    "IterationResult",
    "MemoryReplayStore",
    "PPOCallback",
    "PPOConfig",
    "PPOController",
    "PPOModule",
    "PPOSystem",
    "PPOTrainer",
    "ParallelContext",
    "ProcessGroup",
    "ReplayDataModule",
    "ReplayStore",
    "RolloutEngine",
    "RolloutSettings",
    "StepStateError",
]
