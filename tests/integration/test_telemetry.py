"""Optional OpenTelemetry export (pegaflow.observability.telemetry): off by default and
free when off; when on, one vLLM request's spans from several processes form one trace,
the Prometheus registry is exported under the same names, and both really reach an
OTLP/HTTP receiver (a loopback stand-in for a collector)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pegaflow.config import TelemetryConfig, load_config
from pegaflow.observability import telemetry

pytestmark = pytest.mark.ucx

otel = pytest.importorskip("opentelemetry.sdk", reason="the otlp extra is not installed")


@pytest.fixture(autouse=True)
def _telemetry_off() -> Iterator[None]:
    telemetry.shutdown()
    yield
    telemetry.shutdown()


class CaptureMetrics:
    """A metric exporter that keeps what it was given."""

    def __init__(self) -> None:
        self.exports: list[Any] = []

    def export(self, data: Any, timeout_millis: float = 0, **_kw: Any) -> Any:
        from opentelemetry.sdk.metrics.export import MetricExportResult

        self.exports.append(data)
        return MetricExportResult.SUCCESS

    def shutdown(self, **_kw: Any) -> None:
        pass


def registry() -> tuple[CollectorRegistry, Counter, Histogram]:
    reg = CollectorRegistry()
    c = Counter("pegaflow_test_blocks", "blocks", ["result"], registry=reg)
    g = Gauge("pegaflow_test_used_bytes", "used", registry=reg)
    h = Histogram("pegaflow_test_seconds", "latency", buckets=(0.001, 0.01, 0.1), registry=reg)
    c.labels(result="hit").inc(5)
    c.labels(result="miss").inc(2)
    g.set(4096)
    for v in (0.0005, 0.005, 0.005, 0.5):
        h.observe(v)
    return reg, c, h


def test_off_by_default_and_free() -> None:
    assert load_config(env={}).telemetry.otlp_endpoint == ""
    assert telemetry.setup(TelemetryConfig(), service="t") is False
    assert telemetry.tracing is False
    assert telemetry.span("x") is telemetry.NOOP_SPAN
    with telemetry.span("x", {"a": 1}) as s:
        s.set_attribute("b", 2)
    assert telemetry.remote_span("x", "00-" + "1" * 32 + "-" + "2" * 16 + "-01") is (
        telemetry.NOOP_SPAN
    )
    assert telemetry.traceparent() is None
    assert telemetry.request_context("r") is None
    telemetry.request_root("r", 0)  # nothing to emit, no error


def test_one_request_is_one_trace_across_processes() -> None:
    """The scheduler's lookup, a worker's load and the node's get join one trace, whose
    root span carries the ids every process derives from the request id."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    spans = InMemorySpanExporter()
    reg, _, _ = registry()
    assert telemetry.setup(
        TelemetryConfig(), service="t", registry=reg, span_exporter=spans,
        metric_exporter=CaptureMetrics(),
    )  # fmt: skip
    start = 1_000_000_000
    # the scheduler process
    with telemetry.span("pegaflow.connector.lookup", parent=telemetry.request_context("req-1")):
        with telemetry.span("pegaflow.client.lookup", {"blocks": 8}):
            pass
    # a worker process: its load sends a traceparent with the get to the node
    with telemetry.span("pegaflow.connector.load", parent=telemetry.request_context("req-1")):
        with telemetry.span("pegaflow.client.get", {"node": "n1"}):
            tp = telemetry.traceparent()
    # the node, on the other end of the data plane
    with telemetry.remote_span("pegaflow.node.get", tp, {"blocks": 8}):
        pass
    with telemetry.span("pegaflow.connector.lookup", parent=telemetry.request_context("req-2")):
        pass
    telemetry.request_root("req-1", start, {"hit_tokens": 128})
    telemetry.flush()

    by_name: dict[str, list[Any]] = {}
    for s in spans.get_finished_spans():
        by_name.setdefault(s.name, []).append(s)
    trace_id, root_id = telemetry.request_ids("req-1")
    (root,) = by_name["pegaflow.request"]
    assert (root.context.trace_id, root.context.span_id) == (trace_id, root_id)
    assert root.parent is None and root.start_time == start
    assert root.attributes["vllm.request_id"] == "req-1"
    one = [s for s in spans.get_finished_spans() if s.context.trace_id == trace_id]
    assert {s.name for s in one} == {
        "pegaflow.request", "pegaflow.connector.lookup", "pegaflow.client.lookup",
        "pegaflow.connector.load", "pegaflow.client.get", "pegaflow.node.get",
    }  # fmt: skip
    ids = {s.name: s.context.span_id for s in one}
    parents = {s.name: s.parent.span_id if s.parent else None for s in one}
    assert parents["pegaflow.connector.lookup"] == root_id
    assert parents["pegaflow.connector.load"] == root_id
    assert parents["pegaflow.client.lookup"] == ids["pegaflow.connector.lookup"]
    assert parents["pegaflow.node.get"] == ids["pegaflow.client.get"]
    other = [s for s in by_name["pegaflow.connector.lookup"] if s.context.trace_id != trace_id]
    assert other and other[0].context.trace_id == telemetry.request_ids("req-2")[0]
    # a malformed traceparent from the wire starts a fresh trace instead of failing
    assert telemetry.remote_context("garbage") is None
    assert telemetry.remote_context("00-zz-zz-01") is None


