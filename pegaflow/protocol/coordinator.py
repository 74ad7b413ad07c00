"""The coordinator's protocol: its ops in one table, each with its request and reply types.

The ops travel as the ``args`` and ``result`` of :mod:`pegaflow.protocol.framing`
requests (TCP, or a Unix socket; :mod:`~pegaflow.transport.rpc_server` serves them,
:mod:`~pegaflow.transport.rpc_client` calls them).  :data:`OPS` says, per op, what a
request carries (with its bounds), what the reply is, whether a tenant's connection may
ask it and how the server runs it.  The coordinator
(:mod:`pegaflow.coordinator.service`) registers a handler for each op of :data:`OPS` and
reads requests with the ``from_wire`` decoders here; the client
(:mod:`pegaflow.client.api`) builds requests and reads replies with the types here: a
field or bound is defined here once.  Adding an op: its entry in :data:`OPS` and its
types here, its handler in the service's table, its call in the client.

Access: a connection presenting the cluster token may ask every op of every namespace; a
tenant's connection (:mod:`pegaflow.auth`) may ask only of namespaces of its own (the
server refuses a request whose ``ns`` is another's), and not the ops whose
:attr:`OpSpec.cluster_only` says what a tenant may not do.

``lookup`` ``{ns, hashes: [bytes], shards: [int], gens?: bool, warm_up?: bool}`` ->
    ``{hits, nodes: {node_id: NodeRecord}, blocks: [[node_id per shard] per hit]}``; with
    ``gens: true`` also ``gens: [int]``, the generation each of those shards had when it
    was published, flat and block-major (``gens[i * len(shards) + j]``); with
    ``warm_up: true`` (a connector connecting at engine start) it is not counted in the
    lookup metrics; ``disk: bytes`` (:func:`~pegaflow.protocol.codec.pack_bits`, a bit per
    hit block) is there when some hit block has an asked shard only on its node's disk
    tier: bit ``i`` set for those (absent: every hit block is in memory); ``miss``
    (:meth:`~pegaflow.protocol.misses.MissInfo.to_wire`) is there when the lookup missed
    some block: why its first missing block is not stored (a warm-up's is not counted).
    :class:`LookupEncoder` writes it, :meth:`LookupResult.from_wire` reads it.
``place`` ``{ns, count, block_bytes, client_host?}`` -> ``{node: NodeRecord}``
``status`` ``{}`` -> ``{nodes, blocks, entries, namespaces, cluster_lookups,
    coordinator: {...}, routers, misses}`` (see :meth:`~pegaflow.coordinator.service.Coordinator.
    op_status`)
``nodes`` ``{}`` -> ``{nodes: [NodeRecord]}``
``router_report`` ``{url, mode, ttl_ms, started_at, max_inflight, replicas: [{url, role,
    node, host, healthy, inflight, queued_blocks?, requests, failures, last_error}],
    counters: {str: int}}`` -> ``{routers: int}`` (:mod:`pegaflow.coordinator.routers`)
``report_unreachable`` ``{node}`` -> ``{suspected: bool}``
    (:mod:`pegaflow.coordinator.suspects`)
``namespace_peers`` ``{ns, factors: {name: value}}`` -> ``{peers: [{ns, blocks,
    factors}]}`` (:mod:`pegaflow.coordinator.namespaces`)
``miss_report`` ``{ns, host, pid, blocks: {cause: int}, details?: {cause: str}}`` ->
    ``{engines: int}``: an engine's missed blocks by cause since its last report
    (:class:`MissReport`; :mod:`pegaflow.coordinator.enginemisses`)
"""

from __future__ import annotations

import enum
from collections.abc import Container, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from pegaflow.errors import BadRequest, TooLarge, Unavailable
from pegaflow.keys import NodeRecord
from pegaflow.protocol.codec import (
    check_hashes,
    check_namespace,
    check_shards,
    pack,
    pack_bits,
    req_int,
    req_list,
    req_map,
    req_str,
    req_typed,
    unpack_bits,
)
from pegaflow.protocol.misses import MAX_TEXT, NEVER_STORED, MissCause, MissInfo

