"""The coordinator service: lookups, placement and status over the control protocol.

With etcd, the coordinators elect one leader through etcd
(:mod:`~pegaflow.coordinator.election`) that runs the singleton duties: the index GC
(:mod:`~pegaflow.coordinator.gc`).

A :class:`Coordinator` serves a :class:`~pegaflow.coordinator.index.BlockIndex`, fed
either by an :class:`~pegaflow.coordinator.mirror.EtcdMirror` (a cluster: any number of
coordinators, each a full read replica of etcd) or directly by a storage node through a
:class:`~pegaflow.coordinator.inprocess_sink.InProcessSink` (the single-host ``pegaflow-server``, no
etcd).  Its ops, their requests and replies are those of
:mod:`pegaflow.protocol.coordinator` (:data:`~pegaflow.protocol.coordinator.OPS`):
:attr:`Coordinator.handlers` serves each.  The status document's ``routers`` lists the
routers whose report has not expired (:mod:`.routers`); ``report_unreachable`` makes
lookups leave a node out for a while (:mod:`.suspects`); ``namespace_peers`` tells a
connector that finds nothing of its own which namespaces of its model hold blocks
(:mod:`.namespaces`).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import socket
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any

import msgpack
from aiohttp import web
from prometheus_client import CollectorRegistry

from pegaflow import huge_pages
from pegaflow.addresses import settle_coordinator
from pegaflow.auth import authenticator, cluster_token
from pegaflow.config import CoordinatorConfig, EtcdConfig, SecurityConfig
from pegaflow.errors import NoSpace, Unauthorized, Unavailable
from pegaflow.etcd import EtcdClient
from pegaflow.keys import Keyspace, NodeRecord
from pegaflow.observability.http import HttpHandle, new_registry, start_http
from pegaflow.protocol.coordinator import (
    OPS,
    LookupEncoder,
    LookupRequest,
    Op,
    PlaceRequest,
    encode_nodes_reply,
    encode_place_reply,
)
from pegaflow.tls import client_context, server_context
from pegaflow.transport.rpc_server import (
    Handler,
    Packed,
    RpcServer,
    SyncHandler,
    current_tenant,
)

from .election import Election
from .enginemisses import EngineMisses
from .evictions import EvictionLog
from .gc import IndexGC
from .index import BlockIndex
from .metrics import CoordinatorCollector, CoordinatorMetrics
from .mirror import EtcdMirror
from .namespaces import NamespacePeers
from .routers import RouterTable
from .suspects import Suspects, http_alive

log = logging.getLogger(__name__)

#: Hashes looked up in one step of a longer lookup, which the server may interleave with
#: other connections' turns (:class:`~pegaflow.transport.rpc_server.RpcServer`): about a
#: millisecond of index work.
LOOKUP_STEP = 4096


def _cluster_only(op: Op, handler: Handler | SyncHandler) -> Handler | SyncHandler:
    """``handler``, refusing a tenant's connection (``OPS[op].cluster_only``)."""
    what = OPS[op].cluster_only
    if what is None:
        return handler

    def refuse() -> None:
        if current_tenant() is not None:
            raise Unauthorized(f"only the cluster's own clients may {what}")

    if inspect.iscoroutinefunction(handler):

        async def guarded(args: dict[str, Any]) -> Any:
            refuse()
            return await handler(args)

        return guarded

    def guarded_sync(args: dict[str, Any]) -> Any:
        refuse()
        return handler(args)

    return guarded_sync


