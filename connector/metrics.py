"""Connector counters: hits, misses, loaded / saved blocks and bytes, latency, errors.

One :class:`Counters` lives in each connector instance (scheduler and every worker).
It feeds three outlets:

* vLLM's connector stats (``get_kv_connector_stats``; see :mod:`.stats`): deltas since
  the last call, plus the durations of that interval's lookups, load jobs and puts,
  aggregated across workers by vLLM, logged as "KV Transfer metrics" and exported by
  vLLM's ``/metrics`` as ``vllm:pegaflow_<counter>_total`` counters and
  ``vllm:pegaflow_<histogram>`` latency histograms (:data:`HISTOGRAMS`);
* the engine log's ``PegaFlow cache:`` line (:mod:`.report`);
* an optional JSON file of the cumulative totals (``stats_path`` setting), which tests
  and operators can read without a metrics stack.

The connector runs in vLLM's engine-core and worker processes, whose own Prometheus
registries nobody serves: vLLM's API server is the only ``/metrics`` an operator
scrapes, so everything goes through vLLM's connector-stats plumbing.

Pure module: no vLLM import.
"""

from __future__ import annotations

import json
import os
import threading
import time

from pegaflow.protocol.misses import MissCause

COUNTERS: dict[str, str] = {
    # scheduler side
    "lookups": "lookups sent to the coordinator",
    "lookups_local": "lookups answered by this host's node alone (it held every block)",
    "lookup_errors": "lookups that failed or timed out (answered as 0 hits)",
    "lookup_skipped": "lookups skipped while the circuit breaker was open",
    "lookup_hit_blocks": "blocks found in the cluster by lookups",
    "lookup_miss_blocks": "full blocks asked for and not found",
    "lookup_seconds": "time spent in lookups",
    "hit_tokens": "tokens promised to vLLM as external hits",
    "save_planned_blocks": "blocks scheduled for saving",
    "save_known_blocks": "blocks not saved because the cluster already has them",
    "cost_whole": "hits claimed whole (their load expected faster than computing them)",
    "cost_part": "hits of which only a leading part was claimed (the rest is computed)",
    "cost_declined": "hits not claimed at all: computing them was expected to be faster",
    "cost_declined_blocks": "hit blocks not claimed (computed instead of loaded)",
    "probes": "background fetches that timed a declined node (no request waits on them)",
    "unreachable_declined_blocks": (
        "hit blocks not claimed because their node failed this engine's loads and has not "
        "answered since (computed instead, no wait)"
    ),
    "handoffs": "requests that came with a usable prefill/decode handoff (kv_consumer)",
    "handoff_short": "handoffs of which not every block was stored by the end of the wait",
    "handoff_rejected": "handoffs not usable (malformed, expired, another namespace or prompt)",
    # worker side
    "load_jobs": "requests whose blocks were loaded",
    "load_blocks": "blocks loaded into the KV cache",
    "load_bytes": "bytes loaded into the KV cache",
    "layerwise_load_jobs": "loads done during the forward pass, layer by layer (same host)",
    "local_load_blocks": "blocks loaded straight from this host's node pool (no UCX hop)",
    "located_load_jobs": "layer-wise loads whose blocks the scheduler located while looking up",
    "layerwise_start_seconds": "CPU time spent queuing layer-wise loads before the forward pass",
    "layerwise_wait_seconds": "time the step waited after its forward pass for layer-wise loads",
    "load_failed_blocks": "blocks that could not be loaded (reported to vLLM, recomputed)",
    "load_unreachable_blocks": (
        "blocks of loads not asked for because their node failed and has not answered since "
        "(failed at once, recomputed)"
    ),
    "load_seconds": "wall time of load jobs, from start to last block",
    "save_blocks": "blocks stored by the cluster",
    "save_present_blocks": "blocks the node already had (skipped)",
    "save_failed_blocks": "blocks whose save failed",
    "save_dropped_blocks": (
        "blocks not saved: staging memory full, cluster backing off, or still pending when "
        "shutdown's wait ended"
    ),
    "save_bytes": "bytes sent to the cluster",
    "save_seconds": "wall time of puts",
    "save_publish_seconds": (
        "time from the step that filled saved blocks to the node's answer (they are hits "
        "for other engines from then on)"
    ),
    "save_wait_seconds": "time from queuing a save job (with its step) until its copy-out began",
    "save_hold_seconds": (
        "time from the step that filled same-host saved blocks until vLLM may reuse them "
        "(the node holds their commit)"
    ),
    "save_shutdown_seconds": "time engine shutdown waited for pending saves",
    "probe_bytes": "bytes fetched by probes (into host memory only)",
    "copy_seconds": "time spent copying between the KV cache and staging memory",
}

