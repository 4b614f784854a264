"""The markdown report: intro, tables, and the progress lines written while measuring."""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys

import torch
from _memory import MiB
from _results import BUSY, VARIANTS, PairedSummary, Result, Results, summarize_paired

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

#: lppo files whose functions the profile lists by cumulative time.
PROFILED_FILES = (
    "chunks.py:",
    "memory.py:",
    "critic.py:",
    "lifecycle.py:",
    "losses.py:",
    "types.py:",
    "stats.py:",
    "planner.py:",
)


def fmt_mib(b: float) -> str:
    """Bytes as MiB with one decimal."""
    return f"{b / MiB:.1f}"


def print_intro(args: argparse.Namespace) -> None:
    """Title, command, model, rows and chunking, and what each variant does."""
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


def progress_line(n: int, tag: str, variant: str, res: Result) -> str:
    """The stderr line for one finished worker."""
    if variant == "paired":
        ep = res["epochs"]
        return (
            f"  rows={n:5d} {tag:8s} paired   {len(ep)} epoch(s), streamed "
            f"{min(sum(e['read']) + sum(e['train']) for e in ep):.2f} s vs floor "
            f"{min(sum(e['tf']) for e in ep):.2f} s in chunks (others: "
            f"{min(e['foreign'] for e in ep):.2f} cores)"
        )
    return (
        f"  rows={n:5d} {tag:8s} {variant:8s} epoch {min(res['times']):7.2f} s "
        f"(others: {min(res['foreign']):.2f} cores)  peak beyond store "
        f"{fmt_mib(res['peak_beyond']):>6s} MiB  loss {res['loss']:.6f}"
    )


def print_store_table(r: Results) -> None:
    """Rows, store bytes and plan padding per row count."""
    print("## Rows, store and plan\n")
    print(
        "| rows | tokens | valid tokens | longest | chunks | plan padding | merged padding "
        "| raw bytes (MiB) | store nbytes (MiB) | nbytes / raw | **store RssAnon Δ / raw** |"
    )
    print("|---:|" + "---:|" * 10)
    for n in r.rows:
        s = r.first(n, "streamed")
        shape = r.first(n, "merged")["timers"]["payload_shape"]
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


