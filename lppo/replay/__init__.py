"""Replay stores: packed, variable-length rows of the running iteration."""

from lppo.replay.base import InspectableStore, ReplayError, ReplayStore
from lppo.replay.memory import MemoryReplayStore
from lppo.replay.transfer_queue import TransferQueueReplayStore

__all__ = [
    "InspectableStore",
    "MemoryReplayStore",
    "ReplayError",
    "ReplayStore",
    "TransferQueueReplayStore",
]
