"""The coordinator service: lookups, placement and status over the control protocol.

With etcd, the coordinators elect one leader through etcd
(:mod:`~pegaflow.coordinator.election`) that runs the singleton duties: the index GC
(:mod:`~pegaflow.coordinator.gc`).

A :class:`Coordinator` serves a :class:`~pegaflow.coordinator.index.BlockIndex`, fed
either by an :class:`~pegaflow.coordinator.mirror.EtcdMirror` (a cluster: any number of
coordinators, each a full read replica of etcd) or directly by a storage node through a
:class:`~pegaflow.coordinator.inprocess_sink.InProcessSink` (the single-host ``pegaflow-server``, no
etcd).  Ops (``args`` and results are msgpack maps; bytes stay bytes):

``lookup`` ``{ns, hashes: [bytes], shards: [int], gens?: bool, warm_up?: bool}`` ->
    ``{hits, nodes: {node_id: NodeRecord}, blocks: [[node_id per shard] per hit]}``; with
    ``gens: true`` also ``gens: [int]``, the generation each of those shards had when it
    was published, flat and block-major (``gens[i * len(shards) + j]``); with
    ``warm_up: true`` (a connector connecting at engine start) it is not counted in the
    lookup metrics; ``disk: bytes`` (:func:`~pegaflow.protocol.codec.pack_bits`, a bit per hit
    block) is there when some hit block has an asked shard only on its node's disk
    tier: bit ``i`` set for those (absent: every hit block is in memory)
``place`` ``{ns, count, block_bytes, client_host}`` -> ``{node: NodeRecord}``
``status`` ``{}`` -> ``{nodes, blocks, namespaces, cluster_lookups, coordinator: {...},
    routers}``
    (``coordinator`` has ``leader``: whether this one runs the singleton duties, and
    ``election``/``gc``; ``cluster_lookups``: see :meth:`Coordinator.cluster_lookups`)
``nodes`` ``{}`` -> ``{nodes: [NodeRecord]}``
``router_report``: a ``pegaflow-router``'s periodic report (:mod:`.routers`); the
    status document's ``routers`` lists the routers whose report has not expired
``report_unreachable`` ``{node}`` -> ``{suspected}``: a client cannot reach that node;
    unless this coordinator can, lookups leave its blocks out for a while
    (:mod:`.suspects`)
``namespace_peers`` ``{ns, factors}`` -> ``{peers}``: the other namespaces of the same
    model that hold blocks, with their factors, for a connector that finds nothing of
    its own (:mod:`.namespaces`)
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from pegaflow.addresses import settle_coordinator
from pegaflow.auth import Authenticator
from pegaflow.config import CoordinatorConfig, EtcdConfig, SecurityConfig
from pegaflow.errors import NoSpace, Unavailable
from pegaflow.etcd import EtcdClient
from pegaflow.keys import Keyspace, NodeRecord
from pegaflow.observability.http import HttpHandle, new_registry, start_http
from pegaflow.protocol.codec import (
    check_hashes,
    check_namespace,
    check_shards,
    pack,
    pack_bits,
    req_int,
    req_str,
)
from pegaflow.transport.rpc_server import Handler, Packed, RpcServer, SyncHandler

from .election import Election
from .gc import IndexGC
from .index import BlockIndex
from .metrics import CoordinatorCollector, CoordinatorMetrics
from .mirror import EtcdMirror
from .namespaces import NamespacePeers
from .routers import RouterTable
from .suspects import Suspects

log = logging.getLogger(__name__)

#: Most hashes accepted in one lookup (a 1M-token prompt at block size 16).
MAX_LOOKUP_HASHES = 65536
#: Hashes looked up in one step of a longer lookup, which the server may interleave with
#: other connections' turns (:class:`~pegaflow.transport.rpc_server.RpcServer`): about a
#: millisecond of index work.
LOOKUP_STEP = 4096


_HITS = pack("hits")  # after a map header of 3 to 5 entries
_NODES_KEY = pack("nodes")
_BLOCKS_KEY = pack("blocks")
_GENS_KEY = pack("gens")
_DISK_KEY = pack("disk")


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    return (b"\xdc" + n.to_bytes(2, "big")) if n < 1 << 16 else (b"\xdd" + n.to_bytes(4, "big"))


def _map_header(n: int) -> bytes:
    if n < 16:
        return bytes((0x80 | n,))
    return (b"\xde" + n.to_bytes(2, "big")) if n < 1 << 16 else (b"\xdf" + n.to_bytes(4, "big"))


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
        self.token = (security.token if security else "") or None
        self._security = security
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
        self.registry.register(
            CoordinatorCollector(
                self.metrics,
                self.index,
                lambda: self.mirror.status() if self.mirror else None,
                lambda: self.election.is_leader if self.election else None,
                lambda: self.gc.status() if self.gc else None,
            )
        )
        self._dashboard = dashboard
        self._app_hook = http_app_hook
        self._rpc: RpcServer | None = None
        self._http: HttpHandle | None = None
        self.port = 0
        self.http_port: int | None = None
        self._started = 0.0
        self._row_cache: dict[tuple[str, ...], bytes] = {}
        self._ns_ok: set[str] = set()
        self.routers = RouterTable()
        self.suspects = Suspects(
            self.index, self.config.suspect_ttl_s, self.metrics.unreachable_reports
        )
        """nodes clients reported unreachable, left out of lookups for a while"""
        self.namespace_peers = NamespacePeers(self.index)
        """the factors of the namespaces connectors use, to tell one why it gets no hit"""

    # -- lifecycle --------------------------------------------------------------------

    @property
    def address(self) -> str:
        """``host:port`` of the control protocol (after :meth:`start`)."""
        return f"{self.config.host}:{self.port}"

    @property
    def handlers(self) -> dict[str, Handler | SyncHandler]:
        """The ops, for embedding them in another
        :class:`~pegaflow.transport.rpc_server.RpcServer`."""
        return {
            "lookup": self.op_lookup,
            "place": self.op_place,
            "status": self.op_status,
            "nodes": self.op_nodes,
            "router_report": self.routers.op_report,
            "report_unreachable": self.suspects.op_report,
            "namespace_peers": self.namespace_peers.op_peers,
        }

    async def start(self, *, serve: bool = True) -> None:
        """Load the index (waiting up to ``[etcd] timeout_s`` for etcd, then going on in
        the background), then listen for the control protocol and HTTP.  With
        ``serve=False`` nothing listens (the ops are then served by an embedding
        server through :attr:`handlers`)."""
        self._started = time.monotonic()
        if self.mirror is not None:
            assert self.etcd_config is not None
            synced = await self.mirror.start(wait_s=max(1.0, self.etcd_config.timeout_s))
            if not synced:
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
            auth=Authenticator(self.token, self._security.tenant_tokens if self._security else ()),
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

                hook = dashboard.app_hook(status=self.op_status_async, registry=self.registry)
            self._http = await start_http(
                cfg.http_host,
                cfg.http_port,
                status=self.op_status_async,
                health=self.health,
                registry=self.registry,
                app_hook=hook,
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
        """In-process lookup: the ``lookup`` op's result as a map (no validation)."""
        hits, blocks, node_ids, block_gens = self.index.lookup(ns, hashes, shards, gens)
        nodes = {n: self.index.node_wire(n) for n in node_ids}
        out = {"hits": hits, "nodes": nodes, "blocks": [list(b) for b in blocks]}
        if gens:
            out["gens"] = block_gens
        disk = self.index.on_disk(ns, hashes[:hits], shards)
        if disk:
            out["disk"] = pack_bits(disk, hits)
        return out

    def op_lookup(self, args: dict[str, Any]) -> Packed | Generator[None, None, Packed]:
        """Longest stored prefix of ``hashes`` with every shard in ``shards``; one of
        more than :data:`LOOKUP_STEP` hashes is looked up in steps (a generator)."""
        t0 = time.perf_counter()
        ns = args.get("ns")
        if type(ns) is not str or ns not in self._ns_ok:  # validated once per namespace
            ns = check_namespace(ns)
            if len(self._ns_ok) >= 4096:
                self._ns_ok.clear()
            self._ns_ok.add(ns)
        hashes = args.get("hashes")
        if type(hashes) is list and len(hashes) > LOOKUP_STEP:
            return self._lookup_in_steps(ns, args, t0)
        hashes, shards, want_gens = self._lookup_args(args)
        index = self.index
        hits, blocks, node_ids, gens = index.lookup(ns, hashes, shards, want_gens)
        disk = index.on_disk(ns, hashes, shards, hits) if hits else []
        nodes = list(map(index.node_entry_packed, node_ids))
        return self._lookup_reply(
            args, t0, len(hashes), hits, nodes, self._pack_rows(blocks), gens, disk
        )

    @staticmethod
    def _lookup_args(args: dict[str, Any]) -> tuple[list[bytes], list[int], bool]:
        return (
            check_hashes(args, "hashes", MAX_LOOKUP_HASHES),
            check_shards(args),
            args.get("gens") is True,
        )

    def _lookup_in_steps(
        self, ns: str, args: dict[str, Any], t0: float
    ) -> Generator[None, None, Packed]:
        """:meth:`op_lookup` of :data:`LOOKUP_STEP` hashes at a time, yielding between.
        The index may change between two steps: each node's record is the one it had
        when its first block was looked up."""
        hashes, shards, want_gens = self._lookup_args(args)
        index = self.index
        hits = 0
        nodes: dict[str, bytes] = {}
        rows: list[bytes] = []
        gens: list[int] | None = [] if want_gens else None
        disk: list[int] = []
        for start in range(0, len(hashes), LOOKUP_STEP):
            yield
            part = hashes[start : start + LOOKUP_STEP]
            m = index.lookup(ns, part, shards, want_gens)
            for n in m.nodes.difference(nodes):
                nodes[n] = index.node_entry_packed(n)
            rows.append(self._pack_rows(m.blocks))
            if gens is not None:
                gens += m.gens or ()
            if m.hits:
                disk += [start + i for i in index.on_disk(ns, part, shards, m.hits)]
            hits += m.hits
            if m.hits < len(part):
                break
        return self._lookup_reply(
            args, t0, len(hashes), hits, list(nodes.values()), b"".join(rows), gens, disk
        )

    def _lookup_reply(
        self,
        args: dict[str, Any],
        t0: float,
        asked: int,
        hits: int,
        nodes: list[bytes],
        rows: bytes,
        gens: list[int] | None,
        disk: list[int],
    ) -> Packed:
        """The ``lookup`` result, packed from its parts (``nodes``: map entries, ``rows``:
        the items of ``blocks``), counted in the metrics unless it is a warm-up."""
        # {"hits": .., "nodes": {..}, "blocks": [..](, "gens": [..])(, "disk": b"..")}
        result = Packed(
            b"".join(
                (
                    bytes((0x83 + (gens is not None) + bool(disk),)),
                    _HITS,
                    pack(hits),
                    _NODES_KEY,
                    _map_header(len(nodes)),
                    *nodes,
                    _BLOCKS_KEY,
                    _array_header(hits),
                    rows,
                    *((_GENS_KEY, pack(gens)) if gens is not None else ()),
                    *((_DISK_KEY, pack(pack_bits(disk, hits))) if disk else ()),
                )
            )
        )
        if args.get("warm_up") is not True:
            m = self.metrics
            m.lookups += 1
            m.hit_blocks += hits
            m.miss_blocks += asked - hits
            m.lookup_seconds.observe(time.perf_counter() - t0)
        return result

    def _pack_rows(self, blocks: list[tuple[str, ...]]) -> bytes:
        """msgpack of each of ``blocks``, one after another: each distinct row is packed
        once (rows are shared)."""
        n = len(blocks)
        if not n:
            return b""
        first = blocks[0]
        if blocks.count(first) == n:
            return self._packed_row(first) * n
        return b"".join(map(self._packed_row, blocks))

    def _packed_row(self, row: tuple[str, ...]) -> bytes:
        cache = self._row_cache
        packed = cache.get(row)
        if packed is None:
            if len(cache) >= 4096:
                cache.clear()
            packed = cache[row] = pack(list(row))
        return packed

    def op_place(self, args: dict[str, Any]) -> dict[str, Any]:
        """Pick the node for ``count`` new blocks of ``block_bytes``: one on the client's
        host first, else the one with the most free bytes."""
        check_namespace(args.get("ns"))
        count = req_int(args, "count", 1, 1 << 32)
        block_bytes = req_int(args, "block_bytes", 1, 1 << 40)
        host = req_str(args, "client_host", 256) if "client_host" in args else ""
        node = self.place(count * block_bytes, host)
        return {"node": node.to_wire()}

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
        return {"nodes": [n.to_wire() for n in self.index.nodes()]}

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
            "uptime_s": round(time.monotonic() - self._started, 3) if self._started else 0.0,
            "lookups": self.metrics.lookups,
            "hit_blocks": self.metrics.hit_blocks,
            "miss_blocks": self.metrics.miss_blocks,
            "http_port": self.http_port,
            "leader": self.election.is_leader if self.election else False,
        }
        if self.mirror is not None:
            st["etcd"] = self.mirror.status()
        if self.election is not None:
            st["election"] = self.election.status()
        if self.gc is not None:
            st["gc"] = self.gc.status()
        return st
