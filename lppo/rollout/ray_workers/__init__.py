"""Rollout workers: Ray actors running any engine, each on its own copy of the policy."""

from lppo.rollout.ray_workers.engine import RayWorkersEngine
from lppo.rollout.ray_workers.worker import RolloutWorker, RolloutWorkerError

__all__ = ["RayWorkersEngine", "RolloutWorker", "RolloutWorkerError"]