MAX_LOOKUP_HASHES = 65536
"""most hashes accepted in one lookup (a 1M-token prompt at block size 16)"""
MAX_PLACE_BLOCKS = 1 << 32
"""most blocks one ``place`` asks room for"""
MAX_BLOCK_BYTES = 1 << 40
"""largest block a ``place`` names"""
MAX_NODE_ID = 256
"""longest node id (``report_unreachable``) or host name (``place``)"""
MAX_FACTORS = 64
"""factors of one namespace (``namespace_peers``)"""
MAX_FACTOR_VALUE = 512
"""characters of one factor's value (longer ones are cut)"""
MAX_REPLICAS = 256
"""most replicas of one router's report"""
MAX_COUNTERS = 64
"""most counters of one router's report"""
MAX_TTL_MS = 600_000
"""longest TTL a router's report may ask for (one reporting every few seconds asks ~3x
that)"""
MAX_URL = 512
MAX_ERROR = 1024
_COUNT = (0, 2**63 - 1)
_CAUSES = frozenset(c.value for c in MissCause)


class Op(enum.StrEnum):
    """The coordinator's ops."""

    LOOKUP = "lookup"
    PLACE = "place"
    STATUS = "status"
    NODES = "nodes"
    ROUTER_REPORT = "router_report"
    REPORT_UNREACHABLE = "report_unreachable"
    NAMESPACE_PEERS = "namespace_peers"
    MISS_REPORT = "miss_report"


@dataclass(frozen=True)
class OpSpec:
    """One op of the protocol."""

    request: str
    """the request's type (its fields and bounds)"""
    reply: str
    """the reply's type"""
    awaits: bool = False
    """whether its handler awaits something: the server runs it as a task under the
    request's deadline (else inline, as the request is read; a long one in steps)"""
    cluster_only: str | None = None
    """what a tenant's connection may not do (None: a tenant may ask it)"""
    transport: str = "control protocol (pegaflow.protocol.framing)"


OPS: dict[Op, OpSpec] = {
    Op.LOOKUP: OpSpec("LookupRequest", "LookupResult (LookupEncoder)"),
    Op.PLACE: OpSpec("PlaceRequest", "place_reply"),
    Op.STATUS: OpSpec("{}", "the status document (a map)"),
    Op.NODES: OpSpec("{}", "nodes_reply"),
    Op.ROUTER_REPORT: OpSpec("parse_report", "{routers: int}"),
    Op.REPORT_UNREACHABLE: OpSpec(
        "{node} (<= MAX_NODE_ID)", "{suspected: bool}", awaits=True,
        cluster_only="report unreachable nodes",
    ),
    Op.NAMESPACE_PEERS: OpSpec("NamespacePeersRequest", "namespace_peers_reply"),
    Op.MISS_REPORT: OpSpec("MissReport", "{engines: int}"),
}  # fmt: skip


# ---- lookup ---------------------------------------------------------------------------


@dataclass(slots=True)
class LookupRequest:
    """A ``lookup``: the longest prefix of ``hashes`` stored with every one of
    ``shards``; ``gens``: with each shard's generation; ``warm_up``: a lookup made only
    to connect, left out of the lookup metrics."""

    ns: str
    hashes: list[bytes]
    shards: list[int]
    gens: bool = False
    warm_up: bool = False

    def to_wire(self) -> dict[str, Any]:
        """The request's ``args``."""
        args: dict[str, Any] = {"ns": self.ns, "hashes": self.hashes, "shards": self.shards}
        if self.gens:
            args["gens"] = True
        if self.warm_up:
            args["warm_up"] = True
        return args

    @classmethod
    def from_wire(cls, args: dict[str, Any], checked_ns: Container[str] = ()) -> LookupRequest:
        """Decode and check a request's ``args`` (a namespace in ``checked_ns`` is known
        to be valid and not checked again)."""
        ns = args.get("ns")
        if type(ns) is not str or ns not in checked_ns:
            ns = check_namespace(ns)
        return cls(
            ns,
            check_hashes(args, "hashes", MAX_LOOKUP_HASHES),
            check_shards(args),
            args.get("gens") is True,
            args.get("warm_up") is True,
        )


_HITS = pack("hits")  # after a map header of 3 to 5 entries
_NODES_KEY = pack("nodes")
_BLOCKS_KEY = pack("blocks")
_GENS_KEY = pack("gens")
_DISK_KEY = pack("disk")
_MISS_KEY = pack("miss")
_NEVER_STORED = pack(NEVER_STORED.to_wire())


