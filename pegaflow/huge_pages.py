"""Transparent huge pages for a process's large hash tables (the coordinator's index).

A lookup probes one slot of a multi-megabyte dict table per block, at a random place:
with 4 KiB pages nearly every probe also misses the TLB, once the index outgrows what
the TLB maps (a few MB).  glibc (>= 2.35) backs ``malloc``'s heap and its large chunks
(where CPython keeps big dict tables) with transparent huge pages when the tunable
:data:`TUNABLE` is set, which it reads only when a process starts: so
:func:`reexec_with_huge_pages` re-executes the process once with it, before anything is
loaded.  Where the kernel's THP is ``never`` (or not Linux, or not glibc), it does
nothing.  Python's small objects (the keys and values) stay in its own arenas.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import sys
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb=1"
"""glibc's tunable: ``madvise(MADV_HUGEPAGE)`` on the heap and large ``malloc`` chunks"""
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")

log = logging.getLogger(__name__)


def thp_mode(path: Path = THP_ENABLED) -> str:
    """The kernel's transparent huge page mode (``always``, ``madvise``, ``never``), or
    ``""`` where it cannot be read."""
    try:
        text = path.read_text()
    except OSError:
        return ""
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return ""


@functools.cache
def glibc_has_tunable() -> bool:
    """Whether this process runs on glibc >= 2.35 (the first with :data:`TUNABLE`)."""
    lib, version = platform.libc_ver()
    if lib != "glibc":
        return False
    try:
        major, minor = (int(p) for p in version.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (2, 35)


def available() -> bool:
    """Whether asking glibc gives huge pages here: Linux, glibc >= 2.35 and the kernel's
    THP ``always`` or ``madvise``."""
    return sys.platform == "linux" and glibc_has_tunable() and thp_mode() in ("always", "madvise")


def asked() -> bool:
    """Whether this process started with :data:`TUNABLE`."""
    return TUNABLE in os.environ.get("GLIBC_TUNABLES", "").split(":")


def status() -> str:
    """``on``, or ``off (<why>)``: whether this process's ``malloc`` uses huge pages."""
    if not available():
        return f"off (unavailable: glibc >= 2.35 and THP needed, THP is {thp_mode() or 'unknown'})"
    return "on" if asked() else "off (not asked for at start)"


def reexec_with_huge_pages() -> None:
    """Re-execute this process (same PID, argv and environment, plus :data:`TUNABLE`)
    where that turns huge pages on and it is not on yet; returns where it does not."""
    if asked() or not available():
        return
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    env = {**os.environ, "GLIBC_TUNABLES": f"{tunables}:{TUNABLE}" if tunables else TUNABLE}
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, sys.orig_argv, env)
    except OSError as e:  # carry on without them
        log.warning("cannot restart with huge pages (%s): the index uses 4 KiB pages", e)
