"""The router's Prometheus series (names and meaning: docs/metrics.md)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from pegaflow.observability.http import new_registry

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class RouterMetrics:
    """The router's Prometheus series (names and meaning: docs/metrics.md)."""

    def __init__(self, mode: str) -> None:
        self.registry = new_registry()
        r = self.registry
        self.requests = Counter(
            "pegaflow_router_requests",
            "requests answered, by endpoint and HTTP status",
            ["endpoint", "status"],
            registry=r,
        )
        self.routes = Counter(
            "pegaflow_router_routes",
            "routing decisions, by mode and decision",
            ["mode", "decision"],
            registry=r,
        )
        self.upstream = Counter(
            "pegaflow_router_upstream_requests",
            "requests sent to a replica, by replica and outcome",
            ["replica", "outcome"],
            registry=r,
        )
        self.retries = Counter(
            "pegaflow_router_retries", "requests retried on another replica", registry=r
        )
        self.inflight = Gauge(
            "pegaflow_router_inflight", "requests in flight per replica", ["replica"], registry=r
        )
        self.healthy = Gauge(
            "pegaflow_router_replica_healthy",
            "1 while the replica is in rotation",
            ["replica", "role"],
            registry=r,
        )
        self.prefix_blocks = Counter(
            "pegaflow_router_prefix_blocks",
            "cache mode: stored prefix blocks of routed prompts, by where the chosen "
            "replica stands (local: on its host's node; elsewhere: on other nodes)",
            ["where"],
            registry=r,
        )
        self.latency = Histogram(
            "pegaflow_router_request_seconds",
            "time from a request's arrival to the end of its answer",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.first_byte = Histogram(
            "pegaflow_router_first_byte_seconds",
            "time from a request's arrival to the first byte of its answer",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.route_seconds = Histogram(
            "pegaflow_router_route_seconds",
            "time to choose a replica (tokenize, hash, coordinator lookup; pd: the prefill)",
            ["mode"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.mode = mode