def test_prometheus_registry_is_exported_with_the_same_names() -> None:
    reg, _, _ = registry()
    capture = CaptureMetrics()
    assert telemetry.setup(
        TelemetryConfig(export_interval_s=3600), service="t", registry=reg,
        metric_exporter=capture, span_exporter=_NullSpans(),
    )  # fmt: skip
    telemetry.flush()
    data = capture.exports[-1]
    (rm,) = data.resource_metrics
    assert rm.resource.attributes["service.name"] == "t"
    metrics = {m.name: m for sm in rm.scope_metrics for m in sm.metrics}
    blocks = metrics["pegaflow_test_blocks_total"].data
    assert blocks.is_monotonic
    assert {p.attributes["result"]: p.value for p in blocks.data_points} == {"hit": 5, "miss": 2}
    assert metrics["pegaflow_test_used_bytes"].data.data_points[0].value == 4096
    (hp,) = metrics["pegaflow_test_seconds"].data.data_points
    assert hp.count == 4 and hp.sum == pytest.approx(0.5105)
    assert list(hp.explicit_bounds) == [0.001, 0.01, 0.1]
    assert list(hp.bucket_counts) == [1, 2, 0, 1]


class _NullSpans:
    def export(self, spans: Any) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 0) -> bool:
        return True


