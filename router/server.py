"""The router's HTTP server: an OpenAI-compatible proxy in front of vLLM replicas.

Routes: ``POST /v1/completions`` and ``/v1/chat/completions`` (passed through, server-sent
events relayed chunk by chunk), ``GET /v1/models`` (from a healthy replica), ``/health``
(200 while every role the mode needs has a healthy replica), ``/v1/status`` (replicas,
health, load, counters) and ``/metrics`` (``pegaflow_router_*``, docs/metrics.md).  The
replicas' health and ejection: :mod:`~pegaflow.router.backends`; the proxying, retries
and the prefill of ``pd`` mode: :mod:`~pegaflow.router.proxy`.  Cache mode scores each
replica on its GPU cache (:mod:`~pegaflow.router.kvevents`), the pool and its queue
(:func:`~pegaflow.router.policy.tier_scores`, :meth:`~pegaflow.router.policy.Picker.by_affinity`).

The router's own resources are bounded (:mod:`~pegaflow.router.limits`), since a proxy
that runs out of memory or file descriptors fails every client, not one:

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
import contextlib
import functools
import importlib.util
import json
import logging
import time
from dataclasses import replace
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pegaflow.auth import cluster_token
from pegaflow.config import ClientConfig, RouterConfig, SecurityConfig
from pegaflow.errors import BadRequest, Unauthorized
from pegaflow.tls import client_context, http_scheme, server_context

from .backends import NET_ERRORS, Backends, describe
from .hashing import BlockHasher, hashable, vllm_hash_function
from .kvevents import GpuView, Stored, Subscription, block_key
from .limits import Busy, ByteBudget, connection_limit
from .metrics import RouterMetrics
from .policy import (
    Choice,
    RecentRoutes,
    TierWeights,
    node_scores,
    parse_replicas,
    prefill_blocks,
    tier_scores,
    tier_split,
)
from .prompts import PromptTokenizer
from .proxy import Proxy, error, error_body
from .report import Reporter, advertised_url

log = logging.getLogger("pegaflow.router")

COMPLETIONS = ("/v1/completions", "/v1/chat/completions")
PARSE_OFF_LOOP_BYTES = 1 << 20
"""request bodies at least this large are parsed in a thread (63 MiB took ~0.2 s)"""


class Router(Proxy):
    """The proxy's HTTP server: the routes, the routing policy of its mode, its life cycle."""

    def __init__(
        self,
        cfg: RouterConfig,
        client_cfg: ClientConfig | None = None,
        security: SecurityConfig | None = None,
    ) -> None:
        """Check the configuration (``BadRequest``/``ValueError`` naming the problem);
        nothing starts until :meth:`start`."""
        self.replicas = parse_replicas(cfg.replicas, cfg.mode)
        super().__init__(cfg, Backends(cfg, self.replicas, RouterMetrics(cfg.mode)))
        self.mode = cfg.mode
        self.counters: dict[str, int] = {}
        self.recent = RecentRoutes(cfg.affinity_memory)
        self._client_cfg = client_cfg or ClientConfig()
        security = security or SecurityConfig()
        self._token = cluster_token(security)
        self._tls = client_context(security)
        self._server_tls = server_context(security)
        """the router's own HTTP server speaks TLS with it (``[security] tls_cert``)"""
        self.hasher: BlockHasher | None = None
        self.tokenizer = PromptTokenizer()
        self._pega: Any = None
        self._refused = False
        self._stack = contextlib.AsyncExitStack()
        self._runner: web.AppRunner | None = None
        self._bodies = ByteBudget(cfg.max_body_inflight_bytes)
        self.max_connections = 0
        self.refused_connections = 0
        self._lingering = [0]
        self._busy_answer = b""
        self._refused_logged = 0.0
        self.reporter: Reporter | None = None
        self.port = 0
        self.weights = TierWeights(cfg.pool_weight, cfg.remote_weight)
        self.views = self.backends.views
        if cfg.mode == "cache":
            self.hasher = BlockHasher(cfg.block_size, cfg.hash_algo, cfg.hash_seed)
            for r in self.replicas:
                if r.events:
                    self.views[r.url] = GpuView(cfg.events_max_blocks, cfg.events_stale_s)
            if self.views and importlib.util.find_spec("zmq") is None:
                raise BadRequest(
                    "events= needs the pyzmq package: pip install 'pegaflow-cluster[router]'"
                )
            if not cfg.namespace:
                log.warning(
                    "cache mode without --router-namespace: every request is routed by load. "
                    "Give the namespace the engines log at their first request "
                    "('PegaFlow namespace ...')"
                )

    # ---- life cycle ----------------------------------------------------------------

    async def start(self) -> None:
        """Load the tokenizer, connect, check every replica once, then serve; what
        started is closed by :meth:`close`, in reverse (also after a failed start)."""
        stack = self._stack
        if self.mode == "cache":
            self._start_events()
            loop = asyncio.get_running_loop()
            if self.cfg.tokenizer:
                self.tokenizer = await loop.run_in_executor(
                    None, PromptTokenizer, self.cfg.tokenizer
                )
            if self.cfg.namespace:
                from pegaflow.client import PegaClient

                self._pega = PegaClient(self._client_cfg, token=self._token, tls=self._tls)
                stack.push_async_callback(self._pega.close)
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
        stack.push_async_callback(self.backends.close)
        await self.backends.start(self.max_connections)
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
        stack.push_async_callback(self._runner.cleanup)
        listener = await asyncio.get_running_loop().create_server(
            self._accept, self.cfg.host, self.cfg.port, reuse_address=True, backlog=1024,
            ssl=self._server_tls,
        )  # fmt: skip
        stack.callback(listener.close)
        self.port = listener.sockets[0].getsockname()[1]
        coordinators = self._client_cfg.coordinators
        if self.cfg.report_interval_s > 0 and coordinators:
            self.reporter = Reporter(
                advertised_url(self.cfg.host, self.port, http_scheme(self._server_tls)),
                list(coordinators),
                self.status,
                interval_s=self.cfg.report_interval_s,
                timeout_s=self._client_cfg.rpc_timeout_s,
                token=self._token,
                tls=self._tls,
            )
            self.reporter.start()
            stack.push_async_callback(self.reporter.close)

    async def close(self) -> None:
        """Stop serving and close every connection."""
        await self._stack.aclose()

    def _start_events(self) -> None:
        """Subscribe to each ``events=`` replica's KV events and load vLLM's own hash
        function in the background (the router's copy hashes until it is in)."""
        tasks: list[asyncio.Task[Any]] = [asyncio.create_task(self._load_vllm_hash())]
        for r in self.replicas:
            view = self.views.get(r.url)
            if view is None:
                continue
            sub = Subscription(
                r.url, r.events, r.replay, view, self._check_hashes,
                self.cfg.events_timeout_s, self.cfg.events_topic,
                functools.partial(self._on_batch, r.url, view),
            )  # fmt: skip
            tasks.append(asyncio.create_task(sub.run(), name=f"kv-events {r.url}"))

        async def stop() -> None:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self._stack.push_async_callback(stop)

    def _on_batch(self, url: str, view: GpuView, outcome: str) -> None:
        self.metrics.kv_events.labels(url, outcome).inc()
        self.metrics.gpu_blocks.labels(url).set(len(view))

    async def _load_vllm_hash(self) -> None:
        assert self.hasher is not None
        if importlib.util.find_spec("vllm") is None:
            log.info("vLLM is not installed: the router hashes prompts with its own copy")
            return
        fn = await asyncio.get_running_loop().run_in_executor(
            None, vllm_hash_function, self.cfg.hash_algo
        )
        if fn is None:
            log.warning("vLLM does not import here: the router hashes with its own copy")
            return
        h = self.hasher
        self.hasher = BlockHasher(h.block_size, h.algo, h.seed, fn)
        log.info("the router hashes prompts with vLLM's own %s function", h.algo)

    def _check_hashes(self, ev: Stored) -> bool | None:
        """Whether the router's hashes of a replica's stored blocks equal its own."""
        assert self.hasher is not None
        if ev.block_size != self.hasher.block_size:
            return None
        return self.hasher.check(ev.parent, ev.token_ids, ev.hashes)

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
        return Busy(self._busy_answer, self._lingering)

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
                "hash_function": "" if self.hasher is None else (
                    "vllm" if self.hasher.own else "copy"
                ),
                "max_connections": self.max_connections,
                "refused_connections": self.refused_connections,
                "body_bytes_held": self._bodies.used,
            },
            "replicas": [self._replica_status(r) for r in self.replicas],
            "counters": dict(sorted(self.counters.items())),
        }

    def _replica_status(self, r: Any) -> dict[str, Any]:
        view = self.views.get(r.url)
        st = r.status()
        if view is not None:
            st["gpu_view"] = view.status()
        return st

    async def handle_status(self, _req: web.Request) -> web.Response:
        """``GET /v1/status``."""
        return web.json_response(self.status())

    async def handle_metrics(self, _req: web.Request) -> web.Response:
        """``GET /metrics``: Prometheus text."""
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def handle_models(self, req: web.Request) -> web.Response:
        """``GET /v1/models`` from a healthy replica (the next one if it fails)."""
        tried: list[str] = []
        for _ in range(len(self.replicas)):
            rep = self.picker.round_robin("both", tried)
            if rep is None:
                break
            tried.append(rep.url)
            try:
                async with self.backends.session.get(
                    rep.url + "/v1/models", headers=self._headers(req), timeout=self._timeout()
                ) as r:
                    body = await r.read()
                    return web.Response(body=body, status=r.status, content_type="application/json")
            except NET_ERRORS as e:
                self.backends.failed(rep, e, "connect_error")
        return error(self._no_replica_message("both", tried), 503)

    # ---- completions ---------------------------------------------------------------

    def _too_large(self) -> web.Response:
        """A 413 for a body over ``max_body_bytes``; the connection closes (its body is
        never read)."""
        resp = error(
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
            return error(f"unknown Expect: {req.headers['Expect']}", 417, "BadRequestError")
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
                    resp = error("the request body is nested too deeply", 400, "BadRequestError")
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
            resp = error(
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
            return error(f"the request body is not valid JSON: {e}", 400, "BadRequestError")
        stream = bool(body.get("stream"))
        if self.mode == "pd":
            return await self._pd(req, endpoint, body, raw, stream, t0)
        first = await self._route(endpoint, body)
        del body  # only ``raw`` is sent on
        return await self._forward(req, endpoint, raw, stream, first, "both", t0)

    # ---- routing -------------------------------------------------------------------

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
        stored = 0
        local: dict[str, int] = {}
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
            local = node_scores(self.replicas, owners, hosts)
        gpu = self._gpu_prefixes(hashes)
        scores = tier_scores(self.replicas, gpu, local, stored, self.weights)
        choice = self.picker.by_affinity(scores)
        if choice.replica is not None:
            work = prefill_blocks(len(hashes), choice.blocks, stored, self.weights)
            choice = replace(choice, work=work)
            url = choice.replica.url
            split = tier_split(gpu.get(url, 0), local.get(url, 0), stored)
            for where, n in zip(("gpu", "local", "elsewhere"), split, strict=True):
                if n:
                    self.metrics.prefix_blocks.labels(where).inc(n)
        self._remember(hashes, choice)
        return choice

    def _gpu_prefixes(self, hashes: list[bytes]) -> dict[str, int]:
        """Per replica URL, the prefix of ``hashes`` in its GPU cache: as its KV events
        tell while its view is usable, at least what was routed there lately."""
        out: dict[str, int] = {}
        if self.views:
            now = time.monotonic()
            keys = [block_key(h) for h in hashes]
            for url, view in self.views.items():
                if view.usable(now):
                    out[url] = view.prefix(keys)
        n_recent, url = self.recent.longest(hashes)
        if n_recent > out.get(url, 0):
            out[url] = n_recent
        return out

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
                    "(--security-token-file) and namespace (--router-namespace; a tenant's "
                    "token only admits namespaces 'tenant@...')",
                    where, e,
                )  # fmt: skip
        elif at_start:
            log.warning(
                "coordinator %s not reachable yet (%s): requests are routed by load "
                "until it is",
                where, describe(e),
            )  # fmt: skip
        else:
            log.debug("coordinator lookup failed: %s", describe(e))

    def _remember(self, hashes: list[bytes], choice: Choice) -> None:
        if choice.replica is not None:
            self.recent.remember(hashes, choice.replica.url)

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
