"""The ``PegaFlow cache:`` line of the engine log: what the cache did lately.

Like vLLM's own prefix-cache hit-rate line, every ``report_interval_s`` (10 s) the
engine process logs one INFO line, only when something happened since the last one::

    PegaFlow cache (last 10 s): 8 lookups, hit rate 97.5% (4960 of 5088 blocks),
    79360 tokens from the cache (10.40 GB loaded at 21.3 GB/s, 100% same-host),
    0 hits declined as slower than computing, saved 128 blocks (167.8 MB),
    0 dropped, 0 failures

Lookups and decisions are counted in the scheduler's own process; loads and saves by
the workers, whose counters reach the scheduler with every step's output (vLLM's
connector stats, :meth:`CacheReport.add_workers`).  A final line is logged at shutdown.

Pure module: no vLLM import.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping

from .metrics import Counters

logger = logging.getLogger("pegaflow.connector")

WORKER_COUNTERS = frozenset(
    {
        "load_jobs", "load_blocks", "load_bytes", "load_seconds", "load_failed_blocks",
        "local_load_blocks", "layerwise_load_jobs", "save_blocks", "save_bytes",
        "save_present_blocks", "save_failed_blocks", "save_dropped_blocks", "probe_bytes",
    }
)  # fmt: skip
"""the worker-side counters the line reads from the workers' stats (the scheduler's
own counters are read from its :class:`Counters`, never from the stats)"""

_ACTIVITY = (
    "lookups", "lookups_local", "lookup_errors", "lookup_skipped", "load_blocks",
    "load_failed_blocks", "save_blocks", "save_present_blocks", "save_failed_blocks",
    "save_dropped_blocks",
)  # fmt: skip


def _bytes(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def format_line(d: Mapping[str, float], seconds: float) -> str | None:
    """The line for counter deltas ``d`` over ``seconds`` (None: nothing happened)."""
    if not any(d.get(k, 0) for k in _ACTIVITY):
        return None
    g = d.get
    lookups = int(g("lookups", 0) + g("lookups_local", 0))
    hit, miss = int(g("lookup_hit_blocks", 0)), int(g("lookup_miss_blocks", 0))
    rate = f"{100.0 * hit / (hit + miss):.1f}%" if hit + miss else "-"
    loaded, nbytes, secs = g("load_blocks", 0), g("load_bytes", 0), g("load_seconds", 0)
    load = f"{_bytes(nbytes)} loaded"
    if secs > 0 and nbytes:
        load += f" at {nbytes / secs / 1e9:.1f} GB/s"
    if loaded:
        load += f", {100.0 * g('local_load_blocks', 0) / loaded:.0f}% same-host"
    declined = int(g("cost_declined", 0) + g("cost_part", 0))
    failures = int(g("lookup_errors", 0) + g("load_failed_blocks", 0) + g("save_failed_blocks", 0))
    parts = [
        f"{lookups} lookups",
        f"hit rate {rate} ({hit} of {hit + miss} blocks)",
        f"{int(g('hit_tokens', 0))} tokens from the cache ({load})",
        f"{declined} hits declined as slower than computing",
        f"saved {int(g('save_blocks', 0))} blocks ({_bytes(g('save_bytes', 0))})",
        f"{int(g('save_dropped_blocks', 0))} dropped",
        f"{failures} failures",
    ]
    if g("lookup_skipped", 0):
        parts.append(f"{int(g('lookup_skipped', 0))} lookups skipped (cluster backing off)")
    return f"PegaFlow cache (last {seconds:.0f} s): " + ", ".join(parts)


class CacheReport:
    """Logs :func:`format_line` every ``interval_s`` from a thread of its own.

    Args:
        counters: the scheduler side's counters.
        interval_s: seconds between two lines.
        clock: monotonic clock (tests inject one).
    """

    def __init__(
        self,
        counters: Counters,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._counters = counters
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._seen = counters.totals()
        self._workers: dict[str, float] = {}
        self._since = clock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add_workers(self, data: Mapping[str, object]) -> None:
        """Add one step's worker counters (the stats vLLM hands the scheduler)."""
        with self._lock:
            for k, v in data.items():
                if k in WORKER_COUNTERS and isinstance(v, int | float):
                    self._workers[k] = self._workers.get(k, 0) + v

    def take(self) -> str | None:
        """The line for everything since the last one (resets), or None."""
        now = self._clock()
        totals = self._counters.totals()
        with self._lock:
            d = {k: v - self._seen.get(k, 0) for k, v in totals.items()}
            for k in WORKER_COUNTERS:  # worker counters come from the workers only
                d.pop(k, None)
            d.update(self._workers)
            self._seen, self._workers = totals, {}
            seconds, self._since = now - self._since, now
        return format_line(d, seconds)

    def start(self) -> None:
        """Log a line every ``interval_s`` until :meth:`close`."""

        def run() -> None:
            while not self._stop.wait(self.interval_s):
                self.emit()

        self._thread = threading.Thread(target=run, name="pegaflow-report", daemon=True)
        self._thread.start()

    def emit(self) -> None:
        """Log the line now, if something happened."""
        line = self.take()
        if line is not None:
            logger.info("%s", line)

    def close(self) -> None:
        """Stop the thread and log what is left."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self.emit()
