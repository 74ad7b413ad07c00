"""msgpack encoding with limits, and field validation for incoming requests.

Network data is only ever decoded by :func:`unpack` (msgpack, no extension types, no
pickle) and then checked field by field with the ``req_*`` helpers, which raise
:class:`~pegaflow.errors.BadRequest` or :class:`~pegaflow.errors.TooLarge`.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, overload

import msgpack
import numpy as np

from pegaflow.errors import BadRequest, TooLarge

PROTOCOL_VERSION = 1

#: Longest list accepted in any request field (hashes of a lookup, blocks of a batch).
MAX_LIST = 65536
#: Longest block hash accepted (vLLM uses 32-byte sha256 digests).
MAX_HASH_BYTES = 64
#: Shard numbers on the wire are in ``[0, SHARD_LIMIT)`` (the node stores any of them).
SHARD_LIMIT = 1 << 16
#: The coordinators index shards ``[0, INDEX_SHARDS)``; a lookup names at most this many.
INDEX_SHARDS = 4096
#: Generations are unsigned 64-bit integers: ``[0, GEN_MAX]``.
GEN_MAX = (1 << 64) - 1
NO_SLOT = (1 << 64) - 1
"""a packed local ``reserve`` reply's offset for a block that is stored already"""
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9._:=+,@-]{1,256}$")


def pack(obj: Any) -> bytes:
    """Encode ``obj`` as msgpack (bytes stay bytes, str stays str)."""
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes | bytearray | memoryview, max_bytes: int) -> Any:
    """Decode one msgpack object, refusing anything larger than ``max_bytes``."""
    if len(data) > max_bytes:
        raise TooLarge(f"message of {len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_array_len=MAX_LIST,
            max_map_len=MAX_LIST,
            max_str_len=max_bytes,
            max_bin_len=max_bytes,
            max_ext_len=0,
        )
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise BadRequest(f"undecodable msgpack: {e}") from None


def req_map(msg: Any) -> dict[str, Any]:
    """The message itself, which must be a map."""
    if not isinstance(msg, dict):
        raise BadRequest(f"expected a map, got {type(msg).__name__}")
    return msg


def req_int(msg: dict[str, Any], key: str, lo: int = 0, hi: int = 2**63 - 1) -> int:
    """An integer field within ``[lo, hi]``."""
    v = msg.get(key)
    if not isinstance(v, int) or isinstance(v, bool):
        raise BadRequest(f"field {key!r} must be an integer")
    if not lo <= v <= hi:
        raise BadRequest(f"field {key!r}={v} out of range [{lo}, {hi}]")
    return v


def req_typed(msg: dict[str, Any], key: str, kind: type, what: str) -> Any:
    """Field ``key``, which must be of type ``kind`` (``what`` names it in the error)."""
    v = msg.get(key)
    if not isinstance(v, kind):
        raise BadRequest(f"field {key!r} must be {what}")
    return v


def req_str(msg: dict[str, Any], key: str, max_len: int = 256) -> str:
    """A string field of at most ``max_len`` characters."""
    v = req_typed(msg, key, str, "a string")
    if len(v) > max_len:
        raise TooLarge(f"field {key!r} longer than {max_len}")
    return v


def req_list(msg: dict[str, Any], key: str, max_len: int = MAX_LIST) -> list[Any]:
    """A list field of at most ``max_len`` items."""
    v = req_typed(msg, key, list, "a list")
    if len(v) > max_len:
        raise TooLarge(f"field {key!r} has {len(v)} items, limit {max_len}")
    return v


def check_namespace(ns: Any) -> str:
    """A namespace: 1-256 characters of ``[A-Za-z0-9._:=+,@-]``."""
    if not isinstance(ns, str) or not _NAMESPACE_RE.match(ns):
        raise BadRequest("namespace must be 1-256 characters of [A-Za-z0-9._:=+,@-]")
    return ns


def check_hash(h: Any) -> bytes:
    """A block hash: 1-64 bytes."""
    if not isinstance(h, bytes) or not 0 < len(h) <= MAX_HASH_BYTES:
        raise BadRequest(f"block hash must be 1-{MAX_HASH_BYTES} bytes")
    return h