class Coordinator:
    """One coordinator: an index (mirrored from etcd, or fed locally), the control
    protocol server and the HTTP endpoint, with an explicit lifecycle.

    * ``etcd`` with endpoints and no ``index``: the index mirrors etcd.
    * ``index`` given (or no etcd endpoints): the index is fed in-process, e.g. by a
      :class:`~pegaflow.coordinator.inprocess_sink.InProcessSink`; no etcd is used.

    The HTTP endpoint also serves the live dashboard (:mod:`pegaflow.tools.dashboard`) unless
    ``dashboard=False``; ``http_app_hook`` replaces it with routes of your own.
    """

    def __init__(
        self,
        config: CoordinatorConfig,
        *,
        etcd: EtcdConfig | None = None,
        security: SecurityConfig | None = None,
        index: BlockIndex | None = None,
        registry: CollectorRegistry | None = None,
        coordinator_id: str | None = None,
        dashboard: bool = True,
        http_app_hook: Callable[[web.Application], None] | None = None,
    ) -> None:
        self.config = settle_coordinator(config, etcd.endpoints if etcd is not None else ())
        self.etcd_config = etcd
        security = security or SecurityConfig()
        self.token = cluster_token(security)
        self._auth = authenticator(security)
        self._tls = server_context(security)
        self._client_tls = client_context(security)
        """verifies the nodes' HTTPS endpoints (the suspects' checks, the dashboard)"""
        if self._tls is not None and self._client_tls is None:
            log.warning(
                "[security] tls_cert without tls_ca: this coordinator asks nodes' /health "
                "(reported nodes) and the dashboard scrapes them over plain HTTP, which "
                "nodes serving TLS refuse; give it tls_ca too"
            )
        use_etcd = index is None and etcd is not None and bool(etcd.endpoints)
        self.index = index if index is not None else BlockIndex()
        self.registry = registry if registry is not None else new_registry()
        self.metrics = CoordinatorMetrics()
        self.id = coordinator_id or ""
        self.mirror: EtcdMirror | None = None
        self.election: Election | None = None
        self.gc: IndexGC | None = None
        self._etcd: EtcdClient | None = None
        if use_etcd:
            assert etcd is not None
            self._etcd = EtcdClient(etcd)
            self.mirror = EtcdMirror(self._etcd, Keyspace(etcd.prefix), self.index)
        self.engine_misses = EngineMisses()
        """the engines' own tallies of why their lookups missed"""
        self.registry.register(
            CoordinatorCollector(
                self.metrics,
                self.index,
                lambda: self.mirror.status() if self.mirror else None,
                lambda: self.election.is_leader if self.election else None,
                lambda: self.gc.status() if self.gc else None,
                self.engine_misses.total,
            )
        )
        self._dashboard = dashboard
        self._app_hook = http_app_hook
        self._rpc: RpcServer | None = None
        self._http: HttpHandle | None = None
        self.port = 0
        self.http_port: int | None = None
        self._started = 0.0
        self._encoder = LookupEncoder()
        self._ns_ok: set[str] = set()
        self._huge_pages = huge_pages.status()  # fixed for the process's life
        self.routers = RouterTable()
        self.suspects = Suspects(
            self.index, self.config.suspect_ttl_s, self.metrics.unreachable_reports,
            alive=functools.partial(http_alive, tls=self._client_tls),
        )  # fmt: skip
        """nodes clients reported unreachable, left out of lookups for a while"""
        self.namespace_peers = NamespacePeers(self.index)
        """the factors of the namespaces connectors use, to tell one why it gets no hit"""
        self.evictions = self.index.evictions = EvictionLog(self.index, self.namespace_peers)
        """recent saves and removals: why a lookup missed"""

    # -- lifecycle --------------------------------------------------------------------

    @property
    def address(self) -> str:
        """``host:port`` of the control protocol (after :meth:`start`)."""
        return f"{self.config.host}:{self.port}"

    @property
    def handlers(self) -> dict[str, Handler | SyncHandler]:
        """A handler for each op of :data:`~pegaflow.protocol.coordinator.OPS` (also for
        embedding them in another :class:`~pegaflow.transport.rpc_server.RpcServer`)."""
        impls: dict[Op, Handler | SyncHandler] = {
            Op.LOOKUP: self.op_lookup,
            Op.PLACE: self.op_place,
            Op.STATUS: self.op_status,
            Op.NODES: self.op_nodes,
            Op.ROUTER_REPORT: self.routers.op_report,
            Op.REPORT_UNREACHABLE: self.suspects.op_report,
            Op.NAMESPACE_PEERS: self.namespace_peers.op_peers,
            Op.MISS_REPORT: self.engine_misses.op_report,
        }
        assert impls.keys() == OPS.keys(), "every op of the protocol has a handler"
        for op, h in impls.items():
            assert inspect.iscoroutinefunction(h) == OPS[op].awaits, op
        return {op: _cluster_only(op, h) for op, h in impls.items()}

    async def start(self, *, serve: bool = True) -> None:
        """Load the index (waiting up to ``[etcd] timeout_s`` for etcd, then going on in
        the background; a big index only until its load is under way), then listen
        for the control protocol and HTTP.  With ``serve=False`` nothing listens (the
        ops are then served by an embedding server through :attr:`handlers`)."""
        self._started = time.monotonic()
        if self.mirror is not None:
            assert self.etcd_config is not None
            loaded = await self.mirror.start(wait_s=max(1.0, self.etcd_config.timeout_s))
            if not loaded:
                log.warning(
                    "etcd at %s did not answer; serving an empty index until it does "
                    "(check that etcd runs and --etcd-endpoints is right)",
                    ", ".join(self.etcd_config.endpoints),
                )
        if not serve:
            await self._start_duties()
            return
        cfg = self.config
        self._rpc = RpcServer(
            "pegaflow-coordinator",
            self.handlers,
            auth=self._auth,
            tls=self._tls,
            max_frame=cfg.max_frame_bytes,
            on_request=self.metrics.on_request,
            slice_s=cfg.fair_slice_ms / 1000,
        )
        self.port = await self._rpc.start(cfg.host, cfg.port)
        if not self.id:
            self.id = f"{socket.gethostname()}:{self.port}"
        await self._start_duties()
        if cfg.http_port >= 0:
            hook = self._app_hook
            if hook is None and self._dashboard:
                from pegaflow.tools import dashboard

                hook = dashboard.app_hook(
                    status=self.op_status_async, registry=self.registry, tls=self._client_tls
                )
            self._http = await start_http(
                cfg.http_host,
                cfg.http_port,
                status=self.op_status_async,
                health=self.health,
                registry=self.registry,
                app_hook=hook,
                tls=self._tls,
            )
            self.http_port = self._http.port

    async def _start_duties(self) -> None:
        """Campaign for the leadership of the singleton duties and start them (etcd only)."""
        if self._etcd is None or self.election is not None:
            return
        assert self.etcd_config is not None
        keys = Keyspace(self.etcd_config.prefix)
        cfg = self.config
        identity = self.id or f"{socket.gethostname()}-{os.getpid()}"
        self.election = Election(
            self._etcd, f"{keys.election}gc".encode(), identity, cfg.election_ttl_s
        )
        self.gc = IndexGC(
            self.index,
            self._etcd,
            keys,
            self.election,
            interval_s=cfg.gc_interval_s,
            batch=cfg.gc_batch,
            entries_per_s=cfg.gc_entries_per_s,
            token=self.token,
        )
        await self.election.start()
        await self.gc.start()

    async def close(self) -> None:
        """Stop serving and mirroring; safe to call more than once."""
        await self.suspects.close()
        if self._http is not None:
            await self._http.close()
            self._http = None
        if self._rpc is not None:
            await self._rpc.close()
            self._rpc = None
        if self.gc is not None:
            await self.gc.close()
        if self.election is not None:
            await self.election.close()  # resign: another coordinator takes over now
        if self.mirror is not None:
            await self.mirror.close()
        if self._etcd is not None:
            await self._etcd.close()

    async def health(self) -> tuple[bool, dict[str, Any]]:
        """Healthy once the index has been loaded (always, without etcd); a coordinator
        that lost etcd afterwards stays healthy and serves its last state."""
        st = self._coordinator_status()
        ok = self.mirror is None or self.mirror.synced
        return ok, {"coordinator": st}

    # -- ops --------------------------------------------------------------------------

    def lookup(
        self, ns: str, hashes: Sequence[bytes], shards: Sequence[int], gens: bool = False
    ) -> dict[str, Any]:
        """In-process lookup: the ``lookup`` op's result as a map (no validation, not
        counted in the metrics)."""
        req = LookupRequest(ns, list(hashes), list(shards), gens, warm_up=True)
        return msgpack.unpackb(self._lookup_whole(req, 0.0), raw=False)

    def op_lookup(self, args: dict[str, Any]) -> Packed | Generator[None, None, Packed]:
        """Longest stored prefix of ``hashes`` with every shard in ``shards``; one of
        more than :data:`LOOKUP_STEP` hashes is looked up in steps (a generator)."""
        t0 = time.perf_counter()
        hashes = args.get("hashes")
        if type(hashes) is list and len(hashes) > LOOKUP_STEP:
            return self._lookup_in_steps(args, t0)
        return self._lookup_whole(self._lookup_request(args), t0)

    def _lookup_request(self, args: dict[str, Any]) -> LookupRequest:
        req = LookupRequest.from_wire(args, self._ns_ok)
        if req.ns not in self._ns_ok:  # validated once per namespace
            if len(self._ns_ok) >= 4096:
                self._ns_ok.clear()
            self._ns_ok.add(req.ns)
        return req

    def _lookup_whole(self, req: LookupRequest, t0: float) -> Packed:
        index = self.index
        ns, hashes, shards = req.ns, req.hashes, req.shards
        hits, blocks, node_ids, gens = index.lookup(ns, hashes, shards, req.gens)
        disk = index.on_disk(ns, hashes, shards, hits) if hits else []
        enc = self._encoder
        nodes = [enc.node(n, index.node_wire(n)) for n in node_ids]
        rows = enc.rows(blocks)
        return self._lookup_reply(req, t0, hits, nodes, rows, gens, disk)

    def _lookup_in_steps(
        self, args: dict[str, Any], t0: float
    ) -> Generator[None, None, Packed]:
        """:meth:`op_lookup` of :data:`LOOKUP_STEP` hashes at a time, yielding between.
        The index may change between two steps: each node's record is the one it had
        when its first block was looked up."""
        req = self._lookup_request(args)
        ns, hashes, shards = req.ns, req.hashes, req.shards
        index = self.index
        hits = 0
        nodes: dict[str, bytes] = {}
        rows: list[bytes] = []
        gens: list[int] | None = [] if req.gens else None
        disk: list[int] = []
        for start in range(0, len(hashes), LOOKUP_STEP):
            yield
            part = hashes[start : start + LOOKUP_STEP]
            m = index.lookup(ns, part, shards, req.gens)
            for n in m.nodes.difference(nodes):
                nodes[n] = self._encoder.node(n, index.node_wire(n))
            rows.append(self._encoder.rows(m.blocks))
            if gens is not None:
                gens += m.gens or ()
            if m.hits:
                disk += [start + i for i in index.on_disk(ns, part, shards, m.hits)]
            hits += m.hits
            if m.hits < len(part):
                break
        return self._lookup_reply(req, t0, hits, list(nodes.values()), b"".join(rows), gens, disk)

    def _lookup_reply(
        self,
        req: LookupRequest,
        t0: float,
        hits: int,
        nodes: list[bytes],
        rows: bytes,
        gens: list[int] | None,
        disk: list[int],
    ) -> Packed:
        """The ``lookup`` result (:class:`~pegaflow.protocol.coordinator.LookupEncoder`),
        counted in the metrics unless it is a warm-up."""
        missed = len(req.hashes) - hits
        miss = None
        if missed:  # a warm-up's is not counted
            count = 0 if req.warm_up else missed
            miss = self.evictions.cause(req.ns, req.hashes[hits], req.shards, count)
        result = Packed(LookupEncoder.reply(hits, nodes, rows, gens, disk, miss))
        if not req.warm_up:
            m = self.metrics
            m.lookups += 1
            m.hit_blocks += hits
            m.miss_blocks += len(req.hashes) - hits
            m.lookup_seconds.observe(time.perf_counter() - t0)
        return result

    def op_place(self, args: dict[str, Any]) -> dict[str, Any]:
        """Pick the node for ``count`` new blocks of ``block_bytes``: one on the client's
        host first, else the one with the most free bytes."""
        req = PlaceRequest.from_wire(args)
        return encode_place_reply(self.place(req.count * req.block_bytes, req.client_host))

    def place(self, need: int, client_host: str = "") -> NodeRecord:
        """The node a client on ``client_host`` should write ``need`` bytes to."""
        nodes = self.index.nodes()
        if not nodes:
            self._count_place("unavailable")
            raise Unavailable("no storage node is registered")
        fits = [n for n in nodes if n.capacity_bytes >= need]
        if not fits:
            self._count_place("no_space")
            raise NoSpace(f"no storage node can hold {need} bytes")

        def free(n: NodeRecord) -> int:
            return n.capacity_bytes - n.used_bytes

        local = [n for n in fits if client_host and n.host == client_host]
        best = max(local or fits, key=lambda n: (free(n), n.node_id))
        self._count_place("local" if local else "remote")
        return best

    def _count_place(self, result: str) -> None:
        self.metrics.place[result] = self.metrics.place.get(result, 0) + 1

    def op_nodes(self, args: dict[str, Any]) -> dict[str, Any]:
        """Every known storage node."""
        return encode_nodes_reply(self.index.nodes())

    def op_status(self, args: dict[str, Any]) -> dict[str, Any]:
        """Nodes, index size and this coordinator's state."""
        idx = self.index
        nodes = []
        for n in idx.nodes():
            rec = n.to_wire()
            rec["entries"] = idx.entries_of(n.node_id)
            nodes.append(rec)
        return {
            "nodes": nodes,
            "blocks": idx.num_blocks,
            "entries": idx.num_entries,
            "namespaces": idx.num_namespaces,
            "cluster_lookups": self.cluster_lookups(),
            "coordinator": self._coordinator_status(),
            "routers": self.routers.status(),
            "misses": {**self.evictions.status(), **self.engine_misses.status()},
        }

    def cluster_lookups(self) -> dict[str, int]:
        """The cluster's lookups since start: those this coordinator answered plus
        those the connectors' same-host nodes answered alone (which never reach a
        coordinator; each node counts what its connectors report, in its record).  A
        lookup the node answered only partly went on to the coordinator and is counted
        there alone.  ``lookups``, ``hit_blocks``, ``miss_blocks`` are the totals;
        ``same_host_*`` the nodes' part.  With several coordinators, the coordinator
        part is this one's."""
        same = [0, 0, 0]
        for n in self.index.nodes():
            same[0] += n.same_host_lookups
            same[1] += n.same_host_hit_blocks
            same[2] += n.same_host_miss_blocks
        m = self.metrics
        return {
            "lookups": m.lookups + same[0],
            "hit_blocks": m.hit_blocks + same[1],
            "miss_blocks": m.miss_blocks + same[2],
            "same_host_lookups": same[0],
            "same_host_hit_blocks": same[1],
            "same_host_miss_blocks": same[2],
        }

    async def op_status_async(self) -> dict[str, Any]:
        """:meth:`op_status` for the HTTP endpoint."""
        return self.op_status({})

    def _coordinator_status(self) -> dict[str, Any]:
        st: dict[str, Any] = {
            "id": self.id,
            "address": self.address,
            "mode": "etcd" if self.mirror is not None else "local",
            "etcd_connected": self.mirror.connected if self.mirror else False,
            "revision": self.mirror.revision if self.mirror else 0,
            "loading": self.mirror.loading if self.mirror else False,
            "uptime_s": round(time.monotonic() - self._started, 3) if self._started else 0.0,
            "lookups": self.metrics.lookups,
            "hit_blocks": self.metrics.hit_blocks,
            "miss_blocks": self.metrics.miss_blocks,
            "http_port": self.http_port,
            "leader": self.election.is_leader if self.election else False,
            "huge_pages": self._huge_pages,
        }
        if self.mirror is not None:
            st["etcd"] = self.mirror.status()
        if self.election is not None:
            st["election"] = self.election.status()
        if self.gc is not None:
            st["gc"] = self.gc.status()
        return st
