"""The pool's slab allocator: size classes carved from slabs, and slabs moved between them.

The pool file is split into ``slab_bytes`` slabs; a slab serves one slot size (a block
size rounded up to 4 KiB), memcached-style, so blocks of different models share one
pool without fragmentation.  Slabs move between size classes
(:meth:`SlabAllocator._rebalance`): a class that runs out of slots while holding fewer
slabs than its fair share (the pool's slabs divided by the size classes written or read
in the last :attr:`SlabAllocator.rebalance_window_s`) takes a cold slab of the class
holding the most slabs over its own share (a class not used lately has none) instead of
evicting one of its own blocks; that slab's blocks are evicted the usual way (offered to
the disk tier, else reported to ``on_evict``).  Without it, a pool filled with one block
size kept a single slab for any other size for good.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from pegaflow.storage_node.blocks import BlockKey, Entry

from pegaflow.errors import NoSpace

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SizeClass:
    """The slots of one stride: its slabs, its free slots and its blocks' LRU."""

    stride: int
    free: list[int] = field(default_factory=list)
    lru: OrderedDict[BlockKey, Entry] = field(default_factory=OrderedDict)
    slabs: list[int] = field(default_factory=list)
    last_used: float = float("-inf")
    """when a slot of this class was last reserved or a block of it read
    (``time.monotonic``)"""
    rebalance_skip: int = 0
    """allocations left before this class tries to take a slab again (after a try that
    found none it could empty)"""