def _header(n: int, fix: int, two: bytes, four: bytes) -> bytes:
    """A msgpack array or map header of ``n`` items."""
    if n < 16:
        return bytes((fix | n,))
    return (two + n.to_bytes(2, "big")) if n < 1 << 16 else (four + n.to_bytes(4, "big"))


class LookupEncoder:
    """Writes ``lookup`` replies from their parts, already packed: the fast path of a
    hot op (a generic ``pack`` of the same map costs several times more).  Each distinct
    row of node ids is packed once (rows are shared by the blocks of one placement), and
    each node's record once while it stays the same."""

    def __init__(self) -> None:
        self._rows: dict[tuple[str, ...], bytes] = {}
        self._nodes: dict[str, tuple[Any, bytes]] = {}

    def node(self, node_id: str, record: dict[str, Any] | None) -> bytes:
        """An item of the reply's ``nodes`` map: msgpack of ``node_id``, then of its wire
        ``record`` (packed again only when the record is another object)."""
        got = self._nodes.get(node_id)
        if got is None or got[0] is not record:
            if len(self._nodes) >= 4096:
                self._nodes.clear()
            got = self._nodes[node_id] = (record, pack(node_id) + pack(record))
        return got[1]

    def rows(self, blocks: list[tuple[str, ...]]) -> bytes:
        """The items of ``blocks`` (a row of node ids per block), packed back to back."""
        n = len(blocks)
        if not n:
            return b""
        first = blocks[0]
        if blocks.count(first) == n:
            return self._row(first) * n
        return b"".join(map(self._row, blocks))

    def _row(self, row: tuple[str, ...]) -> bytes:
        cache = self._rows
        packed = cache.get(row)
        if packed is None:
            if len(cache) >= 4096:
                cache.clear()
            packed = cache[row] = pack(list(row))
        return packed

    @staticmethod
    def reply(
        hits: int,
        nodes: Sequence[bytes],
        rows: bytes,
        gens: list[int] | None,
        disk: list[int],
        miss: MissInfo | None = None,
    ) -> bytes:
        """The reply: ``nodes``, from :meth:`node`;
        ``rows``, from :meth:`rows`; ``gens``, flat (None: not asked); ``disk``, the
        indexes of the hit blocks with an asked shard only on disk; ``miss``, why the
        first block after the hit is missing (None: not said)."""
        return b"".join(
            (
                bytes((0x83 + (gens is not None) + bool(disk) + (miss is not None),)),
                _HITS,
                pack(hits),
                _NODES_KEY,
                _header(len(nodes), 0x80, b"\xde", b"\xdf"),
                *nodes,
                _BLOCKS_KEY,
                _header(hits, 0x90, b"\xdc", b"\xdd"),
                rows,
                *((_GENS_KEY, pack(gens)) if gens is not None else ()),
                *((_DISK_KEY, pack(pack_bits(disk, hits))) if disk else ()),
                *(
                    (_MISS_KEY, _NEVER_STORED if miss is NEVER_STORED else pack(miss.to_wire()))
                    if miss is not None
                    else ()
                ),
            )
        )


@dataclass
class LookupResult:
    """Answer of a lookup: the first ``hits`` blocks are stored with every shard asked for."""

    hits: int
    nodes: dict[str, NodeRecord] = field(default_factory=dict)
    blocks: list[list[str]] = field(default_factory=list)
    """node id per shard, for each of the first ``hits`` blocks"""
    generations: list[list[int]] = field(default_factory=list)
    """with ``lookup(..., generations=True)``: the generation of each shard of each of
    the first ``hits`` blocks when it was published (same shape as ``blocks``); pass
    them to :meth:`~pegaflow.client.PegaClient.get_blocks` to fence the read (empty
    otherwise)"""
    on_disk: list[bool] = field(default_factory=list)
    """per hit block, whether some shard asked for is only on its node's disk tier (a
    slower read than memory); empty, or False, where it is in memory"""
    miss: MissInfo | None = None
    """why the first block after the hit is not one (None: all hit, or not said)"""

    @classmethod
    def from_wire(cls, res: Any, n_shards: int, generations: bool) -> LookupResult:
        """A ``lookup`` reply (for ``n_shards`` shards, with ``generations`` if asked);
        raises ``Unavailable`` for a malformed one."""
        try:
            nodes = {nid: NodeRecord.from_wire(rec) for nid, rec in res.get("nodes", {}).items()}
            hits = int(res["hits"])
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise Unavailable(f"malformed lookup reply ({type(e).__name__}: {e})") from None
        gens: list[list[int]] = []
        if generations:
            flat, k = res.get("gens") or [], n_shards
            if len(flat) != hits * k:
                raise Unavailable("malformed lookup reply (generations)")
            gens = [flat[i : i + k] for i in range(0, hits * k, k)]
        disk = res.get("disk")
        try:  # absent: a coordinator without disk tiers, or before them
            on_disk = [False] * hits if disk is None else unpack_bits(disk, hits, "disk")
        except BadRequest as e:
            raise Unavailable(f"malformed lookup reply ({e})") from None
        blocks = [list(b) for b in res.get("blocks", [])]
        miss = res.get("miss")
        return cls(hits, nodes, blocks, gens, on_disk, MissInfo.from_wire(miss) if miss else None)


