"""lppo: streamed PPO post-training for language models, built on Lightning.

The main entry points, importable from the top level::

    from lppo import ActorModule, CriticModule, PPOSystem, PPOTrainer, ReplayDataModule
"""

from lppo.config import PPOConfig
from lppo.controller import IterationError, IterationResult, PPOController
from lppo.data import ReplayDataModule
from lppo.hooks import IterationContext, PPOCallback
from lppo.models import HFCausalLM
from lppo.modules import ActorModule, CriticModule, PPOModule, StepStateError
from lppo.replay import MemoryReplayStore, ReplayStore
from lppo.system import PPOSystem, RolloutSettings
from lppo.trainer import PPOTrainer

__version__ = "0.1.0"

__all__ = [
    "ActorModule",
    "CriticModule",
    "HFCausalLM",
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
    "ReplayDataModule",
    "ReplayStore",
    "RolloutSettings",
    "StepStateError",
]
