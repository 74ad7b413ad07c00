"""The coordinator's live dashboard: a self-contained page and the JSON it polls.

``GET /`` serves the page, ``GET /v1/dashboard`` the JSON.

The page draws the cluster as this coordinator sees it: every node with its pool usage,
health and current transfer rates, and charts of the lookup hit rate, transfer
throughput and pool usage over time.  It loads nothing from the network but this
coordinator (no CDN, no fonts), so it works on air-gapped machines.

Where the numbers come from:

* nodes, capacity, usage, index size: the coordinator's status document;
* lookups, hit and miss blocks: the cluster's, from the status document's
  ``cluster_lookups``: those this coordinator served (with several coordinators, each
  dashboard counts the lookups *it* served) and those the nodes answered alone for the
  connectors on their host, as the connectors reported them (a coordinator without
  that document: its own metrics registry);
* transfer bytes, evictions, errors: each node's ``/metrics``, fetched by the
  coordinator from the ``http`` address the node published (a node whose HTTP endpoint
  is this process, as in ``pegaflow-server``, is read from the local registry), with
  its ``/health``, whose node id must be the node's: a node whose address another node
  answers at (two nodes publish one address, e.g. a loopback or wildcard
  ``--node-host``) shows as ``wrong node``, not ok, and none of its numbers are taken;
* routers: the status document's ``routers``, what each ``pegaflow-router`` last
  reported to this coordinator (its replicas with their health and in-flight load).

A sampler turns the counters into a history of rates.  It runs only while a dashboard is
open (a poll in the last :attr:`Dashboard.idle_stop_s` seconds), so a coordinator that
nobody watches never scrapes its nodes and its lookup loop pays nothing.

Install it on an HTTP endpoint with :func:`app_hook`::

    await start_http(host, port, status=..., health=..., registry=reg,
                     app_hook=dashboard.app_hook(status=..., registry=reg))
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import math
import ssl
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import KW_ONLY, InitVar, dataclass, field
from importlib import resources
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from pegaflow.keys import node_http_url
from pegaflow.tls import http_scheme

log = logging.getLogger(__name__)

StatusFn = Callable[[], Awaitable[dict[str, Any]]]

#: Node metrics the dashboard reads: sample name -> field name.
NODE_SAMPLES = {
    "pegaflow_node_capacity_bytes": "capacity_bytes",
    "pegaflow_node_used_bytes": "used_bytes",
    "pegaflow_node_blocks": "blocks",
    "pegaflow_node_evictions": "evictions",
    "pegaflow_node_connections": "connections",
    "pegaflow_node_get_bytes_total": "get_bytes",
    "pegaflow_node_put_bytes_total": "put_bytes",
    "pegaflow_node_put_blocks_total": "put_blocks",
    "pegaflow_node_transfer_errors_total": "transfer_errors",
    "pegaflow_node_request_errors_total": "request_errors",
    "pegaflow_node_checksum_failures_total": "checksum_failures",
    "pegaflow_node_etcd_pending_writes": "etcd_pending_writes",
    "pegaflow_node_disk_capacity_bytes": "disk_capacity_bytes",
    "pegaflow_node_disk_used_bytes": "disk_used_bytes",
    "pegaflow_node_disk_blocks": "disk_blocks",
    "pegaflow_node_disk_promotions_total": "disk_promotions",
    "pegaflow_node_disk_errors_total": "disk_errors",
}
#: Coordinator metrics the dashboard reads (from the local registry).
COORDINATOR_SAMPLES = {
    "pegaflow_coordinator_lookups_total": "lookups",
    "pegaflow_coordinator_lookup_hit_blocks_total": "hit_blocks",
    "pegaflow_coordinator_lookup_miss_blocks_total": "miss_blocks",
}


def read_samples(families: Iterable[Any], wanted: dict[str, str]) -> dict[str, float]:
    """Sum the samples named in ``wanted`` (over all label sets) from metric families
    (``registry.collect()`` or the text parser's output) into ``{field: value}``."""
    out: dict[str, float] = {}
    for fam in families:
        for s in fam.samples:
            key = wanted.get(s.name)
            if key is not None and not math.isnan(s.value):
                out[key] = out.get(key, 0.0) + s.value
    return out


def parse_metrics_text(text: str, wanted: dict[str, str]) -> dict[str, float]:
    """:func:`read_samples` over Prometheus text exposition format."""
    return read_samples(text_string_to_metric_families(text), wanted)


def _is_local_host(host: str) -> bool:
    if host in ("", "localhost", "0.0.0.0", "::"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class _NodeState:
    """What the sampler remembers of one node between samples."""

    t: float = 0.0
    values: dict[str, float] = field(default_factory=dict)
    error: str = ""
    wrong: bool = False
    """another node answers at the node's published HTTP address"""
    get_bps: float | None = None
    put_bps: float | None = None


@dataclass(eq=False, repr=False)
class Dashboard:
    """The dashboard of one coordinator (see the module docstring).

    ``status`` is the coordinator's status function, ``registry`` its metrics registry.
    ``interval_s``: seconds between samples; ``history``: samples kept (default 30 min
    at 2 s); ``idle_stop_s``: the sampler stops this long after the last poll;
    ``scrape_timeout_s``: deadline of one node scrape; ``tls``: nodes are scraped over
    HTTPS, verified by this context.
    """

    status: StatusFn
    registry: CollectorRegistry | None
    _: KW_ONLY
    interval_s: float = 2.0
    history: InitVar[int] = 900
    idle_stop_s: float = 120.0
    scrape_timeout_s: float = 1.0
    tls: ssl.SSLContext | None = None

    def __post_init__(self, history: int) -> None:
        self.history: deque[dict[str, Any]] = deque(maxlen=history)
        self._nodes: dict[str, _NodeState] = {}
        self._coord: dict[str, float] = {}
        self._coord_t = 0.0
        self._last_status: dict[str, Any] = {}
        self._last_view = 0.0
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._local_ports: set[int] = set()
        self._lock = asyncio.Lock()

    # -- aiohttp wiring ---------------------------------------------------------------

    def install(self, app: web.Application) -> None:
        """Add ``/`` and ``/v1/dashboard`` to ``app`` and stop the sampler at cleanup."""
        app.router.add_get("/", self.page_handler)
        app.router.add_get("/v1/dashboard", self.data_handler)
        app.on_cleanup.append(self._cleanup)

    async def page_handler(self, request: web.Request) -> web.Response:
        """The page itself (HTML with inline CSS and JS)."""
        return web.Response(
            text=page_html(), content_type="text/html", headers={"Cache-Control": "no-cache"}
        )

    async def data_handler(self, request: web.Request) -> web.Response:
        """The JSON the page polls; ``?since=<t>`` returns only newer history points."""
        sock = request.transport.get_extra_info("sockname") if request.transport else None
        if sock:
            self._local_ports.add(int(sock[1]))
        try:
            since = float(request.query.get("since", "0") or 0)
        except ValueError:
            raise web.HTTPBadRequest(text="since must be a number") from None
        self._last_view = time.monotonic()
        if not self.history:
            await self.sample()
        self._ensure_sampler()
        return web.json_response(self.snapshot(since))

    async def _cleanup(self, _app: web.Application) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop the sampler and close its HTTP session."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- sampling ---------------------------------------------------------------------

    def _ensure_sampler(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._sampler())

    async def _sampler(self) -> None:
        while time.monotonic() - self._last_view < self.idle_stop_s:
            await asyncio.sleep(self.interval_s)
            try:
                await self.sample()
            except Exception:  # never let the dashboard take the coordinator down
                log.warning("dashboard sample failed", exc_info=True)

    async def sample(self) -> dict[str, Any]:
        """Take one sample now: status, local counters, every node's metrics; append
        a history point and return it."""
        async with self._lock:
            return await self._sample()

    async def _sample(self) -> dict[str, Any]:
        st = await self.status()
        self._last_status = st
        now = time.time()
        nodes = list(st.get("nodes", []))
        local = self._local_values(NODE_SAMPLES)
        scraped = await asyncio.gather(*(self._scrape(rec, local) for rec in nodes))
        get_rate = put_rate = 0.0
        have_rate = False
        seen = set()
        for rec, (values, error, wrong) in zip(nodes, scraped, strict=True):
            nid = str(rec.get("node_id"))
            seen.add(nid)
            prev = self._nodes.get(nid)
            cur = _NodeState(t=now, values=values, error=error, wrong=wrong)
            if prev is not None and values and prev.values and now > prev.t:
                dt = now - prev.t
                cur.get_bps = _rate(prev.values, values, "get_bytes", dt)
                cur.put_bps = _rate(prev.values, values, "put_bytes", dt)
                get_rate += cur.get_bps or 0.0
                put_rate += cur.put_bps or 0.0
                have_rate = True
            elif prev is not None and not values:
                cur.values = {}
            self._nodes[nid] = cur
        for gone in set(self._nodes) - seen:
            del self._nodes[gone]

        coord = _cluster_lookups(st) or self._local_values(COORDINATOR_SAMPLES)
        hit_rate = lookups_ps = None
        if self._coord and now > self._coord_t:
            dh = coord.get("hit_blocks", 0.0) - self._coord.get("hit_blocks", 0.0)
            dm = coord.get("miss_blocks", 0.0) - self._coord.get("miss_blocks", 0.0)
            dl = coord.get("lookups", 0.0) - self._coord.get("lookups", 0.0)
            if dh >= 0 and dm >= 0 and dh + dm > 0:
                hit_rate = dh / (dh + dm)
            if dl >= 0:
                lookups_ps = dl / (now - self._coord_t)
        self._coord, self._coord_t = coord, now

        cap = used = 0.0
        for rec in nodes:
            v = self._nodes[str(rec.get("node_id"))].values
            cap += _capacity(rec, v)
            used += v.get("used_bytes", float(rec.get("used_bytes", 0)))
        point = {
            "t": round(now, 3),
            "hit_rate": hit_rate,
            "lookups_ps": lookups_ps,
            "get_bps": get_rate if have_rate else None,
            "put_bps": put_rate if have_rate else None,
            "used_bytes": used,
            "capacity_bytes": cap,
            "nodes": len(nodes),
        }
        self.history.append(point)
        return point

    def _local_values(self, wanted: dict[str, str]) -> dict[str, float]:
        if self.registry is None:
            return {}
        return read_samples(self.registry.collect(), wanted)

    async def _scrape(
        self, rec: dict[str, Any], local: dict[str, float]
    ) -> tuple[dict[str, float], str, bool]:
        """A node's metrics, why there are none, and whether another node answers at
        its address."""
        url = node_http_url(rec, http_scheme(self.tls))
        if url is None:
            return {}, "no HTTP endpoint published", False
        host_port = url.split("//", 1)[1]
        host, _, port = host_port.rpartition(":")
        if int(port) in self._local_ports and _is_local_host(host.strip("[]")) and local:
            return local, "", False
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.scrape_timeout_s),
                connector=aiohttp.TCPConnector(ssl=self.tls or True),
            )
        session = self._session
        nid = str(rec.get("node_id"))

        async def metrics() -> str:
            async with session.get(f"{url}/metrics") as r:
                if r.status != 200:
                    raise ValueError(f"/metrics answered {r.status}")
                return await r.text()

        async def answering() -> str:
            """The node id the endpoint's ``/health`` names ('' for none: an old node)."""
            async with session.get(f"{url}/health") as r:
                body = await r.json(content_type=None)
            got = body.get("node_id") if isinstance(body, dict) else None
            return got if isinstance(got, str) else ""

        try:
            text, other = await asyncio.gather(metrics(), answering())
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as e:
            return {}, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__, False
        if other and other != nid:
            return {}, (
                f"node {other} answers at {url}, the address node {nid} published: two "
                "nodes publish one address (e.g. a loopback or wildcard --node-host); give "
                "each node its host's address"
            ), True  # fmt: skip
        return parse_metrics_text(text, NODE_SAMPLES), "", False

    # -- the document -----------------------------------------------------------------

    def snapshot(self, since: float = 0.0) -> dict[str, Any]:
        """The ``/v1/dashboard`` document: cluster summary, nodes, history after ``since``."""
        st = self._last_status
        nodes_out = []
        cap_total = used_total = blocks_total = 0.0
        for rec in sorted(st.get("nodes", []), key=lambda r: str(r.get("node_id"))):
            nid = str(rec.get("node_id"))
            ns = self._nodes.get(nid, _NodeState())
            v = ns.values
            cap = _capacity(rec, v)
            used = v.get("used_bytes", float(rec.get("used_bytes", 0)))
            blocks = v.get("blocks", float(rec.get("blocks", 0)))
            cap_total += cap
            used_total += used
            blocks_total += blocks
            nodes_out.append(
                {
                    "node_id": nid,
                    "address": f"{rec.get('host')}:{rec.get('ucx_port')}",
                    "http": rec.get("http") or "",
                    "version": rec.get("version") or "",
                    "started_at": rec.get("started_at") or 0,
                    "capacity_bytes": cap,
                    "used_bytes": used,
                    "blocks": blocks,
                    "entries": rec.get("entries", 0),
                    "health": _health(v, ns),
                    "error": ns.error,
                    "get_bps": ns.get_bps,
                    "put_bps": ns.put_bps,
                    "get_bytes": v.get("get_bytes"),
                    "put_bytes": v.get("put_bytes"),
                    "evictions": v.get("evictions"),
                    "connections": v.get("connections"),
                    "disk_capacity_bytes": v.get(
                        "disk_capacity_bytes", float(rec.get("disk_capacity_bytes") or 0)
                    ),
                    "disk_used_bytes": v.get(
                        "disk_used_bytes", float(rec.get("disk_used_bytes") or 0)
                    ),
                    "disk_blocks": v.get("disk_blocks", float(rec.get("disk_blocks") or 0)),
                    "disk_promotions": v.get("disk_promotions"),
                    "errors": (
                        v.get("transfer_errors", 0.0)
                        + v.get("request_errors", 0.0)
                        + v.get("checksum_failures", 0.0)
                        + v.get("disk_errors", 0.0)
                    )
                    if v
                    else None,
                }
            )
        coord = dict(st.get("coordinator", {}))
        hits = self._coord.get("hit_blocks", 0.0)
        misses = self._coord.get("miss_blocks", 0.0)
        last = self.history[-1] if self.history else {}
        return {
            "now": time.time(),
            "interval_s": self.interval_s,
            "coordinator": coord,
            "cluster": {
                "nodes": len(nodes_out),
                "nodes_ok": sum(1 for n in nodes_out if n["health"] == "ok"),
                "capacity_bytes": cap_total,
                "used_bytes": used_total,
                "node_blocks": blocks_total,
                "index_blocks": st.get("blocks", 0),
                "index_entries": st.get("entries", 0),
                "namespaces": st.get("namespaces", 0),
                "lookups": self._coord.get("lookups", 0.0),
                "hit_blocks": hits,
                "miss_blocks": misses,
                "hit_rate": hits / (hits + misses) if hits + misses else None,
                "same_host_lookups": self._coord.get("same_host_lookups", 0.0),
                "same_host_hit_blocks": self._coord.get("same_host_hit_blocks", 0.0),
                "lookups_ps": last.get("lookups_ps"),
                "get_bps": last.get("get_bps"),
                "put_bps": last.get("put_bps"),
            },
            "nodes": nodes_out,
            "routers": [_router_view(r) for r in st.get("routers") or [] if isinstance(r, dict)],
            "history": [p for p in self.history if p["t"] > since],
        }