# ---- place, nodes ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PlaceRequest:
    """A ``place``: the node for ``count`` new blocks of ``block_bytes``, for a client
    on ``client_host`` (a node on its host is preferred)."""

    ns: str
    count: int
    block_bytes: int
    client_host: str = ""

    def to_wire(self) -> dict[str, Any]:
        """The request's ``args``."""
        return asdict(self)

    @classmethod
    def from_wire(cls, args: dict[str, Any]) -> PlaceRequest:
        """Decode and check a request's ``args``."""
        return cls(
            check_namespace(args.get("ns")),
            req_int(args, "count", 1, MAX_PLACE_BLOCKS),
            req_int(args, "block_bytes", 1, MAX_BLOCK_BYTES),
            req_str(args, "client_host", MAX_NODE_ID) if "client_host" in args else "",
        )


def encode_place_reply(node: NodeRecord) -> dict[str, Any]:
    """A ``place`` reply."""
    return {"node": node.to_wire()}


def place_reply(res: dict[str, Any]) -> NodeRecord:
    """The node a ``place`` reply names."""
    return NodeRecord.from_wire(res["node"])


def encode_nodes_reply(nodes: Sequence[NodeRecord]) -> dict[str, Any]:
    """A ``nodes`` reply."""
    return {"nodes": [n.to_wire() for n in nodes]}


def nodes_reply(res: dict[str, Any]) -> list[NodeRecord]:
    """The nodes of a ``nodes`` reply."""
    return [NodeRecord.from_wire(r) for r in res.get("nodes", [])]


# ---- report_unreachable ---------------------------------------------------------------


def encode_report_unreachable(node_id: str) -> dict[str, Any]:
    """A ``report_unreachable`` request's ``args``."""
    return {"node": node_id}


def decode_report_unreachable(args: dict[str, Any]) -> str:
    """The node id of a ``report_unreachable`` request."""
    return req_str(args, "node", MAX_NODE_ID)


def report_unreachable_reply(res: Any) -> bool:
    """Whether the coordinator now leaves the reported node out."""
    return bool(res.get("suspected")) if isinstance(res, dict) else False


# ---- namespace_peers ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NamespacePeersRequest:
    """A ``namespace_peers``: the other namespaces of ``ns``'s model, after sending
    this engine's ``factors`` of ``ns`` (None: none sent)."""

    ns: str
    factors: dict[str, str] | None

    def to_wire(self) -> dict[str, Any]:
        """The request's ``args``."""
        return asdict(self)

    @classmethod
    def from_wire(cls, args: dict[str, Any]) -> NamespacePeersRequest:
        """Decode and check a request's ``args`` (names cut to 64 characters, values to
        :data:`MAX_FACTOR_VALUE`)."""
        ns = check_namespace(args.get("ns"))
        factors = args.get("factors")
        if factors is None:
            return cls(ns, None)
        factors = req_map(factors)
        if len(factors) > MAX_FACTORS:
            raise BadRequest(f"more than {MAX_FACTORS} namespace factors")
        return cls(ns, {str(k)[:64]: str(v)[:MAX_FACTOR_VALUE] for k, v in factors.items()})


def namespace_peers_reply(res: Any) -> list[dict[str, Any]]:
    """The peers of a ``namespace_peers`` reply, each ``{ns, blocks, factors}``."""
    peers = res.get("peers") if isinstance(res, dict) else None
    return [p for p in peers or [] if isinstance(p, dict) and isinstance(p.get("ns"), str)]


