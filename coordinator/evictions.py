"""Why a lookup missed, as the coordinator's index can tell: a bounded record of removals.

The index forgets a block when its node removes it, so without a record a block
evicted a minute ago looks like one never stored.  :class:`EvictionLog` keeps, per
coordinator and in memory only (each coordinator mirrors every removal from etcd, so
each keeps the same record; nothing is shared), the last :data:`MAX_RECORDS` removals
(hash -> namespace, tier, node, when saved, when removed) and the save times of the
last :data:`MAX_RECORDS` blocks added, both least-recent first out: about 100 bytes a
save and 250 a removal (its hash included; measured with tracemalloc), some 35 MB at
the bound.  A block saved before the last :data:`MAX_RECORDS` saves, or read by a full
load of the index (a coordinator's start, a resync), has no save time (its eviction
says so); a restarted coordinator starts with an empty record.

:meth:`EvictionLog.cause` answers the first missing hash of a lookup (never more than
one per lookup, and only for a lookup that missed): stored but its node is unknown or
suspected (``node_unreachable``), removed by a node that has since left
(``node_unreachable``), evicted (``evicted``, tier and seconds after its save), stored
under another namespace of the same model (``namespace_mismatch``, with the factors
that differ when both namespaces' engines sent theirs), else ``never_stored``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pegaflow.protocol.misses import NEVER_STORED, MissCause, MissInfo

from .index import BlockIndex
from .namespaces import NamespacePeers, label_of

MAX_RECORDS = 100_000
"""removals kept, and save times kept (least recent dropped first)"""

COORDINATOR_CAUSES = tuple(
    c.value
    for c in (
        MissCause.NEVER_STORED,
        MissCause.EVICTED,
        MissCause.NAMESPACE_MISMATCH,
        MissCause.NODE_UNREACHABLE,
    )
)
"""the causes a coordinator tells"""


@dataclass(slots=True)
class Removal:
    """One block shard's removal from the index."""

    ns: str
    tier: str
    node: str
    saved_at: float | None
    removed_at: float


class EvictionLog:
    """The record of recent saves and removals of one index (see the module docstring).

    Args:
        index: the index whose removals are recorded (its owner calls :meth:`saved`
            and :meth:`removing`).
        peers: the namespaces' factors (to name what differs in a mismatch).
        bound: entries kept of each kind.
        clock: monotonic clock.
    """

    def __init__(
        self,
        index: BlockIndex,
        peers: NamespacePeers | None = None,
        bound: int = MAX_RECORDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index = index
        self.peers = peers
        self.bound = bound
        self.clock = clock
        self._saved: OrderedDict[bytes, float] = OrderedDict()
        self._removed: OrderedDict[bytes, Removal] = OrderedDict()
        self.removals: dict[str, int] = {"memory": 0, "disk": 0}
        """removals since start, by the tier they left"""
        self.causes: dict[str, int] = dict.fromkeys(COORDINATOR_CAUSES, 0)
        """blocks missed by lookups since start, by the cause of their first miss"""

    def saved(self, block_hash: bytes, now: float) -> None:
        """A block was published at ``now`` (``clock()``; one per batch of changes)."""
        saved = self._saved
        if block_hash in saved:  # moved to another tier, or another shard: saved before
            return
        saved[block_hash] = now
        if len(saved) > self.bound:
            saved.popitem(last=False)

    def removing(
        self, ns: str, block_hash: bytes, shard: int, now: float, node: str | None = None
    ) -> None:
        """A block shard is about to leave the index (call before removing it; with
        ``node``, only if that node holds it)."""
        where = self.index.locations(ns, block_hash).get(shard)
        if where is None or (node is not None and where[0] != node):
            return
        tier = "disk" if shard in self.index.disk_shards(ns, block_hash) else "memory"
        self.removals[tier] += 1
        removed = self._removed
        saved_at = self._saved.pop(block_hash, None)
        if saved_at is None:  # another shard of the block went first
            prev = removed.get(block_hash)
            saved_at = prev.saved_at if prev is not None and prev.ns == ns else None
        rec = Removal(ns, tier, where[0], saved_at, now)
        removed[block_hash] = rec
        removed.move_to_end(block_hash)
        if len(removed) > self.bound:
            removed.popitem(last=False)

    def cause(self, ns: str, block_hash: bytes, shards: Sequence[int], missed: int) -> MissInfo:
        """The cause of a lookup's first miss (``missed``: blocks it missed, counted)."""
        info = self._cause(ns, block_hash, shards)
        self.causes[info.cause.value] += missed
        return info

    def _cause(self, ns: str, block_hash: bytes, shards: Sequence[int]) -> MissInfo:
        index = self.index
        held = index.locations(ns, block_hash)
        for s in shards if held else ():
            where = held.get(s)
            if where is not None and (index.node(where[0]) is None or where[0] in index.suspects):
                return MissInfo(MissCause.NODE_UNREACHABLE, node=where[0])
        rec = self._removed.get(block_hash)
        if rec is not None and rec.ns == ns:
            if index.node(rec.node) is None:
                return MissInfo(MissCause.NODE_UNREACHABLE, node=rec.node)
            saved_s = rec.removed_at - rec.saved_at if rec.saved_at is not None else None
            return MissInfo(MissCause.EVICTED, tier=rec.tier, saved_s=saved_s)
        if index.num_namespaces > (1 if index.blocks_in(ns) else 0):  # others to look in
            label = label_of(ns)
            for other in index.namespaces():
                if other != ns and label_of(other) == label and index.locations(other, block_hash):
                    factors = self.peers.differing(ns, other) if self.peers is not None else []
                    return MissInfo(MissCause.NAMESPACE_MISMATCH, ns=other, factors=factors)
        return NEVER_STORED

    def status(self) -> dict[str, Any]:
        """``pegaflow status``'s view: removals by tier, misses by cause, what is kept."""
        return {
            "removals": dict(self.removals),
            "miss_blocks_by_cause": dict(sorted(self.causes.items())),
            "kept": {"removals": len(self._removed), "saves": len(self._saved)},
        }
