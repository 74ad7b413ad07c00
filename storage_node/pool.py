"""The node's block pool: a shared-memory file carved into slabs of fixed-size slots.

Memory layout: the pool file (``<shm_dir>/pegaflow-<node_id>.pool``, made, checked and
prepared by :mod:`~pegaflow.storage_node.shm_file`) is split into ``slab_bytes`` slabs,
each serving one slot size (:mod:`~pegaflow.storage_node.slabs`, which also moves slabs
between sizes).  A slot is named by its byte offset in the pool.  A pool that fails to
open removes the files it created (pool file, journal), never a pool file it found and
was going to re-attach.

Block states: *reserved* (a put is writing it; invisible, never evicted; reclaimed when
its reservation expires) and *committed* (immutable, has a generation and an xxh3
checksum, visible in the index).  Committed blocks sit in an LRU; eviction takes the
least recently used block of the size class that is not pinned by an in-flight read.
A block being written to the disk tier ahead of its eviction
(:mod:`~pegaflow.storage_node.spill_ahead`) is *spilling*: served as any committed
block, but never evicted and its slot never reused until that write ends; a drop
meanwhile takes it out of the index at once and frees its slot at the end of the write.

Restarts: commits and drops are journaled (:mod:`~pegaflow.storage_node.journal`); a
pool file left by an earlier process is re-attached, keeping each journaled block only
if its bytes match its xxh3 (and its slot fits the slabs of the blocks kept before it).
A journal that cannot be written (no space) is *degraded*: the pool keeps serving and
committing, and :meth:`BlockPool.maintain_journal` rewrites it once there is room.

A pool file truncated under the node (by anyone who may write ``/dev/shm``) would kill
it with SIGBUS at its next touch of a slot past the new end.  :meth:`BlockPool.check_file`
compares the file's size with the pool's (one ``fstat``) before every batch that
touches slots (each find of blocks to serve, each reservation and commit, each spill to
the disk tier) and from the node's watchdog every second: a short file marks the pool
*failed* for good (the reason in :attr:`BlockPool.failed`): nothing is found (reads are
misses), reserved, committed (published) or spilled any more, and the node's
``/health`` answers 503 with the reason.  A truncation between the check and a transfer
already under way can still hit that transfer.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from pegaflow.storage_node.blocks import ALIGN, BlockKey, Entry, align_up
from pegaflow.storage_node.journal import Journal, SlotRecord
from pegaflow.storage_node.shm_file import (
    PreparationStopped,
    open_pool,
    remove_unused,
    replaced,
)
from pegaflow.storage_node.slabs import SizeClass, SlabAllocator

from pegaflow.checksum import checksum
from pegaflow.errors import TooLarge, Unavailable
from pegaflow.keys import BlockLocation

log = logging.getLogger(__name__)


@dataclass
class PoolStats:
    """Usage figures of the pool."""

    capacity_bytes: int
    used_bytes: int
    blocks: int
    reserved: int
    pinned: int
    evictions: int
    free_slabs: int
    quarantined_bytes: int = 0
    """slots held out of use because a failed put's receives may still write them"""
    spilling: int = 0
    """blocks being written to the disk tier ahead of eviction"""


_T = TypeVar("_T")


def _locked(method: Callable[..., _T]) -> Callable[..., _T]:
    """Run a :class:`BlockPool` method under the pool's lock."""

    @functools.wraps(method)
    def run(self: BlockPool, *args: Any, **kwargs: Any) -> _T:
        with self._lock:
            return method(self, *args, **kwargs)

    return run