def _router_view(rec: dict[str, Any]) -> dict[str, Any]:
    """A router of the status document as the page shows it: its report, with the
    replicas healthy and the requests in flight over all of them."""
    reps = [r for r in rec.get("replicas") or [] if isinstance(r, dict)]
    return {
        "url": rec.get("url", ""),
        "mode": rec.get("mode", ""),
        "max_inflight": rec.get("max_inflight"),
        "last_seen_s": rec.get("last_seen_s"),
        "replicas_healthy": sum(1 for r in reps if r.get("healthy")),
        "inflight": sum(int(r.get("inflight") or 0) for r in reps),
        "counters": rec.get("counters") or {},
        "replicas": reps,
    }


_CLUSTER_LOOKUPS = (
    "lookups", "hit_blocks", "miss_blocks", "same_host_lookups", "same_host_hit_blocks",
)  # fmt: skip


def _cluster_lookups(st: dict[str, Any]) -> dict[str, float]:
    """The cluster's lookup counters from a status document ({} when it has none)."""
    src = st.get("cluster_lookups")
    if not isinstance(src, dict):
        return {}
    return {
        k: float(v)
        for k in _CLUSTER_LOOKUPS
        if isinstance(v := src.get(k), int | float) and not isinstance(v, bool)
    }


def _health(values: dict[str, float], ns: _NodeState) -> str:
    """A node's health on the page: ``ok`` (its metrics came), ``wrong node`` (another
    node answers at its address), ``unreachable`` or ``unknown`` (not asked yet)."""
    if values:
        return "ok"
    if ns.wrong:
        return "wrong node"
    return "unreachable" if ns.error else "unknown"


def _capacity(rec: dict[str, Any], values: dict[str, float]) -> float:
    """A node's capacity: from its record (static), else from its metrics."""
    return float(rec.get("capacity_bytes") or 0) or values.get("capacity_bytes", 0.0)


def _rate(prev: dict[str, float], cur: dict[str, float], key: str, dt: float) -> float | None:
    if key not in cur or key not in prev:
        return None
    d = cur[key] - prev[key]
    return d / dt if d >= 0 else None  # a negative delta: the node restarted


def page_html() -> str:
    """The dashboard page (``index.html`` next to this module)."""
    return resources.files(__package__).joinpath("index.html").read_text(encoding="utf-8")


def app_hook(
    status: StatusFn, registry: CollectorRegistry | None, **kw: Any
) -> Callable[[web.Application], None]:
    """An ``app_hook`` for :func:`pegaflow.observability.http.start_http` that installs a
    :class:`Dashboard` (keyword arguments go to it)."""
    dash = Dashboard(status, registry, **kw)
    return dash.install
