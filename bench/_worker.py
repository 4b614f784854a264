"""The measuring side: one variant at one row count, run in a fresh process by the driver.

:func:`worker` builds the rows and the model, takes the memory baseline, runs a 2-chunk
warm-up and then the timed epochs, and returns plain JSON-able numbers.
"""

from __future__ import annotations

import argparse
import cProfile
import time
from collections.abc import Callable
from typing import Any

import torch
from _memory import ForeignLoad, PeakProbe, own_cpu_s
from _report import profile_report
from _rows import fill_store, iter_rows, row_meta
from _variants import (
    CRITIC_COLUMNS,
    Floor,
    FloorBatch,
    Timers,
    build_backbone,
    epoch_floor,
    epoch_merged,
    epoch_streamed,
    floor_chunk,
    floor_step,
    make_critic,
    plan_step,
    prepad_rows,
    prepad_store,
)
from torch import nn

from lppo.iteration.chunks import iter_chunks
from lppo.iteration.data_settings import DataSettings
from lppo.iteration.planner import ChunkPlanner
from lppo.modules import CriticModule
from lppo.replay import ReplayStore
from lppo.types import RowMeta

Result = dict[str, Any]


def timed_epochs(epochs: int, run: Callable[[Timers], Any]) -> Result:
    """Run ``run(timers)`` ``epochs`` times: wall, process CPU, other processes' load.

    Returns:
        ``times`` / ``cpu`` / ``foreign`` / ``per_chunk`` (one entry per epoch), ``timers``
        (of the last epoch) and ``last`` (what the last ``run`` returned).
    """
    out: Result = {"times": [], "cpu": [], "foreign": [], "per_chunk": []}
    last = None
    for _ in range(epochs):
        timers: Timers = {}
        load = ForeignLoad()
        cpu0 = own_cpu_s()
        t = time.perf_counter()
        last = run(timers)
        out["times"].append(time.perf_counter() - t)
        out["cpu"].append(own_cpu_s() - cpu0)
        out["foreign"].append(load.cores())
        out["per_chunk"].append(timers.pop("per_chunk"))
        out["timers"] = timers
    out["last"] = last
    return out


def backbone_of(args: argparse.Namespace) -> nn.Module:
    """The benchmark's model for the command line's sizes and seed."""
    return build_backbone(args.hidden, args.layers, args.heads, args.vocab, args.seed)


def worker(args: argparse.Namespace) -> Result:
    """Measure ``args.worker`` at ``args.n_rows`` rows in this (fresh) process."""
    torch.set_num_threads(args.threads)
    res: Result = {"variant": args.worker, "rows": args.n_rows}
    res["threads"] = torch.get_num_threads()
    planner = ChunkPlanner(DataSettings(max_tokens_per_chunk=args.chunk_tokens, seed=args.seed))
    backbone = backbone_of(args)
    if args.worker == "paired":
        return worker_paired(args, planner, backbone, res)
    if args.worker == "floor":
        meta, probe = _measure_floor(args, planner, backbone, res)
    else:
        meta, probe = _measure_on_store(args, planner, backbone, res)
    res["peak_method"] = probe.method
    full = plan_step(planner, meta, 0)
    res.update(
        chunks=full.num_chunks,
        padding_fraction=full.padding_fraction,
        tokens=sum(meta.lengths),
        valid_tokens=sum(meta.valid_tokens),
        max_len=max(meta.lengths),
    )
    return res


def _measure_on_store(
    args: argparse.Namespace, planner: ChunkPlanner, backbone: nn.Module, res: Result
) -> tuple[RowMeta, PeakProbe]:
    """Streamed or merged: rows in a store, the critic trained by ``CriticModule``."""
    store, info = fill_store(args.n_rows, args.seed, args.vocab)
    res.update(info)
    critic = make_critic(backbone)
    fn = epoch_streamed if args.worker == "streamed" else epoch_merged
    probe = PeakProbe()
    probe.start()
    fn(critic, planner, store, epoch=0, max_chunks=2)  # warm-up, no optimizer step
    run = timed_epochs(args.epochs, lambda tm: fn(critic, planner, store, epoch=0, timers=tm))
    res["peak_beyond"] = probe.peak_beyond()
    stats = run.pop("last")
    res.update(run, loss=stats.metrics["loss"], grad_norm=stats.grad_norm)
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        fn(critic, planner, store, epoch=0)
        prof.disable()
        res["profile"] = profile_report(prof)
    return store.meta(), probe


