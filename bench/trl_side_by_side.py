"""lppo vs TRL 1.12.0's ``PPOTrainer`` on the same work, interleaved, per phase.

Usage (from the repository root, with lppo's venv)::

    .venv/bin/python bench/trl_side_by_side.py        # docs/benchmarks/trl.md
    .venv/bin/python bench/trl_side_by_side.py --prompts 16 64 --setups equal --iterations 2

The script installs TRL 1.12.0 (the last release with PPO, ``trl.experimental.ppo``) into its
own virtual environment (``--trl-venv``, default ``.venv-trl``; with ``-c constraints.txt``, so
torch stays the local 2.13.0 CPU build), writes the shared inputs once (``_trl_assets``: a
1024-token tokenizer, a random 4.7M-parameter Llama policy, a same-size critic and a random
``LlamaForSequenceClassification`` reward model, the prompts), then for every setting runs
each variant in its own fresh process, alternating which goes first, and prints a markdown
report (medians over the timed iterations; the first iteration of each process is a warm-up).
All variants of a setting run at once but take turns, iteration by iteration, in an order
reversed every round (``_turns``): only one is ever timed, and a slow minute on a shared
machine lands on every variant alike. ``--schedule alone`` instead runs each variant's process
by itself, one after another (use ``--rounds`` to alternate the order): nothing else is
resident while a variant runs, at the price of drift between processes.

Work, identical on both sides: ``N`` prompts per iteration, one sample each, exactly 64 new
tokens (TRL: no stop token; lppo: ``rollout.ignore_eos``), temperature 1, a frozen reference
(KL coefficient 0.05), GAE (γ 1, λ 0.95), 2 PPO epochs of one minibatch, micro-batches of 8
rows (TRL ``per_device_train_batch_size=8``; lppo's chunk budget 640 tokens = 8 × 80), fp32,
``--threads`` intra-op threads. Setups: ``equal`` (every prompt 16 tokens) and ``variable``
(8–128 tokens; TRL left-pads each batch, lppo packs).

Variants: ``trl``; ``trl-dp`` (TRL on ``--threads`` data-parallel processes of one thread each:
accelerate's gloo DDP, the same rows per iteration); ``lppo`` (``--lppo`` settings, the tuned
ones); ``lppo-dp`` (the same settings on ``--threads`` data-parallel processes of one thread
each, ``PPODDPStrategy`` over gloo: the same cores, the same rows per iteration);
``lppo-dp-unbalanced`` (``lppo-dp`` with ``data.balance_ranks`` off: each rank trains the rows
it generated); ``lppo-default`` (lppo's defaults: every ``auto`` setting, score chunks of 4 ×
the training chunks' tokens, ``data.max_tokens_per_score_chunk: auto``);
``floor`` (a plain PyTorch loop over lppo's training chunks, ``_trl_floor``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import _trl_assets  # noqa: E402

TUNED = [
    "old_logprobs=rollout",
    "old_values=critic",
    "score_chunk_tokens=2560",
    "gen_batch=256",
    "sort_by_length=1",
    "prefill_tokens=2048",
    "gen_cache=static",
    "trim_prompt=1",
]


#: The TRL variants; a setting's ratios are against the faster of those it ran.
TRL_VARIANTS = ("trl", "trl-dp")
#: lppo's data-parallel variants (``--threads`` ranks of one thread each).
DP_VARIANTS = ("lppo-dp", "lppo-dp-unbalanced")


def ensure_trl_venv(path: str, version: str = "1.12.0") -> str:
    """The TRL venv's python, creating the venv (TRL ``version``, torch pinned) when missing."""
    python = os.path.join(path, "bin", "python")
    check = [python, "-c", f"import trl, sys; sys.exit(trl.__version__ != {version!r})"]
    if os.path.exists(python) and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    print(f"installing TRL {version} into {path} ...", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", path], check=True)
    constraints = os.path.join(REPO, "constraints.txt")
    pip = [python, "-m", "pip", "install", "-q", "-c", constraints, f"trl=={version}"]
    subprocess.run(pip, check=True)
    return python


def run_paired(cmds: dict[str, list[str]], timeout: float) -> dict[str, dict]:
    """Run every command at once, taking turns iteration by iteration (``_turns``).

    Round ``r`` grants one turn to every live process, in order (reversed on odd rounds),
    and waits for it to end before the next; the first round starts once every process has
    finished its set-up. Returns each command's JSON line.
    """
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    env["PYTHONWARNINGS"] = "ignore"
    procs = {}
    for name, cmd in cmds.items():
        read, write = os.pipe()
        log = tempfile.TemporaryFile(mode="w+")
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env={**env, "LPPO_BENCH_TURN_FD": str(write)},
            pass_fds=(write,),
        )
        os.close(write)
        procs[name] = (proc, os.fdopen(read), log)
    deadline = time.monotonic() + timeout
    ready = {name: ctl.readline() == "ready\n" for name, (_, ctl, _) in procs.items()}
    live = [name for name in procs if ready[name]]
    rnd = 0
    while live:
        for name in list(live if rnd % 2 == 0 else live[::-1]):
            proc, ctl, _ = procs[name]
            if not ready[name] and ctl.readline() != "ready\n":
                live.remove(name)  # it exited
                continue
            ready[name] = False
            proc.stdin.write("go\n")
            proc.stdin.flush()
            if ctl.readline() != "done\n":
                live.remove(name)  # its last turn: teardown, result, exit
            if time.monotonic() > deadline:
                for p, _, _ in procs.values():
                    p.kill()
                raise TimeoutError(f"{list(cmds)} ran past --timeout {timeout} s")
        rnd += 1
    results = {}
    for name, (proc, _, log) in procs.items():
        out = proc.stdout.read()
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        if proc.wait() != 0 or not lines:
            log.seek(0)
            raise RuntimeError(f"{name}: {' '.join(cmds[name][:4])} failed:\n{log.read()[-3000:]}")
        results[name] = json.loads(lines[-1])
    return results


