"""Benchmark: one critic epoch, streamed (lppo) vs merged payload vs a plain PyTorch floor.

Not a test: it prints a markdown report. Every (row count, variant, round) runs in its own fresh
subprocess so the peak RSS it reports is clean. Usage::

    .venv/bin/python bench/critic_epoch.py [--rows 256 1024 4096] [--repeats 3]

Variants (identical rows, identical model weights, identical chunks of ``--chunk-tokens`` padded
tokens, identical clipped value loss normalized by the global valid-token count, one AdamW step
with grad-norm clip 1.0 at the end of the epoch):

* ``streamed``: rows in a ``MemoryReplayStore``; ``ChunkPlanner`` plans the step;
  ``CriticModule.begin -> train_chunk(c) for c in iter_chunks(...) -> finish``. Each chunk is
  read from the store and padded only when reached.
* ``merged``: the same store and plan, but every row is first read and padded to the global
  longest row into ONE batch (the merged payload: input_ids, attention_mask, response_mask,
  values, returns), which is held for the whole epoch. Micro-batches are slices of that padded
  batch with the same row groups as the plan, each sliced to its own longest row (so the
  compute is the same as streamed; only the data path and its memory differ), trained through
  the same ``CriticModule.train_chunk``.
* ``floor``: no lppo machinery in the loop: the identical chunks are pre-padded before timing
  (not counted in time or in peak memory), then a bare loop: backbone + value head forward,
  clipped value loss as masked sum / global token count, backward; clip + AdamW step at the end.

Memory: peak RSS of the training part only: the kernel's high-water mark (``VmHWM``) is reset
through ``/proc/self/clear_refs`` right after the rows are in the store (floor: the chunks are
pre-padded) and the model is built; the reported number is ``VmHWM - VmRSS(at reset)``, i.e.
training-process peak beyond the store. Falls back to a 5 ms psutil poller if the reset is
not available.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import math
import os
import pstats
import random
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import torch

VARIANTS = ("streamed", "merged", "floor")
FIELDS = ("input_ids", "response_mask", "values", "returns")
MiB = 1024 * 1024


# --------------------------------------------------------------------------- memory probes
def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def anon_bytes() -> int:
    """Anonymous resident memory (heap): what the store's data occupies, without code pages."""
    return _status_kib("RssAnon") * 1024


class PeakProbe:
    """Peak RSS from a reset point: kernel high-water mark, or a 5 ms poller as fallback."""

    def __init__(self) -> None:
        self.base = 0
        self.method = "VmHWM reset"
        self._poll_peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        gc.collect()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            self.base = rss_bytes()
            if _status_kib("VmHWM") * 1024 > self.base + MiB:
                raise OSError("VmHWM did not reset")
        except OSError:
            import psutil

            self.method = "psutil poll 5 ms"
            proc = psutil.Process()
            self.base = proc.memory_info().rss
            self._poll_peak = self.base

            def poll() -> None:
                while not self._stop.is_set():
                    self._poll_peak = max(self._poll_peak, proc.memory_info().rss)
                    time.sleep(0.005)

            self._thread = threading.Thread(target=poll, daemon=True)
            self._thread.start()

    def peak_beyond(self) -> int:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            return self._poll_peak - self.base
        return _status_kib("VmHWM") * 1024 - self.base


def _cpu_busy_s() -> float:
    """CPU seconds spent busy by the whole machine (all cores) since boot."""
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    busy = sum(parts[:8]) - parts[3] - parts[4]  # minus idle and iowait
    return busy / os.sysconf("SC_CLK_TCK")


class ForeignLoad:
    """Average number of cores other processes kept busy while this one ran (contention)."""

    def __init__(self) -> None:
        self.t, self.busy, self.own = time.perf_counter(), _cpu_busy_s(), sum(os.times()[:2])

    def cores(self) -> float:
        dt = time.perf_counter() - self.t
        own = sum(os.times()[:2]) - self.own
        return max(0.0, (_cpu_busy_s() - self.busy - own) / max(dt, 1e-9))


def wait_for_quiet(max_wait: float, threshold: float = 0.25) -> float:
    """Wait (up to ``max_wait`` s) until other processes use < ``threshold`` cores."""
    t0 = time.perf_counter()
    while True:
        load = ForeignLoad()
        time.sleep(1.0)
        if load.cores() < threshold or time.perf_counter() - t0 > max_wait:
            return time.perf_counter() - t0


# --------------------------------------------------------------------------- data and model
def gen_row(rng: random.Random, gen: torch.Generator, vocab: int) -> dict[str, torch.Tensor]:
    """One row: prompt 16–64 + response 16–448 tokens; float fields 0 off the response."""
    p, r = rng.randint(16, 64), rng.randint(16, 448)
    n = p + r
    ids = torch.randint(0, vocab, (n,), generator=gen, dtype=torch.int64)
    mask = torch.zeros(n, dtype=torch.bool)
    mask[p:] = True
    values = torch.randn(n, generator=gen) * 0.5
    returns = values + torch.randn(n, generator=gen) * 0.3
    return {
        "input_ids": ids,
        "response_mask": mask,
        "values": torch.where(mask, values, 0.0),
        "returns": torch.where(mask, returns, 0.0),
    }


