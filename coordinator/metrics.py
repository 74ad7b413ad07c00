"""Prometheus metrics of the coordinator (names are stable; all start ``pegaflow_``).

Hot-path figures (lookups, their latency and hit/miss blocks) are plain integers and a
:class:`~pegaflow.observability.fastmetrics.FastHistogram`, updated without locks and read by a
collector at scrape time, so a lookup pays well under a microsecond for its metrics.

=============================================== ==================================
``pegaflow_coordinator_lookups_total``          lookups served
``pegaflow_coordinator_lookup_seconds``         histogram of lookup handling time
``pegaflow_coordinator_lookup_hit_blocks_total`` blocks found by lookups
``pegaflow_coordinator_lookup_miss_blocks_total`` blocks asked for but not found
``pegaflow_coordinator_place_total``            placements, by ``result``
``pegaflow_coordinator_rpc_errors_total``       error replies, by ``op`` and ``code``
``pegaflow_coordinator_unreachable_reports_total`` reports of unreachable nodes
``pegaflow_coordinator_miss_cause_blocks_total`` missed blocks, by the ``cause`` of the first
``pegaflow_coordinator_engine_miss_blocks_total`` missed blocks the engines reported, by ``cause``
``pegaflow_coordinator_removals_total``          blocks removed from the index, by ``tier``
``pegaflow_index_blocks`` / ``_entries`` / ``_nodes`` / ``_namespaces``  index size
``pegaflow_index_node_entries``                 shard entries per ``node``
``pegaflow_etcd_connected``                     1 while the mirror's watch is live
``pegaflow_etcd_revision``                      last revision applied to the index
``pegaflow_etcd_watch_lag_revisions``           revisions behind the latest seen
``pegaflow_etcd_watch_events_total``            watch events applied
``pegaflow_etcd_full_syncs_total``              full reads of the index from etcd
``pegaflow_etcd_reloads_total``                 of those, forced by another etcd or compaction
``pegaflow_etcd_watch_errors_total``            broken or failed watches
``pegaflow_coordinator_leader``                 1 while this one runs the singleton duties
``pegaflow_coordinator_gc_passes_total``        index GC passes run
``pegaflow_coordinator_gc_checked_entries_total`` index entries checked with their node
``pegaflow_coordinator_gc_deleted_entries_total`` stale index entries deleted from etcd
``pegaflow_coordinator_gc_errors_total``        nodes that did not answer a check, failed passes
=============================================== ==================================
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pegaflow.observability.fastmetrics import FastHistogram
from pegaflow.protocol.misses import MissCause

from .index import BlockIndex

LATENCY_BUCKETS = (
    0.00002, 0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1, 1.0,
)  # fmt: skip


class CoordinatorMetrics:
    """The coordinator's counters; the service bumps the fields directly."""

    def __init__(self) -> None:
        self.lookups = 0
        self.hit_blocks = 0
        self.miss_blocks = 0
        self.lookup_seconds = FastHistogram(
            "pegaflow_coordinator_lookup_seconds",
            "time to handle one lookup",
            buckets=LATENCY_BUCKETS,
        )
        self.place: dict[str, int] = {}
        self.errors: dict[tuple[str, str], int] = {}
        self.unreachable_reports: dict[str, int] = {}
        """``report_unreachable`` reports by result (see :mod:`.suspects`)"""

    def on_request(self, op: str, seconds: float, code: str | None) -> None:
        """RpcServer's per-request hook: counts error replies."""
        if code is not None:
            self.errors[(op, code)] = self.errors.get((op, code), 0) + 1