def _measure_floor(
    args: argparse.Namespace, planner: ChunkPlanner, backbone: nn.Module, res: Result
) -> tuple[RowMeta, PeakProbe]:
    """Floor: the rows pre-padded into the plan's chunks (before the baseline), bare loop."""
    rows = dict(enumerate(iter_rows(args.n_rows, args.seed, args.vocab)))
    meta = row_meta(rows)
    plan = plan_step(planner, meta, 0)
    batches = prepad_rows(rows, plan)
    del rows  # only the padded chunks stay, as in the timed loop
    n_valid = plan.normalizers.valid_tokens
    floor = Floor.like(make_critic(backbone))
    probe = PeakProbe()
    probe.start()
    epoch_floor(floor, batches, n_valid, max_chunks=2)  # warm-up, no optimizer step
    run = timed_epochs(args.epochs, lambda tm: epoch_floor(floor, batches, n_valid, timers=tm))
    res["peak_beyond"] = probe.peak_beyond()
    stats = run.pop("last")
    res.update(run, loss=stats["loss"], grad_norm=stats["grad_norm"])
    return meta, probe


def worker_paired(
    args: argparse.Namespace, planner: ChunkPlanner, backbone: nn.Module, res: Result
) -> Result:
    """Streamed vs floor chunk by chunk in one process (alternating order), for timing only.

    Other processes sharing the CPU slow both members of a pair alike, so the per-chunk ratio
    is far less noisy than comparing two separate runs.
    """
    store, _ = fill_store(args.n_rows, args.seed, args.vocab)
    critic = make_critic(backbone)
    floor = Floor.like(make_critic(backbone_of(args)))  # same seed: identical weights
    plan = plan_step(planner, store.meta(), 0)
    batches = prepad_store(store, plan)
    n_valid = plan.normalizers.valid_tokens
    epoch_streamed(critic, planner, store, epoch=0, max_chunks=2)  # warm-up
    epoch_floor(floor, batches, n_valid, max_chunks=2)  # warm-up

    epochs: list[Result] = []
    t_all = time.perf_counter()
    # Repeat whole paired epochs (per-chunk minimum is taken later) within a small time budget.
    while not epochs or (len(epochs) < 5 and time.perf_counter() - t_all < args.paired_budget):
        epochs.append(paired_epoch(critic, floor, planner, store, batches, n_valid))
    res["epochs"] = epochs
    return res


def paired_epoch(
    critic: CriticModule,
    floor: Floor,
    planner: ChunkPlanner,
    store: ReplayStore,
    batches: list[FloorBatch],
    n_valid: int,
) -> Result:
    """One epoch of each, interleaved chunk by chunk; streamed first on even chunks."""
    pc = time.perf_counter
    load = ForeignLoad()
    t0 = pc()
    plan = plan_step(planner, store.meta(), 0)
    critic.begin(plan)
    t_begin = pc() - t0
    floor.opt.zero_grad(set_to_none=True)
    it = iter_chunks(store, plan, CRITIC_COLUMNS)
    t_read, t_train, tf, floor_loss = [], [], [], 0.0
    for k, c in enumerate(batches):
        for who in "sf" if k % 2 == 0 else "fs":
            t = pc()
            if who == "s":
                chunk = next(it)
                t_mid = pc()
                critic.train_chunk(chunk)
                del chunk
                t_read.append(t_mid - t)
                t_train.append(pc() - t_mid)
            else:
                floor_loss += floor_chunk(floor, c, n_valid)
                tf.append(pc() - t)
    t = pc()
    stats = critic.finish()
    t_finish = pc() - t
    t = pc()
    norm = floor_step(floor)
    t_step = pc() - t
    return {
        "read": t_read,
        "train": t_train,
        "tf": tf,
        "t_begin": t_begin,
        "t_finish": t_finish,
        "t_step": t_step,
        "foreign": load.cores(),
        "loss": stats.metrics["loss"],
        "floor_loss": floor_loss,
        "grad_norm": stats.grad_norm,
        "floor_grad_norm": norm,
    }
