"""The node's protocol: its ops in one table, each with paired encode and decode.

Control messages are msgpack maps (``{op, id, ...}`` requests, ``{id, ok, ...}``
replies, one reply per request, matched by ``id``); over UCX they travel in active
messages and payloads in tagged messages (see :mod:`pegaflow.transport.ucx`), on the same-host
control socket (:mod:`~pegaflow.storage_node.local_control`) as the ``args`` and
``result`` of :mod:`pegaflow.protocol.framing` requests.  :data:`OPS` says, per op, what a request
carries (with its bounds), what the reply is, which transports serve it and whether
it needs the cluster token.  The client (:mod:`pegaflow.client.data`) builds requests
and reads replies with the ``encode_*``/``*_reply`` functions here, the node (its
service, :mod:`~pegaflow.storage_node.node_service`, and its UCX site,
:mod:`~pegaflow.storage_node.ucx_site`) reads requests with the ``decode_*`` ones: a
field or bound is defined here once.  Adding an op: its entry in :data:`OPS` and its
codecs here, its handler in the service's table, its call in the client.

``hello`` is required first on a UCX connection when a token is configured (said once
per connection; before it, messages are handled one at a time and may be at most
:data:`MAX_HELLO_BYTES` long).  A ``get``'s present blocks are sent with tag ``(seq,
index)`` straight from the pool, pinned until their send completes; every miss gets an
empty payload message.  A ``reserve``'s receives are posted straight into the slots with
tag ``(seq, index)``; its ``commit`` verifies each block's xxh3 against the writer's and
only then commits and publishes it; a commit the node has taken (a well-formed one of a
live reservation) is carried out whatever happens to the connection that sent it, and a
``taken`` right behind it says so within a round trip.  A local ``reserve`` (same host,
written through the pool file) names the file its writer maps (``pool``: device and
inode; another file than the node's is refused, :class:`~pegaflow.errors.PoolChanged`),
posts no receives and answers slot offsets; its commit's
``xxh3`` entries may be None (the node hashes the slot) and may carry ``digest``, the
writer's signed 64-bit device digest per block, which ``locate`` returns, with the
pool file's device and inode (a reader that maps another file reads nothing of it).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from pegaflow.errors import BadRequest, PoolChanged, ProtocolError, TooLarge, Unavailable
from pegaflow.protocol.codec import (
    GEN_MAX,
    MAX_HASH_BYTES,
    NO_SLOT,
    PROTOCOL_VERSION,
    SHARD_LIMIT,
    LocatedBlocks,
    check_hash,
    check_namespace,
    req_int,
    req_list,
)

MAX_PIN_MS = 30_000
"""longest read pin (``pin``, ``locate``)"""
MAX_HELLO_BYTES = 4096
"""largest message a connection may send before its hello"""
MAX_REPORTED = 1 << 40
"""most lookups (or blocks) one ``report`` may add"""
MAX_SEQ = 2**44 - 1
"""largest ``seq`` of a get (the tag's sequence field)"""
MAX_BLOCK_SIZE = 1 << 40
"""largest block a packed ``reserve`` may ask for"""


class Op(enum.StrEnum):
    """The node's ops (also the only values, with ``unknown``, of the ``op`` label of
    the request metrics: a peer's own strings never become labels)."""

    HELLO = "hello"
    GET = "get"
    CHECK = "check"
    RESERVE = "reserve"
    COMMIT = "commit"
    ABORT = "abort"
    PIN = "pin"
    LOCATE = "locate"
    UNPIN = "unpin"
    STATS = "stats"
    REPORT = "report"
    TAKEN = "taken"
    DROP = "drop"


class Site(enum.Enum):
    """The transports that serve ops."""

    UCX = "ucx"
    SOCKET = "socket"
    """the same-host control socket (admits the cluster token only)"""


class Loop(enum.Enum):
    """Where the control socket serves an op."""

    CONTROL = "control"
    """on its own thread, at once however busy the data loop is"""
    DATA = "data"
    """forwarded to the data loop, in arrival order (ops on reservations)"""


@dataclass(frozen=True)
class OpSpec:
    """One op of the protocol."""

    request: str
    """the request's fields and their bounds"""
    reply: str
    """the reply's fields"""
    sites: frozenset[Site]
    cluster_only: str | None = None
    """what a tenant's connection may not do (None: a tenant may ask it)"""
    loop: Loop = Loop.DATA
    span: str | None = None
    """the trace span a UCX request runs in"""


_UCX = frozenset({Site.UCX})
_BOTH = frozenset({Site.UCX, Site.SOCKET})

OPS: dict[Op, OpSpec] = {
    Op.HELLO: OpSpec(
        "version (= PROTOCOL_VERSION), token", "node_id, version, pool? {path, dev, ino, "
        "bytes, slab, control?} (cluster-wide access only)", _UCX,
    ),
    Op.GET: OpSpec(
        "ns, seq <= MAX_SEQ, blocks: [[hash, shard] | [hash, shard, gen]] <= max_batch",
        "blocks: [[size, gen, xxh3] | None | 'stale'], then a payload per block",
        _UCX, span="pegaflow.node.get",
    ),
    Op.CHECK: OpSpec(
        "ns, blocks: [[hash, shard(, gen)]] <= max_batch",
        "valid: [bool] (stored and committed, with that generation)", _UCX,
    ),
    Op.RESERVE: OpSpec(
        "ns, blocks: [[hash, shard, size]] <= max_batch; local: true (same host) may "
        "instead carry shard, size <= MAX_BLOCK_SIZE, hash_len, hashes: bytes",
        "seq, accept: [bool] (local: offsets: [int | None]; packed: offsets: bytes, a "
        "little-endian uint64 per block, NO_SLOT where stored already)",
        _BOTH, span="pegaflow.node.reserve",
    ),
    Op.COMMIT: OpSpec(
        "seq, xxh3: [int | None] (one per reserved block), digest?: [int | None]",
        "stored, failed: [index]", _BOTH, span="pegaflow.node.commit",
    ),
    Op.ABORT: OpSpec("seq", "{} (another's or an unknown seq: a no-op)", _BOTH),
    Op.PIN: OpSpec(
        "ns, ttl_ms <= MAX_PIN_MS, blocks: [[hash, shard]] <= max_batch",
        "pinned: [bool], pin", _UCX,
    ),
    Op.LOCATE: OpSpec(
        "ns, ttl_ms <= MAX_PIN_MS, shard, hash_len, hashes: bytes (<= max_batch)",
        "pin, flags, cols (LocatedBlocks)", _BOTH,
        cluster_only="locate blocks (where blocks lie is not a tenant's)", loop=Loop.CONTROL,
    ),
    Op.UNPIN: OpSpec("pin", "{} (idempotent)", _BOTH, loop=Loop.CONTROL),
    Op.STATS: OpSpec("", "the pool's counters", _UCX, cluster_only="see node-wide stats"),
    Op.REPORT: OpSpec(
        "lookups, asked_blocks <= MAX_REPORTED, hit_blocks <= asked_blocks", "{}", _BOTH,
        cluster_only="report same-host lookups",
    ),
    Op.TAKEN: OpSpec("seq", "taken: bool (the node holds a commit of seq now)", _BOTH),
    Op.DROP: OpSpec(
        "ns", "dropped, pinned (those dropped once their pins go)", _UCX,
        cluster_only="drop a namespace's blocks",
    ),
}  # fmt: skip

UNKNOWN_OP = "unknown"


def op_label(op: str) -> str:
    """The ``op`` label of a request: its op if the protocol has it, else ``unknown``."""
    return op if op in OPS else UNKNOWN_OP


Key = tuple[str, bytes, int]
"""a block's (namespace, hash, shard)"""
STALE = "stale"
"""a get's typed miss: the block's slot holds another generation now"""
GetHit = tuple[Any, Any, Any]
"""a get reply's ``[size, gen, xxh3]`` of a block sent (as the node gave it)"""


# ---- shared pieces -------------------------------------------------------------------


def _blocks(blocks: Sequence[tuple[bytes, int, int | None]]) -> list[list[Any]]:
    return [[h, s] if g is None else [h, s, g] for h, s, g in blocks]


def _ttl_ms(ttl_s: float) -> int:
    return max(1, int(ttl_s * 1000))


def packed_hashes(hashes: Sequence[bytes]) -> dict[str, Any] | None:
    """``hash_len`` and ``hashes`` (back to back) of hashes of one length, else None."""
    hl = len(hashes[0]) if hashes else 32
    if any(len(h) != hl for h in hashes):
        return None
    return {"hash_len": hl, "hashes": b"".join(hashes)}


def decode_packed_hashes(msg: dict[str, Any], max_batch: int) -> list[bytes]:
    """The ``hash_len``-byte hashes packed back to back in ``hashes`` (at most
    ``max_batch`` of them)."""
    hl = req_int(msg, "hash_len", 1, MAX_HASH_BYTES)
    blob = msg.get("hashes")
    if not isinstance(blob, bytes) or len(blob) % hl:
        raise BadRequest("hashes must be bytes, a multiple of hash_len long")
    n = len(blob) // hl
    if n > max_batch:
        raise TooLarge(f"{n} blocks in one request; the limit is {max_batch}")
    return [blob[i : i + hl] for i in range(0, len(blob), hl)]


def block_key(ns: str, b: Any) -> Key:
    """A ``[hash, shard, ...]`` item of a request -> its key."""
    if not isinstance(b, list) or len(b) < 2:
        raise BadRequest("each block must be [hash, shard, ...]")
    shard = b[1]
    if not isinstance(shard, int) or isinstance(shard, bool) or not 0 <= shard < SHARD_LIMIT:
        raise BadRequest(f"shard must be an integer in [0, {SHARD_LIMIT})")
    return (ns, check_hash(b[0]), shard)


def wanted_gens(items: list[Any]) -> list[int | None] | None:
    """The expected generation of each ``[hash, shard, gen]`` item (None where an item
    has none); None when no item carries one.  Items are already checked as lists."""
    if all(len(b) == 2 for b in items):
        return None
    out: list[int | None] = []
    for b in items:
        g = b[2] if len(b) > 2 else None
        if g is not None and (type(g) is not int or not 0 <= g <= GEN_MAX):
            raise BadRequest("a block's generation must be an integer in [0, 2**64)")
        out.append(g)
    return out


def _keyed(msg: dict[str, Any], max_batch: int) -> tuple[str, list[Key], list[int | None] | None]:
    ns = check_namespace(msg.get("ns"))
    items = req_list(msg, "blocks", max_batch)
    return ns, [block_key(ns, b) for b in items], wanted_gens(items)


def _list_reply(reply: dict[str, Any], key: str, n: int, what: str) -> list[Any]:
    v = reply.get(key)
    if not isinstance(v, list) or len(v) != n:
        raise Unavailable(what)
    return v


# ---- hello ---------------------------------------------------------------------------


def encode_hello(token: str | None) -> dict[str, Any]:
    return {"op": Op.HELLO.value, "version": PROTOCOL_VERSION, "token": token}


def decode_hello(msg: dict[str, Any]) -> Any:
    """Check the version; returns the token (for the authenticator to judge)."""
    version = req_int(msg, "version", 0, 1 << 16)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version} not supported (want {PROTOCOL_VERSION})")
    return msg.get("token")