def run_schedule(cmds: dict[str, list[str]], args: argparse.Namespace) -> dict[str, dict]:
    """Each command's JSON line under ``args.schedule``.

    ``turns``: all at once, taking turns iteration by iteration (:func:`run_paired`).
    ``alone``: one process at a time, in ``cmds``' order; no other variant's process is
    resident while one runs.
    """
    if args.schedule == "turns":
        return run_paired(cmds, args.timeout)
    return {name: run_paired({name: cmd}, args.timeout)[name] for name, cmd in cmds.items()}


def command(variant: str, args: argparse.Namespace, trl_python: str, setup: str, n: int) -> list:
    iters = str(args.iterations)
    common = [args.root, setup, str(n)]
    if variant in TRL_VARIANTS:
        ranks = str(args.threads if variant == "trl-dp" else 1)
        script = os.path.join(HERE, "_trl_trl.py")
        return [trl_python, script, *common, iters, str(args.threads), ranks]
    if variant == "floor":
        script = os.path.join(HERE, "_trl_floor.py")
        return [sys.executable, script, *common, "2", str(args.threads), str(args.chunk_tokens)]
    opts = [f"chunk_tokens={args.chunk_tokens}"]
    opts += args.lppo if variant in ("lppo", *DP_VARIANTS) else []
    opts += [f"ranks={args.threads}"] if variant in DP_VARIANTS else []
    opts += ["balance_ranks=0"] if variant == "lppo-dp-unbalanced" else []
    script = os.path.join(HERE, "_trl_lppo.py")
    return [sys.executable, script, *common, iters, str(args.threads), *opts]


def summarize(result: dict) -> dict:
    """Medians over the timed iterations (the first is a warm-up) and the peak RSS."""
    if result["side"] == "floor":
        return {"training": result["training"], "peak_rss_mb": result["peak_rss_mb"]}
    timed = result["iterations"][1:] or result["iterations"]
    out = {k: statistics.median(r[k] for r in timed) for k in timed[0]}
    out["peak_rss_mb"] = result["peak_rss_mb"]
    if result.get("padding_fraction"):
        out["padding"] = result["padding_fraction"][-1]
    if result["side"] == "lppo" and result.get("ranks", 1) > 1:
        work = result["work"]
        out["balance"] = (work["rank_token_imbalance"], work["moved_rows"])
    return out


def trl_padding(root: str, setup: str, n: int) -> float:
    """Fraction of TRL's token slots that are padding (every row padded to the longest)."""
    prompts = _trl_assets.load_prompts(root, setup, n)
    width = max(len(p) for p in prompts) + 64
    return 1.0 - sum(len(p) + 64 for p in prompts) / (width * len(prompts))


def medians(runs: list[dict]) -> dict[str, float]:
    """Per-key medians over a variant's runs (``padding`` and ``balance`` left out)."""
    return {
        k: statistics.median(r[k] for r in runs) for k in runs[0] if k not in ("padding", "balance")
    }