class CoordinatorCollector(Collector):
    """Reads :class:`CoordinatorMetrics`, the index and the mirror at scrape time."""

    def __init__(
        self,
        metrics: CoordinatorMetrics,
        index: BlockIndex,
        mirror_status: Callable[[], dict[str, Any] | None],
        leader: Callable[[], bool | None] = lambda: None,
        gc_status: Callable[[], dict[str, Any] | None] = lambda: None,
        engine_misses: dict[str, int] | None = None,
    ) -> None:
        self.m = metrics
        self.index = index
        self.mirror_status = mirror_status
        self.leader = leader
        self.gc_status = gc_status
        self.engine_misses = engine_misses if engine_misses is not None else {}
        """the engines' reported missed blocks by cause (:mod:`.enginemisses`)"""

    def collect(self) -> Iterator[Any]:
        m = self.m
        yield _counter("pegaflow_coordinator_lookups", "lookups served", m.lookups)
        yield from m.lookup_seconds.collect()
        yield _counter(
            "pegaflow_coordinator_lookup_hit_blocks", "blocks found by lookups", m.hit_blocks
        )
        yield _counter(
            "pegaflow_coordinator_lookup_miss_blocks",
            "blocks asked for by lookups but not found",
            m.miss_blocks,
        )
        yield _by("pegaflow_coordinator_place", "placement decisions", "result", m.place)
        errors = CounterMetricFamily(
            "pegaflow_coordinator_rpc_errors", "error replies", labels=["op", "code"]
        )
        for (op, code), n in m.errors.items():
            errors.add_metric([op, code], n)
        yield errors
        yield _by(
            "pegaflow_coordinator_unreachable_reports",
            "clients' reports that a node fails their gets",
            "result",
            m.unreachable_reports,
        )
        yield _by(  # every cause from the start: a dashboard's query selects its series
            "pegaflow_coordinator_engine_miss_blocks",
            "blocks the engines' lookups missed, by the cause each engine reported",
            "cause",
            dict.fromkeys(MissCause, 0) | self.engine_misses,
        )
        log = self.index.evictions
        if log is not None:
            yield _by(
                "pegaflow_coordinator_miss_cause_blocks",
                "blocks lookups missed, by the cause of each lookup's first miss",
                "cause",
                log.causes,
            )
            yield _by(
                "pegaflow_coordinator_removals",
                "block shards removed from the index (evicted, dropped), by the tier they left",
                "tier",
                log.removals,
            )

        idx = self.index
        yield _gauge("pegaflow_index_blocks", "blocks in the index", idx.num_blocks)
        yield _gauge("pegaflow_index_entries", "shard entries in the index", idx.num_entries)
        yield _gauge("pegaflow_index_nodes", "known storage nodes", idx.num_nodes)
        yield _gauge("pegaflow_index_namespaces", "namespaces with blocks", idx.num_namespaces)
        per_node = GaugeMetricFamily(
            "pegaflow_index_node_entries", "shard entries held per node", labels=["node"]
        )
        for node, n in idx.node_counts().items():
            per_node.add_metric([node], n)
        yield per_node

        st = self.mirror_status()
        if st is not None:
            yield _gauge("pegaflow_etcd_connected", "1 while the etcd watch is live",
                         int(st["etcd_connected"]))  # fmt: skip
            yield _gauge("pegaflow_etcd_revision", "last etcd revision applied", st["revision"])
            yield _gauge(
                "pegaflow_etcd_watch_lag_revisions",
                "etcd revisions the index is behind",
                st["lag_revisions"],
            )
            yield _counter("pegaflow_etcd_watch_events", "watch events applied", st["events"])
            yield _gauge(
                "pegaflow_etcd_loading",
                "1 while a full read of the index runs (a first load is served as it goes)",
                int(st["state"] == "loading"),
            )
            yield _counter(
                "pegaflow_etcd_full_syncs", "full reads of the index from etcd", st["full_syncs"]
            )
            yield _counter(
                "pegaflow_etcd_reloads",
                "full reloads forced by a rebuilt/restored etcd or by compaction",
                st["reloads"],
            )
            yield _counter(
                "pegaflow_etcd_watch_errors", "broken or failed etcd watches", st["watch_errors"]
            )
        leader = self.leader()
        if leader is not None:
            yield _gauge(
                "pegaflow_coordinator_leader",
                "1 while this coordinator is the elected leader running the singleton duties",
                int(leader),
            )
        gc = self.gc_status()
        if gc is not None:
            yield _counter("pegaflow_coordinator_gc_passes", "index GC passes run", gc["passes"])
            yield _counter(
                "pegaflow_coordinator_gc_checked_entries",
                "index entries the GC checked with their node",
                gc["checked"],
            )
            yield _counter(
                "pegaflow_coordinator_gc_deleted_entries",
                "stale index entries the GC deleted from etcd",
                gc["deleted"],
            )
            yield _counter(
                "pegaflow_coordinator_gc_errors",
                "GC checks a node did not answer, and failed GC passes",
                gc["errors"],
            )


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    c = CounterMetricFamily(name, doc)
    c.add_metric([], value)
    return c


def _by(name: str, doc: str, label: str, counts: dict[str, int]) -> CounterMetricFamily:
    """A counter family with one ``label``: a sample per key of ``counts``."""
    c = CounterMetricFamily(name, doc, labels=[label])
    for value, n in counts.items():
        c.add_metric([value], n)
    return c


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc)
    g.add_metric([], value)
    return g