def print_time_table(r: Results, pp: dict[int, PairedSummary]) -> None:
    """Wall time per epoch of each variant, and the streamed / floor ratios."""
    print("## Wall time per epoch (s)\n")
    print(
        "| rows | streamed best | merged best | floor best | streamed med | merged med | "
        "floor med | **streamed / floor paired** | paired, median chunk | streamed / floor "
        "best | streamed / floor med | streamed / floor Σ chunk-min | streamed / floor CPU s "
        "| merged / floor best | others' load in best runs s / m / f (cores of 2) |"
    )
    print("|---:|" + "---:|" * 14)
    for n in r.rows:
        load = " / ".join(f"{r.best_load(n, v):.2f}" for v in VARIANTS)
        print(
            f"| {n} | {r.best(n, 'streamed'):.2f} | {r.best(n, 'merged'):.2f} | "
            f"{r.best(n, 'floor'):.2f} | {r.med(n, 'streamed'):.2f} | {r.med(n, 'merged'):.2f} | "
            f"{r.med(n, 'floor'):.2f} | **{pp[n].ratio:.3f}** | {pp[n].median:.3f} | "
            f"{r.best(n, 'streamed') / r.best(n, 'floor'):.3f} | "
            f"{r.med(n, 'streamed') / r.med(n, 'floor'):.3f} | "
            f"{r.chunk_min(n, 'streamed') / r.chunk_min(n, 'floor'):.3f} | "
            f"{r.best_cpu(n, 'streamed') / r.best_cpu(n, 'floor'):.3f} | "
            f"{r.best(n, 'merged') / r.best(n, 'floor'):.3f} | {load} |"
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


def print_overhead_table(r: Results, pp: dict[int, PairedSummary]) -> None:
    """Where the streamed overhead goes, from the paired run."""
    print("### Where the streamed overhead goes (paired run)\n")
    print(
        "| rows | paired epochs | others' load (min, cores) | streamed / floor | "
        "store read + collate / floor | train_chunk only / floor chunk |"
    )
    print("|---:|" + "---:|" * 5)
    for n in r.rows:
        q = pp[n]
        print(
            f"| {n} | {q.epochs} | {q.load:.2f} | {q.ratio:.3f} | "
            f"{q.read_share:.2%} | {q.train_only:.3f} |"
        )
    print(
        "\n`train_chunk only / floor chunk`: lppo's `CriticModule.train_chunk` (forward with "
        "`output_hidden_states=True`, clipped value loss, float64 token weights, diagnostic "
        "sums) over the floor's forward + loss + backward on the same padded chunk.\n"
    )


def print_peak_table(r: Results) -> None:
    """Peak RSS beyond the store per variant, the merged payload, and the epoch losses."""
    print("## Peak RSS beyond the store (MiB)\n")
    print(
        "| rows | streamed | merged | floor | merged − streamed | merged payload (held) | "
        "rounds min–max s / m / f | epoch loss s / m / f / paired s / paired f |"
    )
    print("|---:|" + "---:|" * 7)
    for n in r.rows:
        loss = " / ".join(f"{r.first(n, v)['loss']:.6f}" for v in VARIANTS)
        loss += f" / {r.paired[n][0]['loss']:.6f} / {r.paired[n][0]['floor_loss']:.6f}"
        spread = " / ".join(
            f"{fmt_mib(min(r.peaks(n, v)))}–{fmt_mib(max(r.peaks(n, v)))}" for v in VARIANTS
        )
        print(
            f"| {n} | {fmt_mib(r.peak(n, 'streamed'))} | {fmt_mib(r.peak(n, 'merged'))} | "
            f"{fmt_mib(r.peak(n, 'floor'))} | "
            f"{fmt_mib(r.peak(n, 'merged') - r.peak(n, 'streamed'))} | {fmt_mib(r.payload(n))} | "
            f"{spread} | {loss} |"
        )
    print("\nPeak columns are the max over rounds.\n")


def print_breakdown_table(r: Results) -> None:
    """The fastest streamed epoch split into plan, store read + collate, train, finish."""
    print("## Streamed epoch breakdown (s, fastest round)\n")
    print("| rows | epoch | plan | store read + collate | train_chunk | finish | read share |")
    print("|---:|" + "---:|" * 6)
    for n in r.rows:
        rs = min(r.runs[n]["streamed"], key=lambda x: min(x["times"]))
        tm, tot = rs["timers"], min(rs["times"])
        print(
            f"| {n} | {tot:.2f} | {tm['plan']:.3f} | {tm['read_collate']:.3f} | "
            f"{tm['train_chunk']:.2f} | {tm['finish']:.3f} | {tm['read_collate'] / tot:.1%} |"
        )


def print_growth_table(r: Results) -> dict[str, float]:
    """Peak growth of each variant from the first to the last row count; return it."""
    lo, hi = r.rows[0], r.rows[-1]
    print(f"\n## Peak growth from {lo} to {hi} rows\n")
    print(f"| variant | peak @{lo} (MiB) | peak @{hi} (MiB) | growth |")
    print("|---|---:|---:|---:|")
    growth = {}
    for v in VARIANTS:
        a, b = r.peak(lo, v), r.peak(hi, v)
        growth[v] = b / a - 1.0
        print(f"| {v} | {fmt_mib(a)} | {fmt_mib(b)} | {growth[v]:+.1%} |")
    return growth


def profile_report(prof: cProfile.Profile) -> str:
    """Top functions by own time, plus cumulative time of lppo's own entry points."""
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("tottime").print_stats(18)
    rows = []
    for (file, line, name), (_cc, _nc, tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        short = f"{os.path.basename(file)}:{line}({name})"
        if "/lppo/" in file and any(w in short for w in PROFILED_FILES):
            rows.append((ct, tt, short))
    rows.sort(reverse=True)
    s.write("\nlppo functions by cumulative time (s):\n")
    for ct, tt, short in rows[:25]:
        s.write(f"  {ct:8.3f} cum  {tt:8.3f} own  {short}\n")
    return s.getvalue()


def _per_rows(d: dict[int, float]) -> str:
    """``{rows: ratio}`` as ``256: 1.012×, 1024: ...``."""
    return ", ".join(f"{n}: {x:.3f}×" for n, x in d.items())


def target_checks(
    r: Results, pp: dict[int, PairedSummary], growth: dict[str, float]
) -> list[tuple[str, bool]]:
    """The targets as ``(text, met)``: store size, streamed speed and peak, merged peak."""
    lo, hi = r.rows[0], r.rows[-1]
    nb = max(r.per_raw_byte(n, "store_nbytes") for n in r.rows)
    pair = {n: pp[n].ratio for n in r.rows}
    bestr = {n: r.best(n, "streamed") / r.best(n, "floor") for n in r.rows}
    d_merged = r.peak(hi, "merged") - r.peak(lo, "merged")
    d_payload = r.payload(hi) - r.payload(lo)
    # Below ~1024 rows the heap reuses what the warm-up store freed: judge the larger counts.
    big = [n for n in r.rows if n >= 1024] or list(r.rows)
    held = max(r.per_raw_byte(n, "store_rss_delta") for n in big)
    return [
        (f"store nbytes ≤ 1.1× raw bytes (worst {nb:.3f}×)", nb <= 1.1),
        (
            f"store memory actually held (RssAnon growth while filling) ≤ 1.1× raw bytes at "
            f"{', '.join(map(str, big))} rows (worst {held:.3f}×)",
            held <= 1.1,
        ),
        (
            f"streamed within 5% of the floor, paired in-process ({_per_rows(pair)})",
            max(pair.values()) <= 1.05,
        ),
        (
            f"(noisier) streamed within 5% of the floor, best separate epochs ({_per_rows(bestr)})",
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


def print_targets(
    r: Results, pp: dict[int, PairedSummary], growth: dict[str, float], waited: float, quiet: float
) -> None:
    """The target checklist, the loss sanity check, the peak method and the time waited."""
    print("\n## Targets\n")
    for text, ok in target_checks(r, pp, growth):
        print(f"- [{'x' if ok else ' '}] {'MET' if ok else 'NOT MET'}: {text}")
    loss_ok = r.losses_agree(rel_tol=1e-4)
    print(
        f"- [{'x' if loss_ok else ' '}] sanity: epoch loss equal across variants (same rows, "
        "weights, chunks and loss math)"
    )
    print(
        f"\nPeak method: {r.first(r.rows[0], 'streamed')['peak_method']}. Waited {waited:.0f} s "
        f"in total for other processes to idle (< {BUSY} cores, ≤ {quiet:.0f} s per run)."
    )
    sys.stdout.flush()


def print_report(r: Results, waited: float, quiet: float) -> dict[int, PairedSummary]:
    """Every table and the targets, to stdout; return the paired summaries."""
    pp = {n: summarize_paired(r.paired[n]) for n in r.rows}
    print_store_table(r)
    print_time_table(r, pp)
    print_overhead_table(r, pp)
    print_peak_table(r)
    print_breakdown_table(r)
    growth = print_growth_table(r)
    print_targets(r, pp, growth, waited, quiet)
    return pp
