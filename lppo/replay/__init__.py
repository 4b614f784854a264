"""Replay stores: packed, variable-length rows of the running iteration."""

from lppo.replay.base import ReplayError, ReplayStore
from lppo.replay.memory import MemoryReplayStore
from lppo.replay.transfer_queue import TransferQueueReplayStore

__all__ = ["MemoryReplayStore", "ReplayError", "ReplayStore", "TransferQueueReplayStore"]
