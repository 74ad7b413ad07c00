"""The router's Prometheus series (names and meaning: docs/metrics.md)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pegaflow.observability.http import new_registry

T = TypeVar("T")

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class RouterMetrics:
    """The router's Prometheus series (names and meaning: docs/metrics.md)."""

    def __init__(self, mode: str) -> None:
        self.registry = new_registry()
        self.mode = mode
        counter = partial(_series, Counter, self.registry)
        seconds = partial(_series, Histogram, self.registry, buckets=_LATENCY_BUCKETS)
        self.requests: Counter = counter(
            "requests", "requests answered, by endpoint and HTTP status", ("endpoint", "status")
        )
        self.routes: Counter = counter(
            "routes", "routing decisions, by mode and decision", ("mode", "decision")
        )
        self.upstream: Counter = counter(
            "upstream_requests",
            "requests sent to a replica, by replica and outcome",
            ("replica", "outcome"),
        )
        self.retries: Counter = counter("retries", "requests retried on another replica")
        self.inflight: Gauge = _series(
            Gauge, self.registry, "inflight", "requests in flight per replica", ("replica",)
        )
        self.healthy: Gauge = _series(
            Gauge, self.registry, "replica_healthy", "1 while the replica is in rotation",
            ("replica", "role"),
        )  # fmt: skip
        self.prefix_blocks: Counter = counter(
            "prefix_blocks",
            "cache mode: prefix blocks of routed prompts held for the chosen replica, by "
            "where (gpu: its own GPU cache, from its KV events; local: past that, on its "
            "host's node; elsewhere: past that, on other nodes)",
            ("where",),
        )
        self.kv_events: Counter = counter(
            "kv_events",
            "cache mode: KV event messages from a replica, by outcome (applied; lost: a gap "
            "not replayed, view cleared; restart: its sequence began again; bad)",
            ("replica", "outcome"),
        )
        self.gpu_blocks: Gauge = _series(
            Gauge, self.registry, "gpu_view_blocks",
            "cache mode: block hashes in a replica's GPU cache as its KV events tell",
            ("replica",),
        )  # fmt: skip
        endpoint = ("endpoint",)
        self.latency: Histogram = seconds(
            "request_seconds", "time from a request's arrival to the end of its answer", endpoint
        )
        self.first_byte: Histogram = seconds(
            "first_byte_seconds", "time from a request's arrival to the first byte of its answer",
            endpoint,
        )  # fmt: skip
        self.route_seconds: Histogram = seconds(
            "route_seconds",
            "time to choose a replica (tokenize, hash, coordinator lookup; pd: the prefill)",
            ("mode",),
        )


def _series(
    kind: Callable[..., T],
    registry: CollectorRegistry,
    name: str,
    doc: str,
    labels: tuple[str, ...] = (),
    **kw: Any,
) -> T:
    """The series ``pegaflow_router_<name>`` of ``kind`` in ``registry``."""
    return kind(f"pegaflow_router_{name}", doc, labels, registry=registry, **kw)
