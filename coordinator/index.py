"""The in-memory block index: namespace -> block hash -> the node holding each shard.

Lookups are served from here and never touch etcd.  Memory is what limits the index, so
an entry keeps only what a lookup returns: for each shard, the id of the node holding
it.  Slot, generation, size and checksum stay with the node, which is the source of
truth and checks them on every read; etcd keeps them too (the mirror just skips them).

Layout: ``_ns[ns][hash]`` is a tuple indexed by shard (``None`` where a shard is
missing).  Tuples are interned, so the thousands of blocks whose shards all live on
the same node share one tuple; a block then costs its hash bytes plus one dict slot
(about 120 bytes at a million blocks).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from pegaflow.errors import BadRequest
from pegaflow.keys import BlockLocation, NodeRecord
from pegaflow.wire import pack

#: Highest shard number + 1 the index stores (a block's row is a tuple this long at most).
MAX_SHARDS = 4096

_MAX_INTERNED = 1 << 16

Row = tuple[str | None, ...]


class LookupResult(NamedTuple):
    """``hits`` blocks of the prefix are stored; ``blocks[i][j]`` is the node holding
    shard ``shards[j]`` of block ``i`` (rows are shared tuples: do not mutate);
    ``nodes`` is every node id in ``blocks``."""

    hits: int
    blocks: list[tuple[str, ...]]
    nodes: set[str]


_SHARD0 = (0,)


class BlockIndex:
    """Which node holds which shard of which block, plus the table of live nodes.

    Not thread-safe; meant for one event loop.  An entry whose node is not in the node
    table is kept (its record may arrive later) but never returned by :meth:`lookup`.
    """

    def __init__(self) -> None:
        self._ns: dict[str, dict[bytes, Row]] = {}
        self._nodes: dict[str, NodeRecord] = {}
        self._wire: dict[str, dict[str, Any]] = {}
        self._packed: dict[str, bytes] = {}  # node id -> msgpack of id + wire record
        self._counts: dict[str, int] = {}  # node id -> shard entries it holds
        self._unknown: set[str] = set()  # node ids with entries but no record
        self._rows: dict[Row, Row] = {}  # interned rows
        self._ones: dict[str, Row] = {}  # node id -> its interned 1-shard row
        self._blocks = 0
        self._entries = 0

    # -- nodes ------------------------------------------------------------------------

    def set_node(self, record: NodeRecord) -> None:
        """Add or refresh a node record."""
        node_id = sys.intern(record.node_id)
        self._nodes[node_id] = record
        wire = self._wire[node_id] = record.to_wire()
        self._packed[node_id] = pack(node_id) + pack(wire)
        self._unknown.discard(node_id)

    def remove_node(self, node_id: str, *, purge: bool = True) -> int:
        """Forget a node; with ``purge`` also drop every entry it holds (a scan of the
        index, about 50 ms per million blocks).  Returns the number of entries dropped."""
        self._nodes.pop(node_id, None)
        self._wire.pop(node_id, None)
        self._packed.pop(node_id, None)
        if not purge or not self._counts.get(node_id):
            if self._counts.get(node_id):
                self._unknown.add(node_id)
            return 0
        dropped = 0
        done: dict[int, tuple[Row, Row]] = {}  # id(old row) -> (old row kept alive, new row)
        for ns in list(self._ns):
            table = self._ns[ns]
            gone: list[bytes] = []
            for h, row in table.items():
                if node_id not in row:
                    continue
                pair = done.get(id(row))
                if pair is None:
                    new = tuple(None if n == node_id else n for n in row)
                    end = len(new)
                    while end and new[end - 1] is None:
                        end -= 1
                    pair = done[id(row)] = (row, self._intern(new[:end]) if end else ())
                dropped += row.count(node_id)
                if pair[1]:
                    table[h] = pair[1]  # same size: allowed while iterating
                else:
                    gone.append(h)
            for h in gone:
                del table[h]
            self._blocks -= len(gone)
            if not table:
                del self._ns[ns]
        self._rows = {r: r for r in self._rows if node_id not in r}
        self._ones.pop(node_id, None)
        self._entries -= dropped
        self._counts.pop(node_id, None)
        self._unknown.discard(node_id)
        return dropped

    def node(self, node_id: str) -> NodeRecord | None:
        """A node's record, or None."""
        return self._nodes.get(node_id)

    def node_wire(self, node_id: str) -> dict[str, Any] | None:
        """A node's record as a wire map (cached), or None."""
        return self._wire.get(node_id)

    def node_entry_packed(self, node_id: str) -> bytes:
        """msgpack of ``node_id`` followed by its wire record (a ready-made map entry)."""
        return self._packed[node_id]

    def nodes(self) -> list[NodeRecord]:
        """Every known node."""
        return list(self._nodes.values())

    # -- entries ----------------------------------------------------------------------

    def _intern(self, row: Row) -> Row:
        rows = self._rows
        if len(rows) >= _MAX_INTERNED:  # pathological shard placements: stop sharing
            rows.clear()
        return rows.setdefault(row, row)

    def _store(self, ns: str, table: dict[bytes, Row], h: bytes, row: Row) -> None:
        """Put ``row`` (not yet interned; may be all None) at ``table[h]``."""
        end = len(row)
        while end and row[end - 1] is None:
            end -= 1
        if end == 0:
            if table.pop(h, None) is not None:
                self._blocks -= 1
                if not table:
                    self._ns.pop(ns, None)
            return
        if h not in table:
            self._blocks += 1
        table[h] = self._intern(row[:end] if end != len(row) else row)

    def add(self, ns: str, block_hash: bytes, shard: int, node_id: str) -> None:
        """Record that ``node_id`` holds ``shard`` of the block (replacing any holder)."""
        if not 0 <= shard < MAX_SHARDS:
            raise BadRequest(f"shard {shard} out of range [0, {MAX_SHARDS})")
        table = self._ns.get(ns)
        if table is None:
            table = self._ns[sys.intern(ns)] = {}
        row = table.get(block_hash)
        counts = self._counts
        if row is None and shard == 0 and node_id in counts:
            # The common case (a new single-shard block of a node already counted).
            one = self._ones.get(node_id)
            if one is None:
                one = self._ones[node_id] = self._intern((sys.intern(node_id),))
            table[block_hash] = one
            counts[one[0]] += 1  # type: ignore[index]
            self._entries += 1
            self._blocks += 1
            return
        if row is None:
            row = (None,) * (shard + 1)
        elif len(row) <= shard:
            row = row + (None,) * (shard + 1 - len(row))
        old = row[shard]
        if old == node_id:
            return
        if old is None:
            self._entries += 1
        else:
            self._dec(old)
        if node_id not in counts:
            node_id = sys.intern(node_id)
            counts[node_id] = 1
            if node_id not in self._nodes:
                self._unknown.add(node_id)
        else:
            counts[node_id] += 1
        new = (*row[:shard], node_id, *row[shard + 1 :])
        if block_hash not in table:
            self._blocks += 1
        table[block_hash] = self._intern(new)

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
        row = table.get(block_hash)
        if row is None or len(row) <= shard:
            return False
        old = row[shard]
        if old is None or (node_id is not None and old != node_id):
            return False
        self._dec(old)
        self._entries -= 1
        self._store(ns, table, block_hash, (*row[:shard], None, *row[shard + 1 :]))
        return True

    def get(self, ns: str, block_hash: bytes) -> dict[int, str]:
        """``{shard: node id}`` of one block (empty when unknown)."""
        row = self._ns.get(ns, {}).get(block_hash, ())
        return {s: n for s, n in enumerate(row) if n is not None}

    def lookup(self, ns: str, hashes: Sequence[bytes], shards: Sequence[int]) -> LookupResult:
        """The longest prefix of ``hashes`` whose every shard in ``shards`` is held by a
        known node, with the holder of each shard of each block in the prefix."""
        table = self._ns.get(ns)
        if table is None or not hashes:
            return LookupResult(0, [], set())
        # The per-block work runs in C (map, index, set); Python only looks at each
        # distinct row, and rows are interned, so there are few.
        rows = list(map(table.get, hashes))
        if None in rows:
            del rows[rows.index(None) :]
            if not rows:
                return LookupResult(0, [], set())
        want = tuple(shards)
        first = rows[0]
        distinct = (first,) if rows.count(first) == len(rows) else set(rows)
        picks = {row: self._pick(row, want) for row in distinct}
        bad = [row for row, picked in picks.items() if picked is None]
        if bad:
            del rows[min(rows.index(row) for row in bad) :]
            if not rows:
                return LookupResult(0, [], set())
            picks = {row: picks[row] for row in set(rows)}
        if all(picked is row for row, picked in picks.items()):
            blocks: list[tuple[str, ...]] = rows  # type: ignore[assignment]
        else:
            blocks = list(map(picks.__getitem__, rows))  # type: ignore[arg-type]
        nodes: set[str] = set()
        for picked in picks.values():
            nodes.update(picked)  # type: ignore[arg-type]
        return LookupResult(len(blocks), blocks, nodes)

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

    def entries_of(self, node_id: str) -> int:
        """Shard entries held by one node."""
        return self._counts.get(node_id, 0)

    def node_counts(self) -> dict[str, int]:
        """Shard entries per node id (including ids without a record yet)."""
        return dict(self._counts)

    def namespaces(self) -> list[str]:
        """Namespaces with at least one block."""
        return list(self._ns)

    def clear(self) -> None:
        """Drop everything (nodes included)."""
        self.__init__()  # type: ignore[misc]

    def replace_with(self, other: BlockIndex) -> None:
        """Take over ``other``'s whole state (a resync swaps in a freshly built index
        without a moment of emptiness); ``other`` must not be used afterwards."""
        self.__dict__.update(other.__dict__)
        other.__init__()  # type: ignore[misc]

    def bulk_add(self, ns: str, entries: Iterable[tuple[bytes, int, str]]) -> None:
        """:meth:`add` for many ``(hash, shard, node id)`` of one namespace."""
        for h, shard, node in entries:
            self.add(ns, h, shard, node)


