"""The disk tier's spills: blocks queued to the write threads and written to free slots.

:meth:`DiskSpills.spill` never waits for I/O: it copies the block into one of the
tier's staging buffers and returns; with none free the spill is dropped and counted.
:meth:`DiskSpills.spill_in_place` writes a block straight from memory its caller keeps
unchanged until told the write ended (a pool slot, written ahead of its eviction:
:mod:`~pegaflow.storage_node.spill_ahead`).  When every slot is used, a spill takes the
least recently used block's slot and reports the evicted key to ``on_evict``.  A record
is written only after its payload write completed, and a slot's old record is cleared
before the slot is reused (see :mod:`~pegaflow.storage_node.disk_tier`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from pegaflow.storage_node.blocks import BlockKey, align_up
from pegaflow.storage_node.disk_files import DiskFiles
from pegaflow.storage_node.disk_format import EMPTY_RECORD, SlotRecord, check_key, encode_record

from pegaflow.checksum import checksum

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class DiskSlot:
    """A slot of the tier holding a block (in memory: its record's figures, read pins)."""

    idx: int
    key: BlockKey
    gen: int
    length: int
    xxh3: int
    seq: int
    verified: bool = False
    pins: int = 0
    dead: bool = False
    """dropped while a read held it: freed at the last unpin"""


@dataclass(slots=True)
class _Spill:
    """One queued write: ``n`` bytes of ``buf`` (``done``: in place, else staged)."""

    key: BlockKey
    gen: int
    buf: memoryview
    n: int
    xxh3: int | None
    done: Callable[[bool], None] | None


class DiskSpills:
    """The spill half of :class:`~pegaflow.storage_node.disk_tier.DiskTier` (mixed into
    it, which owns the tables and counters named below)."""

    block_size: int
    spills: int
    spill_drops: int
    spill_copies: int
    spill_ahead: int
    evictions: int
    errors: int
    write_bytes: int
    write_seconds: float
    _lock: threading.Lock
    _files: DiskFiles
    _index: dict[BlockKey, DiskSlot]
    _lru: OrderedDict[BlockKey, DiskSlot]
    _free: list[int]
    _pending: set[BlockKey]
    _seq: int
    _recovered: bool
    _closed: bool
    _staging: list[memoryview]
    _writers: ThreadPoolExecutor
    _inflight: set[Future[Any]]
    _on_spilled: Callable[[BlockKey, bool], None] | None

    def _report(self, key: BlockKey) -> None:
        raise NotImplementedError

    def _log_error(self, what: str) -> None:
        raise NotImplementedError

    def spill_queue_full(self) -> bool:
        """Whether a :meth:`spill` now would be dropped for want of room in the queue."""
        with self._lock:
            return not self._staging

    def spill(self, key: BlockKey, gen: int, data: Any, xxh3: int | None = None) -> bool:
        """Write a copy of ``data`` (a block of at most ``block_size`` bytes) in the
        background; returns at once, False when it was dropped (no staging buffer free:
        the write queue is full; too large; tier closed).  ``xxh3``: the block's
        checksum when the caller has it (else computed on the write thread).  A key
        already on disk or queued is not written again.  Once the write is done (or
        failed) ``on_spilled(key, ok)`` is called on the write thread.  Raises
        BadRequest for a key the wire would refuse."""
        check_key(key)
        mv = memoryview(data).cast("B")
        n = mv.nbytes
        with self._lock:
            if not self._recovered or self._closed:
                self.spill_drops += 1
                return False
            if key in self._index or key in self._pending:
                return True
            if not 0 < n <= self.block_size or not self._staging:
                self.spill_drops += 1
                return False
            buf = self._staging.pop()
            self._pending.add(key)
            self.spill_copies += 1
        buf[:n] = mv
        return self._submit(_Spill(key, gen, buf, n, xxh3, None))

    def spill_in_place(
        self,
        key: BlockKey,
        gen: int,
        slot: Any,
        length: int,
        xxh3: int,
        done: Callable[[bool], None],
    ) -> bool:
        """Write the first ``length`` bytes of ``slot`` in the background, straight from
        that memory (no staging copy): the caller keeps the first ``align_up(length)``
        bytes of ``slot`` (page-aligned, for ``O_DIRECT``) unchanged until ``done(ok)``
        is called on the write thread (in place of ``on_spilled``).  Returns False, and
        ``done`` is not called, when it was not taken: the key is on disk or queued
        already, the block is too large, the tier is closed.  Raises BadRequest for a
        key the wire would refuse."""
        check_key(key)
        mv = memoryview(slot).cast("B")
        with self._lock:
            if not self._recovered or self._closed:
                return False
            if key in self._index or key in self._pending:
                return False
            if not 0 < length <= self.block_size or mv.nbytes < align_up(length):
                return False
            self._pending.add(key)
        return self._submit(_Spill(key, gen, mv, length, xxh3, done))

    def _submit(self, spill: _Spill) -> bool:
        try:
            fut = self._writers.submit(self._write, spill)
        except RuntimeError:  # closed meanwhile
            with self._lock:
                self._pending.discard(spill.key)
                if spill.done is None:
                    self._staging.append(spill.buf)
                    self.spill_drops += 1
            return False
        with self._lock:
            self._inflight.add(fut)
        fut.add_done_callback(self._done)
        return True

    def _done(self, fut: Future[Any]) -> None:
        with self._lock:
            self._inflight.discard(fut)

    def _write(self, spill: _Spill) -> None:
        """Write one spill (``done``: in place, from the caller's memory, told at the end
        instead of ``on_spilled``; else from a staging buffer, given back at the end)."""
        key, gen, buf, n, xxh3, done = (
            spill.key, spill.gen, spill.buf, spill.n, spill.xxh3, spill.done
        )  # fmt: skip
        slot: int | None = None
        evicted: BlockKey | None = None
        ok = False
        try:
            if xxh3 is None:
                xxh3 = checksum(buf[:n])
            padded = align_up(n)
            if done is None:  # the caller's memory past the block is not ours to clear
                buf[n:padded] = bytes(padded - n)
            with self._lock:
                slot, evicted = self._alloc()
                self._seq += 1
                seq = self._seq
            if evicted is not None:
                self._report(evicted)
            if slot is None:
                with self._lock:
                    self.spill_drops += done is None
                return
            fd, off = self._files.where(slot)
            t0 = time.perf_counter()
            self._files.write(fd, buf[:padded], off)
            dt = time.perf_counter() - t0
            rec = encode_record(SlotRecord(slot, key, seq, gen, n, xxh3))
            with self._lock:
                self._files.write_record(slot, rec)
                s = DiskSlot(slot, key, gen, n, xxh3, seq, verified=True)
                self._index[key] = self._lru[key] = s
                self.spills += 1
                self.spill_ahead += done is not None
                self.write_bytes += padded
                self.write_seconds += dt
                slot = None
                ok = True
        except OSError as e:
            with self._lock:
                self.errors += 1
                self.spill_drops += done is None
            self._log_error(f"a spill failed ({e}): that block is not kept on disk")
        finally:
            with self._lock:
                if slot is not None:
                    self._free.append(slot)
                self._pending.discard(key)
                if done is None:
                    self._staging.append(buf)
            try:
                if done is not None:
                    done(ok)
                elif self._on_spilled is not None:
                    self._on_spilled(key, ok)
            except Exception:
                log.exception("disk tier: the callback of a spill failed")

    def _alloc(self) -> tuple[int | None, BlockKey | None]:
        """A free slot (lock held), taking the least recently used block's when none is
        free; returns it and the key evicted, if any."""
        if self._free:
            return self._free.pop(), None
        if not self._lru:
            return None, None
        key, s = self._lru.popitem(last=False)
        del self._index[key]
        self.evictions += 1
        self._clear_record(s.idx)
        return s.idx, key

    def _clear_record(self, slot: int) -> None:
        try:
            self._files.write_record(slot, EMPTY_RECORD)
        except OSError as e:
            self.errors += 1
            self._log_error(f"clearing a slot record failed ({e})")

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the spills queued so far; False if some are still running at
        ``timeout``."""
        with self._lock:
            pending = list(self._inflight)
        return not wait(pending, timeout).not_done
