"""Prometheus metrics of a storage node (names are part of the public interface; see
docs/metrics.md).

The per-request and per-block metrics (gets, puts, bytes, latency, errors) sit on the
data path, which runs on the node's event-loop thread, so they are the lock-free
:class:`~pegaflow.observability.fastmetrics.FastCounter` /
:class:`~pegaflow.observability.fastmetrics.FastHistogram`
(same names, types, labels and API as prometheus_client's).  Pool gauges and the
connection count are ordinary prometheus_client gauges.  The disk tier's figures are
read from its counters at scrape time (:class:`DiskCollector`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from pegaflow.storage_node.disk_tier import DiskTierStats
from pegaflow.storage_node.journal import Journal
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pegaflow.observability.fastmetrics import FastCounter, FastHistogram
from pegaflow.protocol.node import op_label

_LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1,
    5,
)


class NodeMetrics:
    """The node's metrics, registered in ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        r = registry
        self.capacity_bytes = Gauge("pegaflow_node_capacity_bytes", "Pool capacity", registry=r)
        self.used_bytes = Gauge("pegaflow_node_used_bytes", "Pool bytes in use", registry=r)
        self.blocks = Gauge("pegaflow_node_blocks", "Committed blocks in the pool", registry=r)
        self.evictions = Gauge(
            "pegaflow_node_evictions", "Blocks evicted since start (monotonic)", registry=r
        )
        self.connections = Gauge("pegaflow_node_connections", "Open data connections", registry=r)
        self.get_blocks = FastCounter(
            "pegaflow_node_get_blocks", "Blocks asked for by get", ["result"], registry=r
        )
        self.get_bytes = FastCounter("pegaflow_node_get_bytes", "Bytes sent by get", registry=r)
        self.put_blocks = FastCounter(
            "pegaflow_node_put_blocks", "Blocks committed by put", registry=r
        )
        self.put_bytes = FastCounter(
            "pegaflow_node_put_bytes", "Bytes committed by put", registry=r
        )
        self.request_seconds = FastHistogram(
            "pegaflow_node_request_seconds",
            "Data-plane request latency (get includes the transfer)",
            ["op"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.request_errors = FastCounter(
            "pegaflow_node_request_errors",
            "Data-plane requests that failed",
            ["op", "code"],
            registry=r,
        )
        self.transfer_errors = FastCounter(
            "pegaflow_node_transfer_errors", "UCX transfers that failed", ["kind"], registry=r
        )
        self.unauthenticated_closed = FastCounter(
            "pegaflow_node_unauthenticated_closed",
            "Data connections closed before their hello",
            ["reason"],
            registry=r,
        )
        self.quota_refusals = FastCounter(
            "pegaflow_node_quota_refusals",
            "Requests refused because they would exceed a quota",
            ["kind", "scope"],
            registry=r,
        )
        self.checksum_failures = FastCounter(
            "pegaflow_node_checksum_failures",
            "Blocks refused because their checksum mismatched",
            registry=r,
        )
        self.same_host_lookups = FastCounter(
            "pegaflow_node_same_host_lookups",
            "Lookups answered by this node alone, as its host's connectors reported them",
            registry=r,
        )
        self.same_host_hit_blocks = FastCounter(
            "pegaflow_node_same_host_hit_blocks",
            "Blocks found by the same-host lookups",
            registry=r,
        )
        self.same_host_miss_blocks = FastCounter(
            "pegaflow_node_same_host_miss_blocks",
            "Blocks asked for by the same-host lookups and not found",
            registry=r,
        )

        self.disk_promotions = FastCounter(
            "pegaflow_node_disk_promotions",
            "Blocks read back from the disk tier into the pool",
            registry=r,
        )
        self.disk_streamed = FastCounter(
            "pegaflow_node_disk_streamed_blocks",
            "Blocks of a get read from the disk tier and sent while its later ones were "
            "still being read",
            registry=r,
        )

    def request_done(self, op: str, seconds: float) -> None:
        """A request of ``op`` (a peer's string: labelled ``unknown`` if not an op) took
        ``seconds``."""
        self.request_seconds.labels(op=op_label(op)).observe(seconds)

    def request_failed(self, op: str, code: str) -> None:
        """A request of ``op`` failed with error ``code``."""
        self.request_errors.labels(op=op_label(op), code=code).inc()


_DISK_GAUGES = (
    ("enabled", "1 while the disk tier is on", None),
    ("capacity_bytes", "Disk tier capacity", "capacity_bytes"),
    ("used_bytes", "Disk tier bytes in use", "used_bytes"),
    ("blocks", "Blocks on the disk tier", "blocks"),
    ("degraded", "1 while the disk tier has a fault (see /health's disk_reason)", "degraded"),
)
_DISK_COUNTERS = (
    ("spills", "Blocks written to the disk tier", "spills"),
    ("spill_drops", "Evicted blocks not written to the disk tier", "spill_drops"),
    ("spill_copies", "Evicted blocks copied into the spill queue at eviction", "spill_copies"),
    ("spill_ahead_blocks", "Blocks written to disk ahead of their eviction", "spill_ahead"),
    ("evictions", "Blocks evicted from the disk tier to make room", "evictions"),
    ("hits", "Disk tier reads that returned a verified block", "hits"),
    ("misses", "Disk tier reads that found no valid block", "misses"),
    ("errors", "Disk tier I/O errors and checksum failures", "errors"),
    ("read_bytes", "Bytes read from the disk tier", "read_bytes"),
    ("write_bytes", "Bytes written to the disk tier", "write_bytes"),
    ("read_seconds", "Seconds spent in disk tier reads", "read_seconds"),
    ("write_seconds", "Seconds spent in disk tier writes", "write_seconds"),
)


class DiskCollector(Collector):
    """The node's ``pegaflow_node_disk_*`` figures from its tier's counters (read at
    scrape time; zeros while ``stats()`` gives None: no disk tier)."""

    def __init__(self, stats: Callable[[], DiskTierStats | None]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Any]:
        st = self.stats()
        for name, doc, field in _DISK_GAUGES:
            g = GaugeMetricFamily(f"pegaflow_node_disk_{name}", doc)
            value = int(st is not None) if field is None else getattr(st, field, 0)
            g.add_metric([], value)
            yield g
        for name, doc, field in _DISK_COUNTERS:
            c = CounterMetricFamily(f"pegaflow_node_disk_{name}", doc)
            c.add_metric([], getattr(st, field, 0) if st is not None else 0)
            yield c


class JournalCollector(Collector):
    """The node's ``pegaflow_node_journal_*`` metrics (read at scrape time)."""

    def __init__(self, journal: Callable[[], Journal | None]) -> None:
        self.journal = journal

    def collect(self) -> Iterator[Any]:
        j = self.journal()
        if j is None:
            return
        for name, doc, value in (
            ("pegaflow_node_journal_degraded",
             "1 while journal writes are off after a failed write (see the log)", j.degraded),
            ("pegaflow_node_journal_bad_records",
             "journal records skipped as invalid when the pool was re-attached", j.bad_records),
        ):  # fmt: skip
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], int(value))
            yield g
        for name, doc, value in (
            ("pegaflow_node_journal_write_errors", "failed journal writes", j.write_errors),
            ("pegaflow_node_journal_unjournaled",
             "commits and drops not journaled while it was degraded", j.unjournaled),
        ):  # fmt: skip
            c = CounterMetricFamily(name, doc)
            c.add_metric([], value)
            yield c
