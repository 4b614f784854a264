"""Driver of the signal sweep: ``lppo fit`` signalled at many points around an iteration end.

Run as a script (``python _signal_sweep.py ROOT POINTS SIGNAL``) in a fresh process: it
imports lppo once, then forks one child per point, so each fit starts in a second instead of
paying the imports again. A calibration child measures the time from the end of iteration 1's
rollout to the end of iteration 2's; the points are spread evenly over that span, so they fall
in iteration 1's critic and actor phases, its end, its checkpoint write and iteration 2's
rollout. Each child starts a timer at iteration 1's rollout end and the timer signals the
process. One JSON line per point goes to stdout: the delay, the exit status and the run
directory, which the test then checks.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from lppo.iteration.hooks import PPOCallback
from lppo.run.cli import main

ROOT = Path(__file__).resolve().parents[2]
ARGS = [
    "fit", "--config", str(ROOT / "configs" / "tiny.yaml"),
    "--model.rollout.prompts_per_iteration", "4", "--model.rollout.samples_per_prompt", "2",
    "--trainer.max_epochs", "6", "--trainer.enable_progress_bar", "false",
]  # fmt: skip
#: The iteration (0-based) whose rollout end starts the timer.
START = 1


class SignalAfter(PPOCallback):
    """Signals this process ``seconds`` after iteration :data:`START`'s rollout ends.

    Args:
        seconds: the delay (negative: never; the run records its clock instead).
        signal: the signal number.
        clock: file the calibration run writes its rollout-end times to.
    """

    def __init__(self, seconds: float, signal: int, clock: str = "") -> None:
        super().__init__()
        self.seconds, self.signal, self.clock = seconds, signal, clock

    def on_rollout_end(self, ctx: Any) -> None:
        if self.clock:
            with open(self.clock, "a") as f:
                f.write(f"{ctx.iteration} {time.monotonic()}\n")
        elif ctx.iteration == START:
            timer = threading.Timer(self.seconds, os.kill, (os.getpid(), self.signal))
            timer.daemon = True
            timer.start()


def fit_in_child(root: Path, seconds: float, sig: int, clock: str = "") -> int:
    """Fork, run ``lppo fit`` into ``root`` in the child; its exit status."""
    pid = os.fork()
    if pid == 0:
        code = 1
        root.mkdir(parents=True, exist_ok=True)
        log = os.open(root / "output.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(log, 1)
        os.dup2(log, 2)
        try:
            callback = "--trainer.callbacks+=_signal_sweep.SignalAfter"
            init = [f"--trainer.callbacks.seconds={seconds}", f"--trainer.callbacks.signal={sig}"]
            init += [f"--trainer.callbacks.clock={clock}"] if clock else []
            sys.argv = ["lppo", *ARGS, "--trainer.default_root_dir", str(root), callback, *init]
            main()
            code = 0
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def sweep(root: Path, points: int, sig: int) -> None:
    clock = root / "clock.txt"
    assert fit_in_child(root / "calibration", -1.0, sig, str(clock)) == 0
    times = dict(line.split() for line in clock.read_text().splitlines())
    span = float(times[str(START + 1)]) - float(times[str(START)])
    for i in range(points):
        seconds = span * i / max(1, points - 1)
        run = root / f"point-{i:03d}"
        code = fit_in_child(run, seconds, sig)
        print(json.dumps({"seconds": seconds, "span": span, "code": code, "root": str(run)}))
        sys.stdout.flush()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sweep(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
