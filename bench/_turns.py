"""Turn-taking between benchmark processes: one timed section runs at a time, in rounds.

``trl_side_by_side.py`` starts every variant of a setting at once and lets them take turns,
iteration by iteration, alternating the order every round: a slow minute on a shared machine
then falls on every variant's iterations alike instead of on one variant's whole run. A worker
holds the turn from :func:`begin` to :func:`end`; it asks for the next turn right after ending
one, so set-up and teardown between iterations never overlap another variant's timed work.
Outside the driver (no ``LPPO_BENCH_TURN_FD``) both calls do nothing. Standard library only:
this module also runs in the TRL venv.
"""

from __future__ import annotations

import os
import sys

_FD = os.environ.get("LPPO_BENCH_TURN_FD")
_held = False


def begin() -> None:
    """Wait for this process's turn (returns at once outside the driver or when held)."""
    global _held
    if _FD is None or _held:
        return
    os.write(int(_FD), b"ready\n")
    grant = sys.stdin.readline()
    if grant.strip() != "go":
        raise RuntimeError(f"benchmark driver sent {grant!r} instead of 'go'")
    _held = True


def end() -> None:
    """Give the turn back."""
    global _held
    if _FD is None or not _held:
        return
    os.write(int(_FD), b"done\n")
    _held = False


def next_turn() -> None:
    """End the turn and wait for the next one (between iterations and before teardown)."""
    end()
    begin()
