"""Optional OpenTelemetry export (OTLP) of PegaFlow's metrics and traces.

Off by default.  Setting ``[telemetry] otlp_endpoint`` (flag
``--telemetry-otlp-endpoint``, env ``PEGAFLOW_TELEMETRY_OTLP_ENDPOINT``) turns both on
for a process once it calls :func:`setup`:

* **metrics**: every ``export_interval_s`` the process's Prometheus registry (the very
  metrics ``/metrics`` serves, same names) is converted to OTLP and pushed: counters as
  monotonic cumulative sums, gauges as gauges, histograms as explicit-bucket histograms;
* **traces**: spans opened with :func:`span` / :func:`remote_span` are batched and
  pushed.  A vLLM request's spans share one trace id derived from its request id
  (:func:`request_context`), so the scheduler's lookup and every worker's load and save
  land in one trace although they run in different processes; the data plane carries a
  W3C ``traceparent`` (:func:`traceparent`) so the node's side of a transfer joins it.

Wiring, for code on the request path:

* ``with telemetry.span("pegaflow.client.get", attrs):`` around an operation (build
  ``attrs`` only ``if telemetry.tracing``);
* ``parent=telemetry.request_context(req_id)`` for the connector's per-request spans,
  and :func:`request_root` once when the request finishes (scheduler side);
* ``{**msg, **telemetry.wire_context()}`` on an outgoing data-plane message and
  ``telemetry.remote_span(name, msg.get(telemetry.TRACEPARENT_KEY))`` on the node;
* :func:`bind_context` on a coroutine handed to another thread's event loop.

Needs the ``otlp`` extra (``pip install 'pegaflow-cluster[otlp]'``); without it
:func:`setup` logs an error and the process runs without export.

Cost when off: :func:`span` is one global check returning a shared no-op context
manager (about 0.1 µs); hot paths that want to pay nothing at all test
:data:`tracing` first.  Nothing from OpenTelemetry is imported unless it is on.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Coroutine, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from pegaflow.config import TelemetryConfig

log = logging.getLogger(__name__)
T = TypeVar("T")

#: True once :func:`setup` turned tracing on (read it before building span attributes).
tracing = False

_tracer: Any = None
_provider: Any = None
_ids: _RequestIds | None = None
_bridge: PrometheusBridge | None = None
_exporters: list[Any] = []
"""the span and metric exporters of :func:`setup` (:func:`shutdown` may cut them short)"""
_lock = threading.Lock()

TRACEPARENT_KEY = "tp"
"""Key of the W3C traceparent string in data-plane messages (absent when not tracing)."""


class _NoopSpan(AbstractContextManager["_NoopSpan"]):
    """What :func:`span` returns while tracing is off: accepts and drops everything."""

    __slots__ = ()

    def __exit__(self, *exc: object) -> None:
        return None

    def set_attribute(self, key: str, value: Any) -> None:
        """Dropped."""

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        """Dropped."""

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        """Dropped."""

    def record_exception(self, exc: BaseException) -> None:
        """Dropped."""

    def is_recording(self) -> bool:
        return False


NOOP_SPAN = _NoopSpan()


def span(
    name: str, attributes: Mapping[str, Any] | None = None, *, parent: Any = None
) -> AbstractContextManager[Any]:
    """A span named ``name`` around a ``with`` block (the current span becomes its
    parent, or ``parent``, a context from :func:`request_context` /
    :func:`remote_context`).  A no-op while tracing is off."""
    if _tracer is None:
        return NOOP_SPAN
    return _tracer.start_as_current_span(name, context=parent, attributes=attributes)


def remote_span(
    name: str, traceparent_value: str | None, attributes: Mapping[str, Any] | None = None
) -> AbstractContextManager[Any]:
    """A server-side span whose parent is the caller's ``traceparent`` (from a message);
    a root span when there is none.  A no-op while tracing is off."""
    if _tracer is None:
        return NOOP_SPAN
    from opentelemetry.trace import SpanKind

    return _tracer.start_as_current_span(
        name,
        context=remote_context(traceparent_value),
        kind=SpanKind.SERVER,
        attributes=attributes,
    )


def traceparent() -> str | None:
    """The W3C ``traceparent`` of the current span, to put in an outgoing message
    (under :data:`TRACEPARENT_KEY`); None while tracing is off or outside a span."""
    if _tracer is None:
        return None
    from opentelemetry import trace

    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


_NO_WIRE: dict[str, str] = {}


def wire_context() -> dict[str, str]:
    """``{TRACEPARENT_KEY: traceparent}`` to merge into an outgoing message (``{**msg,
    **wire_context()}``); an empty mapping while tracing is off or outside a span."""
    if _tracer is None:
        return _NO_WIRE
    tp = traceparent()
    return {TRACEPARENT_KEY: tp} if tp else _NO_WIRE


def bind_context(coro: Coroutine[Any, Any, T]) -> Coroutine[Any, Any, T]:
    """``coro``, made to run in the caller's trace context wherever it is scheduled
    (``asyncio.run_coroutine_threadsafe`` does not carry context to the loop thread).
    Returns ``coro`` itself while tracing is off."""
    if _tracer is None:
        return coro
    from opentelemetry import context as otel_context

    ctx = otel_context.get_current()

    async def in_context() -> T:
        token = otel_context.attach(ctx)
        try:
            return await coro
        finally:
            otel_context.detach(token)

    return in_context()


def remote_context(traceparent_value: Any) -> Any:
    """An OpenTelemetry context whose parent is ``traceparent_value`` (a W3C string);
    None when it is missing or malformed (or tracing is off)."""
    if _tracer is None or not isinstance(traceparent_value, str):
        return None
    parts = traceparent_value.split("-")
    if len(parts) != 4 or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None
    try:
        trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3], 16)
    except ValueError:
        return None
    return _context_of(trace_id, span_id, flags & 0xFF)


def request_ids(request_id: str) -> tuple[int, int]:
    """The (trace id, root span id) every process derives from a vLLM request id."""
    d = hashlib.blake2b(request_id.encode(), digest_size=24, person=b"pegaflow-trace").digest()
    trace_id = int.from_bytes(d[:16], "big") or 1
    span_id = int.from_bytes(d[16:], "big") or 1
    return trace_id, span_id


def request_context(request_id: str) -> Any:
    """Parent context for spans about vLLM request ``request_id``: the same in the
    scheduler and in every worker process, so their spans form one trace under the
    root that :func:`request_root` emits.  None while tracing is off."""
    if _tracer is None:
        return None
    trace_id, span_id = request_ids(request_id)
    return _context_of(trace_id, span_id, 1)


def request_root(
    request_id: str, start_time_ns: int, attributes: Mapping[str, Any] | None = None
) -> None:
    """Emit the root span ``pegaflow.request`` of a request's trace, from
    ``start_time_ns`` (``time.time_ns()`` of its first lookup) to now, with the ids of
    :func:`request_ids`.  Call once per request, in the scheduler, when it finishes."""
    if _tracer is None or _ids is None:
        return
    trace_id, span_id = request_ids(request_id)
    attrs = {"vllm.request_id": request_id, **(attributes or {})}
    with _ids.forced(trace_id, span_id):
        s = _tracer.start_span("pegaflow.request", attributes=attrs, start_time=start_time_ns)
    s.end()


def _context_of(trace_id: int, span_id: int, flags: int) -> Any:
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    sc = SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(flags))
    return trace.set_span_in_context(NonRecordingSpan(sc))


class _RequestIds:
    """Random ids, except inside :meth:`forced` (used to emit a request's root span
    with the ids every process derived from its request id)."""

    def __init__(self) -> None:
        from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

        self._random = RandomIdGenerator()
        self._forced = threading.local()

    @contextmanager
    def forced(self, trace_id: int, span_id: int) -> Iterator[None]:
        self._forced.ids = (trace_id, span_id)
        try:
            yield
        finally:
            self._forced.ids = None

    def generate_trace_id(self) -> int:
        ids = getattr(self._forced, "ids", None)
        return ids[0] if ids else self._random.generate_trace_id()

    def generate_span_id(self) -> int:
        ids = getattr(self._forced, "ids", None)
        return ids[1] if ids else self._random.generate_span_id()

    def is_trace_id_random(self) -> bool:
        return True


# ---- metrics: the Prometheus registry as OTLP ------------------------------------------


class PrometheusBridge:
    """Converts a Prometheus registry to OpenTelemetry metric data and pushes it to an
    exporter every ``interval_s`` (from a daemon thread; :meth:`export_once` on demand)."""

    def __init__(
        self, registry: CollectorRegistry, exporter: Any, resource: Any, interval_s: float
    ) -> None:
        self.registry = registry
        self.exporter = exporter
        self.resource = resource
        self.interval_s = max(0.5, interval_s)
        self.start_ns = time.time_ns()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the export thread."""
        self._thread = threading.Thread(target=self._run, name="pegaflow-otlp", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.export_once()

    def collect(self) -> Any:
        """The registry's current content as an OpenTelemetry ``MetricsData``."""
        from opentelemetry.sdk.metrics.export import (
            AggregationTemporality,
            Gauge,
            Histogram,
            HistogramDataPoint,
            Metric,
            MetricsData,
            NumberDataPoint,
            ResourceMetrics,
            ScopeMetrics,
            Sum,
        )
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        from pegaflow import __version__

        now = time.time_ns()
        start = self.start_ns
        cumulative = AggregationTemporality.CUMULATIVE
        metrics: list[Any] = []
        for fam in self.registry.collect():
            if fam.type == "counter":
                pts = [
                    NumberDataPoint(dict(s.labels), start, now, s.value)
                    for s in fam.samples
                    if s.name.endswith("_total")
                ]
                if pts:
                    metrics.append(
                        Metric(
                            fam.name + "_total", fam.documentation, "", Sum(pts, cumulative, True)
                        )
                    )
            elif fam.type == "gauge":
                pts = [NumberDataPoint(dict(s.labels), start, now, s.value) for s in fam.samples]
                if pts:
                    metrics.append(Metric(fam.name, fam.documentation, "", Gauge(pts)))
            elif fam.type == "histogram":
                hpts = _histogram_points(fam.samples, start, now, HistogramDataPoint)
                if hpts:
                    metrics.append(
                        Metric(fam.name, fam.documentation, "s", Histogram(hpts, cumulative))
                    )
        scope = InstrumentationScope("pegaflow", __version__)
        return MetricsData([ResourceMetrics(self.resource, [ScopeMetrics(scope, metrics, "")], "")])

    def export_once(self) -> bool:
        """Collect and export now; False (and a log line) when the export failed."""
        try:
            result = self.exporter.export(self.collect(), timeout_millis=10_000)
        except Exception as e:  # a collector being down must never hurt the service
            log.warning("OTLP metric export failed: %s", e)
            return False
        ok = getattr(result, "name", "SUCCESS") == "SUCCESS"
        if not ok:
            log.warning("OTLP metric export failed: %s", result)
        return ok

    def shutdown(self) -> None:
        """Stop the thread after one last export."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self.export_once()
        try:
            self.exporter.shutdown()
        except Exception:
            pass


def _histogram_points(samples: list[Any], start: int, now: int, point_cls: Any) -> list[Any]:
    """Prometheus histogram samples (cumulative ``_bucket``, ``_sum``, ``_count`` per
    label set) into OpenTelemetry points (per-bucket counts, explicit bounds)."""
    series: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}
    for s in samples:
        labels = {k: v for k, v in s.labels.items() if k != "le"}
        key = tuple(sorted(labels.items()))
        d = series.setdefault(key, {"labels": labels, "buckets": [], "sum": 0.0, "count": 0})
        if s.name.endswith("_bucket"):
            d["buckets"].append((float(s.labels["le"]), s.value))
        elif s.name.endswith("_sum"):
            d["sum"] = s.value
        elif s.name.endswith("_count"):
            d["count"] = int(s.value)
    out = []
    for d in series.values():
        buckets = sorted(d["buckets"])
        bounds = [b for b, _ in buckets if b != float("inf")]
        counts, prev = [], 0.0
        for _, c in buckets:
            counts.append(int(c - prev))
            prev = c
        if len(counts) == len(bounds):  # no +Inf bucket seen: close the last one
            counts.append(int(d["count"] - prev))
        out.append(
            point_cls(
                d["labels"], start, now, d["count"], d["sum"], counts, bounds,
                min=float("nan"), max=float("nan"),
            )
        )  # fmt: skip
    return out


# ---- lifecycle --------------------------------------------------------------------------


def setup(
    cfg: TelemetryConfig | None = None,
    *,
    service: str,
    registry: CollectorRegistry | None = None,
    span_exporter: Any = None,
    metric_exporter: Any = None,
) -> bool:
    """Turn OTLP export on for this process if ``cfg.otlp_endpoint`` is set (``cfg``
    defaults to the ``[telemetry]`` table of the environment's config).  ``registry`` is
    the Prometheus registry to export (default: prometheus_client's global one).
    ``span_exporter`` / ``metric_exporter`` replace the OTLP exporters (tests).

    Returns whether export is on.  Never raises for a missing package or a bad
    endpoint: it logs and leaves the process without export."""
    global tracing, _tracer, _provider, _ids, _bridge, _exporters
    if cfg is None:
        from pegaflow.config import load_config

        cfg = load_config().telemetry
    if not cfg.otlp_endpoint and span_exporter is None and metric_exporter is None:
        return False
    with _lock:
        if _tracer is not None:
            return True
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

            span_exporter = span_exporter or _otlp_exporter(cfg, "traces")
            metric_exporter = metric_exporter or _otlp_exporter(cfg, "metrics")
        except ImportError as e:
            log.error(
                "telemetry: OTLP export asked for (%s) but OpenTelemetry is not installed "
                "(%s); install the extra: pip install 'pegaflow-cluster[otlp]'",
                cfg.otlp_endpoint,
                e,
            )
            return False
        except ValueError as e:
            log.error("telemetry: bad configuration, no export: %s", e)
            return False
        from pegaflow import __version__

        resource = Resource.create(
            {"service.name": cfg.service_name or service, "service.version": __version__}
        )
        _ids = _RequestIds()
        ratio = min(1.0, max(0.0, cfg.trace_sample_ratio))
        _provider = TracerProvider(
            resource=resource,
            sampler=ParentBased(TraceIdRatioBased(ratio)),
            id_generator=_ids,  # type: ignore[arg-type]
        )
        _provider.add_span_processor(BatchSpanProcessor(span_exporter))
        _exporters = [span_exporter, metric_exporter]
        _tracer = _provider.get_tracer("pegaflow", __version__)
        if registry is None:
            from prometheus_client import REGISTRY

            registry = REGISTRY
        _bridge = PrometheusBridge(registry, metric_exporter, resource, cfg.export_interval_s)
        _bridge.start()
        tracing = True
        log.info(
            "telemetry: exporting metrics and traces to %s (%s) as %s",
            cfg.otlp_endpoint or "a custom exporter",
            cfg.otlp_protocol,
            cfg.service_name or service,
        )
        return True


def _otlp_exporter(cfg: TelemetryConfig, signal: str) -> Any:
    endpoint = cfg.otlp_endpoint.rstrip("/")
    proto = cfg.otlp_protocol.lower()
    if proto in ("http", "http/protobuf"):
        url = endpoint if endpoint.endswith(f"/v1/{signal}") else f"{endpoint}/v1/{signal}"
        if signal == "traces":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            return OTLPSpanExporter(endpoint=url)
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

        return OTLPMetricExporter(endpoint=url)
    if proto != "grpc":
        raise ValueError(f"[telemetry] otlp_protocol must be grpc or http/protobuf, not {proto!r}")
    insecure = endpoint.startswith("http://")
    if signal == "traces":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcSpanExporter,
        )

        return GrpcSpanExporter(endpoint=endpoint, insecure=insecure)
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
        OTLPMetricExporter as GrpcMetricExporter,
    )

    return GrpcMetricExporter(endpoint=endpoint, insecure=insecure)


def flush(timeout_s: float = 10.0) -> None:
    """Export finished spans and the current metrics now (tests, and before exit)."""
    if _provider is not None:
        _provider.force_flush(int(timeout_s * 1000))
    if _bridge is not None:
        _bridge.export_once()


SHUTDOWN_S = 2.0
"""how long a stop waits for the last spans and metrics to reach the collector; a
collector that is down is not waited for longer (its exporters retry for 10 s)"""


def shutdown(timeout_s: float = SHUTDOWN_S) -> None:
    """Flush and stop export (safe to call when it never started), waiting at most
    ``timeout_s`` for the collector: past it, the exporters are stopped mid-retry and
    what was not sent is dropped."""
    global tracing, _tracer, _provider, _ids, _bridge, _exporters
    with _lock:
        tracing = False
        provider, bridge, exporters = _provider, _bridge, _exporters
        _tracer = _provider = _ids = _bridge = None
        _exporters = []

    def flush_and_stop() -> None:
        if provider is not None:
            provider.shutdown()
        if bridge is not None:
            bridge.shutdown()

    if provider is None and bridge is None:
        return
    last = threading.Thread(target=flush_and_stop, name="pegaflow-otlp-stop", daemon=True)
    last.start()
    last.join(timeout_s)
    if not last.is_alive():
        return
    log.warning(
        "telemetry: the OTLP collector did not take the last export in %.0f s; stopping "
        "without it",
        timeout_s,
    )
    for exporter in exporters:
        try:  # ends the exporter's retries: the thread above then finishes at once
            exporter.shutdown()
        except Exception:
            pass