# ---- get -----------------------------------------------------------------------------


def encode_get(
    ns: str, seq: int, blocks: Sequence[tuple[bytes, int]], gens: Sequence[int | None] | None
) -> dict[str, Any]:
    if gens is None:
        items = [[h, s] for h, s in blocks]
    else:
        items = _blocks([(h, s, g) for (h, s), g in zip(blocks, gens, strict=True)])
    return {"op": Op.GET.value, "ns": ns, "seq": seq, "blocks": items}


def decode_get(
    msg: dict[str, Any], max_batch: int
) -> tuple[str, int, list[Key], list[int | None] | None]:
    """-> (ns, seq, keys, expected generations or None)."""
    ns = check_namespace(msg.get("ns"))
    seq = req_int(msg, "seq", 0, MAX_SEQ)
    items = req_list(msg, "blocks", max_batch)
    return ns, seq, [block_key(ns, b) for b in items], wanted_gens(items)


def get_hit(size: int, gen: int, xxh3: int) -> list[int]:
    """A get reply's entry for a block it sends."""
    return [size, gen, xxh3]


def get_reply(reply: dict[str, Any], n: int) -> list[GetHit | Literal["stale"] | None]:
    """Per block of a get of ``n``: its ``(size, gen, xxh3)``, :data:`STALE` or None
    (not stored, or an entry this client cannot read)."""
    header = _list_reply(reply, "blocks", n, "malformed get reply")
    return [
        (h[0], h[1], h[2]) if isinstance(h, list) and len(h) == 3
        else STALE if h == STALE else None
        for h in header
    ]  # fmt: skip