#: Counter families with a label: family -> (label name, help).  Each value of the label
#: is a counter of its own, ``<family>.<value>`` (in :data:`COUNTERS`, the stats and the
#: stats file), exported as ``vllm:pegaflow_<family>_total{<label>="<value>"}``.
LABELLED: dict[str, tuple[str, str]] = {
    "miss_lookups": (
        "cause",
        "lookups that left blocks to compute, by the cause of their first missing block",
    ),
    "miss_blocks": (
        "cause",
        "blocks lookups left to compute (not found, or not claimed), by the cause of the "
        "lookup's first missing block",
    ),
}
#: the values of each labelled family's label
LABEL_VALUES: dict[str, tuple[str, ...]] = {
    family: tuple(c.value for c in MissCause) for family in LABELLED
}
COUNTERS.update(
    (f"{family}.{value}", f"{doc} ({label} {value})")
    for family, (label, doc) in LABELLED.items()
    for value in LABEL_VALUES[family]
)

#: Counters whose every ``add`` is one operation's duration, also kept as a histogram:
#: counter name -> (histogram name, exported as ``vllm:pegaflow_<name>``; its help).
HISTOGRAMS: dict[str, tuple[str, str]] = {
    "lookup_seconds": ("lookup_latency_seconds", "latency of one lookup, as the engine sees it"),
    "load_seconds": ("load_latency_seconds", "wall time of one load job, from start to last block"),
    "save_seconds": ("save_latency_seconds", "wall time of one put"),
    "save_publish_seconds": (
        "save_publish_latency_seconds",
        "from the step that filled a put's blocks to the node's answer",
    ),
    "save_wait_seconds": (
        "save_wait_latency_seconds",
        "from the step that filled a save job's blocks until the save thread starts it",
    ),
    "save_hold_seconds": (
        "save_hold_latency_seconds",
        "from the step that filled a same-host save chunk's blocks until they may be reused",
    ),
}
#: bucket bounds (seconds) of the latency histograms
LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
)  # fmt: skip
#: durations kept per histogram between two takes (vLLM takes them every engine step);
#: beyond it the histogram misses some while the ``*_seconds`` counter stays exact
MAX_SAMPLES = 4096


class Counters:
    """Thread-safe counters with a cumulative view and a since-last-take view."""

    def __init__(self, role: str = "", rank: int = 0, stats_path: str = "") -> None:
        self._lock = threading.Lock()
        self._total: dict[str, float] = {}
        self._delta: dict[str, float] = {}
        self._path = f"{stats_path}.{role}{rank}.json" if stats_path else ""
        self._written = 0.0
        self._timer: threading.Timer | None = None
        self._samples: dict[str, list[float]] = {}

    def add(self, name: str, value: float = 1) -> None:
        """Increase counter ``name`` (one of :data:`COUNTERS`) by ``value``."""
        if not value:
            return
        if name not in COUNTERS:
            raise KeyError(f"unknown connector counter {name!r}")
        hist = HISTOGRAMS.get(name)
        with self._lock:
            self._total[name] = self._total.get(name, 0) + value
            self._delta[name] = self._delta.get(name, 0) + value
            if hist is not None:
                samples = self._samples.setdefault(hist[0], [])
                if len(samples) < MAX_SAMPLES:
                    samples.append(float(value))
        if self._path and self._timer is None:
            t = threading.Timer(0.3, self._flush)
            t.daemon = True
            self._timer = t
            t.start()

    def _flush(self) -> None:
        self._timer = None
        self.maybe_write(force=True)

    def totals(self) -> dict[str, float]:
        """Cumulative values since the connector started."""
        with self._lock:
            return dict(self._total)

    def take_delta(self) -> dict[str, float | list[float]]:
        """Values accumulated since the previous call (then reset): counter name ->
        value, and histogram name (:data:`HISTOGRAMS`) -> the durations observed."""
        with self._lock:
            d: dict[str, float | list[float]] = dict(self._delta)
            d.update(self._samples)
            self._delta, self._samples = {}, {}
        self.maybe_write()
        return d

    def maybe_write(self, force: bool = False) -> None:
        """Write the totals to the stats file (at most twice a second unless forced)."""
        if not self._path:
            return
        now = time.monotonic()
        if not force and now - self._written < 0.5:
            return
        self._written = now
        tmp = f"{self._path}.tmp{os.getpid()}"
        try:
            with open(tmp, "w") as fh:
                json.dump(self.totals(), fh, sort_keys=True)
            os.replace(tmp, self._path)
        except OSError:
            pass
