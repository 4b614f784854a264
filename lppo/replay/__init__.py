"""Replay stores: packed, variable-length rows of the running iteration."""

from lppo.replay.base import ReplayError, ReplayStore
from lppo.replay.memory import MemoryReplayStore

__all__ = ["MemoryReplayStore", "ReplayError", "ReplayStore"]