# ---- check ---------------------------------------------------------------------------


def encode_check(ns: str, blocks: Sequence[tuple[bytes, int, int | None]]) -> dict[str, Any]:
    return {"op": Op.CHECK.value, "ns": ns, "blocks": _blocks(blocks)}


def decode_check(
    msg: dict[str, Any], max_batch: int
) -> tuple[str, list[Key], list[int | None] | None]:
    """-> (ns, keys, expected generations or None)."""
    return _keyed(msg, max_batch)


def check_reply(reply: dict[str, Any], n: int, addr: str) -> list[bool]:
    return [v is True for v in _list_reply(reply, "valid", n, f"malformed check reply from {addr}")]


# ---- reserve -------------------------------------------------------------------------


def encode_reserve(ns: str, blocks: Sequence[tuple[bytes, int, int]]) -> dict[str, Any]:
    """A reservation over UCX of ``(hash, shard, size)`` blocks (payloads sent after)."""
    return {"op": Op.RESERVE.value, "ns": ns, "blocks": [[h, s, z] for h, s, z in blocks]}


def encode_reserve_local(
    ns: str, blocks: Sequence[tuple[bytes, int, int]], pool: tuple[int, int]
) -> dict[str, Any]:
    """A same-host reservation of a writer that maps the pool file ``pool`` (its device
    and inode): packed when the blocks share one shard and size (a connector's save:
    hundreds of blocks), else listed."""
    head = {"op": Op.RESERVE.value, "ns": ns, "local": True, "pool": list(pool)}
    packed = packed_hashes([h for h, _, _ in blocks]) if blocks else None
    if packed is not None and len({(s, z) for _, s, z in blocks}) == 1:
        _, shard, size = blocks[0]
        return {**head, "shard": shard, "size": size, **packed}
    return {**head, "blocks": [list(b) for b in blocks]}


