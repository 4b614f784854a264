"""Whether a set of Ray rollout workers can be placed: the CPUs it needs, the cluster's free.

Ray queues an actor it cannot place instead of failing, so a set of workers that does not fit
would only fail when its start times out (``model.engine.init_args.timeout_s``, minutes). The
run plan counts the CPUs of a local Ray before anything starts
(:meth:`lppo.run.plan.RunPlan.resolve`); :func:`acquire_for_workers` checks the free CPUs of
whatever Ray the workers land on (an attached cluster, a Ray already running) as each set
starts, and refuses with the keys and the fix.
"""

from __future__ import annotations

import time

from lppo.runtime.ray_runtime import acquire_ray, ray_module, release_ray
from lppo.validation import SettingError

__all__ = ["acquire_for_workers"]

_KEY = "model.engine.init_args"
#: Longest wait for the CPUs a set needs: the CPUs of workers just killed (``ray.kill`` is
#: asynchronous) show up as free a little later, seconds on a busy machine.
CPU_WAIT_S = 30.0


def acquire_for_workers(num_workers: int, staleness: int) -> None:
    """Acquire Ray for a set of ``num_workers`` workers (one CPU each), once they fit.

    Args:
        num_workers: ``model.engine.init_args.num_workers``.
        staleness: ``model.rollout.max_staleness`` (named in the refusal: a lag above 0
            starts a second set of workers).

    Raises:
        SettingError: the cluster has fewer CPUs than ``num_workers``, or fewer free ones
            after :data:`CPU_WAIT_S` (Ray is released again).
    """
    acquire_ray("ray")
    try:
        _wait_for_cpus(num_workers, staleness)
    except BaseException:
        release_ray()
        raise


def _wait_for_cpus(need: int, staleness: int) -> None:
    ray = ray_module()
    deadline = time.monotonic() + CPU_WAIT_S
    total = ray.cluster_resources().get("CPU", 0)
    while (free := ray.available_resources().get("CPU", 0)) < need:
        if need > total or time.monotonic() > deadline:  # more than it has: no use waiting
            raise SettingError(_refusal(need, free, total, staleness))
        time.sleep(0.2)


def _refusal(need: int, free: float, total: float, staleness: int) -> str:
    why = ""
    if staleness:
        why = (
            f" (model.rollout.max_staleness={staleness}: the asynchronous rollouts start a "
            "second set of workers beside the first)"
        )
    fix = ", or set model.rollout.max_staleness: 0." if staleness else "."
    return (
        f"{_KEY}.num_workers={need} rollout workers need {need} free Ray CPUs (one each) but "
        f"the cluster has {free:g} free of {total:g}{why}; Ray would wait for them until "
        f"{_KEY}.timeout_s. Use fewer workers, raise trainer.ray.num_cpus for a local Ray "
        f"(logical CPUs, not cores) or add nodes to the cluster{fix}"
    )