def iter_rows(n_rows: int, seed: int, vocab: int):
    """Deterministic rows; the first k rows are the same for any n_rows >= k."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n_rows):
        yield gen_row(rng, gen, vocab)


def build_backbone(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaModel

    cfg = LlamaConfig(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        intermediate_size=4 * args.hidden,
        vocab_size=args.vocab,
        max_position_embeddings=1024,
        attn_implementation="sdpa",
    )
    torch.manual_seed(args.seed)
    return LlamaModel(cfg).to(torch.float32)


def head_like_critic(hidden: int, head_seed: int = 0, std: float = 0.02) -> torch.nn.Linear:
    """The value head exactly as ``CriticModule._attach`` initializes it."""
    head = torch.nn.Linear(hidden, 1)
    gen = torch.Generator().manual_seed(head_seed)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=gen) * std)
        head.bias.zero_()
    return head


# --------------------------------------------------------------------------- the three epochs
def make_critic(backbone: torch.nn.Module):
    from lppo.modules import CriticModule

    return CriticModule(backbone, value_clip=0.2, lr=1e-5, max_grad_norm=1.0)


def plan_step(planner, store, epoch: int):
    return planner.plan(store.meta(), epoch=epoch, minibatches=1, phase="critic").steps[0]


def epoch_streamed(critic, planner, store, epoch, max_chunks=None, timers=None):
    from lppo.chunks import iter_chunks
    from lppo.types import RETURNS, VALUES

    pc = time.perf_counter
    t0 = pc()
    plan = plan_step(planner, store, epoch)
    t_plan = pc() - t0
    critic.begin(plan)
    t_read = t_train = 0.0
    per_chunk = []
    it = iter_chunks(store, plan, [VALUES, RETURNS])
    for k in range(plan.num_chunks):
        if max_chunks is not None and k >= max_chunks:
            break
        a = pc()
        chunk = next(it)
        b = pc()
        critic.train_chunk(chunk)
        c = pc()
        t_read += b - a
        t_train += c - b
        per_chunk.append(c - a)
        del chunk
    if max_chunks is not None:
        critic.abort()
        return None
    a = pc()
    stats = critic.finish()
    t_finish = pc() - a
    if timers is not None:
        timers.update(plan=t_plan, read_collate=t_read, train_chunk=t_train, finish=t_finish)
        timers["per_chunk"] = per_chunk
    return stats


def materialize_merged(store, order: list[int]) -> dict[str, torch.Tensor]:
    """Read every row and pad to the global longest row: the merged payload."""
    from torch.nn.utils.rnn import pad_sequence

    cols = store.read(order, list(FIELDS))
    lengths = torch.tensor([int(t.shape[0]) for t in cols["input_ids"]])
    merged = {name: pad_sequence(rows, batch_first=True) for name, rows in cols.items()}
    del cols
    width = merged["input_ids"].shape[1]
    merged["attention_mask"] = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    return merged


def epoch_merged(critic, planner, store, epoch, max_chunks=None, timers=None):
    from lppo.types import Chunk

    pc = time.perf_counter
    t0 = pc()
    plan = plan_step(planner, store, epoch)
    order = [i for c in plan.chunks for i in c]
    merged = materialize_merged(store, order)
    meta = store.meta(order)
    length = dict(zip(meta.ids, meta.lengths, strict=True))
    t_mat = pc() - t0
    if timers is not None:
        timers["payload_bytes"] = sum(t.numel() * t.element_size() for t in merged.values())
        timers["payload_shape"] = list(merged["input_ids"].shape)
    critic.begin(plan)
    start = 0
    per_chunk = []
    for k, rows in enumerate(plan.chunks):
        if max_chunks is not None and k >= max_chunks:
            break
        end, w = start + len(rows), max(length[i] for i in rows)
        chunk = Chunk(
            row_ids=rows,
            input_ids=merged["input_ids"][start:end, :w],
            attention_mask=merged["attention_mask"][start:end, :w],
            response_mask=merged["response_mask"][start:end, :w],
            values=merged["values"][start:end, :w],
            returns=merged["returns"][start:end, :w],
        )
        a = pc()
        critic.train_chunk(chunk)
        per_chunk.append(pc() - a)
        del chunk
        start = end
    if max_chunks is not None:
        critic.abort()
        return None
    stats = critic.finish()
    del merged  # held for the whole epoch, as a merged-payload framework does
    if timers is not None:
        timers["materialize"] = t_mat
        timers["per_chunk"] = per_chunk
    return stats


def prepad_chunks(rows: dict[int, dict[str, torch.Tensor]], chunks) -> list[dict]:
    from torch.nn.utils.rnn import pad_sequence

    out = []
    for ids in chunks:
        d = {k: pad_sequence([rows[i][k] for i in ids], batch_first=True) for k in FIELDS}
        w = d["input_ids"].shape[1]
        lens = torch.tensor([rows[i]["input_ids"].shape[0] for i in ids])
        d["attention_mask"] = (torch.arange(w).unsqueeze(0) < lens.unsqueeze(1)).long()
        out.append(d)
    return out


def floor_setup(backbone: torch.nn.Module, hidden: int):
    head = head_like_critic(hidden)
    params = [*backbone.parameters(), *head.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    backbone.train()
    return head, params, opt


def floor_chunk(backbone, head, c: dict[str, torch.Tensor], n_valid: int) -> float:
    """Forward, clipped value loss as masked sum / global valid tokens, backward."""
    h = backbone(input_ids=c["input_ids"], attention_mask=c["attention_mask"])
    v = head(h.last_hidden_state[:, :-1]).squeeze(-1)  # predicts positions 1..T-1
    old, ret, m = c["values"][:, 1:], c["returns"][:, 1:], c["response_mask"][:, 1:]
    v_clip = old + torch.clamp(v - old, -0.2, 0.2)
    per_tok = 0.5 * torch.maximum((v - ret).square(), (v_clip - ret).square())
    loss = (per_tok * m).sum() / n_valid
    loss.backward()
    return float(loss.detach())


def floor_step(params, opt) -> float:
    norm = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
    opt.step()
    opt.zero_grad(set_to_none=True)
    return norm


def epoch_floor(backbone, head, opt, params, chunks, n_valid, max_chunks=None, timers=None):
    """Bare PyTorch loop over pre-padded chunks; one clipped AdamW step at the end."""
    pc = time.perf_counter
    opt.zero_grad(set_to_none=True)
    total = 0.0
    per_chunk = []
    for k, c in enumerate(chunks):
        if max_chunks is not None and k >= max_chunks:
            break
        a = pc()
        total += floor_chunk(backbone, head, c, n_valid)
        per_chunk.append(pc() - a)
    if max_chunks is not None:
        opt.zero_grad(set_to_none=True)
        return None
    norm = floor_step(params, opt)
    if timers is not None:
        timers["per_chunk"] = per_chunk
    return {"loss": total, "grad_norm": norm}


# --------------------------------------------------------------------------- worker processes
def fill_store(args: argparse.Namespace):
    """Put the rows into a MemoryReplayStore one at a time; return it and its byte counts."""
    from lppo.replay import MemoryReplayStore

    # Warm up every code path on a throwaway store first, so the measured growth is the store's
    # data, not torch / lppo code and caches touched for the first time.
    warm = MemoryReplayStore()
    for i, row in enumerate(iter_rows(8, args.seed + 1, args.vocab)):
        warm.put([i], {k: [v] for k, v in row.items()})
    warm.read(list(range(8)), list(row))
    warm.release(list(range(8)))
    del warm, row
    store = MemoryReplayStore()
    raw = 0
    gc.collect()
    rss_before = anon_bytes()
    for i, row in enumerate(iter_rows(args.n_rows, args.seed, args.vocab)):
        raw += sum(t.numel() * t.element_size() for t in row.values())
        store.put([i], {k: [v] for k, v in row.items()})
    del row
    gc.collect()
    info = {
        "raw_bytes": raw,
        "store_nbytes": store.nbytes(),
        "store_rss_delta": anon_bytes() - rss_before,
    }
    return store, info


def timed_epochs(args, run) -> dict[str, list]:
    """Run ``run(timers)`` ``args.epochs`` times: wall, process CPU, other processes' load."""
    out: dict[str, list] = {"times": [], "cpu": [], "foreign": [], "per_chunk": []}
    last = None
    for _ in range(args.epochs):
        timers: dict[str, Any] = {}
        load = ForeignLoad()
        cpu0 = sum(os.times()[:2])
        t = time.perf_counter()
        last = run(timers)
        out["times"].append(time.perf_counter() - t)
        out["cpu"].append(sum(os.times()[:2]) - cpu0)
        out["foreign"].append(load.cores())
        out["per_chunk"].append(timers.pop("per_chunk"))
        out["timers"] = timers
    out["last"] = last
    return out