def reserve_is_local(msg: dict[str, Any]) -> bool:
    return msg.get("local") is True


def check_reserve_pool(msg: dict[str, Any], file_id: tuple[int, int], path: str) -> None:
    """Refuse a same-host reservation whose writer maps another file than the node's
    pool (``file_id``: its device and inode): its bytes would never reach the pool
    (:class:`~pegaflow.errors.PoolChanged`)."""
    pool = msg.get("pool")
    if not (isinstance(pool, list) and len(pool) == 2 and all(type(x) is int for x in pool)):
        raise BadRequest("a same-host reservation names the pool file it writes: pool [dev, ino]")
    if tuple(pool) != file_id:
        raise PoolChanged(
            f"the writer maps pool file {pool[0]}:{pool[1]}, the node's is {path} "
            f"({file_id[0]}:{file_id[1]}): the node was restarted on a new pool file; "
            "map it again"
        )


def reserve_is_packed(msg: dict[str, Any]) -> bool:
    return "hashes" in msg


def decode_reserve_blocks(ns: str, msg: dict[str, Any], max_batch: int) -> list[tuple[Key, int]]:
    """The blocks of a reservation -> ``[(key, size)]``."""
    if not reserve_is_packed(msg):
        parsed = []
        for b in req_list(msg, "blocks", max_batch):
            if not isinstance(b, list) or len(b) != 3:
                raise BadRequest("each block must be [hash, shard, size]")
            key = block_key(ns, b[:2])
            size = b[2]
            if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
                raise BadRequest("block size must be a positive integer")
            parsed.append((key, size))
        return parsed
    if not reserve_is_local(msg):
        raise BadRequest("packed reservations are same-host (local) ones")
    shard = req_int(msg, "shard", 0, SHARD_LIMIT - 1)
    size = req_int(msg, "size", 1, MAX_BLOCK_SIZE)
    return [((ns, h, shard), size) for h in decode_packed_hashes(msg, max_batch)]