def check_hashes(msg: dict[str, Any], key: str, max_len: int = MAX_LIST) -> list[bytes]:
    """A list field of block hashes, of a message decoded by :func:`unpack`."""
    v = req_list(msg, key, max_len)
    # The common, valid case is checked in C; the per-item loop only names the culprit.
    # Of what unpack() produces only bytes (a msgpack binary) can be joined, so the join
    # is the type check, at a third of the cost of collecting the items' types.
    if v:
        try:
            b"".join(v)
        except TypeError:
            pass
        else:
            lengths = set(map(len, v))
            if min(lengths) > 0 and max(lengths) <= MAX_HASH_BYTES:
                return v
    return [check_hash(h) for h in v]


def check_shards(msg: dict[str, Any], key: str = "shards") -> list[int]:
    """A non-empty list of distinct shard numbers (rank of the worker that owns them)."""
    shards = req_list(msg, key, INDEX_SHARDS)
    if not shards:
        raise BadRequest(f"field {key!r} must not be empty")
    for s in shards:
        if not isinstance(s, int) or isinstance(s, bool) or not 0 <= s < SHARD_LIMIT:
            raise BadRequest(f"shard {s!r} must be an integer in [0, {SHARD_LIMIT})")
    if len(set(shards)) != len(shards):
        raise BadRequest("shards must be distinct")
    return shards


# ---- bit columns (a lookup reply's ``disk`` field) ---------------------------------------