class BlockPool(SlabAllocator):
    """Slot allocator, LRU and block table over a shared-memory pool file.

    Thread-safe: the node serves its same-host control socket (locates, pins) on a
    thread of its own while its data loop moves bulk data, and both use the pool; every
    method that reads or changes the tables holds the pool's lock.

    With ``persist=True`` (the default) every commit and drop is journaled next to the
    pool file, and a pool file left by an earlier process of the same node is
    re-attached: each journaled block is checked against its xxh3 and kept only if it
    matches (``recovered`` lists them, oldest first); ``fresh=True`` removes such a file
    and its journal first (never one another live process holds) and starts empty.
    ``created`` says whether this pool made its file (so a failed start knows what to
    remove).  ``access_gid``: the group given read/write access (see
    :mod:`~pegaflow.storage_node.shm_file`); ``size_flag``: the option named when the
    pool does not fit; ``stop``: set, it ends the file's preparation (:meth:`opened`).
    ``on_spill``: offered each block evicted, before its slot is reused (the disk tier
    copies it at once); when it returns True the block is kept there and not reported
    to ``on_evict``.  :meth:`watch_free`, :meth:`take_for_spill` and :meth:`end_spill`
    serve the spill-ahead (:mod:`~pegaflow.storage_node.spill_ahead`).
    """

    def __init__(
        self,
        path: str | Path,
        pool_bytes: int,
        slab_bytes: int,
        *,
        node_id: str,
        on_evict: Callable[[Entry], None] | None = None,
        on_spill: Callable[[Entry], bool] | None = None,
        persist: bool = True,
        fresh: bool = False,
        access_gid: int | None = None,
        size_flag: str = "--node-pool-bytes",
        stop: threading.Event | None = None,
    ) -> None:
        if slab_bytes % ALIGN or slab_bytes <= 0:
            raise ValueError(f"slab_bytes must be a positive multiple of {ALIGN}")
        n_slabs = pool_bytes // slab_bytes
        if n_slabs < 1:
            raise ValueError(f"pool_bytes ({pool_bytes}) is smaller than one slab ({slab_bytes})")
        self.path = Path(path)
        self.node_id = node_id
        self.slab_bytes = slab_bytes
        self.capacity = n_slabs * slab_bytes
        self._on_evict = on_evict
        self._on_spill = on_spill
        self._lock = threading.RLock()
        self.journal: Journal | None = None
        journal_path = self.path.with_suffix(".journal")
        if fresh and remove_unused(self.path):
            for old in (journal_path, journal_path.with_suffix(".journal.tmp")):
                old.unlink(missing_ok=True)
            log.info("removed the pool file %s and its journal: starting empty", self.path)
        self._fd, self._mmap, self.created = open_pool(
            self.path, self.capacity, access_gid, size_flag, stop
        )
        st = os.fstat(self._fd)
        self.file_id = (st.st_dev, st.st_ino)
        """the (device, inode) of the file this pool maps: a same-host writer names the
        file it maps in each reservation, and another file's writes are refused"""
        if persist:
            self.journal = Journal(journal_path, self.capacity, slab_bytes)
        self.buf = np.frombuffer(self._mmap, dtype=np.uint8)
        self._free_slabs = list(range(n_slabs - 1, -1, -1))
        self._classes: dict[int, SizeClass] = {}
        self._slab_class: dict[int, int] = {}
        self._blocks: dict[BlockKey, Entry] = {}
        self._by_offset: dict[int, Entry] = {}
        self._gen = int(time.time() * 1000) << 16
        self.used_bytes = 0
        self.quarantined_bytes = 0
        self.evictions = 0
        self._low_bytes = 0
        self._on_low: Callable[[], None] | None = None
        self._last_stride = 0
        self.spilling = 0
        """blocks being written ahead (:meth:`take_for_spill`), dropped ones included"""
        self.failed: str | None = None
        """why the pool may no longer be touched (its file was truncated), else None"""
        self.recovered: list[Entry] = []
        #: This pool file's id, kept across re-attaches (in the journal's header).
        self.pool_id = uuid.uuid4().hex
        if self.journal is not None:
            self.recovered = self._recover(self.journal.replay())
            self.pool_id = self.journal.pool_id
            self.journal.rewrite(self._record(e) for e in self.recovered)

    @classmethod
    async def opened(cls, *args: Any, **kwargs: Any) -> BlockPool:
        """A pool made (``BlockPool(*args, **kwargs)``) on a thread, so that the event
        loop, and its stop signals, run while a large pool file is prepared (minutes for
        tens of GiB).  Cancelled, it stops the preparation at its next chunk, removes a
        file it created, and raises ``CancelledError``."""
        stop = threading.Event()
        made = asyncio.get_running_loop().run_in_executor(
            None, functools.partial(cls, *args, stop=stop, **kwargs)
        )
        try:
            return await asyncio.shield(made)
        except asyncio.CancelledError:
            stop.set()
            try:
                pool = await made
            except PreparationStopped as e:
                log.info("%s", e)
            else:  # done before it saw the stop
                pool.close(unlink=pool.created)
            raise

    def _recover(self, records: list[SlotRecord]) -> list[Entry]:
        """Adopt the journaled blocks whose bytes still match their checksum (the
        journal validated each record's slot against the pool's geometry)."""
        slab_stride: dict[int, int] = {}
        kept: list[Entry] = []
        for r in sorted(records, key=lambda r: r.gen):
            slab = r.offset // self.slab_bytes
            key = (r.ns, r.block_hash, r.shard)
            if (
                slab_stride.get(slab, r.stride) != r.stride
                or key in self._blocks
                or r.offset in self._by_offset
                or checksum(self.buf[r.offset : r.offset + r.size]) != r.xxh3
            ):
                continue
            slab_stride[slab] = r.stride
            e = Entry(key, r.offset, r.size, r.stride, gen=r.gen, xxh3=r.xxh3, committed=True)
            self._blocks[key] = e
            self._by_offset[e.offset] = e
            self.used_bytes += e.stride
            self._gen = max(self._gen, e.gen)
            kept.append(e)
        for slab, stride in slab_stride.items():
            self._carve(self._classes.setdefault(stride, SizeClass(stride)), slab, held=True)
        for e in kept:
            self._classes[e.stride].lru[e.key] = e
        self._free_slabs = [s for s in self._free_slabs if s not in slab_stride]
        return kept

    @staticmethod
    def _record(e: Entry) -> SlotRecord:
        return SlotRecord(e.offset, e.stride, e.size, e.gen, e.xxh3, e.key[0], e.key[1], e.key[2])

    # ---- queries -------------------------------------------------------------------

    def check_file(self) -> str | None:
        """Why the pool's slots may not be touched (its file is shorter than the pool:
        a read or write past its end would raise SIGBUS), else None; a short file marks
        the pool failed for good (see the module docstring).  One ``fstat``."""
        if self.failed is None and self.buf.size:
            try:
                size = os.fstat(self._fd).st_size
            except OSError as e:
                size, why = -1, f"cannot be checked ({e.strerror})"
            else:
                why = f"was truncated to {size} of {self.capacity} bytes"
            if size < self.capacity:
                self.failed = (
                    f"pool file {self.path} {why}: its blocks are no longer served or "
                    "stored; restart the node (the blocks in the pool are lost)"
                )
                log.error("%s", self.failed)
        return self.failed

    def _check_usable(self) -> None:
        if self.check_file() is not None:
            raise Unavailable(str(self.failed))

    @_locked
    def get(self, key: BlockKey) -> Entry | None:
        """The committed entry of ``key``, or None (None for every key once the pool
        failed)."""
        e = self._blocks.get(key)
        return e if e is not None and e.committed and self.failed is None else None

    @_locked
    def get_many(self, ns: str, hashes: Sequence[bytes], shard: int) -> list[Entry | None]:
        """:meth:`get` of ``(ns, h, shard)`` for each hash."""
        if self.failed is not None:
            return [None] * len(hashes)
        blocks = self._blocks
        return [
            e if (e := blocks.get((ns, h, shard))) is not None and e.committed else None
            for h in hashes
        ]

    def contains(self, key: BlockKey) -> bool:
        """Whether ``key`` is committed or being written."""
        return key in self._blocks

    def view(self, e: Entry) -> np.ndarray:
        """The bytes of a block (a view into the pool, no copy)."""
        return self.buf[e.offset : e.offset + e.size]

    def committed(self) -> Iterator[Entry]:
        """Every committed entry."""
        return (e for e in self._blocks.values() if e.committed)

    @_locked
    def stats(self) -> PoolStats:
        reserved = sum(1 for e in self._blocks.values() if not e.committed)
        pinned = sum(1 for e in self._blocks.values() if e.pins)
        return PoolStats(
            capacity_bytes=self.capacity,
            used_bytes=self.used_bytes,
            blocks=len(self._blocks) - reserved,
            reserved=reserved,
            pinned=pinned,
            evictions=self.evictions,
            free_slabs=len(self._free_slabs),
            quarantined_bytes=self.quarantined_bytes,
            spilling=self.spilling,
        )

    # ---- reads ---------------------------------------------------------------------

    @_locked
    def pin(self, e: Entry) -> None:
        """Keep ``e`` from eviction while it is being read; marks it recently used."""
        self.pin_many((e,))

    @_locked
    def unpin(self, e: Entry) -> None:
        self.unpin_many((e,))

    @_locked
    def pin_many(self, entries: Sequence[Entry]) -> None:
        """:meth:`pin` each entry (a locate of a long prefix pins hundreds); a read
        counts as use of its size class (:meth:`_rebalance` keeps its fair share)."""
        classes = self._classes
        now = time.monotonic()
        for e in entries:
            e.pins += 1
            cls = classes[e.stride]
            cls.lru.pop(e.key, None)
            cls.last_used = now

    @_locked
    def unpin_many(self, entries: Sequence[Entry]) -> None:
        """:meth:`unpin` each entry."""
        blocks, classes = self._blocks, self._classes
        for e in entries:
            e.pins -= 1
            if e.pins == 0 and e.committed and not e.spilling and blocks.get(e.key) is e:
                classes[e.stride].lru[e.key] = e

    # ---- writes --------------------------------------------------------------------

    @_locked
    def reserve(self, key: BlockKey, size: int, ttl_s: float) -> Entry | None:
        """Reserve a slot for a new block; None when the key is already stored or in flight.

        Raises TooLarge for a block bigger than a slab, NoSpace when nothing can be
        evicted to make room.
        """
        self._check_usable()
        if key in self._blocks:
            return None
        stride = align_up(size)
        if size <= 0 or stride > self.slab_bytes:
            raise TooLarge(f"block of {size} bytes does not fit a slab of {self.slab_bytes}")
        offset = self._alloc(stride)
        e = Entry(key, offset, size, stride, reserve_deadline=time.monotonic() + ttl_s)
        self._blocks[key] = e
        self._by_offset[offset] = e
        self.used_bytes += stride
        self._last_stride = stride
        if self._on_low is not None and self.capacity - self.used_bytes < self._low_bytes:
            self._on_low()
        return e

    @_locked
    def commit(
        self, e: Entry, xxh3: int, digest: int | None = None, gen: int | None = None
    ) -> BlockLocation:
        """Make a reserved block visible and immutable; returns its location.  ``gen``:
        the generation it keeps (a block promoted from the disk tier), else a new one.
        Raises Unavailable once the pool failed (nothing new is published)."""
        self._check_usable()
        if gen is None:
            self._gen += 1
            gen = self._gen
        else:
            self._gen = max(self._gen, gen)
        e.gen = gen
        e.xxh3 = xxh3
        e.digest = digest
        e.committed = True
        e.reserve_deadline = 0.0
        if e.pins == 0:
            self._classes[e.stride].lru[e.key] = e
        if self.journal is not None:
            self.journal.committed(self._record(e))
            self.maintain_journal()
        return e.location(self.node_id)

    @_locked
    def raise_gen(self, floor: int) -> None:
        """Make every later generation larger than ``floor`` (blocks kept elsewhere, on
        the disk tier, hold generations up to it)."""
        self._gen = max(self._gen, floor)

    @_locked
    def maintain_journal(self) -> None:
        """Rewrite the journal compactly when it asks for it: dead records dominate, or
        it is degraded (a write failed) and may fit again (cheap; called often)."""
        j = self.journal
        if j is not None and j.wants_rewrite(len(self._blocks)):
            j.rewrite(self._record(x) for x in self.committed())

    def file_problem(self) -> str | None:
        """Why the pool file can no longer be shared (its path was deleted or now names
        another file: same-host clients and handshakes need it), else None."""
        return replaced(self.path, self.file_id)

    @_locked
    def abort(self, e: Entry) -> None:
        """Drop a reservation (the put failed or expired)."""
        if self._blocks.get(e.key) is e and not e.committed:
            self._release(e)

    @_locked
    def quarantine(self, e: Entry) -> None:
        """Take a reservation out of use while a transfer may still write its slot (UCX
        cannot cancel a receive under way): its key is free for new puts at once, its
        slot stays allocated until :meth:`release_quarantined`."""
        if self._blocks.get(e.key) is e and not e.committed:
            del self._blocks[e.key]
            self.quarantined_bytes += e.stride

    @_locked
    def release_quarantined(self, e: Entry) -> None:
        """Give a quarantined slot back, once nothing can write it any more."""
        if self._by_offset.get(e.offset) is e:
            self._free_slot(e)
            self.quarantined_bytes -= e.stride

    @_locked
    def drop(self, e: Entry, report: bool = True) -> None:
        """Remove a committed block (invalid or evicted); reports it to ``on_evict``
        (unless ``report`` is False)."""
        if self._blocks.get(e.key) is not e:
            return
        self._classes[e.stride].lru.pop(e.key, None)
        if e.spilling:  # the write reads its slot: freed when it ends (end_spill)
            del self._blocks[e.key]
        else:
            self._release(e)
        if e.committed and self.journal is not None:
            self.journal.dropped(e.offset, e.gen)
        if report and e.committed and self._on_evict is not None:
            self._on_evict(e)

    @_locked
    def reclaim_expired(self, now: float | None = None) -> int:
        """Abort reservations past their deadline; returns how many."""
        now = time.monotonic() if now is None else now
        stale = [e for e in self._blocks.values() if not e.committed and e.reserve_deadline < now]
        for e in stale:
            if e.pins == 0:
                self.abort(e)
        return len(stale)

    # ---- spill-ahead ---------------------------------------------------------------

    @_locked
    def watch_free(self, low_bytes: int, on_low: Callable[[], None]) -> None:
        """Call ``on_low()`` after each reservation that leaves less than ``low_bytes``
        of the pool free (under the pool's lock, on the reserving thread: it must be
        quick and thread-safe)."""
        self._low_bytes, self._on_low = low_bytes, on_low

    def free_bytes(self) -> int:
        """Bytes of the pool in no slot (free slots and free slabs)."""
        return self.capacity - self.used_bytes

    @_locked
    def take_for_spill(self, skip: Callable[[Entry], bool], scan: int) -> Entry | None:
        """The least recently used committed, unpinned block but those ``skip`` names,
        among the ``scan`` least recently used (of the size class reserved last, else of
        any), now *spilling*: out of the LRU, so neither evicted nor its slot reused
        until :meth:`end_spill`; None when there is none."""
        if self.check_file() is not None:
            return None
        last = self._classes.get(self._last_stride)
        for cls in (last, *self._classes.values()):
            if cls is None:
                continue
            for n, (key, e) in enumerate(cls.lru.items()):
                if n >= scan:
                    break
                if not skip(e):
                    del cls.lru[key]
                    e.spilling = True
                    self.spilling += 1
                    return e
        return None

    @_locked
    def end_spill(self, e: Entry, on_disk: bool) -> bool:
        """The write of ``e`` taken by :meth:`take_for_spill` ended (``on_disk``: its
        copy on the disk tier is complete).  Written and not pinned by a read: evicted
        (through ``on_spill``, which finds it on disk: nothing is copied); pinned: it
        stays, its eviction later writes nothing; not written: back at the head of the
        LRU (the next eviction takes it the usual way).  Returns False when ``e`` was
        dropped meanwhile (its slot is freed now; the caller discards its disk copy)."""
        e.spilling = False
        self.spilling -= 1
        if self._blocks.get(e.key) is not e:
            if self._by_offset.get(e.offset) is e:
                self._free_slot(e)
            return False
        if e.pins:
            return True
        if on_disk:
            self._evict(e)
        else:
            lru = self._classes[e.stride].lru
            lru[e.key] = e
            lru.move_to_end(e.key, last=False)
        return True

    # ---- allocation ----------------------------------------------------------------

    def _release(self, e: Entry) -> None:
        del self._blocks[e.key]
        self._free_slot(e)

    def _free_slot(self, e: Entry) -> None:
        self._by_offset.pop(e.offset, None)
        self.used_bytes -= e.stride
        self._classes[e.stride].free.append(e.offset)

    def _evict(self, e: Entry) -> None:
        """Evict ``e``: offered to ``on_spill`` first (which copies it to the disk tier
        at once), reported to ``on_evict`` only if that did not keep it."""
        self.evictions += 1
        kept = self._on_spill is not None and e.committed and self._on_spill(e)
        self.drop(e, report=not kept)

    def close(self, unlink: bool = False) -> None:
        """Unmap the pool (``unlink=True`` also deletes the shared-memory file and its
        journal)."""
        self.buf = np.empty(0, dtype=np.uint8)
        try:
            self._mmap.close()
        except BufferError:
            pass  # views still alive (e.g. in-flight sends); the OS frees it at exit
        self._close_files(unlink)

    def _close_files(self, unlink: bool) -> None:
        os.close(self._fd)
        if self.journal is not None:
            self.journal.close()
        if unlink:
            self.path.unlink(missing_ok=True)
            if self.journal is not None:
                self.journal.path.unlink(missing_ok=True)
                with contextlib.suppress(OSError):
                    self.journal.path.with_suffix(".journal.tmp").unlink()
