"""Prometheus metrics of a storage node (names are part of the public interface; see
docs/metrics.md).

The per-request and per-block metrics (gets, puts, bytes, latency, errors) sit on the
data path, which runs on the node's event-loop thread.  prometheus_client's own
``Counter.labels(...).inc()`` takes locks and costs about 3 µs on the development
machines, which for a batch of small blocks is several percent of the transfer.  They
are therefore :class:`FastCounter` / :class:`FastHistogram`: plain numbers updated
without locks (one thread updates them) and read by a collector at scrape time, with
the same names, types, labels and API (``.labels(...).inc()``, ``.observe()``).
Pool gauges and the connection count are ordinary prometheus_client gauges.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

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


class _CounterChild:
    """One label set of a :class:`FastCounter`."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1) -> None:
        """Add ``amount`` (>= 0)."""
        self.value += amount


class FastCounter(Collector):
    """A lock-free counter for one thread, exposed as a Prometheus counter ``name``
    (``name_total``).  Same API as ``prometheus_client.Counter`` for ``inc`` and
    ``labels``."""

    def __init__(
        self, name: str, doc: str, labelnames: tuple[str, ...] | list[str] = (), *,
        registry: CollectorRegistry | None = None,
    ) -> None:  # fmt: skip
        self.name = name
        self.doc = doc
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], _CounterChild] = {}
        self._solo = _CounterChild() if not self.labelnames else None
        self._single = len(self.labelnames) == 1
        self._first = self.labelnames[0] if self.labelnames else ""
        if registry is not None:
            registry.register(self)

    def labels(self, *values: str, **kw: str) -> _CounterChild:
        """The child of one label set (created on first use)."""
        if kw:
            key = (kw[self._first],) if self._single else tuple(kw[n] for n in self.labelnames)
        else:
            key = values
        child = self._children.get(key)
        if child is None:
            if len(key) != len(self.labelnames):
                raise ValueError(f"{self.name}: labels {self.labelnames} expected")
            child = self._children[key] = _CounterChild()
        return child

    def inc(self, amount: float = 1) -> None:
        """Add ``amount`` to an unlabelled counter."""
        assert self._solo is not None, f"{self.name} has labels; use .labels(...)"
        self._solo.value += amount

    @property
    def value(self) -> float:
        """The value of an unlabelled counter."""
        assert self._solo is not None, f"{self.name} has labels; use .labels(...)"
        return self._solo.value

    def collect(self) -> Iterator[Any]:
        fam = CounterMetricFamily(self.name, self.doc, labels=self.labelnames)
        if self._solo is not None:
            fam.add_metric([], self._solo.value, created=self._solo.created)
        for key, child in list(self._children.items()):
            fam.add_metric(list(key), child.value, created=child.created)
        yield fam

    def describe(self) -> Iterator[Any]:
        yield CounterMetricFamily(self.name, self.doc, labels=self.labelnames)


class _HistogramChild:
    """One label set of a :class:`FastHistogram`."""

    __slots__ = ("buckets", "counts", "sum")

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Record one value: a bisect and two adds."""
        self.counts[bisect_left(self.buckets, value)] += 1
        self.sum += value


class FastHistogram(Collector):
    """A lock-free labelled histogram for one thread, exposed as a Prometheus
    histogram ``name`` (``_bucket``, ``_sum``, ``_count``)."""

    def __init__(
        self, name: str, doc: str, labelnames: tuple[str, ...] | list[str] = (), *,
        buckets: tuple[float, ...] = _LATENCY_BUCKETS,
        registry: CollectorRegistry | None = None,
    ) -> None:  # fmt: skip
        self.name = name
        self.doc = doc
        self.labelnames = tuple(labelnames)
        self.bucket_bounds = tuple(float(b) for b in buckets)
        self._single = len(self.labelnames) == 1
        self._first = self.labelnames[0] if self.labelnames else ""
        self._children: dict[tuple[str, ...], _HistogramChild] = {}
        if registry is not None:
            registry.register(self)

    def labels(self, *values: str, **kw: str) -> _HistogramChild:
        """The child of one label set (created on first use)."""
        if kw:
            key = (kw[self._first],) if self._single else tuple(kw[n] for n in self.labelnames)
        else:
            key = values
        child = self._children.get(key)
        if child is None:
            if len(key) != len(self.labelnames):
                raise ValueError(f"{self.name}: labels {self.labelnames} expected")
            child = self._children[key] = _HistogramChild(self.bucket_bounds)
        return child

    def observe(self, value: float) -> None:
        """Record one value (unlabelled histogram)."""
        self.labels().observe(value)

    def collect(self) -> Iterator[Any]:
        fam = HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)
        for key, child in list(self._children.items()):
            acc = 0
            buckets: list[tuple[str, float]] = []
            for bound, c in zip((*child.buckets, float("inf")), child.counts, strict=True):
                acc += c
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), acc))
            fam.add_metric(list(key), buckets, child.sum)
        yield fam

    def describe(self) -> Iterator[Any]:
        yield HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)


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