def pack_bits(indexes: Sequence[int], n: int) -> bytes:
    """A column of ``n`` bits, those at ``indexes`` set: bit ``i`` is bit ``i % 8`` of
    byte ``i // 8`` (``(n + 7) // 8`` bytes)."""
    bits = 0
    for i in indexes:
        bits |= 1 << i
    return bits.to_bytes((n + 7) // 8, "little")


def unpack_bits(data: Any, n: int, what: str) -> list[bool]:
    """The ``n`` bits of a :func:`pack_bits` column from the network (``what`` names
    the field in the error)."""
    if not isinstance(data, bytes) or len(data) != (n + 7) // 8:
        raise BadRequest(f"{what} must be {(n + 7) // 8} bytes, a bit per block")
    bits = int.from_bytes(data, "little")
    if bits >> n:
        raise BadRequest(f"{what} has bits set past its {n} blocks")
    return [bool(bits >> i & 1) for i in range(n)]


# ---- block locations (the node's ``locate`` reply) --------------------------------------

_FOUND, _HAS_DIGEST = 1, 2
_U64 = (1 << 64) - 1


@dataclass
class LocatedBlock:
    """A pinned block of a node's pool file: where it is and what it must hash to."""

    offset: int
    size: int
    gen: int
    xxh3: int
    digest: int | None = None
    """the writer's device digest, when it gave one (see ``KVBlockIO.digest``)"""


class LocatedBlocks(Sequence["LocatedBlock | None"]):
    """Where a ``locate`` found each asked block, as columns (one row per block).

    On the wire: ``flags``, one byte per block (1: found, 2: has a device digest), and
    ``cols``, five little-endian uint64 per block (offset, size, generation, xxh3,
    digest as two's complement), so thousands of locations cost two buffers, not
    thousands of msgpack lists.  Indexing gives a :class:`LocatedBlock` or None.
    ``pool``: the (device, inode) of the pool file the offsets are in, when the node
    said (a reader checks that it maps that file).
    """

    __slots__ = ("cols", "flags", "pool")

    def __init__(
        self, flags: np.ndarray, cols: np.ndarray, pool: tuple[int, int] | None = None
    ) -> None:
        if flags.ndim != 1 or cols.shape != (len(flags), 5):
            raise BadRequest("malformed block locations")
        self.flags = flags
        self.cols = cols
        self.pool = pool

    ROW = struct.Struct("<5Q")
    """one block of ``cols`` on the wire"""
    _MISS = (0, bytes(ROW.size))

    @classmethod
    def wire_row(
        cls, offset: int, size: int, gen: int, xxh3: int, digest: int | None
    ) -> tuple[int, bytes]:
        """One found block as it goes on the wire: its flag and its packed row (a node
        computes this once per committed block, see :meth:`wire_rows`)."""
        flag = _FOUND | (_HAS_DIGEST if digest is not None else 0)
        return flag, cls.ROW.pack(offset, size, gen, xxh3, (digest or 0) & _U64)

    @classmethod
    def wire_rows(cls, rows: Sequence[tuple[int, bytes] | None]) -> dict[str, bytes]:
        """The ``flags`` and ``cols`` fields of a locate reply from :meth:`wire_row`
        results (None: not found), without building the columns."""
        full = [cls._MISS if r is None else r for r in rows]
        return {"flags": bytes([f for f, _ in full]), "cols": b"".join([c for _, c in full])}

    @classmethod
    def build(cls, rows: Sequence[tuple[int, int, int, int, int | None] | None]) -> LocatedBlocks:
        """From ``(offset, size, gen, xxh3, digest)`` per block (None: not found)."""
        n = len(rows)
        flags = np.fromiter(
            (0 if r is None else _FOUND | (_HAS_DIGEST if r[4] is not None else 0) for r in rows),
            np.uint8,
            n,
        )
        cols = np.array(
            [(0,) * 5 if r is None else (r[0], r[1], r[2], r[3], (r[4] or 0) & _U64) for r in rows],
            dtype=np.uint64,
        ).reshape(n, 5)
        return cls(flags, cols)

    def to_wire(self) -> dict[str, bytes]:
        """The ``flags`` and ``cols`` fields of a locate reply."""
        return {"flags": self.flags.tobytes(), "cols": self.cols.astype("<u8").tobytes()}

    @classmethod
    def from_wire(cls, msg: dict[str, Any], n: int) -> LocatedBlocks:
        """Decode and check the locations of ``n`` blocks from a locate reply."""
        flags, cols = msg.get("flags"), msg.get("cols")
        if not isinstance(flags, bytes) or not isinstance(cols, bytes):
            raise BadRequest("locate reply without flags and cols")
        if len(flags) != n or len(cols) != 40 * n:
            raise BadRequest("locate reply of the wrong length")
        f = np.frombuffer(flags, dtype=np.uint8).copy()
        c = np.frombuffer(cols, dtype="<u8").astype(np.uint64).reshape(n, 5)
        return cls(f, c)

    @property
    def found(self) -> np.ndarray:
        """Bool per block: whether the node has it (and pinned it)."""
        return (self.flags & _FOUND) != 0

    @property
    def has_digest(self) -> np.ndarray:
        """Bool per block: whether its writer gave a device digest."""
        return (self.flags & _HAS_DIGEST) != 0

    def column(self, name: str) -> np.ndarray:
        """``offset``, ``size``, ``gen``, ``xxh3`` (uint64) or ``digest`` (int64)."""
        i = ("offset", "size", "gen", "xxh3", "digest").index(name)
        col = self.cols[:, i]
        return col.view(np.int64) if name == "digest" else col

    def __len__(self) -> int:
        return len(self.flags)

    @overload
    def __getitem__(self, i: int) -> LocatedBlock | None: ...
    @overload
    def __getitem__(self, i: slice) -> LocatedBlocks: ...
    def __getitem__(self, i: int | slice) -> LocatedBlock | LocatedBlocks | None:
        if isinstance(i, slice):
            return LocatedBlocks(self.flags[i], self.cols[i], self.pool)
        f = int(self.flags[i])
        if not f & _FOUND:
            return None
        o, s, g, x, d = (int(v) for v in self.cols[i])
        digest = (d - (1 << 64) if d >= 1 << 63 else d) if f & _HAS_DIGEST else None
        return LocatedBlock(o, s, g, x, digest)

    @staticmethod
    def concat(parts: Sequence[LocatedBlocks]) -> LocatedBlocks:
        """One table of several locates' answers, in order (of one pool file: parts
        from different files have none, which no reader accepts)."""
        if not parts:
            return LocatedBlocks(np.zeros(0, np.uint8), np.zeros((0, 5), np.uint64))
        pools = {p.pool for p in parts}
        return LocatedBlocks(
            np.concatenate([p.flags for p in parts]),
            np.concatenate([p.cols for p in parts]),
            pools.pop() if len(pools) == 1 else None,
        )
