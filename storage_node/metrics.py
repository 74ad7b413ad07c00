"""Prometheus metrics of a storage node (names are part of the public interface; see
docs/metrics.md).

The per-request and per-block metrics (gets, puts, bytes, latency, errors) sit on the
data path, which runs on the node's event-loop thread, so they are the lock-free
:class:`~pegaflow.observability.fastmetrics.FastCounter` /
:class:`~pegaflow.observability.fastmetrics.FastHistogram`
(same names, types, labels and API as prometheus_client's).  Pool gauges and the
connection count are ordinary prometheus_client gauges.  The disk tier's figures are
read from its counters at scrape time (:class:`DiskCollector`), and so are the etcd
publisher's (:class:`PublisherCollector`).
"""

from __future__ import annotations

import functools
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
        counter = functools.partial(FastCounter, registry=r)
        self.capacity_bytes = Gauge("pegaflow_node_capacity_bytes", "Pool capacity", registry=r)
        self.used_bytes = Gauge("pegaflow_node_used_bytes", "Pool bytes in use", registry=r)
        self.blocks = Gauge("pegaflow_node_blocks", "Committed blocks in the pool", registry=r)
        self.evictions = Gauge(
            "pegaflow_node_evictions", "Blocks evicted since start (monotonic)", registry=r
        )
        self.connections = Gauge("pegaflow_node_connections", "Open data connections", registry=r)
        self.get_blocks = counter("pegaflow_node_get_blocks", "Blocks asked for by get", ["result"])
        self.get_bytes = counter(
            "pegaflow_node_get_bytes", "Bytes served: sent by get, or located for a same-host read"
        )
        self.put_blocks = counter("pegaflow_node_put_blocks", "Blocks committed by put")
        self.put_bytes = counter("pegaflow_node_put_bytes", "Bytes committed by put")
        self.request_seconds = FastHistogram(
            "pegaflow_node_request_seconds",
            "Data-plane request latency (get includes the transfer)",
            ["op"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.request_errors = counter(
            "pegaflow_node_request_errors", "Data-plane requests that failed", ["op", "code"]
        )
        self.transfer_errors = counter(
            "pegaflow_node_transfer_errors", "UCX transfers that failed", ["kind"]
        )
        self.unauthenticated_closed = counter(
            "pegaflow_node_unauthenticated_closed",
            "Data connections closed before their hello",
            ["reason"],
        )
        self.quota_refusals = counter(
            "pegaflow_node_quota_refusals",
            "Requests refused because they would exceed a quota",
            ["kind", "scope"],
        )
        self.checksum_failures = counter(
            "pegaflow_node_checksum_failures", "Blocks refused because their checksum mismatched"
        )
        self.same_host_lookups = counter(
            "pegaflow_node_same_host_lookups",
            "Lookups answered by this node alone, as its host's connectors reported them",
        )
        self.same_host_hit_blocks = counter(
            "pegaflow_node_same_host_hit_blocks", "Blocks found by the same-host lookups"
        )
        self.same_host_miss_blocks = counter(
            "pegaflow_node_same_host_miss_blocks",
            "Blocks asked for by the same-host lookups and not found",
        )

        self.disk_promotions = counter(
            "pegaflow_node_disk_promotions", "Blocks read back from the disk tier into the pool"
        )
        self.disk_streamed = counter(
            "pegaflow_node_disk_streamed_blocks",
            "Blocks of a get read from the disk tier and sent while its later ones were "
            "still being read",
        )

    def request_done(self, op: str, seconds: float) -> None:
        """A request of ``op`` (a peer's string: labelled ``unknown`` if not an op) took
        ``seconds``."""
        self.request_seconds.labels(op=op_label(op)).observe(seconds)

    def request_failed(self, op: str, code: str) -> None:
        """A request of ``op`` failed with error ``code``."""
        self.request_errors.labels(op=op_label(op), code=code).inc()


_G, _C = GaugeMetricFamily, CounterMetricFamily
_DISK_FIGURES: tuple[tuple[type[Any], str, str, str | None], ...] = (
    # (family, metric name suffix, help, DiskTierStats field; None: whether a tier is on)
    (_G, "enabled", "1 while the disk tier is on", None),
    (_G, "capacity_bytes", "Disk tier capacity", "capacity_bytes"),
    (_G, "used_bytes", "Disk tier bytes in use", "used_bytes"),
    (_G, "blocks", "Blocks on the disk tier", "blocks"),
    (_G, "degraded", "1 while the disk tier has a fault (see /health's disk_reason)", "degraded"),
    # the write side: blocks leaving the pool for the tier, and the tier's own evictions
    (_C, "spills", "Blocks written to the disk tier", "spills"),
    (_C, "spill_drops", "Evicted blocks not written to the disk tier", "spill_drops"),
    (_C, "spill_copies", "Evicted blocks copied into the spill queue at eviction", "spill_copies"),
    (_C, "spill_ahead_blocks", "Blocks written to disk ahead of their eviction", "spill_ahead"),
    (_C, "evictions", "Blocks evicted from the disk tier to make room", "evictions"),
    # reads, and the I/O of both sides
    (_C, "hits", "Disk tier reads that returned a verified block", "hits"),
    (_C, "misses", "Disk tier reads that found no valid block", "misses"),
    (_C, "errors", "Disk tier I/O errors and checksum failures", "errors"),
    (_C, "read_bytes", "Bytes read from the disk tier", "read_bytes"),
    (_C, "write_bytes", "Bytes written to the disk tier", "write_bytes"),
    (_C, "read_seconds", "Seconds spent in disk tier reads", "read_seconds"),
    (_C, "write_seconds", "Seconds spent in disk tier writes", "write_seconds"),
)


def _family(kind: type[Any], name: str, doc: str, value: float) -> Any:
    """One unlabelled metric family of ``kind`` holding ``value``."""
    family = kind(name, doc)
    family.add_metric([], value)
    return family


class DiskCollector(Collector):
    """The node's ``pegaflow_node_disk_*`` figures from its tier's counters (read at
    scrape time; zeros while ``stats()`` gives None: no disk tier)."""

    def __init__(self, stats: Callable[[], DiskTierStats | None]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Any]:
        st = self.stats()
        for kind, name, doc, field in _DISK_FIGURES:
            # without a tier every figure is 0 (getattr(None, field, 0))
            value = int(st is not None) if field is None else getattr(st, field, 0)
            yield _family(kind, f"pegaflow_node_disk_{name}", doc, value)


_ETCD_FIGURES: dict[str, tuple[type[Any], str, str]] = {
    # the publisher's stats() key: (family, metric name suffix, help)
    "batches": (CounterMetricFamily, "write_batches", "etcd transactions written"),
    "keys_written": (CounterMetricFamily, "write_keys", "keys written to etcd"),
    "write_errors": (CounterMetricFamily, "write_errors", "failed etcd transactions"),
    "dropped": (CounterMetricFamily, "dropped_writes", "writes dropped: queue full"),
    "keepalive_errors": (CounterMetricFamily, "keepalive_errors", "failed lease keepalives"),
    "lease_losses": (CounterMetricFamily, "lease_losses", "leases found expired"),
    "rotations": (CounterMetricFamily, "registrations", "lease grants + republishes"),
    "pending": (GaugeMetricFamily, "pending_writes", "writes queued for etcd"),
    "registered": (GaugeMetricFamily, "registered", "1 while registered under a live lease"),
}


class PublisherCollector(Collector):
    """The node's ``pegaflow_node_etcd_*`` figures from its
    :class:`~pegaflow.storage_node.publisher.EtcdPublisher`'s ``stats()`` (read at
    scrape time)."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Any]:
        st = self.stats()
        for key, (kind, name, doc) in _ETCD_FIGURES.items():
            yield _family(kind, f"pegaflow_node_etcd_{name}", doc, int(st[key]))


class JournalCollector(Collector):
    """The node's ``pegaflow_node_journal_*`` metrics (read at scrape time)."""

    def __init__(self, journal: Callable[[], Journal | None]) -> None:
        self.journal = journal

    def collect(self) -> Iterator[Any]:
        j = self.journal()
        if j is None:
            return
        for kind, name, doc, value in (
            (GaugeMetricFamily, "degraded",
             "1 while journal writes are off after a failed write (see the log)", j.degraded),
            (GaugeMetricFamily, "bad_records",
             "journal records skipped as invalid when the pool was re-attached", j.bad_records),
            (CounterMetricFamily, "write_errors", "failed journal writes", j.write_errors),
            (CounterMetricFamily, "unjournaled",
             "commits and drops not journaled while it was degraded", j.unjournaled),
        ):  # fmt: skip
            yield _family(kind, f"pegaflow_node_journal_{name}", doc, int(value))
