"""Run as a script: a TransferQueue store on its own Ray (``argv[1]`` as ``_temp_dir``, store
``timeout_s`` ``argv[2]``) loses its storage unit to SIGKILL; print what a read then raises.

Output (last line, JSON): ``error`` (type name), ``message``, ``partition``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil
import torch
from _tq import ray_processes

from lppo.replay import TransferQueueReplayStore
from lppo.runtime.ray_runtime import RaySettings, configure_ray


def main() -> None:
    configure_ray(RaySettings(num_cpus=3, temp_dir=sys.argv[1]))
    store = TransferQueueReplayStore(timeout_s=float(sys.argv[2]))
    ids = store.allocate(2)
    store.put(ids, {"input_ids": [torch.arange(3), torch.arange(4)]})
    assert [t.tolist() for t in store.read(ids, ["input_ids"])["input_ids"]] == [
        [0, 1, 2],
        [0, 1, 2, 3],
    ]
    units = [pid for pid, name in ray_processes().items() if "SimpleStorageUnit" in name]
    assert len(units) == 1, ray_processes()
    os.kill(units[0], signal.SIGKILL)
    psutil.wait_procs([psutil.Process(units[0])], timeout=30)
    try:
        store.read(ids, ["input_ids"])
        out = {"error": None, "message": ""}
    except Exception as error:  # what the trainer would see mid-phase
        out = {"error": type(error).__name__, "message": str(error)}
    out["partition"] = store.partition
    try:
        store.close()  # bounded too; stops this process's Ray
    except Exception as error:
        out["close"] = type(error).__name__
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