class _Receiver(BaseHTTPRequestHandler):
    got: list[tuple[str, bytes]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        _Receiver.got.append((self.path, body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def test_otlp_http_export_reaches_a_collector() -> None:
    """With only ``otlp_endpoint`` (and the protocol) set, metrics and spans are POSTed
    as OTLP protobuf to ``/v1/metrics`` and ``/v1/traces`` (loopback receiver)."""
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest,
    )
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    _Receiver.got = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        reg, _, _ = registry()
        cfg = TelemetryConfig(
            otlp_endpoint=f"http://127.0.0.1:{httpd.server_address[1]}",
            otlp_protocol="http/protobuf",
            export_interval_s=3600,
        )
        assert telemetry.setup(cfg, service="pegaflow-test", registry=reg)
        with telemetry.span("pegaflow.client.get", {"blocks": 3}):
            pass
        telemetry.flush()
    finally:
        telemetry.shutdown()
        httpd.shutdown()
    paths = {p for p, _ in _Receiver.got}
    assert {"/v1/metrics", "/v1/traces"} <= paths
    names = set()
    for p, body in _Receiver.got:
        if p == "/v1/metrics":
            req = ExportMetricsServiceRequest.FromString(body)
            for rm in req.resource_metrics:
                for sm in rm.scope_metrics:
                    names |= {m.name for m in sm.metrics}
    assert {"pegaflow_test_blocks_total", "pegaflow_test_used_bytes"} <= names
    spans = [
        s.name
        for p, body in _Receiver.got
        if p == "/v1/traces"
        for rs in ExportTraceServiceRequest.FromString(body).resource_spans
        for ss in rs.scope_spans
        for s in ss.spans
    ]
    assert "pegaflow.client.get" in spans


def test_missing_package_or_bad_protocol_does_not_raise() -> None:
    cfg = TelemetryConfig(otlp_endpoint="http://127.0.0.1:1", otlp_protocol="carrier-pigeon")
    assert telemetry.setup(cfg, service="t") is False
    assert telemetry.tracing is False


async def test_a_transfer_is_traced_from_client_to_node() -> None:
    """A real pegaflow-server exporting over OTLP/HTTP with one flag, and a client whose
    get runs inside a request's span: the node's get span lands in the request's trace,
    as a child of the client's span (the traceparent travelled in the data plane)."""
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
    import os

    import numpy as np
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest,
    )
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from pegaflow.client import PegaClient

    from pegaflow.config import ClientConfig
    from pegaflow.tools.devcluster import start_server

    _Receiver.got = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{httpd.server_address[1]}"
    server = start_server(
        extra=["--node-id", "traced", "--node-pool-bytes", "64MiB",
               "--node-slab-bytes", "4MiB", "--telemetry-otlp-endpoint", endpoint,
               "--telemetry-otlp-protocol", "http/protobuf"],
    )  # fmt: skip
    spans = InMemorySpanExporter()
    try:
        telemetry.setup(TelemetryConfig(), service="test-client", span_exporter=spans,
                        metric_exporter=CaptureMetrics())  # fmt: skip
        client = PegaClient(ClientConfig(coordinators=[server.ready["coordinator"]]))
        try:
            hashes = [os.urandom(32) for _ in range(4)]
            data = np.arange(4 * 4096, dtype=np.uint8).reshape(4, 4096)
            put = await client.put_blocks("ns", [(h, 0, data[i]) for i, h in enumerate(hashes)],
                                          node_id="traced")  # fmt: skip
            assert put.stored == 4
            out = np.zeros_like(data)
            ctx = telemetry.request_context("req-e2e")
            with telemetry.span("pegaflow.connector.load", parent=ctx):
                ok = await client.get_blocks(
                    "ns", [("traced", h, 0, out[i]) for i, h in enumerate(hashes)]
                )
            assert all(ok) and np.array_equal(out, data)
        finally:
            await client.close()
        telemetry.flush()
    finally:
        server.terminate()  # flushes the server's spans and metrics on the way out
        httpd.shutdown()
    trace_id, _ = telemetry.request_ids("req-e2e")
    (client_get,) = [s for s in spans.get_finished_spans() if s.name == "pegaflow.client.get"]
    assert client_get.context.trace_id == trace_id
    node_spans = [
        s
        for p, body in _Receiver.got
        if p == "/v1/traces"
        for rs in ExportTraceServiceRequest.FromString(body).resource_spans
        for ss in rs.scope_spans
        for s in ss.spans
    ]
    gets = [s for s in node_spans if s.name == "pegaflow.node.get"]
    assert gets, f"the node exported no get span (got {[s.name for s in node_spans]})"
    assert int.from_bytes(gets[0].trace_id, "big") == trace_id
    assert int.from_bytes(gets[0].parent_span_id, "big") == client_get.context.span_id
    names = {
        m.name
        for p, body in _Receiver.got
        if p == "/v1/metrics"
        for rm in ExportMetricsServiceRequest.FromString(body).resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
    }
    assert {"pegaflow_node_get_bytes_total", "pegaflow_coordinator_lookups_total"} <= names


def test_connector_lookup_is_a_span_of_the_request_trace() -> None:
    """The real scheduler-side connector code traces its lookup under the request, and
    emits the request's root span when vLLM finishes it."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tests.support.connector_fakes import FakeRequest, make, store, toks

    spans = InMemorySpanExporter()
    reg, _, _ = registry()
    assert telemetry.setup(
        TelemetryConfig(), service="t", registry=reg, span_exporter=spans,
        metric_exporter=CaptureMetrics(),
    )  # fmt: skip
    side, cl, _ = make()
    req = FakeRequest("req-traced", toks(18), 4)
    store(cl, req, 3)
    assert side.get_num_new_matched_tokens(req, 0) == (12, True)
    telemetry.flush()
    side.request_finished(req)  # emits the request's root span
    telemetry.flush()
    trace_id, root_id = telemetry.request_ids("req-traced")
    (lk,) = [s for s in spans.get_finished_spans() if s.name == "pegaflow.connector.lookup"]
    assert lk.context.trace_id == trace_id and lk.parent.span_id == root_id
    (root,) = [s for s in spans.get_finished_spans() if s.name == "pegaflow.request"]
    assert (root.context.trace_id, root.context.span_id) == (trace_id, root_id)
    assert root.attributes["pegaflow.hit_blocks"] == 3


class DownCollector:
    """A span and metric exporter whose collector is down: every export retries until
    the exporter is shut down, as the OTLP exporters do for 10 s."""

    def __init__(self) -> None:
        self.stopped = threading.Event()

    def export(self, data: Any, timeout_millis: float = 0, **_kw: Any) -> Any:
        from opentelemetry.sdk.metrics.export import MetricExportResult

        self.stopped.wait()
        return MetricExportResult.FAILURE

    def shutdown(self, **_kw: Any) -> None:
        self.stopped.set()

    def force_flush(self, timeout_millis: int = 0) -> bool:
        return False


def test_a_collector_that_is_down_does_not_hold_the_stop() -> None:
    spans, metrics = DownCollector(), DownCollector()
    reg, _, _ = registry()
    assert telemetry.setup(
        TelemetryConfig(export_interval_s=3600), service="t", registry=reg,
        span_exporter=spans, metric_exporter=metrics,
    )  # fmt: skip
    with telemetry.span("pegaflow.test.pending"):
        pass
    stop = threading.Thread(target=telemetry.shutdown, kwargs={"timeout_s": 0.2}, daemon=True)
    stop.start()
    stop.join(30)  # without a bound, it waits for the collector forever
    stopped = not stop.is_alive() and spans.stopped.is_set() and metrics.stopped.is_set()
    spans.shutdown()
    metrics.shutdown()
    assert stopped


def test_a_service_stops_without_an_unreachable_collector() -> None:
    """A real coordinator exporting to a closed port: SIGTERM stops it, and the log says
    the last export was given up."""
    from pegaflow.tools.devcluster import free_port, start_coordinator

    closed = f"http://127.0.0.1:{free_port()}"
    p = start_coordinator(extra=["--telemetry-otlp-endpoint", closed])
    try:
        p.popen.terminate()
        assert p.popen.wait(60) == 0
    finally:
        p.kill()
    for _ in range(100):  # the log's last lines may still be on their way from the pipe
        if any("did not take the last export" in line for line in p.log):
            return
        time.sleep(0.1)
    raise AssertionError(p.log[-20:])
