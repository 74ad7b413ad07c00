"""The HTTP endpoint every service runs (aiohttp): ``/health``, ``/metrics``, ``/v1/status``.

* ``GET /health``: 200 with a JSON body when healthy, 503 with the same body otherwise.
* ``GET /metrics``: Prometheus text format from the given registry.
* ``GET /v1/status``: the service's status as JSON.
"""

from __future__ import annotations

import json
import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

log = logging.getLogger(__name__)

StatusFn = Callable[[], Awaitable[dict[str, Any]]]
HealthFn = Callable[[], Awaitable[tuple[bool, dict[str, Any]]]]


def new_registry() -> CollectorRegistry:
    """A per-process registry holding only the process collectors (CPU, memory, fds,
    GC); each service adds its own collectors to it."""
    reg = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=reg)
    PlatformCollector(registry=reg)
    GCCollector(registry=reg)
    return reg


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(
        text=json.dumps(data, default=_jsonable), status=status, content_type="application/json"
    )


def _jsonable(o: Any) -> Any:
    if isinstance(o, bytes):
        return o.hex()
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    return str(o)


class HttpHandle:
    """A running HTTP endpoint."""

    def __init__(self, runner: web.AppRunner, port: int) -> None:
        self._runner = runner
        #: The bound port (useful when started on port 0).
        self.port = port

    async def close(self) -> None:
        """Stop serving."""
        await self._runner.cleanup()


async def start_http(
    host: str,
    port: int,
    *,
    status: StatusFn,
    health: HealthFn,
    registry: CollectorRegistry | None = None,
    app_hook: Callable[[web.Application], None] | None = None,
    tls: ssl.SSLContext | None = None,
) -> HttpHandle:
    """Serve ``/health``, ``/metrics`` and ``/v1/status`` on ``host:port`` (port 0: any
    free one).  ``registry`` defaults to a fresh :func:`new_registry`.  ``app_hook``, if
    given, is called with the application before it starts, to add routes or startup and
    cleanup callbacks (the coordinator's dashboard uses it).  ``tls``: serve HTTPS with
    this context (:func:`pegaflow.tls.server_context`)."""
    reg = registry if registry is not None else new_registry()

    async def health_handler(_req: web.Request) -> web.Response:
        try:
            ok, body = await health()
        except Exception as e:
            log.exception("health check failed")
            ok, body = False, {"error": f"{type(e).__name__}: {e}"}
        return _json({"ok": ok, **body}, 200 if ok else 503)

    async def metrics_handler(_req: web.Request) -> web.Response:
        body = generate_latest(reg)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def status_handler(_req: web.Request) -> web.Response:
        try:
            return _json(await status())
        except Exception as e:
            log.exception("status failed")
            return _json({"error": f"{type(e).__name__}: {e}"}, 500)

    app = web.Application()
    app.router.add_get("/health", health_handler)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/v1/status", status_handler)
    if app_hook is not None:
        app_hook(app)
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, ssl_context=tls).start()
    except OSError:
        await runner.cleanup()
        raise
    return HttpHandle(runner, runner.addresses[0][1])
