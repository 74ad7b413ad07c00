"""The router's Prometheus series (names and meaning: docs/metrics.md)."""

from __future__ import annotations

from functools import partial

from prometheus_client import Counter, Gauge, Histogram

from pegaflow.observability.http import new_registry

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class RouterMetrics:
    """The router's Prometheus series (names and meaning: docs/metrics.md)."""

    def __init__(self, mode: str) -> None:
        self.registry = new_registry()
        self.mode = mode
        counter = partial(Counter, registry=self.registry)
        gauge = partial(Gauge, registry=self.registry)
        seconds = partial(Histogram, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.requests = counter(
            "pegaflow_router_requests",
            "requests answered, by endpoint and HTTP status",
            ["endpoint", "status"],
        )
        self.routes = counter(
            "pegaflow_router_routes",
            "routing decisions, by mode and decision",
            ["mode", "decision"],
        )
        self.upstream = counter(
            "pegaflow_router_upstream_requests",
            "requests sent to a replica, by replica and outcome",
            ["replica", "outcome"],
        )
        self.retries = counter("pegaflow_router_retries", "requests retried on another replica")
        self.inflight = gauge(
            "pegaflow_router_inflight", "requests in flight per replica", ["replica"]
        )
        self.healthy = gauge(
            "pegaflow_router_replica_healthy",
            "1 while the replica is in rotation",
            ["replica", "role"],
        )
        self.prefix_blocks = counter(
            "pegaflow_router_prefix_blocks",
            "cache mode: stored prefix blocks of routed prompts, by where the chosen "
            "replica stands (local: on its host's node; elsewhere: on other nodes)",
            ["where"],
        )
        self.latency = seconds(
            "pegaflow_router_request_seconds",
            "time from a request's arrival to the end of its answer",
            ["endpoint"],
        )
        self.first_byte = seconds(
            "pegaflow_router_first_byte_seconds",
            "time from a request's arrival to the first byte of its answer",
            ["endpoint"],
        )
        self.route_seconds = seconds(
            "pegaflow_router_route_seconds",
            "time to choose a replica (tokenize, hash, coordinator lookup; pd: the prefill)",
            ["mode"],
        )
