"""The router's HTTP server: an OpenAI-compatible proxy in front of vLLM replicas.

Routes: ``POST /v1/completions`` and ``/v1/chat/completions`` (passed through, server-sent
events relayed chunk by chunk), ``GET /v1/models`` (from a healthy replica), ``/health``
(200 while every role the mode needs has a healthy replica), ``/v1/status`` (replicas,
health, load, counters) and ``/metrics`` (``pegaflow_router_*``, docs/metrics.md).

Every upstream call has a deadline (:class:`~pegaflow.config.RouterConfig`).  A replica
that cannot be reached is taken out of rotation at once; the periodic health check puts
it back.  A request whose replica fails before the first byte of the answer reached the
client is retried on another replica; a failure after that ends the answer with an
error event (streams) and is never a hang.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterable
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest

from pegaflow.config import ClientConfig, RouterConfig, SecurityConfig
from pegaflow.errors import Unauthorized
from pegaflow.http import new_registry

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


class UpstreamFailed(Exception):
    """A replica failed before any byte of its answer reached the client (retryable)."""


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
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=False),
            auto_decompress=False,
        )
        await self.check_health()
        self._health_task = asyncio.create_task(self._health_loop())
        app = web.Application(client_max_size=self.cfg.max_body_bytes)
        for path in COMPLETIONS:
            app.router.add_post(path, self.handle_completion)
        app.router.add_get("/v1/models", self.handle_models)
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/v1/status", self.handle_status)
        app.router.add_get("/metrics", self.handle_metrics)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        try:
            await web.TCPSite(self._runner, self.cfg.host, self.cfg.port).start()
        except OSError:
            await self.close()
            raise
        self.port = self._runner.addresses[0][1]
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
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()
        if self._pega is not None:
            await self._pega.close()

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
        self.metrics.healthy.labels(rep.url, rep.role).set(1 if ok else 0)

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

    def _failed(self, rep: Replica, e: BaseException | str, outcome: str) -> None:
        why = e if isinstance(e, str) else _describe(e)
        rep.failures += 1
        self.metrics.upstream.labels(rep.url, outcome).inc()
        self._set_health(rep, False, why)

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

    async def handle_completion(self, req: web.Request) -> web.StreamResponse:
        """``POST /v1/completions`` and ``/v1/chat/completions``."""
        t0 = time.monotonic()
        endpoint = req.path
        try:
            raw = await req.read()
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("the body is not a JSON object")
        except web.HTTPRequestEntityTooLarge:
            resp: web.StreamResponse = _error(
                f"request body over {self.cfg.max_body_bytes} bytes (--router-max-body-bytes)",
                413,
                "BadRequestError",
            )
        except (ValueError, UnicodeDecodeError) as e:
            resp = _error(f"the request body is not valid JSON: {e}", 400, "BadRequestError")
        else:
            stream = bool(body.get("stream"))
            if self.mode == "pd":
                resp = await self._pd(req, endpoint, body, raw, stream, t0)
            else:
                first = await self._route(endpoint, body)
                resp = await self._forward(req, endpoint, raw, stream, first, "both", t0)
        self.metrics.requests.labels(endpoint, str(resp.status)).inc()
        self.metrics.latency.labels(endpoint).observe(time.monotonic() - t0)
        return resp

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
        payload: bytes,
        stream: bool,
        first: Choice,
        role: str,
        t0: float,
    ) -> web.StreamResponse:
        """Send to ``first``'s replica, then (a failure before any byte reached the
        client) to the least loaded others, ``retries`` times at most."""
        tried: list[str] = []
        rep = first.replica
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
                log.warning("request to %s failed before any answer: %s; retrying", rep.url, e)
        return _error(self._no_replica_message(role, tried), 503)

    async def _send(
        self,
        req: web.Request,
        rep: Replica,
        endpoint: str,
        payload: bytes,
        stream: bool,
        t0: float,
    ) -> web.StreamResponse:
        """One upstream request; ``UpstreamFailed`` while nothing was sent downstream."""
        assert self._session is not None
        rep.inflight += 1
        rep.requests += 1
        self.metrics.inflight.labels(rep.url).inc()
        try:
            try:
                up = await self._session.post(
                    rep.url + endpoint,
                    data=payload,
                    headers=self._headers(req),
                    timeout=self._timeout(stream=stream),
                )
            except _NET_ERRORS as e:
                self._failed(rep, e, "connect_error")
                raise UpstreamFailed(_describe(e)) from None
            try:
                return await self._relay(req, rep, up, stream, endpoint, t0)
            finally:
                up.close()
        finally:
            rep.inflight -= 1
            self.metrics.inflight.labels(rep.url).dec()

    async def _relay(
        self,
        req: web.Request,
        rep: Replica,
        up: aiohttp.ClientResponse,
        stream: bool,
        endpoint: str,
        t0: float,
    ) -> web.StreamResponse:
        ctype = up.headers.get("Content-Type", "application/json")
        if not stream or up.status != 200:
            try:
                body = await up.read()
            except _NET_ERRORS as e:
                self._failed(rep, e, "read_error")
                raise UpstreamFailed(_describe(e)) from None
            self.metrics.upstream.labels(rep.url, str(up.status)).inc()
            self.metrics.first_byte.labels(endpoint).observe(time.monotonic() - t0)
            headers = {"Content-Type": ctype, REPLICA_HEADER: rep.url}
            return web.Response(body=body, status=up.status, headers=headers)
        try:
            chunk = await up.content.readany()
        except _NET_ERRORS as e:
            self._failed(rep, e, "read_error")
            raise UpstreamFailed(_describe(e)) from None
        if not chunk:
            self._failed(rep, "closed the stream before its first event", "read_error")
            raise UpstreamFailed("empty stream")
        self.metrics.first_byte.labels(endpoint).observe(time.monotonic() - t0)
        out = web.StreamResponse(
            status=200,
            headers={"Content-Type": ctype, "Cache-Control": "no-cache", REPLICA_HEADER: rep.url},
        )
        broken = False
        try:
            await out.prepare(req)
            while chunk:
                await out.write(chunk)
                try:
                    chunk = await up.content.readany()
                except _NET_ERRORS as e:
                    broken = True
                    log.warning("replica %s broke a stream mid-way: %s", rep.url, _describe(e))
                    self._failed(rep, e, "stream_broken")
                    why = f"replica {rep.url} failed mid-stream: {_describe(e)}"
                    await out.write(_sse_error(why))
                    break
            else:
                self.metrics.upstream.labels(rep.url, "200").inc()
            await out.write_eof()
        except ConnectionError:  # the client left; closing ``up`` aborts the request upstream
            if not broken:
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
            try:
                async with self._session.post(
                    rep.url + endpoint,
                    data=payload,
                    headers=self._headers(req),
                    timeout=self._timeout(self.cfg.prefill_timeout_s),
                ) as r:
                    data = await r.read()
                    self.metrics.upstream.labels(rep.url, str(r.status)).inc()
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
                self._failed(rep, e, "prefill_error")
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
        raw: bytes,
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