# ---- router_report --------------------------------------------------------------------


def _url(msg: dict[str, Any], key: str) -> str:
    url = req_str(msg, key, MAX_URL)
    if not url.startswith(("http://", "https://")):
        raise BadRequest(f"field {key!r} must be an http(s) URL")
    return url


def _replica(rec: Any) -> dict[str, Any]:
    if not isinstance(rec, dict):
        raise BadRequest("each replica must be a map")
    return {
        "url": _url(rec, "url"),
        "role": req_str(rec, "role", 16),
        "node": req_str(rec, "node", 256) if rec.get("node") is not None else "",
        "host": req_str(rec, "host", 256) if rec.get("host") is not None else "",
        "healthy": req_typed(rec, "healthy", bool, "a boolean"),
        "inflight": req_int(rec, "inflight", *_COUNT),
        "queued_blocks": (
            req_int(rec, "queued_blocks", *_COUNT) if rec.get("queued_blocks") is not None else 0
        ),
        "requests": req_int(rec, "requests", *_COUNT),
        "failures": req_int(rec, "failures", *_COUNT),
        "last_error": req_str(rec, "last_error", MAX_ERROR) if rec.get("last_error") else "",
    }


def parse_report(args: dict[str, Any]) -> dict[str, Any]:
    """A ``router_report``'s arguments, checked field by field (``BadRequest`` or
    ``TooLarge`` naming the field), as the record the coordinator keeps."""
    counters = args.get("counters", {})
    if not isinstance(counters, dict):
        raise BadRequest("field 'counters' must be a map")
    if len(counters) > MAX_COUNTERS:
        raise TooLarge(f"field 'counters' has {len(counters)} items, limit {MAX_COUNTERS}")
    for k in counters:
        if not isinstance(k, str) or len(k) > 64:
            raise BadRequest("counter names must be strings of at most 64 characters")
    started = args.get("started_at", 0.0)
    if not isinstance(started, int | float) or isinstance(started, bool) or started < 0:
        raise BadRequest("field 'started_at' must be a non-negative number")
    return {
        "url": _url(args, "url"),
        "mode": req_str(args, "mode", 16),
        "ttl_ms": req_int(args, "ttl_ms", 0, MAX_TTL_MS),
        "started_at": float(started),
        "max_inflight": req_int(args, "max_inflight", *_COUNT),
        "replicas": [_replica(r) for r in req_list(args, "replicas", MAX_REPLICAS)],
        "counters": {k: req_int(counters, k, *_COUNT) for k in sorted(counters)},
    }


# ---- miss_report ----------------------------------------------------------------------


@dataclass(slots=True)
class MissReport:
    """A ``miss_report``: the blocks an engine's lookups missed since its last report, by
    the cause of each lookup's first miss (:class:`~pegaflow.protocol.misses.MissCause`),
    with the last detail seen of a cause; the engine is named by its namespace, host
    and pid."""

    ns: str
    host: str
    pid: int
    blocks: dict[str, int]
    details: dict[str, str] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        """The request's ``args``."""
        args: dict[str, Any] = {
            "ns": self.ns, "host": self.host, "pid": self.pid, "blocks": self.blocks
        }  # fmt: skip
        if self.details:
            args["details"] = self.details
        return args

    @classmethod
    def from_wire(cls, args: dict[str, Any]) -> MissReport:
        """Decode and check a request's ``args`` (``BadRequest`` naming the field)."""
        blocks = _by_cause(args, "blocks")
        details = _by_cause(args, "details") if args.get("details") is not None else {}
        return cls(
            check_namespace(args.get("ns")),
            req_str(args, "host", MAX_NODE_ID),
            req_int(args, "pid", 0, 2**31),
            {c: req_int(blocks, c, *_COUNT) for c in sorted(blocks)},
            {c: req_str(details, c, 1 << 16)[:MAX_TEXT] for c in sorted(details)},
        )


def _by_cause(args: dict[str, Any], key: str) -> dict[str, Any]:
    """Field ``key``: a map keyed by miss causes."""
    m = args.get(key)
    if not isinstance(m, dict):
        raise BadRequest(f"field {key!r} must be a map of miss causes")
    for k in m:
        if k not in _CAUSES:
            raise BadRequest(f"field {key!r}: {k!r} is not a miss cause")
    return m