def worker(args: argparse.Namespace) -> dict[str, Any]:
    from lppo.planner import ChunkPlanner
    from lppo.types import RowMeta

    torch.set_num_threads(args.threads)
    variant = args.worker
    res: dict[str, Any] = {"variant": variant, "rows": args.n_rows}
    res["threads"] = torch.get_num_threads()
    planner = ChunkPlanner(max_tokens_per_chunk=args.chunk_tokens, seed=args.seed)
    backbone = build_backbone(args)
    if variant == "paired":
        return worker_paired(args, planner, backbone, res)

    if variant in ("streamed", "merged"):
        store, info = fill_store(args)
        res.update(info)
        meta = store.meta()
        critic = make_critic(backbone)
        probe = PeakProbe()
        probe.start()
        fn = epoch_streamed if variant == "streamed" else epoch_merged
        fn(critic, planner, store, epoch=0, max_chunks=2)  # warm-up, no optimizer step
        run = timed_epochs(args, lambda tm: fn(critic, planner, store, epoch=0, timers=tm))
        res["peak_beyond"] = probe.peak_beyond()
        stats = run.pop("last")
        res.update(run, loss=stats.metrics["loss"], grad_norm=stats.grad_norm)
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            fn(critic, planner, store, epoch=0)
            prof.disable()
            res["profile"] = profile_report(prof)
    else:
        rows = dict(enumerate(iter_rows(args.n_rows, args.seed, args.vocab)))
        meta = RowMeta(
            ids=tuple(rows),
            lengths=tuple(int(r["input_ids"].shape[0]) for r in rows.values()),
            valid_tokens=tuple(int(r["response_mask"].sum()) for r in rows.values()),
        )
        plan = planner.plan(meta, epoch=0, minibatches=1, phase="critic").steps[0]
        chunks = prepad_chunks(rows, plan.chunks)
        del rows
        n_valid = plan.normalizers.valid_tokens
        head, params, opt = floor_setup(backbone, args.hidden)
        probe = PeakProbe()
        probe.start()
        epoch_floor(backbone, head, opt, params, chunks, n_valid, max_chunks=2)  # warm-up
        run = timed_epochs(
            args, lambda tm: epoch_floor(backbone, head, opt, params, chunks, n_valid, timers=tm)
        )
        res["peak_beyond"] = probe.peak_beyond()
        stats = run.pop("last")
        res.update(run, loss=stats["loss"], grad_norm=stats["grad_norm"])

    res["peak_method"] = probe.method
    full = planner.plan(meta, epoch=0, minibatches=1, phase="critic").steps[0]
    res.update(
        chunks=full.num_chunks,
        padding_fraction=full.padding_fraction,
        tokens=sum(meta.lengths),
        valid_tokens=sum(meta.valid_tokens),
        max_len=max(meta.lengths),
    )
    return res