def encode_reserve_reply(
    msg: dict[str, Any], seq: int, offsets: Sequence[int | None]
) -> dict[str, Any]:
    """The reply to reservation ``msg``: ``offsets`` per block, None where not
    reserved (stored already)."""
    if reserve_is_packed(msg):
        offs = [NO_SLOT if o is None else o for o in offsets]
        return {"seq": seq, "offsets": np.array(offs, dtype="<u8").tobytes()}
    reply: dict[str, Any] = {"seq": seq, "accept": [o is not None for o in offsets]}
    if reserve_is_local(msg):
        reply["offsets"] = list(offsets)
    return reply


def reserve_reply(reply: dict[str, Any], n: int) -> tuple[int, list[bool]]:
    """A UCX reservation's (seq, accepted per block)."""
    return int(reply["seq"]), _list_reply(reply, "accept", n, "malformed reserve reply")


def reserve_local_reply(
    request: dict[str, Any], reply: dict[str, Any], n: int
) -> tuple[int, list[int | None]]:
    """A same-host reservation's (seq, slot offset per block or None when stored)."""
    if reserve_is_packed(request):
        raw = reply.get("offsets")
        if not isinstance(raw, bytes) or len(raw) != 8 * n:
            raise Unavailable("malformed reserve reply")
        offs = np.frombuffer(raw, dtype="<u8").tolist()
        return int(reply["seq"]), [None if o == NO_SLOT else o for o in offs]
    offsets = _list_reply(reply, "offsets", n, "malformed reserve reply")
    return int(reply["seq"]), [o if isinstance(o, int) else None for o in offsets]


# ---- commit, taken, abort ------------------------------------------------------------


def encode_commit(
    seq: int, xxh3: Sequence[int | None], digests: Sequence[int | None] | None = None
) -> dict[str, Any]:
    msg: dict[str, Any] = {"op": Op.COMMIT.value, "seq": seq, "xxh3": list(xxh3)}
    if digests is not None:
        msg["digest"] = list(digests)
    return msg


def decode_commit(msg: dict[str, Any], max_batch: int) -> tuple[int, list[Any], Any]:
    """-> (seq, xxh3 list, digest field as sent: checked against the reservation)."""
    return req_int(msg, "seq"), req_list(msg, "xxh3", max_batch), msg.get("digest")


def digest_of(d: Any) -> int | None:
    """A commit's digest entry: a signed 64-bit integer, else None."""
    ok = isinstance(d, int) and not isinstance(d, bool) and -(2**63) <= d < 2**63
    return d if ok else None


def commit_reply(reply: dict[str, Any]) -> int:
    """Blocks a commit stored."""
    return int(reply.get("stored", 0))


def encode_taken(seq: int) -> dict[str, Any]:
    return {"op": Op.TAKEN.value, "seq": seq}


def taken_reply(reply: dict[str, Any]) -> bool:
    return reply.get("taken") is True


def encode_abort(seq: int) -> dict[str, Any]:
    return {"op": Op.ABORT.value, "seq": seq}


def decode_seq(msg: dict[str, Any]) -> int:
    """The ``seq`` of a ``commit``, ``taken`` or ``abort``."""
    return req_int(msg, "seq")


# ---- pin, locate, unpin --------------------------------------------------------------


def encode_pin(ns: str, blocks: Sequence[tuple[bytes, int]], ttl_s: float) -> dict[str, Any]:
    return {"op": Op.PIN.value, "ns": ns, "ttl_ms": _ttl_ms(ttl_s),
            "blocks": [[h, s] for h, s in blocks]}  # fmt: skip


