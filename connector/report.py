"""The ``PegaFlow cache:`` line of the engine log: what the cache did lately.

Like vLLM's own prefix-cache hit-rate line, every ``report_interval_s`` (10 s) the
engine process logs one INFO line, only when something happened since the last one::

    PegaFlow cache (last 10 s): 8 lookups, hit rate 97.5% (4960 of 5088 blocks),
    79360 tokens from the cache (10.40 GB loaded at 21.3 GB/s, 100% same-host),
    0 hits declined as slower than computing, saved 128 blocks (167.8 MB),
    0 dropped, 0 failures, misses: never stored 80%, evicted 20% (memory, 42 s after save)

An interval without lookups says ``no lookups``; failures are said by kind, each in a
clause of its own (``2 lookups failed (answered as misses)``, ``62 blocks failed to load
(recomputed)``, ``3 blocks failed to save``) instead of ``0 failures``.  ``misses:``
gives the share of the blocks lookups left to compute by the cause of each lookup's
first miss, with the last detail seen of a cause (:mod:`.scheduler.misscause`).  Loads are
counted when they end, lookups when they are made: a load that failed may belong to an
earlier interval's lookup, whose request vLLM then looks up again (that lookup may miss,
e.g. when the node that held the blocks is gone).

Lookups and decisions are counted in the scheduler's own process; loads and saves by
the workers.  A worker in the scheduler's process (one rank) is read directly, so saves
that finish after an engine's last step still show; other workers' counters reach the
scheduler with every step's output (vLLM's connector stats,
:meth:`CacheReport.add_workers`).  A final line is logged at shutdown.

:class:`SameHostReport` reports the lookups the node on this host answered alone (which
no coordinator sees) to that node, so that ``pegaflow status`` counts them in the
cluster's hit rate.

Pure module: no vLLM import.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping

from pegaflow.protocol.misses import shares

from .metrics import Counters

logger = logging.getLogger("pegaflow.connector")

WORKER_COUNTERS = frozenset(
    {
        "load_jobs", "load_blocks", "load_bytes", "load_seconds", "load_failed_blocks",
        "local_load_blocks", "layerwise_load_jobs", "save_blocks", "save_bytes",
        "save_present_blocks", "save_failed_blocks", "save_dropped_blocks", "probe_bytes",
        "load_unreachable_blocks",
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


def _rate(bps: float) -> str:
    """A rate that shows its size: GB/s from 1 GB/s, else MB/s (kB/s, B/s) with 2 or 3
    significant digits, never ``0.0 GB/s`` for a slow load."""
    if bps >= 1e9:
        return f"{bps / 1e9:.1f} GB/s"
    for scale, unit in ((1e6, "MB/s"), (1e3, "kB/s")):
        if bps >= scale:
            v = bps / scale
            digits = 0 if v >= 99.5 else 1 if v >= 9.995 else 2
            return f"{v:.{digits}f} {unit}"
    return f"{bps:.0f} B/s"


def misses_clause(d: Mapping[str, float], details: Mapping[str, str]) -> str:
    """``misses: never stored 80%, evicted 20% (memory, 42 s after save)``: the share of
    the missed blocks (``miss_blocks.<cause>`` of ``d``) by cause, largest first, with
    ``details`` of a cause in brackets ('' when nothing missed)."""
    by = {k.split(".", 1)[1]: v for k, v in d.items() if k.startswith("miss_blocks.")}
    text = shares(by, details)
    return f"misses: {text}" if text else ""


def format_line(
    d: Mapping[str, float],
    seconds: float,
    estimates: str = "",
    load_failure_fate: str = "recomputed",
    title: str = "",
    miss_details: Mapping[str, str] | None = None,
) -> str | None:
    """The line for counter deltas ``d`` over ``seconds`` (None: nothing happened);
    ``estimates``: the cost model's, shown when hits were declined;
    ``load_failure_fate``: what vLLM does with a block that failed to load;
    ``title``: the line's start (default ``PegaFlow cache (last <seconds> s)``);
    ``miss_details``: the last detail seen of each miss cause (:func:`misses_clause`).

    The hit rate covers the lookups of this interval only, and loads are counted when
    they end: a load that failed may belong to a lookup of an earlier interval (vLLM
    then asks again, and that lookup may miss), so failures are said apart from the
    hit rate, each kind in its own clause.
    """
    if not any(d.get(k, 0) for k in _ACTIVITY):
        return None
    g = d.get
    lookups = int(g("lookups", 0) + g("lookups_local", 0))
    hit, miss = int(g("lookup_hit_blocks", 0)), int(g("lookup_miss_blocks", 0))
    errors = int(g("lookup_errors", 0))
    load_failed, save_failed = int(g("load_failed_blocks", 0)), int(g("save_failed_blocks", 0))
    loaded, nbytes, secs = g("load_blocks", 0), g("load_bytes", 0), g("load_seconds", 0)
    load = f"{_bytes(nbytes)} loaded"
    if secs > 0 and nbytes:
        load += f" at {_rate(nbytes / secs)}"
    if loaded:
        load += f", {100.0 * g('local_load_blocks', 0) / loaded:.0f}% same-host"
    declined = int(g("cost_declined", 0) + g("cost_part", 0))
    why = f" (estimates: {estimates})" if declined and estimates else ""
    if lookups:
        rate = f"{100.0 * hit / (hit + miss):.1f}%" if hit + miss else "-"
        parts = [f"{lookups} lookups", f"hit rate {rate} ({hit} of {hit + miss} blocks)"]
    else:
        parts = ["no lookups answered" if errors else "no lookups"]
    parts += [
        f"{int(g('hit_tokens', 0))} tokens from the cache ({load})",
        f"{declined} hits declined as slower than computing{why}",
        f"saved {int(g('save_blocks', 0))} blocks ({_bytes(g('save_bytes', 0))})",
        f"{int(g('save_dropped_blocks', 0))} dropped",
    ]
    if not (errors or load_failed or save_failed):
        parts.append("0 failures")
    if errors:
        parts.append(f"{errors} lookups failed (answered as misses)")
    if load_failed:
        earlier = "hits of earlier lookups, " if load_failed > hit else ""
        parts.append(f"{load_failed} blocks failed to load ({earlier}{load_failure_fate})")
    if save_failed:
        parts.append(f"{save_failed} blocks failed to save")
    unreachable = int(g("unreachable_declined_blocks", 0) + g("load_unreachable_blocks", 0))
    if unreachable:
        parts.append(f"loads skipped: node unreachable ({unreachable} blocks computed instead)")
    if g("lookup_skipped", 0):
        parts.append(f"{int(g('lookup_skipped', 0))} lookups skipped (cluster backing off)")
    misses = misses_clause(d, miss_details or {})
    if misses:
        parts.append(misses)
    return (title or f"PegaFlow cache (last {seconds:.0f} s)") + ": " + ", ".join(parts)


class CacheReport:
    """Logs :func:`format_line` every ``interval_s`` from a thread of its own.

    Args:
        counters: the scheduler side's counters.
        interval_s: seconds between two lines.
        clock: monotonic clock (tests inject one).
        estimates: the cost model's estimates in words
        (:meth:`~.scheduler.costmodel.CostModel.explain`), shown when hits were declined.
        worker_totals: the cumulative counters of a worker in this process, or None
            while there is none (the workers' stats are read instead).
        load_failure_fate: what vLLM does with a block that failed to load, in words
            (its ``kv_load_failure_policy``).
        miss_details: the last detail seen of each miss cause
            (:meth:`~.scheduler.misscause.MissTally.details`).
        on_tick: also run on the timer, after each line (the misses' report to a
            coordinator, :mod:`.scheduler.missreport`).
    """

    def __init__(
        self,
        counters: Counters,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
        estimates: Callable[[], str] | None = None,
        worker_totals: Callable[[], Mapping[str, float] | None] | None = None,
        load_failure_fate: str = "recomputed",
        miss_details: Callable[[], Mapping[str, str]] | None = None,
        on_tick: Callable[[], object] | None = None,
    ) -> None:
        self._counters = counters
        self._on_tick = on_tick
        self._miss_details = miss_details
        self._load_failure_fate = load_failure_fate
        self._worker_totals = worker_totals
        self._seen_worker: dict[str, float] = {}
        self.interval_s = interval_s
        self._estimates = estimates
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
            d.update(self._worker_delta())
            self._seen, self._workers = totals, {}
            seconds, self._since = now - self._since, now
        estimates = self._estimates() if self._estimates else ""
        details = self._miss_details() if self._miss_details else None
        return format_line(d, seconds, estimates, self._load_failure_fate, miss_details=details)

    def _worker_delta(self) -> Mapping[str, float]:
        """The workers' counters since the last line: the same-process worker's own,
        else the sum of the stats handed over (call with the lock held)."""
        totals = self._worker_totals() if self._worker_totals is not None else None
        if totals is None:
            return self._workers
        now = {k: v for k, v in totals.items() if k in WORKER_COUNTERS}
        d = {k: v - self._seen_worker.get(k, 0) for k, v in now.items()}
        self._seen_worker = now
        return d

    def start(self) -> None:
        """Log a line every ``interval_s`` until :meth:`close`."""

        def run() -> None:
            while not self._stop.wait(self.interval_s):
                self.emit()
                if self._on_tick is not None:
                    self._on_tick()

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


SAME_HOST_REPORT_S = 5.0
"""seconds between two reports of same-host lookups to their node"""
SAME_HOST_REPORT_TIMEOUT_S = 1.0
"""deadline of one such report (best effort: what fails is sent with the next one)"""

Send = Callable[[str, int, int, int, float], None]
"""``send(node_id, lookups, asked_blocks, hit_blocks, timeout)``: one report, or raises"""


class SameHostReport:
    """The lookups answered by this host's node alone, reported to that node in batches.

    Such a lookup never reaches a coordinator (the scheduler asks the node first and the
    coordinator only when the node lacks blocks), so the coordinators' counters miss it;
    the node adds the reported figures to its record, and the coordinators' status to
    the cluster's.  :meth:`add` (on the request path) only adds to a tally; a thread of
    its own sends the tally every ``interval_s`` and :meth:`close` sends what is left,
    each report under ``timeout_s``.  A report that fails is kept and sent with the next
    (one that timed out after reaching the node may so be counted twice).

    Args:
        send: sends one report (see :data:`Send`).
        interval_s: seconds between two reports.
        timeout_s: deadline of one report.
    """

    def __init__(
        self,
        send: Send,
        interval_s: float = SAME_HOST_REPORT_S,
        timeout_s: float = SAME_HOST_REPORT_TIMEOUT_S,
    ) -> None:
        self._send = send
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._pending: dict[str, list[int]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, node: str, asked_blocks: int, hit_blocks: int) -> None:
        """Count one lookup that ``node`` answered alone (sent later, never here)."""
        with self._lock:
            if self._closed:
                return
            t = self._pending.setdefault(node, [0, 0, 0])
            t[0] += 1
            t[1] += asked_blocks
            t[2] += hit_blocks
            if self._thread is None:  # started by the first such lookup
                self._thread = threading.Thread(
                    target=self._run, name="pegaflow-same-host-report", daemon=True
                )
                self._thread.start()

    def pending(self) -> dict[str, tuple[int, int, int]]:
        """Per node, (lookups, asked blocks, hit blocks) not reported yet."""
        with self._lock:
            return {n: (t[0], t[1], t[2]) for n, t in self._pending.items()}

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.flush()

    def flush(self) -> bool:
        """Send every node its tally now; True when nothing is left unsent."""
        with self._lock:
            todo, self._pending = self._pending, {}
        ok = True
        for node, (lookups, asked, hits) in todo.items():
            try:
                self._send(node, lookups, asked, hits, self.timeout_s)
            except Exception as e:
                ok = False
                logger.debug("PegaFlow: reporting %d same-host lookups to %s failed: %s",
                             lookups, node, e)  # fmt: skip
                with self._lock:
                    t = self._pending.setdefault(node, [0, 0, 0])
                    t[0] += lookups
                    t[1] += asked
                    t[2] += hits
        return ok

    def close(self) -> None:
        """Stop the thread and send what is left (once, under the deadline)."""
        with self._lock:
            self._closed = True
            thread = self._thread
        self._stop.set()
        if thread is not None:
            thread.join(self.timeout_s + 1.0)
        if self.flush():
            return
        for node, (lookups, _asked, _hits) in self.pending().items():
            logger.info(
                "PegaFlow: could not report %d same-host lookups to node %s at shutdown; "
                "`pegaflow status` leaves them out of the cluster's hit rate",
                lookups,
                node,
            )