def report(results: dict, args: argparse.Namespace) -> str:
    """The markdown table; ratios are against the faster TRL variant of the setting."""
    lines = [
        "| setup | prompts | variant | generation s | scoring s | training s | iteration s "
        "| × TRL (iteration) | × TRL gen / score / train | padding | peak RSS MB |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    for (setup, n), variants in results.items():
        meds = {name: medians(runs) for name, runs in variants.items()}
        trls = [meds[v] for v in TRL_VARIANTS if v in meds]
        base = min(trls, key=lambda t: t["total"]) if trls else None
        for name, runs in variants.items():
            s = meds[name]
            pad = ""
            if name in TRL_VARIANTS:
                pad = f"{trl_padding(args.root, setup, n):.1%}"
            elif runs[0].get("padding"):
                pad = f"{runs[0]['padding'].get('actor', 0.0):.1%}"
            cells = [f"{s[k]:.2f}" if k in s else "" for k in ("generation", "scoring")]
            cells += [f"{s['training']:.2f}", f"{s['total']:.2f}" if "total" in s else ""]
            ratio, phases = "", ""
            if base and (name not in TRL_VARIANTS or len(trls) > 1):
                if "total" in s:
                    ratio = f"**{s['total'] / base['total']:.2f}**"
                    phases = " / ".join(
                        f"{s[k] / base[k]:.2f}" for k in ("generation", "scoring", "training")
                    )
                else:
                    phases = f"– / – / {s['training'] / base['training']:.2f}"
            lines.append(
                f"| {setup} | {n} | {name} | {' | '.join(cells)} | {ratio} | {phases} | {pad} "
                f"| {statistics.median(r['peak_rss_mb'] for r in runs):.0f} |"
            )
    for (setup, n), variants in results.items():
        for name, runs in variants.items():
            for imbalance, moved in (r["balance"] for r in runs if "balance" in r):
                share = ", ".join(f"{x:.1%}" for x in imbalance)
                lines.append(
                    f"\n{setup} {n} {name}: busiest rank's tokens over the mean, per iteration: "
                    f"+{share}; rows moved: {', '.join(str(int(m)) for m in moved)}"
                )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prompts", type=int, nargs="+", default=[16, 64, 256, 1024])
    p.add_argument("--variable-prompts", type=int, nargs="+", default=[64, 256])
    p.add_argument("--setups", nargs="+", default=["equal", "variable"])
    p.add_argument("--variants", nargs="+", default=["trl", "lppo", "lppo-default", "floor"])
    p.add_argument("--iterations", type=int, default=3, help="per process, first is warm-up")
    p.add_argument("--rounds", type=int, default=1, help="processes per variant and setting")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--chunk-tokens", type=int, default=640)
    p.add_argument("--lppo", nargs="*", default=TUNED, help="KEY=VALUE settings of 'lppo'")
    p.add_argument("--root", default="/tmp/lppo-trl-bench")
    p.add_argument("--trl-venv", default=os.path.join(REPO, ".venv-trl"))
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument(
        "--schedule",
        choices=["turns", "alone"],
        default="turns",
        help="turns: a setting's variants run at once, taking turns per iteration; "
        "alone: each variant's process runs by itself, one after another "
        "(order reversed every round)",
    )
    args = p.parse_args()
    uses_trl = set(TRL_VARIANTS) & set(args.variants)
    trl_python = ensure_trl_venv(args.trl_venv) if uses_trl else ""
    settings = [
        (s, n)
        for s in args.setups
        for n in (args.prompts if s == "equal" else args.variable_prompts)
    ]
    _trl_assets.build(args.root, sorted({n for _, n in settings}), args.setups)
    results: dict = {}
    started = time.time()
    for setup, n in settings:
        for r in range(args.rounds):
            t0 = time.time()
            order = args.variants if r % 2 == 0 else args.variants[::-1]
            cmds = {v: command(v, args, trl_python, setup, n) for v in order}
            for variant, raw in run_schedule(cmds, args).items():
                out = summarize(raw)
                results.setdefault((setup, n), {}).setdefault(variant, []).append(out)
                print(
                    f"[{time.time() - started:6.0f}s] {setup} {n} {variant}: "
                    f"{out.get('total', out['training']):.2f}s/iter",
                    file=sys.stderr,
                )
            print(f"  round {r + 1}: {time.time() - t0:.0f}s", file=sys.stderr)
        # keep the variants' order stable in the report
        results[(setup, n)] = {v: results[(setup, n)][v] for v in args.variants}
    print(
        f"`{' '.join(['python', 'bench/trl_side_by_side.py', *sys.argv[1:]])}` "
        f"(lppo settings: {' '.join(args.lppo) or 'defaults'}; {args.threads} threads)\n"
    )
    print(report(results, args))


if __name__ == "__main__":
    main()
