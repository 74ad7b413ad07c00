"""The in-memory block index: namespace -> block hash -> node and generation per shard.

Lookups are served from here and never touch etcd.  Memory is what limits the index, so
an entry keeps only what a lookup returns: for each shard, the node holding it and the
generation the block had when it was published (a reader passes it back to the node,
which answers a typed miss when the slot now holds another generation).  Slot, size and
checksum stay with the node, which is the source of truth and checks them on every
read; etcd keeps them too (the mirror just skips them).

Layout: the node ids of a block's shards form a *row* (a tuple indexed by shard,
``None`` where a shard is missing).  Rows are interned and numbered, so the thousands of
blocks whose shards all live on the same nodes share one row.  ``_ns[ns][hash]`` is a
small bytes value: ``<I`` row id, then a ``<Q`` generation per shard of the row (0
where the shard is missing).  A single-shard block costs its hash bytes (80 with the
allocator's rounding), a dict slot (34-56 bytes, by how full the table is) and a
48-byte value; a coordinator grows by about 210 bytes a block at 1M (bench_index).

Lookups join the values of the asked-for hashes and unpack row ids (and generations)
with :mod:`struct` in C; Python only looks at each distinct row.

Tiers: a shard its node holds only on its disk tier (published with slot
:data:`~pegaflow.keys.DISK_SLOT`) is also in ``_disk[ns][hash]``, a bit mask of such
shards; a namespace without any has no entry, so memory-only clusters pay nothing.
:meth:`BlockIndex.on_disk` says which blocks of a hit are on disk.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Callable, Iterable, Sequence
from itertools import chain, compress
from operator import itemgetter
from typing import Any, NamedTuple

from pegaflow.errors import BadRequest
from pegaflow.keys import NodeRecord
from pegaflow.protocol.codec import GEN_MAX as MAX_GEN
from pegaflow.protocol.codec import INDEX_SHARDS as MAX_SHARDS

_MAX_ROWS = (1 << 32) - 1

Row = tuple[str | None, ...]

_U32 = struct.Struct("<I")
_ONE = struct.Struct("<IQ")  # the value of a single-shard block
_VALUES: dict[int, struct.Struct] = {}  # value length -> struct of one value
_UNPACK: dict[tuple[int, int, bool], struct.Struct] = {}  # (length, blocks, gens) -> struct
_CHUNK = 1024  # most values unpacked by one struct
_first = itemgetter(0)


def _value_struct(nbytes: int) -> struct.Struct:
    """The struct of one value of ``nbytes`` (row id + a u64 per shard)."""
    s = _VALUES.get(nbytes)
    if s is None:
        s = _VALUES[nbytes] = struct.Struct(f"<I{(nbytes - 4) // 8}Q")
    return s


def _unpack(buf: bytes, size: int, k: int, gens: bool) -> list[int]:
    """From ``k`` joined values of ``size`` bytes: their row ids, or (``gens``) all
    their generations, block-major.  Structs are cached for power-of-two counts."""
    out: list[int] = []
    off = 0
    while k:
        m = 1 << (min(k, _CHUNK).bit_length() - 1)
        st = _UNPACK.get((size, m, gens))
        if st is None:
            if len(_UNPACK) >= 512:
                _UNPACK.clear()
            pad = size - 4
            rec = f"4x{pad // 8}Q" if gens else f"I{pad}x"
            st = _UNPACK[(size, m, gens)] = struct.Struct("<" + rec * m)
        out += st.unpack_from(buf, off)
        off += size * m
        k -= m
    return out


class PrefixMatch(NamedTuple):
    """``hits`` blocks of the prefix are stored; ``blocks[i][j]`` is the node holding
    shard ``shards[j]`` of block ``i`` (rows are shared tuples: do not mutate);
    ``nodes`` is every node id in ``blocks``.  With ``gens=True``, ``gens`` holds the
    generation of each of those shards, flat and block-major:
    ``gens[i * len(shards) + j]``; otherwise None."""

    hits: int
    blocks: list[tuple[str, ...]]
    nodes: set[str]
    gens: list[int] | None = None


_SHARD0 = (0,)


class BlockIndex:
    """Which node holds which shard of which block (and its generation), plus the table
    of live nodes.

    Not thread-safe; meant for one event loop.  An entry whose node is not in the node
    table is kept (its record may arrive later) but never returned by :meth:`lookup`.
    """

    def __init__(self) -> None:
        self._ns: dict[str, dict[bytes, bytes]] = {}
        self._lens: dict[str, dict[int, int]] = {}  # ns -> {value length: blocks}
        self._nodes: dict[str, NodeRecord] = {}
        self._wire: dict[str, dict[str, Any]] = {}
        self._counts: dict[str, int] = {}  # node id -> shard entries it holds
        self._unknown: set[str] = set()  # node ids with entries but no record
        self._suspect: frozenset[str] = frozenset()  # reported unreachable: left out
        self._rows: list[Row | None] = []  # row id -> row (None: free id)
        self._rids: dict[Row, int] = {}  # row -> row id
        self._refs: list[int] = []  # row id -> blocks using it
        self._free: list[int] = []  # free row ids
        self._ones: dict[str, int] = {}  # node id -> row id of (node id,)
        self._disk: dict[str, dict[bytes, int]] = {}  # ns -> hash -> disk-only shards
        self._blocks = 0
        self._entries = 0
        self.evictions: Any = None
        """the :class:`~.evictions.EvictionLog` its feeders tell (None: not recorded)"""
        self.catch_up: Callable[[], None] | None = None
        """called before every :meth:`lookup`: applies changes queued for this index
        elsewhere (:class:`~pegaflow.coordinator.inprocess_sink.InProcessSink` with an
        ``owner``), so a lookup sees every block committed before it"""

    # -- nodes ------------------------------------------------------------------------

    def set_suspects(self, node_ids: frozenset[str]) -> None:
        """Leave the blocks of ``node_ids`` out of lookups (as if not stored) until the
        next call (:mod:`~pegaflow.coordinator.suspects`: nodes clients cannot reach)."""
        self._suspect = frozenset(node_ids)

    @property
    def suspects(self) -> frozenset[str]:
        """The nodes whose blocks lookups leave out now."""
        return self._suspect

    def set_node(self, record: NodeRecord) -> None:
        """Add or refresh a node record."""
        node_id = sys.intern(record.node_id)
        self._nodes[node_id] = record
        self._wire[node_id] = record.to_wire()
        self._unknown.discard(node_id)

    def remove_node(self, node_id: str, *, purge: bool = True) -> int:
        """Forget a node; with ``purge`` also drop every entry it holds (a scan of the
        index, about 0.1 s per million blocks).  Returns the number of entries dropped."""
        self._nodes.pop(node_id, None)
        self._wire.pop(node_id, None)
        if not purge or not self._counts.get(node_id):
            if self._counts.get(node_id):
                self._unknown.add(node_id)
            return 0
        affected = {rid for rid, row in enumerate(self._rows) if row and node_id in row}
        dropped = 0
        for ns in list(self._ns):
            table = self._ns[ns]
            keys = list(table)
            rids = self._rids_of(ns, list(table.values()))
            for h in list(compress(keys, map(affected.__contains__, rids))):
                v = table[h]
                row, gens = self._decode(v)
                dropped += row.count(node_id)
                for s, n in enumerate(row):
                    if n == node_id:
                        self._set_disk(ns, h, s, False)
                self._store(ns, table, h, v, [None if n == node_id else n for n in row], gens)
        self._entries -= dropped
        self._counts.pop(node_id, None)
        self._unknown.discard(node_id)
        return dropped

    def node(self, node_id: str) -> NodeRecord | None:
        """A node's record, or None."""
        return self._nodes.get(node_id)

    def node_wire(self, node_id: str) -> dict[str, Any] | None:
        """A node's record as a wire map (the same object until the record changes), or
        None."""
        return self._wire.get(node_id)

    def nodes(self) -> list[NodeRecord]:
        """Every known node."""
        return list(self._nodes.values())

    # -- rows and values --------------------------------------------------------------

    def _acquire(self, row: Row) -> int:
        """The id of ``row`` (interned and numbered on first use), one more reference."""
        rid = self._rids.get(row)
        if rid is None:
            row = tuple(None if n is None else sys.intern(n) for n in row)
            if self._free:
                rid = self._free.pop()
                self._rows[rid] = row
            else:
                rid = len(self._rows)
                if rid > _MAX_ROWS:
                    raise BadRequest("too many distinct shard placements in the index")
                self._rows.append(row)
                self._refs.append(0)
            self._rids[row] = rid
            if len(row) == 1:
                self._ones[row[0]] = rid  # type: ignore[index]
        self._refs[rid] += 1
        return rid

    def _release(self, rid: int) -> None:
        refs = self._refs
        refs[rid] -= 1
        if refs[rid]:
            return
        row = self._rows[rid]
        assert row is not None
        del self._rids[row]
        self._rows[rid] = None
        self._free.append(rid)
        if len(row) == 1 and self._ones.get(row[0]) == rid:  # type: ignore[arg-type]
            del self._ones[row[0]]  # type: ignore[arg-type]

    def _rids_of(self, ns: str, vals: list[bytes]) -> list[int]:
        """The row id of each of ``vals`` (values of namespace ``ns``)."""
        if not vals:
            return []
        lens = self._lens[ns]
        if len(lens) == 1:
            return _unpack(b"".join(vals), len(vals[0]), len(vals), False)
        return [_U32.unpack_from(v)[0] for v in vals]

    def _decode(self, v: bytes) -> tuple[Row, list[int]]:
        """``(row, generation per shard)`` of a stored value."""
        t = _value_struct(len(v)).unpack(v)
        return self._rows[t[0]], list(t[1:])  # type: ignore[return-value]

    def _store(
        self,
        ns: str,
        table: dict[bytes, bytes],
        h: bytes,
        old: bytes | None,
        row: Sequence[str | None],
        gens: Sequence[int],
    ) -> None:
        """Replace ``table[h]`` (``old``) by ``row``/``gens`` (may be all None: delete)."""
        end = len(row)
        while end and row[end - 1] is None:
            end -= 1
        rid = self._acquire(tuple(row[:end])) if end else -1
        lens = self._lens.get(ns)
        if lens is None:
            lens = self._lens[ns] = {}
        if old is not None:
            self._release(_U32.unpack_from(old)[0])
            n = lens[len(old)] - 1
            if n:
                lens[len(old)] = n
            else:
                del lens[len(old)]
        if end == 0:
            if old is not None:
                del table[h]
                self._blocks -= 1
                if not table:
                    self._ns.pop(ns, None)
                    self._lens.pop(ns, None)
            return
        if old is None:
            self._blocks += 1
        value = _value_struct(4 + 8 * end).pack(
            rid, *(g if n is not None else 0 for n, g in zip(row[:end], gens, strict=False))
        )
        table[h] = value
        lens[len(value)] = lens.get(len(value), 0) + 1

    # -- entries ----------------------------------------------------------------------

    def add(
        self,
        ns: str,
        block_hash: bytes,
        shard: int,
        node_id: str,
        gen: int = 0,
        disk: bool = False,
    ) -> None:
        """Record that ``node_id`` holds ``shard`` of the block with generation ``gen``
        (replacing any holder); ``disk``: only on its disk tier."""
        if not 0 <= shard < MAX_SHARDS:  # a block's row is a tuple this long at most
            raise BadRequest(f"shard {shard} out of range [0, {MAX_SHARDS})")
        if not 0 <= gen <= MAX_GEN:
            raise BadRequest(f"generation {gen} out of range")
        table = self._ns.get(ns)
        if table is None:
            ns = sys.intern(ns)
            table = self._ns[ns] = {}
            self._lens[ns] = {}
        old = table.get(block_hash)
        counts = self._counts
        if old is None and shard == 0 and node_id in counts:
            # The common case: a new single-shard block of a node already counted.
            rid = self._ones.get(node_id)
            if rid is not None:
                self._refs[rid] += 1
                table[block_hash] = _ONE.pack(rid, gen)
                lens = self._lens[ns]
                lens[12] = lens.get(12, 0) + 1
                counts[node_id] += 1
                self._entries += 1
                self._blocks += 1
                if disk:
                    self._set_disk(ns, block_hash, 0, True)
                return
        if old is None:
            row: list[str | None] = []
            gens: list[int] = []
        else:
            r, gens = self._decode(old)
            row = list(r)
        if len(row) <= shard:
            row += [None] * (shard + 1 - len(row))
            gens += [0] * (shard + 1 - len(gens))
        prev = row[shard]
        self._set_disk(ns, block_hash, shard, disk)
        if prev == node_id and gens[shard] == gen:
            return
        if prev != node_id:
            if prev is None:
                self._entries += 1
            else:
                self._dec(prev)
            if node_id not in counts:
                node_id = sys.intern(node_id)
                counts[node_id] = 1
                if node_id not in self._nodes:
                    self._unknown.add(node_id)
            else:
                counts[node_id] += 1
        row[shard] = node_id
        gens[shard] = gen
        self._store(ns, table, block_hash, old, row, gens)

    def _dec(self, node_id: str) -> None:
        c = self._counts[node_id] - 1
        if c:
            self._counts[node_id] = c
        else:
            del self._counts[node_id]
            self._unknown.discard(node_id)

    def remove(self, ns: str, block_hash: bytes, shard: int, node_id: str | None = None) -> bool:
        """Drop a shard entry; with ``node_id``, only if that node holds it.  Returns
        whether something was dropped."""
        table = self._ns.get(ns)
        if table is None:
            return False
        old = table.get(block_hash)
        if old is None:
            return False
        r, gens = self._decode(old)
        if len(r) <= shard:
            return False
        prev = r[shard]
        if prev is None or (node_id is not None and prev != node_id):
            return False
        self._dec(prev)
        self._entries -= 1
        self._set_disk(ns, block_hash, shard, False)
        row = list(r)
        row[shard] = None
        self._store(ns, table, block_hash, old, row, gens)
        return True

    def _set_disk(self, ns: str, block_hash: bytes, shard: int, disk: bool) -> None:
        """Mark ``shard`` of the block as held only on disk, or not."""
        marks = self._disk.get(ns)
        if disk:
            if marks is None:
                marks = self._disk[sys.intern(ns)] = {}
            marks[block_hash] = marks.get(block_hash, 0) | 1 << shard
            return
        if marks is None:
            return
        m = marks.get(block_hash, 0)
        if not m >> shard & 1:
            return
        m &= ~(1 << shard)
        if m:
            marks[block_hash] = m
        else:
            del marks[block_hash]
            if not marks:
                del self._disk[ns]

    def on_disk(
        self, ns: str, hashes: Sequence[bytes], shards: Sequence[int], hits: int | None = None
    ) -> list[int]:
        """Indexes into ``hashes`` (its first ``hits``, when given) of the blocks with any
        of ``shards`` held only on its node's disk tier (a lookup's hit: a disk read costs
        more than memory)."""
        marks = self._disk.get(ns)
        if not marks:
            return []
        got = list(map(marks.get, hashes if hits is None else hashes[:hits]))
        if got.count(None) == len(got):
            return []
        want = 0
        for s in shards:
            want |= 1 << s
        return [i for i, m in enumerate(got) if m and m & want]

    def disk_shards(self, ns: str, block_hash: bytes) -> set[int]:
        """Shards of one block held only on disk."""
        m = self._disk.get(ns, {}).get(block_hash, 0)
        return {s for s in range(m.bit_length()) if m >> s & 1}

    def get(self, ns: str, block_hash: bytes) -> dict[int, str]:
        """``{shard: node id}`` of one block (empty when unknown)."""
        return {s: n for s, (n, _) in self.locations(ns, block_hash).items()}

    def locations(self, ns: str, block_hash: bytes) -> dict[int, tuple[str, int]]:
        """``{shard: (node id, generation)}`` of one block (empty when unknown)."""
        v = self._ns.get(ns, {}).get(block_hash)
        if v is None:
            return {}
        row, gens = self._decode(v)
        return {s: (n, g) for s, (n, g) in enumerate(zip(row, gens, strict=False)) if n is not None}

    def hashes(self, ns: str) -> list[bytes]:
        """Every block hash of a namespace (a snapshot)."""
        return list(self._ns.get(ns, ()))

    def entries(self, ns: str, hashes: Iterable[bytes]) -> list[tuple[bytes, int, str, int]]:
        """``(hash, shard, node id, generation)`` of every shard entry of those blocks
        of ``ns`` that are still in the index."""
        table = self._ns.get(ns)
        if table is None:
            return []
        out = []
        for h in hashes:
            v = table.get(h)
            if v is None:
                continue
            row, gens = self._decode(v)
            out.extend(
                (h, s, n, g)
                for s, (n, g) in enumerate(zip(row, gens, strict=True))
                if n is not None
            )
        return out

    def lookup(
        self, ns: str, hashes: Sequence[bytes], shards: Sequence[int], gens: bool = False
    ) -> PrefixMatch:
        """The longest prefix of ``hashes`` whose every shard in ``shards`` is held by a
        known node, with the holder of each shard of each block in the prefix (and,
        with ``gens``, the generation of each)."""
        if self.catch_up is not None:
            self.catch_up()
        empty = PrefixMatch(0, [], set(), [] if gens else None)
        table = self._ns.get(ns)
        if table is None or not hashes:
            return empty
        # The per-block work runs in C (map, join, struct, count); Python only looks at
        # each distinct row, and rows are interned, so there are few.
        vals = list(map(table.get, hashes))
        try:
            joined = b"".join(vals)  # type: ignore[arg-type]
        except TypeError:  # a miss: the prefix ends there
            del vals[vals.index(None) :]
            if not vals:
                return empty
            joined = b"".join(vals)  # type: ignore[arg-type]
        k = len(vals)
        lens = self._lens[ns]
        size = len(vals[0]) if len(lens) == 1 else 0  # type: ignore[arg-type]
        each: list[tuple[int, ...]] | None = None  # per-value unpacking (mixed lengths)
        if size:
            rids = _unpack(joined, size, k, False)
        else:
            each = [_value_struct(len(v)).unpack(v) for v in vals]  # type: ignore[arg-type]
            rids = list(map(_first, each))
        want = tuple(shards)
        rows = self._rows
        first = rids[0]
        if rids.count(first) == k:  # the whole prefix on the same nodes
            picked = self._pick(rows[first], want)  # type: ignore[arg-type]
            if picked is None:
                return empty
            blocks = [picked] * k
            nodes = set(picked)
        else:
            picks = {rid: self._pick(rows[rid], want) for rid in set(rids)}  # type: ignore[arg-type]
            bad = [rid for rid, p in picks.items() if p is None]
            if bad:
                k = min(rids.index(rid) for rid in bad)
                if not k:
                    return empty
                del rids[k:]
                picks = {rid: picks[rid] for rid in set(rids)}
            blocks = list(map(picks.__getitem__, rids))  # type: ignore[arg-type]
            nodes = set()
            for p in picks.values():
                nodes.update(p)  # type: ignore[arg-type]
        if not gens:
            return PrefixMatch(k, blocks, nodes)
        if each is None:
            n = (size - 4) // 8
            allg = _unpack(joined, size, k, True)
            if want == tuple(range(n)):
                out = allg
            elif len(want) == 1:
                out = allg[want[0] :: n]
            else:
                out = list(chain.from_iterable(zip(*(allg[s::n] for s in want), strict=True)))
        else:
            got = map(itemgetter(*(s + 1 for s in want)), each[:k])
            out = list(got) if len(want) == 1 else list(chain.from_iterable(got))
        return PrefixMatch(k, blocks, nodes, out)

    def _pick(self, row: Row, shards: tuple[int, ...]) -> tuple[str, ...] | None:
        """``row`` restricted to ``shards`` (``row`` itself when equal), or None when a
        shard is missing or held by an unknown node."""
        if shards == _SHARD0 and len(row) == 1:
            picked = row
        else:
            try:
                picked = tuple(row[s] for s in shards)
            except IndexError:
                return None
            if picked == row:
                picked = row
        if None in picked:
            return None
        if self._unknown and any(n not in self._nodes for n in picked):
            return None
        if self._suspect and not self._suspect.isdisjoint(picked):
            return None
        return picked  # type: ignore[return-value]

    # -- whole index ------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Distinct ``(namespace, hash)`` with at least one shard."""
        return self._blocks

    @property
    def num_entries(self) -> int:
        """Shard entries (a block of 8 shards counts 8)."""
        return self._entries

    @property
    def num_namespaces(self) -> int:
        """Namespaces with at least one block."""
        return len(self._ns)

    @property
    def num_nodes(self) -> int:
        """Known nodes."""
        return len(self._nodes)

    @property
    def num_rows(self) -> int:
        """Distinct shard placements (interned rows) in use."""
        return len(self._rids)

    def entries_of(self, node_id: str) -> int:
        """Shard entries held by one node."""
        return self._counts.get(node_id, 0)

    def node_counts(self) -> dict[str, int]:
        """Shard entries per node id (including ids without a record yet)."""
        return dict(self._counts)

    def namespaces(self) -> list[str]:
        """Namespaces with at least one block."""
        return list(self._ns)

    def blocks_in(self, ns: str) -> int:
        """Blocks (with any shard) of namespace ``ns``."""
        return len(self._ns.get(ns, ()))

    def clear(self) -> None:
        """Drop everything (nodes included; not the eviction record)."""
        evictions = self.evictions
        self.__init__()  # type: ignore[misc]
        self.evictions = evictions

    def replace_with(self, other: BlockIndex) -> None:
        """Take over ``other``'s whole state (a resync swaps in a freshly built index
        without a moment of emptiness); ``other`` must not be used afterwards."""
        # who cannot be reached, and what was removed, are not the index's content
        suspect, evictions = self._suspect, self.evictions
        self.__dict__.update(other.__dict__)
        self._suspect, self.evictions = suspect, evictions
        other.__init__()  # type: ignore[misc]
