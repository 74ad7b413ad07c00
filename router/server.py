"""The router's HTTP server: an OpenAI-compatible proxy in front of vLLM replicas.

Routes: ``POST /v1/completions`` and ``/v1/chat/completions`` (passed through, server-sent
events relayed chunk by chunk), ``GET /v1/models`` (from a healthy replica), ``/health``
(200 while every role the mode needs has a healthy replica), ``/v1/status`` (replicas,
health, load, counters) and ``/metrics`` (``pegaflow_router_*``, docs/metrics.md).

Every upstream call has a deadline (:class:`~pegaflow.config.RouterConfig`), a stream's
first bytes ``first_byte_timeout_s`` (a long prefill), and a client that goes away
cancels its request (the upstream request is closed, vLLM aborts it).  A replica that
cannot be reached is taken out of rotation at once; the periodic health check puts it
back.  A replica that answers its ``/health`` but fails its answers (5xx, broken or
truncated streams) is ejected after ``eject_after`` of them in a row
(:mod:`pegaflow.router.policy`), and a failed ``/health`` cancels the requests still
waiting for its first byte.  A request whose replica fails before the first byte of the
answer reached the client is retried on another replica (nothing was relayed, so it
is safe); a failure after that is made visible, never a clean end: a stream ends with
an error event, any other answer is cut off (its connection aborted).

The router's own resources are bounded, since a proxy that runs out of memory or file
descriptors fails every client, not one:

* answers are relayed chunk by chunk as they come, never read whole;
* request bodies: one over ``max_body_bytes`` is refused (413) before it is read, also
  on ``Expect: 100-continue``; at most ``max_body_inflight_bytes`` of bodies are held at
  once (a request past it waits before its body is read); a large body is parsed off
  the event loop, so it never stalls other requests; one nested too deeply is a 400;
* client connections: closed after ``idle_timeout_s`` without a request (a request's
  head must be complete within it: a trickling client counts as idle), a body must
  arrive within ``body_timeout_s`` (408), and past ``max_connections`` (below the file
  descriptor limit, which it raises to the hard limit) a new connection gets a 503 and
  is closed, so the descriptors left serve those admitted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any, cast

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest

from pegaflow.config import ClientConfig, RouterConfig, SecurityConfig
from pegaflow.errors import Unauthorized
from pegaflow.observability.http import new_registry

from .hashing import BlockHasher, hashable
from .policy import Choice, Picker, RecentRoutes, Replica, node_scores, parse_replicas
from .prompts import PromptTokenizer
from .report import Reporter, advertised_url

log = logging.getLogger("pegaflow.router")

COMPLETIONS = ("/v1/completions", "/v1/chat/completions")
REPLICA_HEADER = "X-PegaFlow-Replica"
"""response header naming the replica that answered"""
_FORWARD_HEADERS = ("Authorization", "X-Request-Id")
#: What a failed upstream call raises (connection refused/reset, deadline, bad answer).
_NET_ERRORS = (TimeoutError, aiohttp.ClientError, OSError)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
PARSE_OFF_LOOP_BYTES = 1 << 20
"""request bodies at least this large are parsed in a thread (63 MiB took ~0.2 s)"""
ERROR_BODY_BYTES = 64 << 10
"""most of a replica's 5xx answer kept (to answer with when no other replica is left)"""
FD_RESERVE = 64
"""file descriptors kept out of ``max_connections``' default (log, replicas' probes,
the coordinator, the tokenizer's files)"""
_DONE = b"data: [DONE]"
BUSY_LINGER_S = 0.5
"""how long a refused connection waits for its request head (see ``_Busy``)"""
BUSY_LINGERING = FD_RESERVE // 2
"""refused connections waiting for their head at most"""


class UpstreamFailed(Exception):
    """A replica failed before any byte of its answer reached the client (retryable);
    ``answer``: its own error answer (a 5xx), given when no other replica is left."""

    def __init__(self, why: str, answer: web.Response | None = None) -> None:
        super().__init__(why)
        self.answer = answer


