"""The disk tier's files: its directory's lock, slab files and index, opened (or made)
and checked against each other, and the positional I/O on them.

Format: :mod:`~pegaflow.storage_node.disk_format`.  A directory holds one index
(``pegaflow-disk.index``: a header and one record a slot) and a few preallocated slab
files (``pegaflow-disk.<n>.slab``: a header and the slots' payloads).  The slab files are
reopened with ``O_DIRECT`` where the file system allows it.  The slot table, eviction
and verification on top are :mod:`~pegaflow.storage_node.disk_tier`'s.

Opening raises typed errors: :class:`~pegaflow.errors.IncompatibleFormat` for files of
another format version or geometry, :class:`~pegaflow.errors.NoSpace` when the tier does
not fit its file system, :class:`DiskInUse` when another process holds the directory.

Test hook: ``io`` (a :class:`DiskIO`) performs every data and record read and write;
tests pass a subclass that raises ``OSError`` to inject faults.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import logging
import mmap
import os
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from pegaflow.storage_node.blocks import ALIGN, BlockKey, align_up
from pegaflow.storage_node.disk_format import (
    EMPTY_RECORD,
    HEADER_BYTES,
    INDEX_MAGIC,
    RECORD_BYTES,
    SLAB_MAGIC,
    CorruptRecord,
    Header,
    SlotRecord,
    decode_record,
)

from pegaflow.errors import IncompatibleFormat, NoSpace

log = logging.getLogger(__name__)

DEFAULT_FILE_BYTES = 64 << 30
"""largest slab file; a bigger tier is split over several"""
_SCAN_RECORDS = (8 << 20) // RECORD_BYTES
"""index records read at once by :meth:`DiskFiles.scan_records`"""
PROGRESS_S = 3.0
"""seconds between two progress lines while the tier's files are made or its index read"""


class _Progress:
    """A progress line at most every :data:`PROGRESS_S` of a long step of the start."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.shown = time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self.shown >= PROGRESS_S:
            self.shown = now
            log.info("%s: %d%%", self.what, done * 100 // max(1, total))


class DiskInUse(OSError):
    """Another live process holds this disk tier's directory."""


class DiskIO:
    """The tier's system calls (the fault-injection hook: override and raise OSError)."""

    def pwritev(self, fd: int, bufs: Sequence[Any], offset: int) -> int:
        return os.pwritev(fd, bufs, offset)

    def preadv(self, fd: int, bufs: Sequence[Any], offset: int) -> int:
        return os.preadv(fd, bufs, offset)


