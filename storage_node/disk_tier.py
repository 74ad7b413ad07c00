"""The disk tier: blocks spilled from the memory pool to preallocated slab files.

A :class:`DiskTier` is the slot table over one directory's files
(:mod:`~pegaflow.storage_node.disk_files`: the slab files, the index, ``O_DIRECT`` and
the typed errors of opening them; format: :mod:`~pegaflow.storage_node.disk_format`):
fixed-size slots (the block size given at open, rounded up to 4 KiB), which block each
holds, their LRU order, the reads and the counters; the spills are
:mod:`~pegaflow.storage_node.disk_spills`.

I/O.  Spills run on ``write_threads`` threads, reads on ``read_threads`` others
(``os.pwritev``/``os.preadv`` release the GIL, so several I/Os are in flight and a
spill never delays a read behind it in a queue), whole 4 KiB-multiple writes and reads
from page-aligned buffers.  A spill never waits for I/O (``queue_depth`` staging
buffers; :mod:`~pegaflow.storage_node.disk_spills`).  Reads return
``concurrent.futures.Future`` objects (``await asyncio.wrap_future(f)`` in a loop).

Eviction.  When every slot is used, a spill takes the least recently used block's slot
(a read marks a block used) and reports the evicted key to ``on_evict``, which is also
told of blocks dropped because they failed verification.  ``on_evict`` runs on an I/O
thread, outside the tier's lock: it must be quick and thread-safe.

Verification.  Every read checks the payload's xxh3 against its record before the
bytes are handed out: a mismatch, a short read or an I/O error is a miss, counted in
``errors``, and frees the slot.  :meth:`DiskTier.recover` reads the records only (one
sequential pass of the index: about 0.5 KiB a slot), so a tier of tens of GB reopens
in well under a second; payloads are verified lazily, on their first read (or all up
front with ``recover(verify=True)``, or later in the background with :meth:`scrub`).

Crash safety.  A record is written only after its payload write completed, and a slot's
old record is cleared before the slot is reused, so after a ``kill -9`` mid-spill
every record left describes a whole payload (records go through the page cache, which
outlives the process; after a power loss, records of recent writes may be lost, and
one whose payload did not reach the disk fails its checksum at its first read).

Faults show in the node's ``/health`` (200, ``disk_degraded`` and ``disk_reason``) and
``pegaflow_node_disk_degraded``: :meth:`DiskTier.problem` reports the tier's directory
gone, its file system full, and any error counted in the last
``DEGRADED_AFTER_ERROR_S`` (60 s).

Failures (a full disk, an I/O error, a file that vanished) never raise out of
:meth:`spill` or the reads: they are misses or dropped spills, counted in ``errors``
and logged (at most once every 10 s).  Opening raises what
:class:`~pegaflow.storage_node.disk_files.DiskFiles` raises.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pegaflow.storage_node.blocks import BlockKey, align_up
from pegaflow.storage_node.disk_files import DEFAULT_FILE_BYTES, DiskFiles, DiskIO
from pegaflow.storage_node.disk_spills import DiskSlot, DiskSpills

from pegaflow.checksum import checksum
from pegaflow.errors import BadRequest
from pegaflow.units import human_bytes

log = logging.getLogger(__name__)

_LOG_EVERY_S = 10.0
DEGRADED_AFTER_ERROR_S = 60.0
"""a counted error keeps the tier degraded (in /health) this long"""


@dataclass
class DiskTierStats:
    """Counters of a tier (totals since it opened)."""

    capacity_bytes: int
    used_bytes: int
    blocks: int
    spills: int
    spill_drops: int
    spill_copies: int
    """spills copied into a staging buffer (by the eviction that made them)"""
    spill_ahead: int
    """spills written in place (:meth:`DiskTier.spill_in_place`)"""
    evictions: int
    reads: int
    hits: int
    misses: int
    errors: int
    read_bytes: int
    write_bytes: int
    read_seconds: float
    write_seconds: float
    recovered: int
    recover_dropped: int
    direct_io: bool
    degraded: int = 0
    """1 while :meth:`DiskTier.problem` reports a fault"""
    problem: str | None = None


@dataclass(frozen=True, slots=True)
class DiskBlock:
    """What the tier knows of one block on disk (to publish its location)."""

    gen: int
    length: int
    xxh3: int


class DiskTier(DiskSpills):
    """A directory of slab files holding blocks of at most ``block_size`` bytes, within
    ``capacity_bytes``.  Open, then call :meth:`recover` once before any other call."""

    def __init__(
        self,
        path: str | Path,
        capacity_bytes: int,
        block_size: int,
        *,
        on_evict: Callable[[BlockKey], None] | None = None,
        on_spilled: Callable[[BlockKey, bool], None] | None = None,
        read_threads: int = 4,
        write_threads: int = 2,
        queue_depth: int = 16,
        file_bytes: int = DEFAULT_FILE_BYTES,
        direct: bool = True,
        preallocate: bool = True,
        io: DiskIO | None = None,
    ) -> None:
        self.path = Path(path)
        self.block_size = block_size
        self.stride = align_up(block_size)
        slot_count = capacity_bytes // self.stride if block_size > 0 else 0
        if slot_count < 1:
            raise BadRequest(
                f"disk tier of {capacity_bytes} bytes cannot hold one block of {block_size}"
            )
        self._on_evict = on_evict
        self._on_spilled = on_spilled
        self._lock = threading.Lock()
        self._last_log = 0.0
        self._last_error: tuple[float, str] | None = None
        """when the last error was counted, and what it was"""
        log.info(
            "disk tier %s: opening %s in %d slots of %d bytes",
            self.path, human_bytes(slot_count * self.stride), slot_count, self.stride,
        )  # fmt: skip
        self._files = DiskFiles(
            self.path,
            slot_count,
            block_size,
            self.stride,
            file_bytes=file_bytes,
            direct=direct,
            preallocate=preallocate,
            io=io,
        )
        self.header = self._files.header
        self.direct_io = self._files.direct_io
        self.slot_count = self.header.slot_count
        self.capacity = self.slot_count * self.stride
        self._index: dict[BlockKey, DiskSlot] = {}
        self._lru: OrderedDict[BlockKey, DiskSlot] = OrderedDict()
        self._free: list[int] = []
        self._pending: set[BlockKey] = set()
        self._seq = 0
        self._recovered = False
        self._closed = False
        # resident from the start: a first touch of each page would otherwise cost the
        # data loop a page fault per 4 KiB on the first evictions (half a save's speed)
        self._staging_mem = mmap.mmap(
            -1,
            queue_depth * self.stride,
            flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0),
        )
        whole = memoryview(self._staging_mem)
        self._staging = [whole[i * self.stride : (i + 1) * self.stride] for i in range(queue_depth)]
        self._writers = ThreadPoolExecutor(write_threads, thread_name_prefix="pegaflow-disk-w")
        self._readers = ThreadPoolExecutor(read_threads, thread_name_prefix="pegaflow-disk-r")
        self.read_threads = read_threads
        self._inflight: set[Future[Any]] = set()
        self.spills = self.spill_drops = self.evictions = 0
        self.spill_copies = self.spill_ahead = 0
        self.reads = self.hits = self.misses = self.errors = 0
        self.read_bytes = self.write_bytes = 0
        self.read_seconds = self.write_seconds = 0.0
        self.recovered = self.recover_dropped = 0

    # ---- recovery ------------------------------------------------------------------

    def recover(self, verify: bool = False) -> list[BlockKey]:
        """Rebuild the tier from its records; returns the keys kept, least recently
        written first.  A record that does not verify is cleared and counted in
        ``recover_dropped``; of two records of one key the later write wins.  Payloads
        are verified lazily at their first read, or here with ``verify=True`` (reads
        every payload: seconds a GB)."""
        if self._recovered:
            raise RuntimeError("DiskTier.recover() was already called")
        t0 = time.perf_counter()
        log.info("disk tier %s: reading the records of %d slots", self.path, self.slot_count)
        found, empty, bad = self._files.scan_records()
        with self._lock:
            for slot in bad:
                self._clear_record(slot)
            for r in sorted(found.values(), key=lambda r: r.seq):
                s = DiskSlot(r.slot, r.key, r.gen, r.length, r.xxh3, r.seq)
                self._index[r.key] = self._lru[r.key] = s
                self._seq = max(self._seq, r.seq)
            self._free = sorted(empty + bad, reverse=True)
            self.recover_dropped = len(bad)
            self._recovered = True
        if verify:
            self.scrub().result()
        keys = list(self._lru)
        self.recovered = len(keys)
        if keys or bad:
            log.info(
                "disk tier %s: recovered %d blocks (%d records dropped) in %.2f s",
                self.path,
                len(keys),
                len(bad),
                time.perf_counter() - t0,
            )
        return keys

    def scrub(self) -> Future[list[BlockKey]]:
        """Verify every block not yet verified, on the read threads, half of them at
        most (a read queues behind those few, not behind the whole tier's); the future
        gives the keys dropped (each also reported to ``on_evict``)."""
        with self._lock:
            todo = [s.key for s in self._index.values() if not s.verified]
        window = max(1, self.read_threads // 2)
        done: Future[list[BlockKey]] = Future()

        def run() -> None:
            bad: list[BlockKey] = []
            going: deque[tuple[BlockKey, Future[bool]]] = deque()
            try:
                for key in todo:
                    if len(going) >= window:
                        k, f = going.popleft()
                        if not f.result():
                            bad.append(k)
                    going.append((key, self._readers.submit(self._verify_one, key)))
            except RuntimeError:  # closed meanwhile: the rest stays unverified
                pass
            finally:
                bad += [k for k, f in going if not f.result()]
                done.set_result(bad)

        threading.Thread(target=run, name="pegaflow-disk-scrub", daemon=True).start()
        return done

    def _verify_one(self, key: BlockKey) -> bool:
        s = self._pin(key, count=False)
        if s is None:
            return True  # gone meanwhile: nothing to drop
        return self._read_slot(s, None, count=False) is not None

    # ---- reads ---------------------------------------------------------------------

    def contains(self, key: BlockKey) -> bool:
        """Whether ``key`` is on disk (written, not dropped)."""
        return key in self._index

    def info(self, key: BlockKey) -> DiskBlock | None:
        """Generation, length and xxh3 of ``key`` on disk, or None."""
        s = self._index.get(key)
        return None if s is None else DiskBlock(s.gen, s.length, s.xxh3)

    def keys(self) -> list[BlockKey]:
        """Every key on disk, least recently used first."""
        with self._lock:
            return [*self._lru, *(k for k, s in self._index.items() if s.pins)]

    def read(self, key: BlockKey) -> Future[bytes | None]:
        """The verified bytes of ``key``, or None (not on disk, failed verification, I/O
        error)."""
        s = self._pin(key)
        if s is None:
            return _resolved(None)
        return self._readers.submit(self._read_bytes, s)

    def read_into(self, key: BlockKey, buffer: Any) -> Future[int | None]:
        """Read ``key`` into the start of ``buffer`` (writable, at least the block's
        length); the future gives the length, or None on a miss (then ``buffer``'s
        contents are undefined).  Raises BadRequest when the buffer is too small."""
        mv = memoryview(buffer).cast("B")
        if mv.readonly:
            raise BadRequest("read_into needs a writable buffer")
        s = self._pin(key)
        if s is None:
            return _resolved(None)
        if mv.nbytes < s.length:
            self._unpin(s, drop=False)
            raise BadRequest(f"buffer of {mv.nbytes} bytes cannot hold a block of {s.length}")
        return self._readers.submit(self._read_slot, s, mv)

    def _pin(self, key: BlockKey, count: bool = True) -> DiskSlot | None:
        with self._lock:
            s = None if self._closed else self._index.get(key)
            if count:
                self.reads += 1
                if s is None:
                    self.misses += 1
            if s is not None:
                s.pins += 1
                self._lru.pop(key, None)
            return s

    def _unpin(self, s: DiskSlot, drop: bool) -> bool:
        """Release a read's pin (``drop``: and drop the block); whether it dropped it."""
        with self._lock:
            s.pins -= 1
            dropped = drop and not s.dead and self._index.get(s.key) is s
            if dropped:
                s.dead = True
                del self._index[s.key]
                self._clear_record(s.idx)
            if s.pins:
                return dropped
            if s.dead:
                self._free.append(s.idx)
            elif self._index.get(s.key) is s:
                self._lru[s.key] = s
            return dropped

    def _read_bytes(self, s: DiskSlot) -> bytes | None:
        n = self._read_slot(s, None)
        return None if n is None else bytes(self._files.bounce()[:n])

    def _read_slot(self, s: DiskSlot, dest: memoryview | None, count: bool = True) -> int | None:
        """Read and verify slot ``s`` into ``dest`` (None: into this thread's bounce
        buffer), unpinning it; the length, or None after dropping it."""
        ok = False
        try:
            n = s.length
            t0 = time.perf_counter()
            data = self._files.read_payload(s.idx, n, dest)
            dt = time.perf_counter() - t0
            if checksum(data) != s.xxh3:
                self._count(count, error=True)
                self._log_error(f"a block failed its checksum (slot {s.idx}): dropped")
                return None
            s.verified = ok = True
            with self._lock:
                if count:
                    self.hits += 1
                self.read_bytes += align_up(n)
                self.read_seconds += dt
            return n
        except OSError as e:
            self._count(count, error=True)
            self._log_error(f"a read failed ({e}): a miss, block dropped")
            return None
        finally:
            if self._unpin(s, drop=not ok):
                self._report(s.key)

    def _report(self, key: BlockKey) -> None:
        if self._on_evict is None:
            return
        try:
            self._on_evict(key)
        except Exception:
            log.exception("disk tier: on_evict callback failed")

    def _count(self, count: bool, error: bool) -> None:
        with self._lock:
            if count:
                self.misses += 1
            if error:
                self.errors += 1

    def discard(self, key: BlockKey) -> bool:
        """Drop ``key`` from the tier (not reported to ``on_evict``); whether it was
        there."""
        with self._lock:
            s = self._index.pop(key, None)
            if s is None:
                return False
            self._lru.pop(key, None)
            s.dead = True
            self._clear_record(s.idx)
            if not s.pins:
                self._free.append(s.idx)
            return True

    # ---- helpers -------------------------------------------------------------------

    def problem(self) -> str | None:
        """Why the tier is degraded, else None: its directory is gone, its file system
        is full, or an error was counted in the last ``DEGRADED_AFTER_ERROR_S``.  Cheap
        (a ``statvfs``): the node's watchdog and ``/health`` ask it."""
        try:
            fs = os.statvfs(self.path)
        except OSError as e:
            return f"disk tier directory {self.path} is gone ({e.strerror}): spills and reads fail"
        if fs.f_bavail == 0:
            return f"the file system of disk tier {self.path} is full"
        last = self._last_error
        if last is not None and time.monotonic() - last[0] < DEGRADED_AFTER_ERROR_S:
            return f"disk tier {self.path}: {last[1]} ({self.errors} errors so far)"
        return None

    def _log_error(self, what: str) -> None:
        now = time.monotonic()
        self._last_error = (now, what)
        if now - self._last_log >= _LOG_EVERY_S:
            self._last_log = now
            log.error(
                "disk tier %s: %s (%d errors so far; check the disk and its free space)",
                self.path,
                what,
                self.errors,
            )

    def stats(self) -> DiskTierStats:
        """A snapshot of the tier's counters."""
        problem = self.problem()
        with self._lock:
            return DiskTierStats(
                capacity_bytes=self.capacity,
                used_bytes=len(self._index) * self.stride,
                blocks=len(self._index),
                spills=self.spills,
                spill_drops=self.spill_drops,
                spill_copies=self.spill_copies,
                spill_ahead=self.spill_ahead,
                evictions=self.evictions,
                reads=self.reads,
                hits=self.hits,
                misses=self.misses,
                errors=self.errors,
                read_bytes=self.read_bytes,
                write_bytes=self.write_bytes,
                read_seconds=self.read_seconds,
                write_seconds=self.write_seconds,
                recovered=self.recovered,
                recover_dropped=self.recover_dropped,
                direct_io=self.direct_io,
                degraded=int(problem is not None),
                problem=problem,
            )

    def close(self, timeout: float | None = 30.0) -> None:
        """Finish the queued spills (up to ``timeout``), then close the files."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.flush(timeout)
        self._writers.shutdown(wait=True, cancel_futures=True)
        self._readers.shutdown(wait=True)  # reads under way finish; later ones are misses
        self._files.close()


def _resolved(value: Any) -> Future[Any]:
    f: Future[Any] = Future()
    f.set_result(value)
    return f