def decode_pin(msg: dict[str, Any], max_batch: int) -> tuple[int, list[Key]]:
    """-> (ttl_ms, keys)."""
    ns = check_namespace(msg.get("ns"))
    ttl_ms = req_int(msg, "ttl_ms", 1, MAX_PIN_MS)
    return ttl_ms, [block_key(ns, b) for b in req_list(msg, "blocks", max_batch)]


def pin_reply(reply: dict[str, Any]) -> list[bool]:
    return [bool(x) for x in reply.get("pinned", [])]


def encode_locate(ns: str, hashes: Sequence[bytes], shard: int, ttl_s: float) -> dict[str, Any]:
    packed = packed_hashes(hashes)
    if packed is None:
        raise BadRequest("locate: every hash must have the same length")
    return {"op": Op.LOCATE.value, "ns": ns, "ttl_ms": _ttl_ms(ttl_s), "shard": shard, **packed}


def decode_locate(msg: dict[str, Any], max_batch: int) -> tuple[str, int, int, list[bytes]]:
    """-> (ns, ttl_ms, shard, hashes)."""
    ns = check_namespace(msg.get("ns"))
    ttl_ms = req_int(msg, "ttl_ms", 1, MAX_PIN_MS)
    shard = req_int(msg, "shard", 0, SHARD_LIMIT - 1)
    return ns, ttl_ms, shard, decode_packed_hashes(msg, max_batch)


def encode_locate_reply(
    pin: int, rows: Sequence[tuple[int, bytes] | None], pool: tuple[int, int]
) -> dict[str, Any]:
    """``rows``: :meth:`~pegaflow.protocol.codec.LocatedBlocks.wire_row` per block, None: not
    found; ``pool``: the device and inode of the pool file the offsets are in."""
    return {"pin": pin, "pool": list(pool), **LocatedBlocks.wire_rows(rows)}


def locate_reply(reply: dict[str, Any], n: int) -> tuple[int, LocatedBlocks]:
    try:
        where = LocatedBlocks.from_wire(reply, n)
    except BadRequest as e:
        raise Unavailable(f"malformed locate reply: {e}") from None
    pool = reply.get("pool")
    if isinstance(pool, list) and len(pool) == 2 and all(type(x) is int for x in pool):
        where.pool = (pool[0], pool[1])
    return int(reply.get("pin", 0)), where


def encode_unpin(pin: int) -> dict[str, Any]:
    return {"op": Op.UNPIN.value, "pin": pin}


def decode_unpin(msg: dict[str, Any]) -> int:
    return req_int(msg, "pin")


# ---- stats, report -------------------------------------------------------------------


def encode_stats() -> dict[str, Any]:
    return {"op": Op.STATS.value}


def encode_report(lookups: int, asked_blocks: int, hit_blocks: int) -> dict[str, Any]:
    return {"op": Op.REPORT.value, "lookups": lookups, "asked_blocks": asked_blocks,
            "hit_blocks": hit_blocks}  # fmt: skip


def decode_report(msg: dict[str, Any]) -> tuple[int, int, int]:
    """-> (lookups, asked blocks, hit blocks)."""
    lookups = req_int(msg, "lookups", 0, MAX_REPORTED)
    asked = req_int(msg, "asked_blocks", 0, MAX_REPORTED)
    return lookups, asked, req_int(msg, "hit_blocks", 0, asked)


# ---- drop ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Dropped:
    """What a ``drop`` did: blocks dropped at once, and pinned ones dropped once their
    pins go."""

    dropped: int
    pinned: int


def encode_drop(ns: str) -> dict[str, Any]:
    return {"op": Op.DROP.value, "ns": ns}


def decode_drop(msg: dict[str, Any]) -> str:
    """-> the namespace."""
    return check_namespace(msg.get("ns"))


def encode_drop_reply(out: Dropped) -> dict[str, Any]:
    return {"dropped": out.dropped, "pinned": out.pinned}


def drop_reply(reply: dict[str, Any]) -> Dropped:
    return Dropped(int(reply.get("dropped", 0)), int(reply.get("pinned", 0)))