def worker_paired(args, planner, backbone, res: dict[str, Any]) -> dict[str, Any]:
    """Streamed vs floor chunk by chunk in one process (alternating order), for timing only.

    Other processes sharing the CPU slow both members of a pair alike, so the per-chunk ratio
    is far less noisy than comparing two separate runs.
    """
    from lppo.chunks import iter_chunks
    from lppo.types import RETURNS, VALUES

    store, _ = fill_store(args)
    critic = make_critic(backbone)
    fb = build_backbone(args)  # same seed: identical weights
    head, params, opt = floor_setup(fb, args.hidden)
    plan = plan_step(planner, store, 0)
    ids = [i for c in plan.chunks for i in c]
    cols = store.read(ids, list(FIELDS))
    rows = {i: {k: cols[k][j] for k in FIELDS} for j, i in enumerate(ids)}
    chunks = prepad_chunks(rows, plan.chunks)
    del cols, rows
    n_valid = plan.normalizers.valid_tokens
    epoch_streamed(critic, planner, store, epoch=0, max_chunks=2)  # warm-up
    epoch_floor(fb, head, opt, params, chunks, n_valid, max_chunks=2)  # warm-up

    pc = time.perf_counter
    epochs: list[dict[str, Any]] = []
    t_all = pc()
    # Repeat whole paired epochs (per-chunk minimum is taken later) within a small time budget.
    while not epochs or (len(epochs) < 5 and pc() - t_all < args.paired_budget):
        load = ForeignLoad()
        t0 = pc()
        plan = plan_step(planner, store, 0)
        critic.begin(plan)
        t_begin = pc() - t0
        opt.zero_grad(set_to_none=True)
        it = iter_chunks(store, plan, [VALUES, RETURNS])
        t_read, t_train, tf, floor_loss = [], [], [], 0.0
        for k, c in enumerate(chunks):
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
                    floor_loss += floor_chunk(fb, head, c, n_valid)
                    tf.append(pc() - t)
        t = pc()
        stats = critic.finish()
        t_finish = pc() - t
        t = pc()
        norm = floor_step(params, opt)
        t_step = pc() - t
        epochs.append(
            {
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
        )
    res["epochs"] = epochs
    return res


def profile_report(prof: cProfile.Profile) -> str:
    """Top functions by own time, plus cumulative time of lppo's own entry points."""
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("tottime").print_stats(18)
    watch = (
        "chunks.py:",
        "memory.py:",
        "critic.py:",
        "lifecycle.py:",
        "losses.py:",
        "types.py:",
        "planner.py:",
    )
    rows = []
    for (file, line, name), (_cc, _nc, tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        short = f"{os.path.basename(file)}:{line}({name})"
        if "/lppo/" in file and any(w in short for w in watch):
            rows.append((ct, tt, short))
    rows.sort(reverse=True)
    s.write("\nlppo functions by cumulative time (s):\n")
    for ct, tt, short in rows[:25]:
        s.write(f"  {ct:8.3f} cum  {tt:8.3f} own  {short}\n")
    return s.getvalue()


# --------------------------------------------------------------------------- driver
def run_worker(args: argparse.Namespace, variant: str, n_rows: int, profile: bool = False):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", variant, "--n-rows", str(n_rows)]
    for name in ("threads", "chunk_tokens", "hidden", "layers", "heads", "vocab", "seed"):
        cmd += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    cmd += ["--epochs", str(args.epochs), "--paired-budget", str(args.paired_budget)]
    if profile:
        cmd.append("--profile")
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        sys.stderr.write(out.stdout + out.stderr)
        raise SystemExit(f"worker {variant} rows={n_rows} failed (rc {out.returncode})")
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


def fmt_mib(b: float) -> str:
    return f"{b / MiB:.1f}"


HEADER = """\
- **streamed** (lppo): `MemoryReplayStore` → `ChunkPlanner` → `CriticModule.begin` → \
`train_chunk(c) for c in iter_chunks(store, plan, …)` (each chunk read + padded only when \
reached) → `finish`.
- **merged**: same store, plan and `CriticModule`, but every row is first read and padded to the \
global longest row into ONE payload (input_ids, attention_mask, response_mask, values, returns) \
held for the whole epoch; micro-batches are slices of it with the *same row groups as the plan*, \
each cut to its own longest row, so compute equals streamed and only the data path and memory \
differ. (A framework running fixed micro-batches at the full padded width would also pay the \
padding in compute; that is NOT charged to merged here.)
- **floor**: bare PyTorch loop over the identical chunks, pre-padded before timing and before \
the memory baseline; same backbone, value head and clipped value loss (masked sum / global \
valid tokens), backward, one clipped AdamW step; no store, no planner, no diagnostics.
- **paired**: streamed and floor in ONE process, chunk by chunk, alternating which goes first; \
per-chunk contention hits both alike, so this is the robust lppo-overhead number on a shared box.
- **time**: wall time of one epoch after a 2-chunk warm-up (streamed/merged include planning, \
store reads and padding; merged includes building the payload); {repeats} round(s) × \
{epochs} epoch(s), each variant in a fresh subprocess, variant order rotated per round.
- **peak**: kernel RSS high-water mark (reset via /proc/self/clear_refs) minus RSS right after \
the rows are in the store (floor: chunks pre-padded) and the model is built = training-process \
peak beyond the store.
"""


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument(
        "--repeats", type=int, default=3, help="rounds; each runs every variant in a fresh process"
    )
    p.add_argument("--epochs", type=int, default=1, help="timed epochs per subprocess")
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--chunk-tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=3.0,
        help="before each run, wait up to this many s for other processes to idle",
    )
    p.add_argument(
        "--paired-budget",
        type=float,
        default=20.0,
        help="the paired run repeats its epoch (≤ 5 times) while under this many seconds",
    )
    p.add_argument(
        "--retry-budget",
        type=float,
        default=90.0,
        help="seconds of extra runs allowed to replace runs slowed by other processes",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="cProfile one streamed epoch at the largest row count (automatic when slow)",
    )
    p.add_argument("--worker", choices=(*VARIANTS, "paired"), help=argparse.SUPPRESS)
    p.add_argument("--n-rows", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.worker:
        print("RESULT " + json.dumps(worker(args)))
        return

    t_start = time.perf_counter()
    print("# Critic epoch: streamed (lppo) vs merged payload vs plain-PyTorch floor\n")
    print(
        f"Command: `{' '.join([os.path.relpath(sys.executable), *sys.argv])}`  \n"
        f"Model: random `LlamaModel` (hidden {args.hidden}, {args.layers} layers, {args.heads} "
        f"heads, MLP {4 * args.hidden}, vocab {args.vocab}, float32, sdpa) + scalar value head; "
        f"CPU, torch {torch.__version__}, `torch.set_num_threads({args.threads})` in every "
        f"variant.  \n"
        "Rows: prompt 16–64 + response 16–448 tokens (≤ 512), response_mask True on response "
        "tokens; columns input_ids int64, response_mask bool, values / returns float32 (the "
        "same rows in every variant; the first k rows are shared by every row count).  \n"
        f"Chunks: `ChunkPlanner(max_tokens_per_chunk={args.chunk_tokens})`, one optimizer step "
        "per epoch (minibatches=1); clipped value loss (ε 0.2), global token mean, grad-norm "
        "clip 1.0, AdamW lr 1e-5.\n"
    )
    print(HEADER.format(repeats=args.repeats, epochs=args.epochs))
    sys.stdout.flush()

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    results: dict[int, dict[str, list[dict]]] = {n: {v: [] for v in VARIANTS} for n in args.rows}
    paired: dict[int, list[dict]] = {n: [] for n in args.rows}
    waited = 0.0
    retry_end = None  # deadline for extra runs, set when the first retry starts
    busy = 0.25  # other processes' cores above which a run counts as contended

    def one(n: int, v: str, tag: str) -> None:
        nonlocal waited
        waited += wait_for_quiet(args.quiet_wait, busy)
        res = run_worker(args, v, n)
        if v == "paired":
            paired[n] += res["epochs"]
            ep = res["epochs"]
            log(
                f"  rows={n:5d} {tag:8s} paired   {len(ep)} epoch(s), streamed "
                f"{min(sum(e['read']) + sum(e['train']) for e in ep):.2f} s vs floor "
                f"{min(sum(e['tf']) for e in ep):.2f} s in chunks (others: "
                f"{min(e['foreign'] for e in ep):.2f} cores)"
            )
            return
        results[n][v].append(res)
        log(
            f"  rows={n:5d} {tag:8s} {v:8s} epoch {min(res['times']):7.2f} s "
            f"(others: {min(res['foreign']):.2f} cores)  peak beyond store "
            f"{fmt_mib(res['peak_beyond']):>6s} MiB  loss {res['loss']:.6f}"
        )

    def contended(n: int, v: str) -> bool:
        if v == "paired":
            return min(e["foreign"] for e in paired[n]) > busy
        return best_load(n, v) > busy

    def may_retry() -> bool:
        nonlocal retry_end
        if retry_end is None:
            retry_end = time.perf_counter() + args.retry_budget
        return time.perf_counter() < retry_end

    def runs(n, v):
        out = []
        for res in results[n][v]:
            out += zip(res["times"], res["cpu"], res["foreign"], res["per_chunk"], strict=True)
        return out

    def best(n, v):
        return min(x[0] for x in runs(n, v))

    def best_cpu(n, v):
        return min(x[1] for x in runs(n, v))

    def best_load(n, v):
        return min(runs(n, v))[2]

    def med(n, v):
        return statistics.median(x[0] for x in runs(n, v))

    def chunk_min(n, v):
        """Σ over chunks of that chunk's fastest time over rounds + fastest remainder."""
        rr = runs(n, v)
        per = [min(col) for col in zip(*(x[3] for x in rr), strict=True)]
        return sum(per) + min(x[0] - sum(x[3]) for x in rr)

    def peaks(n, v):
        return [res["peak_beyond"] for res in results[n][v]]

    def peak(n, v):
        return max(peaks(n, v))

    def payload(n):
        return results[n]["merged"][0]["timers"]["payload_bytes"]

    def paired_parts(n) -> dict[str, Any]:
        """Per-chunk minimum over the paired epochs of each side, plus fixed parts."""
        ep = paired[n]

        def col_min(key):
            return [min(c) for c in zip(*(e[key] for e in ep), strict=True)]

        s_chunk = [
            min(r + t for r, t in zip(rs, ts, strict=True))
            for rs, ts in zip(
                zip(*(e["read"] for e in ep), strict=True),
                zip(*(e["train"] for e in ep), strict=True),
                strict=True,
            )
        ]
        fixed_s = min(e["t_begin"] + e["t_finish"] for e in ep)
        fixed_f = min(e["t_step"] for e in ep)
        f_chunk = col_min("tf")
        return {
            "ratio": (sum(s_chunk) + fixed_s) / (sum(f_chunk) + fixed_f),
            "median": statistics.median(a / b for a, b in zip(s_chunk, f_chunk, strict=True)),
            "train_only": sum(col_min("train")) / sum(f_chunk),
            "read_share": sum(col_min("read")) / (sum(f_chunk) + fixed_f),
            "epochs": len(ep),
            "load": min(e["foreign"] for e in ep),
        }

    for n in args.rows:
        for r in range(args.repeats):
            for v in VARIANTS[r % 3 :] + VARIANTS[: r % 3]:
                one(n, v, f"round {r + 1}")
        one(n, "paired", "")
        for v in (*VARIANTS, "paired"):
            for _ in range(2):  # replace contended best runs while the retry budget lasts
                if contended(n, v) and may_retry():
                    one(n, v, "retry")

    pp = {n: paired_parts(n) for n in args.rows}

    # ---------------------------------------------------------------- tables
    print("## Rows, store and plan\n")
    print(
        "| rows | tokens | valid tokens | longest | chunks | plan padding | merged padding "
        "| raw bytes (MiB) | store nbytes (MiB) | nbytes / raw | **store RssAnon Δ / raw** |"
    )
    print("|---:|" + "---:|" * 10)
    for n in args.rows:
        s = results[n]["streamed"][0]
        shape = results[n]["merged"][0]["timers"]["payload_shape"]
        merged_pad = 1.0 - s["tokens"] / (shape[0] * shape[1])
        print(
            f"| {n} | {s['tokens']} | {s['valid_tokens']} | {s['max_len']} | {s['chunks']} | "
            f"{s['padding_fraction']:.3f} | {merged_pad:.3f} | {fmt_mib(s['raw_bytes'])} | "
            f"{fmt_mib(s['store_nbytes'])} | {s['store_nbytes'] / s['raw_bytes']:.3f} | "
            f"**{s['store_rss_delta'] / s['raw_bytes']:.2f}** |"
        )
    print(
        "\n`nbytes / raw`: `store.nbytes()` over Σ numel·element_size of the tensors put. "
        "`store RssAnon Δ / raw`: growth of the process's anonymous resident memory while "
        "putting the rows (after a warm-up store exercised every code path), over the same raw "
        "bytes: what the store really holds, allocator and index overhead included (at 256 rows "
        "the heap reuses memory freed by the warm-up, so that figure is a lower bound). "
        "`plan padding`: `StepPlan.padding_fraction`; `merged padding`: empty slots of the "
        "merged payload (padded to the global longest row).\n"
    )

    print("## Wall time per epoch (s)\n")
    print(
        "| rows | streamed best | merged best | floor best | streamed med | merged med | "
        "floor med | **streamed / floor paired** | paired, median chunk | streamed / floor "
        "best | streamed / floor med | streamed / floor Σ chunk-min | streamed / floor CPU s "
        "| merged / floor best | others' load in best runs s / m / f (cores of 2) |"
    )
    print("|---:|" + "---:|" * 14)
    for n in args.rows:
        load = " / ".join(f"{best_load(n, v):.2f}" for v in VARIANTS)
        print(
            f"| {n} | {best(n, 'streamed'):.2f} | {best(n, 'merged'):.2f} | "
            f"{best(n, 'floor'):.2f} | {med(n, 'streamed'):.2f} | {med(n, 'merged'):.2f} | "
            f"{med(n, 'floor'):.2f} | **{pp[n]['ratio']:.3f}** | {pp[n]['median']:.3f} | "
            f"{best(n, 'streamed') / best(n, 'floor'):.3f} | "
            f"{med(n, 'streamed') / med(n, 'floor'):.3f} | "
            f"{chunk_min(n, 'streamed') / chunk_min(n, 'floor'):.3f} | "
            f"{best_cpu(n, 'streamed') / best_cpu(n, 'floor'):.3f} | "
            f"{best(n, 'merged') / best(n, 'floor'):.3f} | {load} |"
        )
    print(
        "\n`paired`: (begin + Σ streamed chunks incl. store read and padding + finish) / "
        "(Σ floor chunks + clip/step), streamed and floor interleaved chunk by chunk in one "
        "process, each chunk's time the minimum over the paired epochs; `median chunk`: median "
        "of per-chunk ratios. `best` / `med`: over separate fresh-process epochs. `Σ "
        "chunk-min`: each chunk's fastest time over the rounds, summed, plus the fastest "
        "remainder. `CPU s`: process user+sys seconds of the fastest-CPU epoch. `others' "
        "load`: cores kept busy by other processes on this machine during that best run.\n"
    )
    print("### Where the streamed overhead goes (paired run)\n")
    print(
        "| rows | paired epochs | others' load (min, cores) | streamed / floor | "
        "store read + collate / floor | train_chunk only / floor chunk |"
    )
    print("|---:|" + "---:|" * 5)
    for n in args.rows:
        q = pp[n]
        print(
            f"| {n} | {q['epochs']} | {q['load']:.2f} | {q['ratio']:.3f} | "
            f"{q['read_share']:.2%} | {q['train_only']:.3f} |"
        )
    print(
        "\n`train_chunk only / floor chunk`: lppo's `CriticModule.train_chunk` (forward with "
        "`output_hidden_states=True`, clipped value loss, float64 token weights, diagnostic "
        "sums) over the floor's forward + loss + backward on the same padded chunk.\n"
    )

    print("## Peak RSS beyond the store (MiB)\n")
    print(
        "| rows | streamed | merged | floor | merged − streamed | merged payload (held) | "
        "rounds min–max s / m / f | epoch loss s / m / f / paired s / paired f |"
    )
    print("|---:|" + "---:|" * 7)
    for n in args.rows:
        loss = " / ".join(f"{results[n][v][0]['loss']:.6f}" for v in VARIANTS)
        loss += f" / {paired[n][0]['loss']:.6f} / {paired[n][0]['floor_loss']:.6f}"
        spread = " / ".join(
            f"{fmt_mib(min(peaks(n, v)))}–{fmt_mib(max(peaks(n, v)))}" for v in VARIANTS
        )
        print(
            f"| {n} | {fmt_mib(peak(n, 'streamed'))} | {fmt_mib(peak(n, 'merged'))} | "
            f"{fmt_mib(peak(n, 'floor'))} | "
            f"{fmt_mib(peak(n, 'merged') - peak(n, 'streamed'))} | {fmt_mib(payload(n))} | "
            f"{spread} | {loss} |"
        )
    print("\nPeak columns are the max over rounds.\n")

    print("## Streamed epoch breakdown (s, fastest round)\n")
    print("| rows | epoch | plan | store read + collate | train_chunk | finish | read share |")
    print("|---:|" + "---:|" * 6)
    for n in args.rows:
        rs = min(results[n]["streamed"], key=lambda x: min(x["times"]))
        tm, tot = rs["timers"], min(rs["times"])
        print(
            f"| {n} | {tot:.2f} | {tm['plan']:.3f} | {tm['read_collate']:.3f} | "
            f"{tm['train_chunk']:.2f} | {tm['finish']:.3f} | {tm['read_collate'] / tot:.1%} |"
        )

    lo, hi = args.rows[0], args.rows[-1]
    print(f"\n## Peak growth from {lo} to {hi} rows\n")
    print(f"| variant | peak @{lo} (MiB) | peak @{hi} (MiB) | growth |")
    print("|---|---:|---:|---:|")
    growth = {}
    for v in VARIANTS:
        growth[v] = peak(hi, v) / peak(lo, v) - 1.0
        print(f"| {v} | {fmt_mib(peak(lo, v))} | {fmt_mib(peak(hi, v))} | {growth[v]:+.1%} |")

    # ---------------------------------------------------------------- targets
    print("\n## Targets\n")
    nb = max(
        results[n]["streamed"][0]["store_nbytes"] / results[n]["streamed"][0]["raw_bytes"]
        for n in args.rows
    )
    pair = {n: pp[n]["ratio"] for n in args.rows}
    bestr = {n: best(n, "streamed") / best(n, "floor") for n in args.rows}
    d_merged = peak(hi, "merged") - peak(lo, "merged")
    d_payload = payload(hi) - payload(lo)

    def per_rows(d: dict[int, float]) -> str:
        return ", ".join(f"{n}: {r:.3f}×" for n, r in d.items())

    big = [n for n in args.rows if n >= 1024] or list(args.rows)
    held = max(
        results[n]["streamed"][0]["store_rss_delta"] / results[n]["streamed"][0]["raw_bytes"]
        for n in big
    )
    checks = [
        (f"store nbytes ≤ 1.1× raw bytes (worst {nb:.3f}×)", nb <= 1.1),
        (
            f"store memory actually held (RssAnon growth while filling) ≤ 1.1× raw bytes at "
            f"{', '.join(map(str, big))} rows (worst {held:.3f}×)",
            held <= 1.1,
        ),
        (
            f"streamed within 5% of the floor, paired in-process ({per_rows(pair)})",
            max(pair.values()) <= 1.05,
        ),
        (
            f"(noisier) streamed within 5% of the floor, best separate epochs ({per_rows(bestr)})",
            max(bestr.values()) <= 1.05,
        ),
        (
            f"streamed peak grows ≤ 10% from {lo} to {hi} rows ({growth['streamed']:+.1%})",
            growth["streamed"] <= 0.10,
        ),
        (
            f"merged peak grows with rows ({growth['merged']:+.1%}: {d_merged / MiB:+.1f} MiB "
            f"for {d_payload / MiB:+.1f} MiB of payload; criterion: rises by ≥ half the "
            "payload's growth and by more than streamed)",
            d_merged >= 0.5 * d_payload and growth["merged"] > growth["streamed"],
        ),
    ]
    for text, ok in checks:
        print(f"- [{'x' if ok else ' '}] {'MET' if ok else 'NOT MET'}: {text}")
    loss_ok = all(
        math.isclose(results[n][v][0]["loss"], results[n]["floor"][0]["loss"], rel_tol=1e-4)
        for n in args.rows
        for v in VARIANTS
    ) and all(
        math.isclose(e["loss"], e["floor_loss"], rel_tol=1e-4) for ep in paired.values() for e in ep
    )
    print(
        f"- [{'x' if loss_ok else ' '}] sanity: epoch loss equal across variants (same rows, "
        "weights, chunks and loss math)"
    )
    print(
        f"\nPeak method: {results[lo]['streamed'][0]['peak_method']}. Waited {waited:.0f} s in "
        f"total for other processes to idle (< 0.25 cores, ≤ {args.quiet_wait:.0f} s per run)."
    )
    sys.stdout.flush()

    slow = [n for n in args.rows if pair[n] > 1.05]
    if slow or args.profile:
        n = slow[-1] if slow else hi
        why = "paired streamed/floor > 1.05" if slow else "--profile"
        print(f"\n## cProfile of one streamed epoch at {n} rows ({why})\n")
        res = run_worker(args, "streamed", n, profile=True)
        print("```\n" + res["profile"] + "```")
    print(f"\nTotal bench time: {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