class SlabAllocator:
    """Slot allocation over the pool's slabs, mixed into
    :class:`~pegaflow.storage_node.pool.BlockPool`, which owns the tables named below
    and evicts a block (:meth:`_evict`) when a slot must be freed."""

    rebalance_window_s: float = 60.0
    """a size class reserved within this many seconds counts as *active* when slabs are
    shared out fairly (:meth:`_rebalance`)"""
    _REBALANCE_SCAN = 64
    """least recently used blocks of a donor class looked at for a slab to take"""
    _REBALANCE_CANDIDATES = 4
    """distinct slabs of those checked for one whose blocks can all be evicted"""

    slab_bytes: int
    capacity: int
    used_bytes: int
    _free_slabs: list[int]
    _classes: dict[int, SizeClass]
    _slab_class: dict[int, int]
    _blocks: dict[BlockKey, Entry]
    _by_offset: dict[int, Entry]

    def _evict(self, e: Entry) -> None:
        raise NotImplementedError

    def _carve(self, cls: SizeClass, slab: int, held: bool = False) -> None:
        """Give ``slab`` to ``cls``, all its slots free (``held``: but those holding a
        block already, in a slab adopted at recovery)."""
        base = slab * self.slab_bytes
        stride = cls.stride
        slots = range(base + (self.slab_bytes // stride - 1) * stride, base - 1, -stride)
        if held:
            cls.free.extend(o for o in slots if o not in self._by_offset)
        else:
            cls.free.extend(slots)
        cls.slabs.append(slab)
        self._slab_class[slab] = stride

    def _alloc(self, stride: int) -> int:
        cls = self._classes.get(stride)
        if cls is None:
            cls = self._classes[stride] = SizeClass(stride)
        cls.last_used = time.monotonic()
        if cls.free:
            return cls.free.pop()
        if self._free_slabs:
            self._carve(cls, self._free_slabs.pop())
            return cls.free.pop()
        if cls.lru:
            slab = self._rebalance(cls)
            if slab is not None:
                self._carve(cls, slab)
                return cls.free.pop()
            self._evict(next(iter(cls.lru.values())))
            return cls.free.pop()
        slab = self._steal_slab(stride)
        if slab is None:
            raise NoSpace(
                f"pool full: no free or evictable slot of {stride} bytes "
                f"({self.used_bytes}/{self.capacity} bytes used)"
            )
        self._carve(cls, slab)
        return cls.free.pop()


    def _steal_slab(self, stride: int) -> int | None:
        """Empty a slab of another size class whose blocks are all evictable."""
        for other in self._classes.values():
            if other.stride == stride:
                continue
            for slab in list(other.slabs):
                entries = self._evictable(other, slab)
                if entries is not None:
                    self._empty_slab(other, slab, entries)
                    return slab
        return None

    def _rebalance(self, needy: SizeClass) -> int | None:
        """A slab for ``needy`` (out of slots, no free slab) taken from another class,
        when ``needy`` holds fewer slabs than its fair share: the pool's slabs divided by
        the classes *active* (reserved or read within :attr:`rebalance_window_s`, ``needy``
        included).  The donor is the class holding the most slabs over its own share (an
        inactive class's share is none); its slab is the first, among those of its
        least recently used blocks, whose blocks can all be evicted (none pinned,
        reserved, quarantined or spilling).  None: ``needy`` evicts its own block.
        Cheap unless it moves a slab (once per slab of slots); a try that finds nothing
        to take is not repeated for a slab's worth of ``needy``'s allocations."""
        if needy.rebalance_skip > 0:
            needy.rebalance_skip -= 1
            return None
        now = time.monotonic()
        window = self.rebalance_window_s
        classes = self._classes.values()
        active = {c.stride for c in classes if c is needy or now - c.last_used <= window}
        fair = (self.capacity // self.slab_bytes) // len(active)
        if len(needy.slabs) >= fair:
            return None

        def excess(c: SizeClass) -> int:
            return len(c.slabs) - (fair if c.stride in active else 0)

        donors = sorted(
            (c for c in classes if c is not needy),
            key=lambda c: (excess(c), len(c.slabs)),
            reverse=True,
        )
        for donor in donors:
            if excess(donor) <= 0:
                break
            found = self._cold_slab(donor)
            if found is not None:
                slab, entries = found
                self._empty_slab(donor, slab, entries)
                log.debug(
                    "moved slab %d from %d-byte to %d-byte blocks (%d and %d slabs now)",
                    slab, donor.stride, needy.stride, len(donor.slabs), len(needy.slabs) + 1,
                )  # fmt: skip
                return slab
        needy.rebalance_skip = self.slab_bytes // needy.stride
        return None

    def _cold_slab(self, cls: SizeClass) -> tuple[int, list[Entry]] | None:
        """A slab of ``cls`` whose blocks can all be evicted, and its blocks, among the
        slabs of its least recently used blocks (coldest first), else None."""
        tried: set[int] = set()
        for n, e in enumerate(cls.lru.values()):
            if n >= self._REBALANCE_SCAN or len(tried) >= self._REBALANCE_CANDIDATES:
                break
            slab = e.offset // self.slab_bytes
            if slab in tried:
                continue
            tried.add(slab)
            entries = self._evictable(cls, slab)
            if entries is not None:
                return slab, entries
        return None

    def _evictable(self, cls: SizeClass, slab: int) -> list[Entry] | None:
        """The blocks in ``slab`` (of ``cls``), if all of them can be evicted (committed
        and in the index, not pinned, not spilling; a reserved or quarantined slot
        cannot), else None."""
        base = slab * self.slab_bytes
        entries = []
        by_offset, blocks = self._by_offset, self._blocks
        for o in range(base, base + (self.slab_bytes // cls.stride) * cls.stride, cls.stride):
            e = by_offset.get(o)
            if e is None:
                continue
            if not e.committed or e.pins or e.spilling or blocks.get(e.key) is not e:
                return None
            entries.append(e)
        return entries

    def _empty_slab(self, cls: SizeClass, slab: int, entries: list[Entry]) -> None:
        """Evict ``entries`` (every block of ``slab``, checked by :meth:`_evictable`)
        and take ``slab`` from ``cls``."""
        for e in entries:
            self._evict(e)
        base = slab * self.slab_bytes
        end = base + self.slab_bytes
        cls.free = [o for o in cls.free if not base <= o < end]
        cls.slabs.remove(slab)
        del self._slab_class[slab]

