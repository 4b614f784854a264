"""lppo: streamed PPO post-training for language models, built on Lightning.

The main entry points, importable from the top level::

    from lppo import ActorModule, CriticModule, PPOSystem, PPOTrainer, ReplayDataModule
"""

from lppo.config import PPOConfig
from lppo.controller import PPOController
from lppo.data import ReplayDataModule
from lppo.errors import IterationError
from lppo.estimators import GAE, AdvantageEstimator
from lppo.hooks import IterationContext, PPOCallback
from lppo.models import HFCausalLM
from lppo.modules import ActorModule, CriticModule, PPOModule, StepStateError
from lppo.parallel import ParallelContext, ProcessGroup
from lppo.replay import MemoryReplayStore, ReplayStore
from lppo.rollout import HFGenerateEngine, RolloutEngine, RolloutSettings
from lppo.system import PPOSystem
from lppo.trainer import PPOTrainer
from lppo.types import IterationResult

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