class LocalSink:
    """An :class:`~pegaflow.inventory.InventorySink` writing straight into a
    :class:`BlockIndex`: the single-host ``pegaflow-server`` runs its node with this sink
    and needs no etcd.  Every call takes effect immediately."""

    def __init__(self, index: BlockIndex) -> None:
        self.index = index
        self._node_id: str | None = None

    async def start(self, record: NodeRecord) -> None:
        """Register the node."""
        self._node_id = record.node_id
        self.index.set_node(record)

    async def update_node(self, record: NodeRecord) -> None:
        """Refresh the node record."""
        self.index.set_node(record)

    def publish(self, ns: str, block_hash: bytes, shard: int, loc: BlockLocation) -> None:
        """The block's shard is now on ``loc.node``."""
        self.index.add(ns, block_hash, shard, loc.node)

    def unpublish(self, ns: str, block_hash: bytes, shard: int, loc: BlockLocation) -> None:
        """The block's shard is gone from ``loc.node`` (no-op if another node holds it)."""
        self.index.remove(ns, block_hash, shard, loc.node)

    async def flush(self, timeout: float | None = None) -> None:
        """Nothing to wait for."""

    async def close(self) -> None:
        """Unregister the node and drop its entries."""
        if self._node_id is not None:
            self.index.remove_node(self._node_id)
            self._node_id = None