class DiskFiles:
    """The files of a disk tier of ``slot_count`` slots of ``stride`` bytes (blocks of
    at most ``block_size``) in ``path``, locked for this process while open.  An index
    found there must have the same geometry; its header (and tier id) then wins."""

    def __init__(
        self,
        path: Path,
        slot_count: int,
        block_size: int,
        stride: int,
        *,
        file_bytes: int = DEFAULT_FILE_BYTES,
        direct: bool = True,
        preallocate: bool = True,
        io: DiskIO | None = None,
    ) -> None:
        self.path = path
        self.block_size = block_size
        self.stride = stride
        self.io = io or DiskIO()
        self._bounce = threading.local()
        path.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(path / "pegaflow-disk.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise DiskInUse(
                errno.EBUSY,
                f"disk tier {path} is in use by another process: give each node "
                "its own [node] disk_path",
            ) from None
        self.fds: list[int] = []
        """the slab files, by number"""
        self.index_fd = -1
        self.fresh_files: set[int] = set()
        """the slab files made anew at open (their slots' records are stale)"""
        try:
            self._open_files(slot_count, file_bytes, direct, preallocate)
        except BaseException:
            self.close()
            raise

    def where(self, slot: int) -> tuple[int, int]:
        """The slab file and offset of ``slot``'s payload."""
        per = self.header.slots_per_file
        return self.fds[slot // per], HEADER_BYTES + (slot % per) * self.stride

    def write(self, fd: int, buf: Any, offset: int) -> None:
        """Write all of ``buf`` at ``offset`` of ``fd`` (OSError on failure)."""
        write_all(self.io, fd, buf, offset)

    def bounce(self) -> memoryview:
        """This thread's aligned buffer of one slot (for reads that cannot land in
        place)."""
        mem = getattr(self._bounce, "mem", None)
        if mem is None:
            mem = self._bounce.mem = memoryview(mmap.mmap(-1, self.stride))
        return mem

    def read_payload(self, slot: int, n: int, dest: memoryview | None) -> memoryview:
        """Read the first ``n`` bytes of ``slot``'s payload into ``dest`` (None: into
        this thread's :meth:`bounce` buffer); the bytes read, in place.  With
        ``O_DIRECT`` the whole aligned part lands in ``dest`` when it is aligned, the
        tail (or all of it, when not) through the bounce buffer.  OSError on an I/O
        error or a short read."""
        padded = align_up(n)
        whole = n & ~(ALIGN - 1)
        bounce = self.bounce()
        copy_at = -1  # where in dest the bounce buffer's first bytes go
        if dest is None:
            dest = bounce
            bufs = [bounce[:padded]]
        elif not self.direct_io:
            bufs = [dest[:n]]
        elif aligned(dest):
            bufs = [dest[:whole]] if whole else []
            if padded > whole:
                bufs.append(bounce[: padded - whole])
                copy_at = whole
        else:
            bufs = [bounce[:padded]]
            copy_at = 0
        fd, off = self.where(slot)
        got = self.io.preadv(fd, bufs, off)
        if got < sum(b.nbytes for b in bufs):
            raise OSError(errno.EIO, f"short read: {got} bytes")
        if copy_at >= 0:
            dest[copy_at:n] = bounce[: n - copy_at]
        return dest[:n]

    def write_record(self, slot: int, record: bytes) -> None:
        """Write ``slot``'s index record (OSError on failure)."""
        write_all(self.io, self.index_fd, record, HEADER_BYTES + slot * RECORD_BYTES)

    def scan_records(self) -> tuple[dict[BlockKey, SlotRecord], list[int], list[int]]:
        """Read the whole index (one sequential pass): per key its latest record, the
        slots that are empty, and those whose record is corrupt, stale (a slab file
        made anew) or lost to a later write of the same key (to clear)."""
        h = self.header
        found: dict[BlockKey, SlotRecord] = {}
        empty: list[int] = []
        bad: list[int] = []
        progress = _Progress(f"disk tier {self.path}: index records read")
        for first in range(0, h.slot_count, _SCAN_RECORDS):
            progress(first, h.slot_count)
            count = min(_SCAN_RECORDS, h.slot_count - first)
            chunk = os.pread(
                self.index_fd, count * RECORD_BYTES, HEADER_BYTES + first * RECORD_BYTES
            )
            mv = memoryview(chunk)
            for i in range(len(chunk) // RECORD_BYTES):
                slot = first + i
                rec_buf = mv[i * RECORD_BYTES : (i + 1) * RECORD_BYTES]
                if slot // h.slots_per_file in self.fresh_files:
                    (bad if rec_buf[:4] != EMPTY_RECORD[:4] else empty).append(slot)
                    continue
                try:
                    r = decode_record(rec_buf, slot, h.block_size)
                except CorruptRecord as e:
                    log.debug("disk tier: %s", e)
                    bad.append(slot)
                    continue
                if r is None:
                    empty.append(slot)
                    continue
                old = found.get(r.key)
                if old is not None:
                    keep, lose = (r, old) if r.seq > old.seq else (old, r)
                    found[r.key] = keep
                    bad.append(lose.slot)
                else:
                    found[r.key] = r
        return found, empty, bad

    def _slab_path(self, n: int) -> Path:
        return self.path / f"pegaflow-disk.{n}.slab"

    def _open_files(self, slot_count: int, file_bytes: int, direct: bool, prealloc: bool) -> None:
        index_path = self.path / "pegaflow-disk.index"
        per_file = max(1, (max(file_bytes, HEADER_BYTES + self.stride) - HEADER_BYTES))
        per_file //= self.stride
        want = Header(
            block_size=self.block_size,
            stride=self.stride,
            slot_count=slot_count,
            slots_per_file=min(per_file, slot_count),
            file_count=-(-slot_count // min(per_file, slot_count)),
            tier_id=uuid.uuid4().bytes,
        )
        if index_path.exists():
            self.index_fd = os.open(index_path, os.O_RDWR)
            head = os.pread(self.index_fd, HEADER_BYTES, 0)
            got = Header.decode(head, INDEX_MAGIC, str(index_path))
            geometry = (got.block_size, got.slot_count, got.slots_per_file)
            if geometry != (want.block_size, want.slot_count, want.slots_per_file):
                raise IncompatibleFormat(
                    f"{index_path}: written for blocks of {got.block_size} bytes x "
                    f"{got.slot_count} slots ({got.slots_per_file} a file), configured "
                    f"{want.block_size} x {want.slot_count} ({want.slots_per_file}); set "
                    "disk_bytes and the block size back, or remove the directory's "
                    "pegaflow-disk.* files to start the tier empty"
                )
            self.header = got
            size = HEADER_BYTES + got.slot_count * RECORD_BYTES
            if os.fstat(self.index_fd).st_size < size:  # cut short: the rest reads empty
                os.ftruncate(self.index_fd, size)
        else:
            self.header = want
            self._check_room(want, prealloc)
        fresh = self.index_fd < 0
        progress = _Progress(f"disk tier {self.path}: slab files opened")
        for n in range(self.header.file_count):
            progress(n, self.header.file_count)
            self.fds.append(self._open_slab(n, prealloc, fresh))
        if self.index_fd < 0:
            self.index_fd = self._create_index(index_path, prealloc)
        self.direct_io = direct and self._try_direct()
        if not self.direct_io and direct:
            log.info("disk tier %s: O_DIRECT not supported here, using buffered I/O", self.path)

    def _check_room(self, h: Header, prealloc: bool) -> None:
        need = h.slot_count * (h.stride + RECORD_BYTES) + (h.file_count + 1) * HEADER_BYTES
        st = os.statvfs(self.path)
        free = st.f_bavail * st.f_frsize
        if prealloc and need > free:
            raise NoSpace(
                f"disk tier of {need >> 20} MiB does not fit: {free >> 20} MiB free in "
                f"{self.path}; lower disk_bytes, or make room"
            )

    def _slab_bytes(self, n: int) -> int:
        h = self.header
        slots = min(h.slots_per_file, h.slot_count - n * h.slots_per_file)
        return HEADER_BYTES + slots * h.stride

    def _open_slab(self, n: int, prealloc: bool, fresh: bool) -> int:
        """The slab file ``n``, checked against the index (``fresh``: made anew); one
        that is missing or not of this tier is made anew (its slots' records are
        cleared by :meth:`recover`)."""
        p = self._slab_path(n)
        want = dataclasses.replace(self.header, file_no=n)
        fd = -1
        if not fresh:
            try:
                fd = os.open(p, os.O_RDWR)
            except FileNotFoundError:
                log.warning("disk tier: %s is missing; making it anew (its blocks are lost)", p)
        if fd >= 0:
            try:
                got = Header.decode(os.pread(fd, HEADER_BYTES, 0), SLAB_MAGIC, str(p))
                if got != want:
                    raise IncompatibleFormat(f"{p}: belongs to another disk tier")
            except IncompatibleFormat as e:
                log.warning("disk tier: %s; making it anew (its blocks are lost)", e)
                os.close(fd)
                fd = -1
        if fd < 0:
            fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            self.fresh_files.add(n)
            os.pwrite(fd, want.encode(SLAB_MAGIC), 0)
        size = self._slab_bytes(n)
        if os.fstat(fd).st_size < size:
            allocate(fd, size, prealloc, p)
        return fd

    def _create_index(self, path: Path, prealloc: bool) -> int:
        """Write a new, empty index next to the slabs (named only once it is whole)."""
        tmp = path.with_suffix(".index.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.pwrite(fd, self.header.encode(INDEX_MAGIC), 0)
            allocate(fd, HEADER_BYTES + self.header.slot_count * RECORD_BYTES, prealloc, tmp)
            os.fsync(fd)
            os.rename(tmp, path)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        return fd

    def _try_direct(self) -> bool:
        """Reopen the slab files with O_DIRECT; False where the file system refuses."""
        direct: list[int] = []
        for n in range(len(self.fds)):
            try:
                direct.append(os.open(self._slab_path(n), os.O_RDWR | os.O_DIRECT))
            except OSError as e:
                for fd in direct:
                    os.close(fd)
                if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                    return False
                raise
        for old in self.fds:
            os.close(old)
        self.fds = direct
        return True

    def close(self) -> None:
        """Close every file (the lock goes with it)."""
        for fd in [*self.fds, self.index_fd, self._lock_fd]:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.fds = []
        self.index_fd = self._lock_fd = -1


def aligned(mv: memoryview) -> bool:
    """Whether ``mv`` is writable and starts on an ``ALIGN`` boundary (O_DIRECT's rule)."""
    if mv.readonly or not mv.nbytes:
        return False
    return np.frombuffer(mv, dtype=np.uint8).ctypes.data % ALIGN == 0


def allocate(fd: int, size: int, prealloc: bool, path: Path) -> None:
    """Grow ``fd`` to ``size`` bytes, reserving the blocks where ``prealloc`` and the file
    system allow (NoSpace when they do not fit)."""
    if prealloc:
        try:
            os.posix_fallocate(fd, 0, size)
            return
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise NoSpace(
                    f"disk tier file {path} ({size >> 20} MiB) does not fit: {e.strerror}; "
                    "lower disk_bytes, or make room"
                ) from None
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
    os.ftruncate(fd, size)


def write_all(io: DiskIO, fd: int, buf: Any, offset: int) -> None:
    """Write all of ``buf`` at ``offset`` (OSError when a write fails or stalls)."""
    mv = memoryview(buf).cast("B")
    while mv.nbytes:
        n = io.pwritev(fd, [mv], offset)
        if n <= 0:
            raise OSError(errno.EIO, "write made no progress")
        mv, offset = mv[n:], offset + n
