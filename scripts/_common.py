"""What several scripts of ``scripts/`` share: a process's CPU time and memory, progress
lines, log findings, start errors, Ctrl-C handling and the fault suites' ``--cooldown``.

Imported as ``scripts._common`` (the scripts put the repository root on ``sys.path``;
``scripts/`` is not a package).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

LOG_PATTERNS = ("Traceback", "ERROR", "CRITICAL", "never retrieved", "was never awaited")
"""log lines worth a look"""


def proc_cpu_seconds(pid: int, unreadable: float = math.nan) -> float:
    """User + system CPU seconds of ``pid`` so far (from /proc), ``unreadable`` if
    unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return unreadable


def proc_rss_bytes(pid: int, unreadable: float = math.nan) -> float:
    """VmRSS of ``pid`` in bytes (from /proc/<pid>/status), ``unreadable`` if unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return unreadable


def log(msg: str) -> None:
    """A human-readable progress line on stderr."""
    print(msg, file=sys.stderr, flush=True)


def log_findings(lines: Iterable[str]) -> dict[str, int]:
    """How many of ``lines`` name each of :data:`LOG_PATTERNS` (those named at all)."""
    hits = dict.fromkeys(LOG_PATTERNS, 0)
    for line in lines:
        for pattern in LOG_PATTERNS:
            if pattern in line:
                hits[pattern] += 1
    return {k: v for k, v in hits.items() if v}


def start_error(what: str, *steps: Callable[[], None]) -> str:
    """Run ``steps`` in turn: ``""``, or the error line (logged) of the RuntimeError that
    stopped them (a fault suite then exits with status 2)."""
    try:
        for step in steps:
            step()
    except RuntimeError as e:
        error = f"{what} did not start: {str(e)[:2000]}"
        log(error)
        return error
    return ""


def _interrupt(_sig: int, _frame: object) -> None:
    raise KeyboardInterrupt


def trap_signals() -> None:
    """Turn SIGINT, SIGTERM and SIGHUP into a KeyboardInterrupt (cleanup runs in
    ``finally``)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)


def mute_signals() -> None:
    """Ignore SIGINT and SIGTERM (while cleaning up after one)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def add_cooldown(ap: argparse.ArgumentParser, most_s: float) -> None:
    """``--cooldown``: seconds without faults at the end of a fault suite's run."""
    ap.add_argument(
        "--cooldown",
        type=float,
        default=None,
        help=f"seconds without faults at the end (default: a quarter of the run, at most "
        f"{most_s:g})",
    )


def cooldown_s(args: argparse.Namespace, total_s: float, most_s: float) -> float:
    """``--cooldown``, or its default: a quarter of the run, at most ``most_s``."""
    return args.cooldown if args.cooldown is not None else min(most_s, total_s / 4)