class ByteBudget:
    """At most ``capacity`` bytes held at once; :meth:`hold` waits its turn (FIFO).  A
    request over the whole capacity holds all of it (it runs alone)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.used = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    @asynccontextmanager
    async def hold(self, n: int) -> AsyncIterator[None]:
        """Hold ``n`` bytes for the body of the ``async with``."""
        n = min(max(0, n), self.capacity)
        if not self._waiters and self.used + n <= self.capacity:
            self.used += n
        else:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            entry = (n, fut)
            self._waiters.append(entry)
            try:
                await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():
                    self._release(n)  # granted, then cancelled
                else:
                    self._waiters.remove(entry)
                    self._release(0)
                raise
        try:
            yield
        finally:
            self._release(n)

    def _release(self, n: int) -> None:
        self.used -= n
        while self._waiters and self.used + self._waiters[0][0] <= self.capacity:
            m, fut = self._waiters.popleft()
            if not fut.done():
                self.used += m
                fut.set_result(None)


def connection_limit(configured: int) -> int:
    """Client connections served at once: ``configured``, or (0) from the file
    descriptor limit, raised to its hard limit first: half of it less ``FD_RESERVE``
    (each proxied request holds a client and an upstream descriptor)."""
    if configured > 0:
        return configured
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(8, (soft - FD_RESERVE) // 2)


class _Busy(asyncio.Protocol):
    """A connection past ``max_connections``: once its request head is in (or after
    ``BUSY_LINGER_S``), a 503 with ``Connection: close`` and the end of our side; what
    the client sends is read and dropped (so it reads the 503 rather than a reset), and
    the connection closed when it closes or ``BUSY_LINGER_S`` later.  Past
    ``BUSY_LINGERING`` of them at once, the 503 goes out and the connection closes at
    once (their descriptors come out of ``FD_RESERVE``)."""

    def __init__(self, answer: bytes, lingering: list[int]) -> None:
        self._answer = answer
        self._lingering = lingering  # [count], shared by every _Busy of one router
        self._transport: asyncio.Transport | None = None
        self._tail = b""
        self._answered = False
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, base: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, base)  # uvloop's is not a subclass
        if self._lingering[0] >= BUSY_LINGERING:
            transport.write(self._answer)
            transport.close()
            return
        self._lingering[0] += 1
        self._transport = transport
        self._timer = asyncio.get_running_loop().call_later(BUSY_LINGER_S, self._step)

    def data_received(self, data: bytes) -> None:
        if not self._answered:
            self._tail = (self._tail + data)[-(len(data) + 4) :]
            if b"\r\n\r\n" in self._tail:
                self._step()

    def eof_received(self) -> bool:
        self._step()
        return False  # closes the transport

    def _step(self) -> None:
        """Answer (head in, or the wait over); the second time, close."""
        t = self._transport
        if t is None or t.is_closing():
            return
        if self._answered:
            t.close()
            return
        self._answered = True
        t.write(self._answer)
        if t.can_write_eof():
            t.write_eof()
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(BUSY_LINGER_S, self._step)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._transport is not None:
            self._lingering[0] -= 1
            self._transport = None
        if self._timer is not None:
            self._timer.cancel()


def error_body(message: str, status: int, kind: str = "RouterError") -> dict[str, Any]:
    """An error in the OpenAI format vLLM answers with."""
    return {"error": {"message": message, "type": kind, "code": status}}


def _error(message: str, status: int, kind: str = "RouterError") -> web.Response:
    return web.json_response(error_body(message, status, kind), status=status)


def _sse_error(message: str) -> bytes:
    """The end of a stream that broke: an error event, then ``[DONE]`` (what vLLM sends
    when a request fails mid-stream)."""
    ev = json.dumps(error_body(message, 502, "UpstreamError"))
    return f"data: {ev}\n\ndata: [DONE]\n\n".encode()


def _describe(e: BaseException) -> str:
    if isinstance(e, TimeoutError):
        return "timed out"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


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


class Router:
    """The proxy: replicas, their health, the routing policy, the HTTP handlers."""

    def __init__(
        self,
        cfg: RouterConfig,
        client_cfg: ClientConfig | None = None,
        security: SecurityConfig | None = None,
    ) -> None:
        """Check the configuration (``BadRequest``/``ValueError`` naming the problem);
        nothing starts until :meth:`start`."""
        self.cfg = cfg
        self.mode = cfg.mode
        self.replicas = parse_replicas(cfg.replicas, cfg.mode)
        self.picker = Picker(self.replicas, max_inflight=cfg.max_inflight)
        self.metrics = RouterMetrics(cfg.mode)
        self.counters: dict[str, int] = {}
        self.recent = RecentRoutes(cfg.affinity_memory)
        self._client_cfg = client_cfg or ClientConfig()
        self._token = (security or SecurityConfig()).token
        self.hasher: BlockHasher | None = None
        self.tokenizer = PromptTokenizer()
        self._pega: Any = None
        self._refused = False
        self._session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.AbstractServer | None = None
        self._opening: dict[str, set[asyncio.Future[Any]]] = {r.url: set() for r in self.replicas}
        self._bodies = ByteBudget(cfg.max_body_inflight_bytes)
        self.max_connections = 0
        self.refused_connections = 0
        self._lingering = [0]
        self._busy_answer = b""
        self._refused_logged = 0.0
        self.reporter: Reporter | None = None
        self.port = 0
        if cfg.mode == "cache":
            self.hasher = BlockHasher(cfg.block_size, cfg.hash_algo, cfg.hash_seed)
            if not cfg.namespace:
                log.warning(
                    "cache mode without --router-namespace: every request is routed by load. "
                    "Give the namespace the engines log at their first request "
                    "('PegaFlow namespace ...')"
                )
        for r in self.replicas:
            self.metrics.healthy.labels(r.url, r.role).set(0)
            self.metrics.inflight.labels(r.url).set(0)

    # ---- life cycle ----------------------------------------------------------------

    async def start(self) -> None:
        """Load the tokenizer, connect, check every replica once, then serve."""
        if self.mode == "cache":
            loop = asyncio.get_running_loop()
            if self.cfg.tokenizer:
                self.tokenizer = await loop.run_in_executor(
                    None, PromptTokenizer, self.cfg.tokenizer
                )
            if self.cfg.namespace:
                from pegaflow.client import PegaClient

                self._pega = PegaClient(self._client_cfg, token=self._token or None)
                try:  # connect now, not within the first request's lookup deadline
                    await self._pega.lookup(
                        self.cfg.namespace,
                        [bytes(32)],
                        timeout=self._client_cfg.rpc_timeout_s,
                        warm_up=True,
                    )
                except Exception as e:
                    self._lookup_failed(e, at_start=True)
        self.max_connections = connection_limit(self.cfg.max_connections)
        msg = f"the router serves {self.max_connections} connections at once; try again"
        body = json.dumps(error_body(msg, 503)).encode()
        self._busy_answer = (
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=self.max_connections + len(self.replicas) + 8, force_close=False
            ),
            auto_decompress=False,
        )
        await self.check_health()
        self._health_task = asyncio.create_task(self._health_loop())
        app = web.Application(client_max_size=self.cfg.max_body_bytes)
        for path in COMPLETIONS:
            app.router.add_post(path, self.handle_completion, expect_handler=self._expect)
        app.router.add_get("/v1/models", self.handle_models)
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/v1/status", self.handle_status)
        app.router.add_get("/metrics", self.handle_metrics)
        self._runner = web.AppRunner(
            app,
            access_log=None,
            handle_signals=False,
            handler_cancellation=True,  # a client that goes away cancels its request
            keepalive_timeout=self.cfg.idle_timeout_s,
        )
        await self._runner.setup()
        try:
            self._listener = await asyncio.get_running_loop().create_server(
                self._accept, self.cfg.host, self.cfg.port, reuse_address=True, backlog=1024
            )
        except OSError:
            await self.close()
            raise
        self.port = self._listener.sockets[0].getsockname()[1]
        coordinators = self._client_cfg.coordinators
        if self.cfg.report_interval_s > 0 and coordinators:
            self.reporter = Reporter(
                advertised_url(self.cfg.host, self.port),
                list(coordinators),
                self.status,
                interval_s=self.cfg.report_interval_s,
                timeout_s=self._client_cfg.rpc_timeout_s,
                token=self._token or None,
            )
            self.reporter.start()

    async def close(self) -> None:
        """Stop serving and close every connection."""
        if self.reporter is not None:
            await self.reporter.close()
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()
        if self._pega is not None:
            await self._pega.close()

    def _accept(self) -> asyncio.Protocol:
        """A new client connection: served, or past ``max_connections`` a 503."""
        assert self._runner is not None and self._runner.server is not None
        server = self._runner.server
        if len(server.connections) < self.max_connections:
            return server()
        self.refused_connections += 1
        now = time.monotonic()
        if now - self._refused_logged > 10:
            self._refused_logged = now
            log.warning(
                "%d client connections open (--router-max-connections): new ones get a 503 "
                "until some close (%d refused so far)",
                len(server.connections), self.refused_connections,
            )  # fmt: skip
        return _Busy(self._busy_answer, self._lingering)

    # ---- health --------------------------------------------------------------------

    def _set_health(self, rep: Replica, ok: bool, why: str = "") -> None:
        if ok and not rep.healthy:
            log.info("replica %s (%s) is healthy: in rotation", rep.url, rep.role)
        elif not ok and rep.healthy:
            log.warning(
                "replica %s (%s) out of rotation: %s; requests go to the others until its "
                "/health answers again",
                rep.url,
                rep.role,
                why,
            )
        if not ok:
            rep.last_error = why
        rep.healthy = ok
        ejected = time.monotonic() < rep.ejected_until
        self.metrics.healthy.labels(rep.url, rep.role).set(1 if ok and not ejected else 0)

    async def _probe(self, rep: Replica) -> None:
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=self.cfg.health_timeout_s)
        try:
            async with self._session.get(rep.url + "/health", timeout=timeout) as r:
                await r.read()
                ok, why = r.status == 200, f"/health answered {r.status}"
        except _NET_ERRORS as e:
            ok, why = False, f"/health: {_describe(e)}"
        self._set_health(rep, ok, why)
        if not ok:  # requests waiting for its first byte: retried elsewhere
            for task in list(self._opening.get(rep.url, ())):
                task.cancel()

    async def check_health(self) -> None:
        """Ask every replica's ``/health`` once (within ``health_timeout_s``)."""
        await asyncio.gather(*(self._probe(r) for r in self.replicas))

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            try:
                await self.check_health()
            except Exception:  # never let the loop die
                log.exception("health check round failed")

    def _failed(
        self,
        rep: Replica,
        e: BaseException | str,
        outcome: str,
        down: bool = True,
        sent: float | None = None,
    ) -> None:
        """A failed answer to a request sent at ``sent`` (monotonic; None: now): counted
        against the replica (``eject_after`` in a row eject it); ``down`` (it could not
        be reached, or timed out): out of rotation at once, until its ``/health``
        answers."""
        why = e if isinstance(e, str) else _describe(e)
        rep.failures += 1
        rep.last_error = why
        self.metrics.upstream.labels(rep.url, outcome).inc()
        seconds = rep.note_failure(time.monotonic(), self.cfg.eject_after, self.cfg.eject_s, sent)
        if seconds:
            log.warning(
                "replica %s (%s) out of rotation for %.0f s: %d failed answers in a row "
                "(last: %s) though its /health may answer; then one trial request",
                rep.url, rep.role, seconds, rep.failed_in_row, why,
            )  # fmt: skip
            self.metrics.healthy.labels(rep.url, rep.role).set(0)
        if down:
            self._set_health(rep, False, why)

    def _answered(self, rep: Replica, status: int, sent: float) -> None:
        """An answer that did not fail (a 4xx is the request's fault, not the replica's)
        to a request sent at ``sent``."""
        self.metrics.upstream.labels(rep.url, str(status)).inc()
        if rep.note_success(sent):
            log.info("replica %s (%s) answered its trial request: in rotation", rep.url, rep.role)
            self.metrics.healthy.labels(rep.url, rep.role).set(1 if rep.healthy else 0)

    # ---- counters ------------------------------------------------------------------

    def _count(self, decision: str) -> None:
        self.counters[decision] = self.counters.get(decision, 0) + 1
        self.metrics.routes.labels(self.mode, decision).inc()

    def _needed_roles(self) -> tuple[str, ...]:
        return ("prefill", "decode") if self.mode == "pd" else ("both",)

    # ---- simple handlers -----------------------------------------------------------

    async def handle_health(self, _req: web.Request) -> web.Response:
        """200 while each role the mode needs has a healthy replica, else 503."""
        missing = [r for r in self._needed_roles() if not self.picker.candidates(r)]
        ok = not missing
        body: dict[str, Any] = {
            "ok": ok,
            "healthy": sum(r.healthy for r in self.replicas),
            "replicas": len(self.replicas),
        }
        if missing:
            body["error"] = f"no healthy replica for role {', '.join(missing)}"
        return web.json_response(body, status=200 if ok else 503)

    def status(self) -> dict[str, Any]:
        """The ``/v1/status`` document."""
        return {
            "router": {
                "mode": self.mode,
                "port": self.port,
                "namespace": self.cfg.namespace,
                "max_inflight": self.cfg.max_inflight,
                "recent_routes": len(self.recent),
                "max_connections": self.max_connections,
                "refused_connections": self.refused_connections,
                "body_bytes_held": self._bodies.used,
            },
            "replicas": [r.status() for r in self.replicas],
            "counters": dict(sorted(self.counters.items())),
        }

    async def handle_status(self, _req: web.Request) -> web.Response:
        """``GET /v1/status``."""
        return web.json_response(self.status())

    async def handle_metrics(self, _req: web.Request) -> web.Response:
        """``GET /metrics``: Prometheus text."""
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def handle_models(self, req: web.Request) -> web.Response:
        """``GET /v1/models`` from a healthy replica (the next one if it fails)."""
        assert self._session is not None
        tried: list[str] = []
        for _ in range(len(self.replicas)):
            rep = self.picker.round_robin("both", tried)
            if rep is None:
                break
            tried.append(rep.url)
            try:
                async with self._session.get(
                    rep.url + "/v1/models", headers=self._headers(req), timeout=self._timeout()
                ) as r:
                    body = await r.read()
                    return web.Response(body=body, status=r.status, content_type="application/json")
            except _NET_ERRORS as e:
                self._failed(rep, e, "connect_error")
        return _error(self._no_replica_message("both", tried), 503)

    # ---- the proxy -----------------------------------------------------------------

    def _timeout(self, total: float | None = None, stream: bool = False) -> aiohttp.ClientTimeout:
        """Deadlines of one upstream request; the wait between two reads is bounded for
        streams only (a plain answer sends nothing until it is complete)."""
        return aiohttp.ClientTimeout(
            total=total if total is not None else self.cfg.request_timeout_s,
            connect=self.cfg.connect_timeout_s,
            sock_read=self.cfg.read_timeout_s if stream else None,
        )

    @staticmethod
    def _headers(req: web.Request) -> dict[str, str]:
        h = {k: req.headers[k] for k in _FORWARD_HEADERS if k in req.headers}
        h["Content-Type"] = "application/json"
        return h

    def _no_replica_message(self, role: str, tried: Iterable[str]) -> str:
        tried = list(tried)
        what = "no healthy replica" + ("" if role == "both" else f" with role {role}")
        if tried:
            what = f"every replica tried failed ({', '.join(tried)}) and {what} is left"
        return f"{what}; see the router's /v1/status for each replica's last error"

    def _too_large(self) -> web.Response:
        """A 413 for a body over ``max_body_bytes``; the connection closes (its body is
        never read)."""
        resp = _error(
            f"request body over {self.cfg.max_body_bytes} bytes (--router-max-body-bytes)",
            413,
            "BadRequestError",
        )
        resp.force_close()
        return resp

    async def _expect(self, req: web.Request) -> web.Response | None:
        """``Expect: 100-continue``: a 413 at once for a body over ``max_body_bytes``
        (the client never sends it), else ``100 Continue``."""
        if req.content_length is not None and req.content_length > self.cfg.max_body_bytes:
            return self._too_large()
        if req.headers.get("Expect", "").lower() != "100-continue":
            return _error(f"unknown Expect: {req.headers['Expect']}", 417, "BadRequestError")
        if req.version >= aiohttp.HttpVersion11:
            await req.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return None

    async def handle_completion(self, req: web.Request) -> web.StreamResponse:
        """``POST /v1/completions`` and ``/v1/chat/completions``: a body over
        ``max_body_bytes`` is a 413 before it is read; others wait for room among
        ``max_body_inflight_bytes`` (held until the answer ends)."""
        t0 = time.monotonic()
        endpoint = req.path
        size = req.content_length
        if size is not None and size > self.cfg.max_body_bytes:
            resp: web.StreamResponse = self._too_large()
        else:
            async with self._bodies.hold(self.cfg.max_body_bytes if size is None else size):
                try:
                    resp = await self._completion(req, endpoint, t0)
                except RecursionError:  # a body nested deeper than the parser or encoder go
                    resp = _error("the request body is nested too deeply", 400, "BadRequestError")
        self.metrics.requests.labels(endpoint, str(resp.status)).inc()
        self.metrics.latency.labels(endpoint).observe(time.monotonic() - t0)
        return resp

    async def _read_body(self, req: web.Request) -> bytearray:
        """The body, read into one buffer of its announced size (no copy of it kept
        growing); ``HTTPRequestEntityTooLarge`` past ``max_body_bytes``."""
        limit = self.cfg.max_body_bytes
        size = req.content_length
        buf = bytearray(size or 0)
        n = 0
        while chunk := await req.content.readany():
            if n + len(chunk) > limit:
                raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=n + len(chunk))
            if n + len(chunk) <= len(buf):
                buf[n : n + len(chunk)] = chunk
            else:
                del buf[n:]
                buf += chunk
            n += len(chunk)
        del buf[n:]
        return buf

    async def _completion(self, req: web.Request, endpoint: str, t0: float) -> web.StreamResponse:
        try:
            async with asyncio.timeout(self.cfg.body_timeout_s):
                raw = await self._read_body(req)
        except TimeoutError:
            resp = _error(
                f"the request body did not arrive within {self.cfg.body_timeout_s} s "
                "(--router-body-timeout-s)",
                408,
                "BadRequestError",
            )
            resp.force_close()
            return resp
        except web.HTTPRequestEntityTooLarge:
            return self._too_large()
        try:
            if len(raw) >= PARSE_OFF_LOOP_BYTES:  # never stall the other requests
                body = await asyncio.get_running_loop().run_in_executor(None, json.loads, raw)
            else:
                body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("the body is not a JSON object")
        except (ValueError, UnicodeDecodeError) as e:
            return _error(f"the request body is not valid JSON: {e}", 400, "BadRequestError")
        stream = bool(body.get("stream"))
        if self.mode == "pd":
            return await self._pd(req, endpoint, body, raw, stream, t0)
        first = await self._route(endpoint, body)
        del body  # only ``raw`` is sent on
        return await self._forward(req, endpoint, raw, stream, first, "both", t0)

    async def _route(self, endpoint: str, body: dict[str, Any]) -> Choice:
        """The first replica to try for a request (rr or cache mode)."""
        if self.mode == "rr":
            choice = Choice(self.picker.round_robin(), "rr")
        else:
            t0 = time.monotonic()
            choice = await self._cache_choice(endpoint, body)
            self.metrics.route_seconds.labels(self.mode).observe(time.monotonic() - t0)
        self._count(choice.decision)
        return choice

    async def _cache_choice(self, endpoint: str, body: dict[str, Any]) -> Choice:
        assert self.hasher is not None
        if not hashable(body):
            return Choice(self.picker.least_loaded(), "unhashable")
        hasher = self.hasher

        def compute() -> list[bytes] | None:
            tokens = self.tokenizer.tokens(endpoint, body)
            return None if tokens is None else hasher.hashes(tokens)

        hashes = await asyncio.get_running_loop().run_in_executor(None, compute)
        if hashes is None:
            return Choice(self.picker.least_loaded(), "untokenized")
        if not hashes:
            return Choice(self.picker.least_loaded(), "short")
        scores: dict[str, int] = {}
        stored = 0
        if self._pega is not None:
            try:
                res = await self._pega.lookup(
                    self.cfg.namespace, hashes, timeout=self.cfg.lookup_timeout_s
                )
            except Exception as e:  # any failure: route by load, never fail the request
                self._lookup_failed(e)
                choice = Choice(self.picker.least_loaded(), "lookup_failed")
                self._remember(hashes, choice)
                return choice
            stored = res.hits
            owners = [row[0] for row in res.blocks[: res.hits] if row]
            hosts = {nid: rec.host for nid, rec in res.nodes.items()}
            scores = node_scores(self.replicas, owners, hosts)
        n_recent, url = self.recent.longest(hashes)
        if n_recent > scores.get(url, 0) and n_recent > stored:
            scores[url] = n_recent
        choice = self.picker.by_affinity(scores)
        if choice.decision == "affinity" and choice.blocks:
            local = min(choice.blocks, stored) if stored else 0
            self.metrics.prefix_blocks.labels("local").inc(local)
            self.metrics.prefix_blocks.labels("elsewhere").inc(max(0, stored - local))
        elif stored:
            self.metrics.prefix_blocks.labels("elsewhere").inc(stored)
        self._remember(hashes, choice)
        return choice

    def _lookup_failed(self, e: Exception, at_start: bool = False) -> None:
        """Log a failed coordinator lookup: a refusal (token or namespace) once at
        WARNING, saying what to fix; the coordinator not reachable at start at WARNING;
        any other failure at DEBUG (each is a request routed by load)."""
        where = ",".join(self._client_cfg.coordinators)
        if isinstance(e, Unauthorized):
            if not self._refused:
                self._refused = True
                log.warning(
                    "coordinator %s refuses this router's lookups (%s): requests are "
                    "routed by load. Give the router the engines' token "
                    "(--security-token) and namespace (--router-namespace; a tenant's "
                    "token only admits namespaces 'tenant@...')",
                    where, e,
                )  # fmt: skip
        elif at_start:
            log.warning(
                "coordinator %s not reachable yet (%s): requests are routed by load "
                "until it is",
                where, _describe(e),
            )  # fmt: skip
        else:
            log.debug("coordinator lookup failed: %s", _describe(e))

    def _remember(self, hashes: list[bytes], choice: Choice) -> None:
        if choice.replica is not None:
            self.recent.remember(hashes, choice.replica.url)

    async def _forward(
        self,
        req: web.Request,
        endpoint: str,
        payload: bytes | bytearray,
        stream: bool,
        first: Choice,
        role: str,
        t0: float,
    ) -> web.StreamResponse:
        """Send to ``first``'s replica, then (a failure before any byte reached the
        client) to the least loaded others, ``retries`` times at most.  When none is
        left: the last replica's own 5xx answer, else a 503."""
        tried: list[str] = []
        rep = first.replica
        answer: web.Response | None = None
        for attempt in range(1 + max(0, self.cfg.retries)):
            if attempt:
                rep = self.picker.least_loaded(role, tried)
                if rep is not None:
                    self.metrics.retries.inc()
            if rep is None:
                break
            tried.append(rep.url)
            try:
                return await self._send(req, rep, endpoint, payload, stream, t0)
            except UpstreamFailed as e:
                answer = e.answer
                log.warning("request to %s failed before any answer: %s; retrying", rep.url, e)
        return answer or _error(self._no_replica_message(role, tried), 503)

    async def _send(
        self,
        req: web.Request,
        rep: Replica,
        endpoint: str,
        payload: bytes | bytearray,
        stream: bool,
        t0: float,
    ) -> web.StreamResponse:
        """One upstream request; ``UpstreamFailed`` while nothing was sent downstream."""
        rep.inflight += 1
        rep.requests += 1
        self.metrics.inflight.labels(rep.url).inc()
        up: aiohttp.ClientResponse | None = None
        sent = time.monotonic()
        try:
            up, chunk = await self._open(rep, endpoint, payload, self._headers(req), stream, sent)
            return await self._relay(req, rep, up, chunk, stream, endpoint, t0, sent)
        except asyncio.CancelledError:  # the client went away: closing ``up`` aborts it
            self.metrics.upstream.labels(rep.url, "client_left").inc()
            raise
        finally:
            if up is not None:
                up.close()
            rep.inflight -= 1
            self.metrics.inflight.labels(rep.url).dec()

    async def _open(
        self,
        rep: Replica,
        endpoint: str,
        payload: bytes | bytearray,
        headers: dict[str, str],
        stream: bool,
        sent: float,
    ) -> tuple[aiohttp.ClientResponse, bytes]:
        """Send the request and wait for the answer's first bytes, in a task that a
        failed ``/health`` of the replica cancels (:meth:`_probe`).  ``UpstreamFailed``
        when the replica cannot be reached, times out, fails its ``/health`` meanwhile
        or answers a 5xx."""
        task = asyncio.ensure_future(
            self._first_bytes(rep, endpoint, payload, headers, stream, sent)
        )
        waiting = self._opening.setdefault(rep.url, set())
        waiting.add(task)
        try:
            return await task
        except asyncio.CancelledError:
            this = asyncio.current_task()
            if this is not None and this.cancelling():
                raise  # the client went away (``task`` is cancelled with us)
            why = f"failed its /health while the request waited ({rep.last_error})"
            self._failed(rep, why, "health_failed", down=False, sent=sent)
            raise UpstreamFailed(why) from None
        finally:
            waiting.discard(task)

    async def _first_bytes(
        self,
        rep: Replica,
        endpoint: str,
        payload: bytes | bytearray,
        headers: dict[str, str],
        stream: bool,
        sent: float,
    ) -> tuple[aiohttp.ClientResponse, bytes]:
        assert self._session is not None
        deadline = self.cfg.first_byte_timeout_s if stream else None
        try:
            async with asyncio.timeout(deadline):
                up = await self._session.post(
                    rep.url + endpoint,
                    data=payload,
                    headers=headers,
                    timeout=self._timeout(stream=stream),
                )
                try:
                    chunk = await up.content.readany()
                except BaseException:
                    up.close()
                    raise
        except TimeoutError:
            why = "timed out" if deadline is None else (
                f"no first byte within {deadline} s (--router-first-byte-timeout-s)"
            )  # fmt: skip
            self._failed(rep, why, "first_byte_timeout", sent=sent)
            raise UpstreamFailed(why) from None
        except _NET_ERRORS as e:
            self._failed(rep, e, "connect_error", sent=sent)
            raise UpstreamFailed(_describe(e)) from None
        if up.status >= 500:
            try:
                async with asyncio.timeout(self.cfg.connect_timeout_s):
                    while chunk and len(chunk) < ERROR_BODY_BYTES:
                        more = await up.content.readany()
                        if not more:
                            break
                        chunk += more
            except _NET_ERRORS:
                pass
            up.close()
            why = f"answered {up.status}"
            self._failed(rep, why, str(up.status), down=False, sent=sent)
            ctype = up.headers.get("Content-Type", "application/json")
            answer = web.Response(
                body=chunk[:ERROR_BODY_BYTES],
                status=up.status,
                headers={"Content-Type": ctype, REPLICA_HEADER: rep.url},
            )
            raise UpstreamFailed(why, answer)
        if stream and up.status == 200 and not chunk:
            up.close()
            why = "closed the stream before its first event"
            self._failed(rep, why, "read_error", sent=sent)
            raise UpstreamFailed("empty stream")
        return up, chunk

    async def _relay(
        self,
        req: web.Request,
        rep: Replica,
        up: aiohttp.ClientResponse,
        chunk: bytes,
        stream: bool,
        endpoint: str,
        t0: float,
        sent: float,
    ) -> web.StreamResponse:
        """Relay the answer chunk by chunk (never read whole).  A failure once bytes
        went out is made visible: a stream ends with an error event, as does one that
        ends without ``data: [DONE]``; any other answer is cut off (its connection
        aborted: the client sees a short body, never a complete-looking one)."""
        self.metrics.first_byte.labels(endpoint).observe(time.monotonic() - t0)
        sse = stream and up.status == 200
        headers = {"Content-Type": up.headers.get("Content-Type", "application/json")}
        headers[REPLICA_HEADER] = rep.url
        if "Content-Encoding" in up.headers:
            headers["Content-Encoding"] = up.headers["Content-Encoding"]
        if sse:
            headers["Cache-Control"] = "no-cache"
        out = web.StreamResponse(status=up.status, headers=headers)
        if not sse and up.content_length is not None:
            out.content_length = up.content_length
        failure: BaseException | str | None = None
        outcome = "stream_broken"
        tail = b""
        try:
            await out.prepare(req)
            while chunk:
                await out.write(chunk)
                tail = (tail + chunk)[-64:]
                try:
                    chunk = await up.content.readany()
                except _NET_ERRORS as e:
                    failure = e
                    break
            if failure is None and sse and not tail.rstrip().endswith(_DONE):
                failure, outcome = "ended the stream without data: [DONE]", "truncated"
            if failure is None:
                self._answered(rep, up.status, sent)
                await out.write_eof()
                return out
            why = failure if isinstance(failure, str) else _describe(failure)
            log.warning("replica %s broke a stream mid-way: %s", rep.url, why)
            self._failed(rep, failure, outcome, down=not isinstance(failure, str), sent=sent)
            if sse:
                await out.write(_sse_error(f"replica {rep.url} failed mid-stream: {why}"))
                await out.write_eof()
            elif req.transport is not None:
                req.transport.abort()
        except ConnectionError:  # the client left; closing ``up`` aborts the request upstream
            if failure is None:
                self.metrics.upstream.labels(rep.url, "client_left").inc()
        return out

    # ---- prefill/decode ------------------------------------------------------------

    @staticmethod
    def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
        """The prefill replica's request: the same prompt, one token, no stream."""
        pre = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
        pre.update(stream=False, max_tokens=1, n=1)
        if "max_completion_tokens" in pre:
            pre["max_completion_tokens"] = 1
        return pre

    async def _prefill(
        self, req: web.Request, endpoint: str, body: dict[str, Any]
    ) -> tuple[dict[str, Any] | None, web.Response | None]:
        """``(kv_transfer_params or None, None)``, or ``(None, an error to answer)``
        when the prefill replica rejected the request itself (a 4xx)."""
        assert self._session is not None
        payload = json.dumps(self.prefill_body(body)).encode()
        tried: list[str] = []
        for _ in range(1 + max(0, self.cfg.retries)):
            rep = self.picker.least_loaded("prefill", tried)
            if rep is None:
                break
            tried.append(rep.url)
            rep.inflight += 1
            rep.requests += 1
            self.metrics.inflight.labels(rep.url).inc()
            sent = time.monotonic()
            try:
                async with self._session.post(
                    rep.url + endpoint,
                    data=payload,
                    headers=self._headers(req),
                    timeout=self._timeout(self.cfg.prefill_timeout_s),
                ) as r:
                    data = await r.read()
                    if r.status >= 500:
                        why = f"prefill answered {r.status}"
                        self._failed(rep, why, str(r.status), down=False, sent=sent)
                    else:
                        self._answered(rep, r.status, sent)
                    if 400 <= r.status < 500:
                        ctype = r.headers.get("Content-Type", "application/json")
                        return None, web.Response(
                            body=data, status=r.status, headers={"Content-Type": ctype}
                        )
                    if r.status != 200:
                        log.warning(
                            "prefill on %s answered %d: decode recomputes", rep.url, r.status
                        )
                        return None, None
                    try:
                        params = json.loads(data).get("kv_transfer_params")
                    except (ValueError, AttributeError):
                        params = None
                    return (params if isinstance(params, dict) and params else None), None
            except _NET_ERRORS as e:
                self._failed(rep, e, "prefill_error", sent=sent)
                log.warning("prefill on %s failed: %s", rep.url, _describe(e))
            finally:
                rep.inflight -= 1
                self.metrics.inflight.labels(rep.url).dec()
        return None, None

    async def _pd(
        self,
        req: web.Request,
        endpoint: str,
        body: dict[str, Any],
        raw: bytes | bytearray,
        stream: bool,
        t0: float,
    ) -> web.StreamResponse:
        """Prefill on a prefill replica, then decode (streamed) on a decode replica with
        the producer's ``kv_transfer_params``; without them the decode replica
        recomputes the prompt."""
        params, rejected = await self._prefill(req, endpoint, body)
        self.metrics.route_seconds.labels(self.mode).observe(time.monotonic() - t0)
        if rejected is not None:
            self._count("prefill_rejected")
            return rejected
        if params is not None:
            self._count("handoff")
            payload = json.dumps({**body, "kv_transfer_params": params}).encode()
        else:
            self._count("recompute")
            payload = raw
        first = Choice(self.picker.least_loaded("decode"), "decode")
        return await self._forward(req, endpoint, payload, stream, first, "decode", t0)
