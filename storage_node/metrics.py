"""Prometheus metrics of a storage node (names are part of the public interface; see
docs/metrics.md).

The per-request and per-block metrics (gets, puts, bytes, latency, errors) sit on the
data path, which runs on the node's event-loop thread, so they are the lock-free
:class:`~pegaflow.fastmetrics.FastCounter` / :class:`~pegaflow.fastmetrics.FastHistogram`
(same names, types, labels and API as prometheus_client's).  Pool gauges and the
connection count are ordinary prometheus_client gauges.
"""

from __future__ import annotations

from pegaflow.storage_node.protocol import op_label
from prometheus_client import CollectorRegistry, Gauge

from pegaflow.fastmetrics import FastCounter, FastHistogram

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

    def request_done(self, op: str, seconds: float) -> None:
        """A request of ``op`` (a peer's string: labelled ``unknown`` if not an op) took
        ``seconds``."""
        self.request_seconds.labels(op=op_label(op)).observe(seconds)

    def request_failed(self, op: str, code: str) -> None:
        """A request of ``op`` failed with error ``code``."""
        self.request_errors.labels(op=op_label(op), code=code).inc()
