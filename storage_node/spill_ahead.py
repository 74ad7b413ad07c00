"""Spill-ahead: the pool keeps some room free by writing its coldest blocks to the disk
tier in the background, so that a save into a full pool pays no eviction copy.

Without it, a put into a full pool evicts the least recently used block in
:meth:`~pegaflow.storage_node.pool.BlockPool.reserve`, and the disk tier copies that
block into a staging buffer on the data loop before its slot is reused: every save
into a full pool pays a memcpy of a block.  With it (``[node] disk_spill_ahead_bytes``,
:func:`reserve_bytes`; only with a disk tier): whenever a reservation leaves less than
the reserve free, the least recently used committed, unpinned blocks not on disk yet
are marked *spilling* (:meth:`~pegaflow.storage_node.pool.BlockPool.take_for_spill`:
never evicted, their slots never reused meanwhile) and written to the tier straight
from their pool slots on its write threads
(:meth:`~pegaflow.storage_node.disk_tier.DiskTier.spill_in_place`).  Once a block's
write is complete its slot is freed through the pool's usual eviction
(:meth:`~pegaflow.storage_node.pool.BlockPool.end_spill`): the node's ``on_spill`` finds
it on disk, publishes its disk location and copies nothing, exactly as for a block
evicted after a promotion.  So the block stays published throughout: in memory while
it is written (a get is served from there), on disk after.  Blocks on disk already
(promoted from there) are left in the LRU: their eviction costs a put nothing, and one
just promoted may not be pinned by its reader yet.

Bounds: writes in flight are at most ``max_inflight`` blocks and together with the free
room at most the reserve.  A disk slower than the puts empties the reserve, and puts
fall back to the eviction path (a copy, or a drop past the spill queue); a put never
waits for the disk.  A block read while its write ends stays in memory (its later
eviction writes nothing); a block dropped meanwhile is unpublished at once, its slot
freed and its disk copy discarded when the write ends; a failed write puts the block
back at the head of the LRU, and no write ahead starts until a spill succeeds again
(or :data:`RETRY_S` passed).  Crash safety is the tier's: a record is written only after
its payload.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, InitVar, dataclass

from pegaflow.storage_node.blocks import Entry
from pegaflow.storage_node.disk_tier import DiskTier
from pegaflow.storage_node.pool import BlockPool

log = logging.getLogger(__name__)

POOL_SHARE = 8
"""the reserve is at most 1/POOL_SHARE of the pool"""
_SCAN = 64
"""least recently used blocks looked at for one not on disk yet"""
RETRY_S = 10.0
"""after a failed write, how long spill-ahead waits (unless an eviction's spill
succeeds sooner) before it writes again"""


def reserve_bytes(configured: int, pool_bytes: int) -> int:
    """The free room kept in a pool of ``pool_bytes``: ``[node] disk_spill_ahead_bytes``,
    at most an eighth of the pool (0: spill-ahead off)."""
    return max(0, min(configured, pool_bytes // POOL_SHARE))


@dataclass(eq=False, repr=False)
class SpillAhead:
    """Keeps ``reserve`` bytes of ``pool`` free by writing its least recently used
    blocks to ``disk`` ahead of their eviction (see the module docstring).

    ``post(fn, *args)`` runs ``fn(*args)`` on the data loop (from any thread: the tier
    calls back on its write threads, the pool on the reserving thread).
    """

    pool: BlockPool
    disk: DiskTier
    reserve: int
    post: InitVar[Callable[..., None]]
    _: KW_ONLY
    max_inflight: InitVar[int] = 4

    def __post_init__(self, post: Callable[..., None], max_inflight: int) -> None:
        self._post = post
        self._max_inflight = max(1, max_inflight)
        self._writing: dict[int, Entry] = {}
        """blocks being written, by pool offset"""
        self._writing_bytes = 0
        self._queued = False
        self._closed = False
        self._failed: tuple[int, float] | None = None
        """after a failed write: the tier's spill count then, and when to retry"""
        self.pool.watch_free(self.reserve, self.kick)

    def kick(self) -> None:
        """Make room, soon, on the data loop (cheap; from any thread)."""
        if self._queued or self._closed:
            return
        self._queued = True
        self._post(self._run)

    def _run(self) -> None:
        """Start writes of the coldest blocks until free room and writes in flight make
        the reserve (on the data loop)."""
        self._queued = False
        pool, disk = self.pool, self.disk
        while (
            not self._closed
            and not self._paused()
            and len(self._writing) < self._max_inflight
            and pool.free_bytes() + self._writing_bytes < self.reserve
        ):
            e = pool.take_for_spill(self._skip, _SCAN)
            if e is None:
                return  # everything left is on disk, pinned or being written
            slot = pool.buf[e.offset : e.offset + e.stride]
            if not disk.spill_in_place(e.key, e.gen, slot, e.size, e.xxh3, self._done_cb(e)):
                pool.end_spill(e, on_disk=False)  # queued by an eviction, or closed
                return
            self._writing[e.offset] = e
            self._writing_bytes += e.stride

    def _skip(self, e: Entry) -> bool:
        """Blocks not to write ahead: on disk already (promoted from there: their
        eviction writes nothing), or too large for the tier."""
        return e.size > self.disk.block_size or self.disk.contains(e.key)

    def _paused(self) -> bool:
        """Whether a write failed lately (a full or failing disk: the puts' evictions
        take their course meanwhile), and no spill has succeeded since."""
        if self._failed is None:
            return False
        spills, retry_at = self._failed
        if self.disk.spills > spills or time.monotonic() >= retry_at:
            self._failed = None
            return False
        return True

    def _done_cb(self, e: Entry) -> Callable[[bool], None]:
        return lambda ok: self._post(self._written, e, ok)

    def _written(self, e: Entry, ok: bool) -> None:
        """The write of ``e`` ended (on the data loop): free its slot, or keep it."""
        if self._writing.pop(e.offset, None) is not None:
            self._writing_bytes -= e.stride
        if self._closed:
            return  # the pool is going: the block stays in it (and is on disk too)
        if not ok and self._failed is None:
            self._failed = (self.disk.spills, time.monotonic() + RETRY_S)
            log.warning(
                "disk tier: a write ahead of eviction failed; saves into a full pool evict "
                "as without spill-ahead until a spill succeeds again (see the disk errors)"
            )
        if not self.pool.end_spill(e, on_disk=ok) and ok:
            self.disk.discard(e.key)  # dropped while written: keep no copy
        self.kick()

    def close(self) -> None:
        """Start no more writes (before the tier closes: the writes under way finish,
        and their blocks stay in the pool)."""
        self._closed = True
