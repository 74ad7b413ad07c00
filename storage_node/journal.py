"""The pool's journal: what each slot holds, so a restarted node can re-attach its pool.

Format.  An append-only file next to the pool (``pegaflow-<node_id>.journal``) of
frames ``b"PJ" | body length (u16) | crc32 of the body (u32) | body`` (little-endian),
each body one msgpack record:

* a header first, ``["pegaflow-journal", 2, pool bytes, slab bytes, pool id]``; the pool
  id is random when the pool file is created and kept while it is re-attached, so it
  names this pool file across restarts (the node publishes it in its etcd record: see
  :mod:`~pegaflow.storage_node.publisher` for how it tells its own previous process
  from another node with the same id);
* ``["C", offset, stride, size, gen, xxh3, ns, hash, shard]`` when a block is committed;
* ``["D", offset, gen]`` when it is dropped.

Version 1 journals (PegaFlow 0.1.0: bare msgpack records, header
``["pegaflow-journal", 1, pool bytes, slab bytes]``) are still replayed, with the same
validation, and rewritten as version 2 at attach; having no frames, a version 1 journal
ends at its first undecodable byte.

Replay never raises.  Every record is validated: types, offset/stride/size within the
pool's geometry, gen and xxh3 unsigned 64-bit, a valid namespace, hash and shard.  A
record that fails is skipped and counted (:attr:`Journal.bad_records`, logged at
WARNING).  A frame whose crc does not match (a flipped bit, a torn write in the middle)
is skipped up to the next frame that checks out, counted once.  Damage that runs to
the end of the file is a *torn tail* (a crash mid-append): the end of the journal, not
counted.  A header that does not match this pool's geometry, or is damaged, means the
journal is not this pool's: the pool starts empty.  Replay gives the blocks the pool
should hold; the pool then checks each one against its checksum before trusting it, so
a damaged or stale record can only lose a block, never serve a wrong one.  (The block's
xxh3 covers its bytes; the frame's crc covers what it cannot: the key the bytes are
filed under, e.g. a shard number with a flipped bit.)

Writes.  Every append writes the whole frame (``os.write`` is repeated until all bytes
are written).  A write that fails (no space, quota, I/O error) never leaves a torn
frame behind: the file is truncated back to the end of its last whole frame, and the
journal becomes *degraded*: it stops appending and logs at ERROR what to do (free
space).  Meanwhile the node keeps serving and committing: blocks committed while
degraded are served, but a restart would not re-attach them (nor see their drops; the
pool's checksums keep a stale record harmless).  About once a second (at a commit or
the node's watchdog tick) the journal checks the free space of its file system; once
there looks to be room, the pool rewrites the journal compactly from its live blocks,
and when that succeeds the journal is whole again and appends resume.  A rewrite that
fails anyway leaves the old journal in place and backs off (up to a minute).
The journal is also rewritten compactly at every attach and whenever dead records
dominate it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import struct
import time
import uuid
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
from pegaflow.storage_node.blocks import ALIGN

from pegaflow.errors import BadRequest, PegaError
from pegaflow.protocol.codec import SHARD_LIMIT, check_hash, check_namespace, unpack

log = logging.getLogger(__name__)

MAGIC = "pegaflow-journal"
VERSION = 2
_CHECK_S = 1.0  # while degraded: how often free space is checked
_BACKOFF_MAX_S = 60.0  # and the longest wait after a failed rewrite

_FRAME = struct.Struct("<2sHI")
_FRAME_MAGIC = b"PJ"
_MAX_BODY = 4096
_MAX_SHARD = SHARD_LIMIT - 1  # as the data plane accepts
_U64 = (1 << 64) - 1
_RECORD_ESTIMATE = 128  # bytes of a typical C frame, to tell if a rewrite can fit
_POOL_ID = re.compile(r"^[0-9a-f]{8,64}$")


@dataclass(frozen=True, slots=True)
class SlotRecord:
    """A committed block as the journal remembers it."""

    offset: int
    stride: int
    size: int
    gen: int
    xxh3: int
    ns: str
    block_hash: bytes
    shard: int

    def pack(self) -> bytes:
        """This record's commit frame."""
        return _frame(
            ["C", self.offset, self.stride, self.size, self.gen, self.xxh3, self.ns,
             self.block_hash, self.shard]
        )  # fmt: skip


@dataclass
class Replay:
    """What a journal's bytes say (see :func:`parse`)."""

    records: list[SlotRecord] = field(default_factory=list)
    pool_id: str = ""
    """the header's pool id ("" when absent or damaged)"""
    matched: bool = False
    """whether the header is this pool's (magic, a known version, the same geometry)"""
    bad: int = 0
    """records skipped: invalid, or a damaged stretch followed by valid frames"""
    torn: bool = False
    """whether the journal ends in a damaged stretch (a crash mid-append)"""


def parse(data: bytes, pool_bytes: int, slab_bytes: int) -> Replay:
    """The live records of a journal's bytes (see the module docstring); never raises."""
    if data[:2] == _FRAME_MAGIC:
        return _parse_v2(data, pool_bytes, slab_bytes)
    return _parse_v1(data, pool_bytes, slab_bytes)


class Journal:
    """Append-only record of commits and drops of one pool (see the module docstring)."""

    def __init__(self, path: Path, pool_bytes: int, slab_bytes: int) -> None:
        self.path = path
        self.pool_bytes = pool_bytes
        self.slab_bytes = slab_bytes
        #: This pool file's id (kept from the header by :meth:`replay`, else new).
        self.pool_id = uuid.uuid4().hex
        #: Records :meth:`replay` skipped as invalid.
        self.bad_records = 0
        #: Whether the replayed journal ended in a torn record.
        self.torn_tail = False
        #: Whether appends are off after a failed write (see the module docstring).
        self.degraded = False
        #: Failed writes (appends and rewrites) since start.
        self.write_errors = 0
        #: Commits and drops not journaled because the journal was degraded.
        self.unjournaled = 0
        #: When a degraded journal next checks for room (``time.monotonic()``).
        self.retry_at = 0.0
        self._backoff = _CHECK_S
        self._fd: int | None = None
        self._size = 0  # file size at the end of the last whole frame
        self._records = 0
        self._live = 0

    def replay(self) -> list[SlotRecord]:
        """The blocks the journal says are committed (empty if absent, damaged at its
        header or for another pool geometry).  Never raises."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return []
        except OSError as e:
            log.warning("journal %s unreadable (%s): starting with an empty pool", self.path, e)
            return []
        r = parse(data, self.pool_bytes, self.slab_bytes)
        if _POOL_ID.match(r.pool_id):
            self.pool_id = r.pool_id
        self.bad_records, self.torn_tail = r.bad, r.torn
        if not r.matched:
            log.warning(
                "journal %s does not belong to this pool (damaged header, or another "
                "pool_bytes/slab_bytes): starting with an empty pool",
                self.path,
            )
        if r.bad:
            log.warning(
                "journal %s: skipped %d bad record(s) (damaged or not PegaFlow's); the "
                "blocks they named are not re-attached, everything else is",
                self.path,
                r.bad,
            )
        if r.torn:
            log.info("journal %s ends in a torn record (a crash mid-write): ignored", self.path)
        return r.records

    def rewrite(self, live: Iterable[SlotRecord]) -> bool:
        """Replace the journal by a compact one holding ``live``, then append to it.

        False (logged, :attr:`degraded`) when it could not be written: the old journal
        stays as it was and appends stay off.
        """
        self.close()
        tmp = self.path.with_suffix(".journal.tmp")
        header = _frame([MAGIC, VERSION, self.pool_bytes, self.slab_bytes, self.pool_id])
        parts = [header, *(r.pack() for r in live)]
        data = b"".join(parts)
        try:
            tmp.write_bytes(data)
            os.replace(tmp, self.path)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            self._degrade(f"rewriting it failed ({e})")
            return False
        if self.degraded:
            log.info(
                "journal %s is written again (%d blocks); restarts re-attach every block",
                self.path,
                len(parts) - 1,
            )
        self._fd, self._size, self.degraded = fd, len(data), False
        self._records = self._live = len(parts) - 1
        return True

    def committed(self, rec: SlotRecord) -> None:
        """Journal a commit."""
        self._append(rec.pack())
        self._live += 1

    def dropped(self, offset: int, gen: int) -> None:
        """Journal a drop of the block committed at ``offset`` with ``gen``."""
        self._append(_frame(["D", offset, gen]))
        self._live -= 1

    def wants_rewrite(self, live: int) -> bool:
        """Whether the caller should :meth:`rewrite` now: dead records dominate, or the
        journal is degraded, its retry is due and ``live`` records look like they fit."""
        if not self.degraded:
            return self._records > 100_000 and self._records > 4 * self._live
        now = time.monotonic()
        if now < self.retry_at:
            return False
        self.retry_at = now + _CHECK_S
        try:
            st = os.statvfs(self.path.parent)
        except OSError:
            return False
        return st.f_bavail * st.f_frsize > 2 * (live + 1) * _RECORD_ESTIMATE

    def close(self) -> None:
        """Stop appending (the file stays)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _append(self, data: bytes) -> None:
        if self._fd is None:
            if self.degraded:
                self.unjournaled += 1
            return
        try:
            _write_all(self._fd, data)
        except OSError as e:
            # Never leave a torn frame: cut the file back to its last whole frame.
            try:
                os.ftruncate(self._fd, self._size)
                what = f"a write failed ({e}); truncated it back to its last whole record"
            except OSError as e2:
                what = f"a write failed ({e}) and truncating it failed too ({e2})"
            self.close()
            self._degrade(what)
            self.unjournaled += 1
            return
        self._size += len(data)
        self._records += 1

    def _degrade(self, what: str) -> None:
        self.write_errors += 1
        if self.degraded:
            self._backoff = min(_BACKOFF_MAX_S, self._backoff * 2)
            self.retry_at = time.monotonic() + self._backoff
            log.warning(
                "journal %s still not writable: %s; next try in %g s",
                self.path,
                what,
                self._backoff,
            )
            return
        self.degraded = True
        self._backoff = _CHECK_S
        self.retry_at = time.monotonic() + _CHECK_S
        log.error(
            "journal %s: %s. Journaling is off: blocks committed from now on are served "
            "but a restart will not re-attach them. Free space in %s (or fix the error); "
            "the node then rewrites the journal from its live blocks by itself",
            self.path,
            what,
            self.path.parent,
        )


def _frame(record: list[Any]) -> bytes:
    body = msgpack.packb(record, use_bin_type=True)
    return _FRAME.pack(_FRAME_MAGIC, len(body), zlib.crc32(body)) + body


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.EIO, "write wrote nothing")
        view = view[n:]


# ---- replay ------------------------------------------------------------------------


def _validate(
    r: Any, pool_bytes: int, slab_bytes: int, namespaces: set[str]
) -> SlotRecord | tuple[int, int]:
    """A commit record, or a drop's ``(offset, gen)``; PegaError when ``r`` is neither.
    ``namespaces``: those found valid so far (a pool holds few; checked once each).
    (Written out rather than with :func:`~pegaflow.protocol.codec.req_int` per field: a restart
    replays every record of a large pool, and this is most of that time.)"""
    if type(r) is not list or not r:
        raise BadRequest("not a record")
    if r[0] == "C" and len(r) == 9:
        _, offset, stride, size, gen, xxh3, ns, block_hash, shard = r
        if not (
            type(offset) is int and type(stride) is int and type(size) is int
            and type(gen) is int and type(xxh3) is int and type(shard) is int
        ):  # fmt: skip
            raise BadRequest("a commit record's numbers must be integers")
        within = offset % slab_bytes
        if not (
            ALIGN <= stride <= slab_bytes and stride % ALIGN == 0
            and 0 <= offset <= pool_bytes - stride
            and within % stride == 0 and within + stride <= slab_bytes
            and 0 < size <= stride
            and 0 <= gen <= _U64 and 0 <= xxh3 <= _U64 and 0 <= shard <= _MAX_SHARD
        ):  # fmt: skip
            raise BadRequest(f"commit record out of range: {r[1:6]}, shard {shard}")
        if type(ns) is not str or ns not in namespaces:
            namespaces.add(check_namespace(ns))
        return SlotRecord(offset, stride, size, gen, xxh3, ns, check_hash(block_hash), shard)
    if r[0] == "D" and len(r) == 3:
        _, offset, gen = r
        if type(offset) is not int or type(gen) is not int:
            raise BadRequest("a drop record's numbers must be integers")
        if not (0 <= offset < pool_bytes and 0 <= gen <= _U64):
            raise BadRequest(f"drop record out of range: {r[1:]}")
        return offset, gen
    raise BadRequest("not a record")


class _Live:
    """Applies validated records in order: the commits no later drop undid."""

    def __init__(self, pool_bytes: int, slab_bytes: int, out: Replay) -> None:
        self.geometry = (pool_bytes, slab_bytes)
        self.out = out
        self.slots: dict[int, SlotRecord] = {}
        self.namespaces: set[str] = set()

    def apply(self, r: Any) -> None:
        try:
            rec = _validate(r, *self.geometry, self.namespaces)
        except PegaError:
            self.out.bad += 1
            return
        if isinstance(rec, SlotRecord):
            self.slots[rec.offset] = rec
        else:
            cur = self.slots.get(rec[0])
            if cur is not None and cur.gen == rec[1]:
                del self.slots[rec[0]]


def _header(r: Any, version: int, pool_bytes: int, slab_bytes: int) -> tuple[bool, str]:
    """Whether ``r`` is a matching header of ``version``, and its pool id."""
    n = 5 if version == 2 else 4
    if not isinstance(r, list) or len(r) != n or r[:2] != [MAGIC, version]:
        return False, ""
    pool_id = r[4] if n == 5 and isinstance(r[4], str) else ""
    return r[2:4] == [pool_bytes, slab_bytes], pool_id


def _parse_v2(data: bytes, pool_bytes: int, slab_bytes: int) -> Replay:
    out = Replay()
    live = _Live(pool_bytes, slab_bytes, out)
    pos, n = 0, len(data)
    damaged = False  # inside a stretch of damaged frames
    while pos < n:
        body = _frame_at(data, pos)
        if body is None:  # resync at the next frame that checks out
            if pos == 0:
                return out  # no header: not this pool's journal
            damaged = True
            pos = data.find(_FRAME_MAGIC, pos + 1)
            if pos < 0:
                break
            continue
        if damaged:
            out.bad += 1
            damaged = False
        try:
            r = unpack(body, _MAX_BODY)
        except PegaError:
            r = None
        if pos == 0:
            out.matched, out.pool_id = _header(r, 2, pool_bytes, slab_bytes)
            if not out.matched:
                return out
        else:
            live.apply(r)
        pos += _FRAME.size + len(body)
    out.torn = damaged
    out.records = list(live.slots.values())
    return out


def _frame_at(data: bytes, pos: int) -> bytes | None:
    """The body of the whole, crc-checked frame at ``pos``, else None."""
    if len(data) - pos < _FRAME.size:
        return None
    magic, length, crc = _FRAME.unpack_from(data, pos)
    start = pos + _FRAME.size
    if magic != _FRAME_MAGIC or length > _MAX_BODY or start + length > len(data):
        return None
    body = data[start : start + length]
    return body if zlib.crc32(body) == crc else None


def _parse_v1(data: bytes, pool_bytes: int, slab_bytes: int) -> Replay:
    """Version 1: bare msgpack records.  Without frames a damaged record cannot be
    skipped reliably, so the first undecodable byte ends the replay."""
    out = Replay()
    live = _Live(pool_bytes, slab_bytes, out)
    unpacker = msgpack.Unpacker(
        raw=False,
        max_buffer_size=max(len(data), 1),
        max_str_len=_MAX_BODY,
        max_bin_len=_MAX_BODY,
        max_array_len=16,
        max_map_len=16,
        max_ext_len=0,
    )
    unpacker.feed(data)
    end = 0
    try:
        for r in unpacker:
            if end == 0:
                out.matched, _ = _header(r, 1, pool_bytes, slab_bytes)
                if not out.matched:
                    return out
            else:
                live.apply(r)
            end = unpacker.tell()
    except (ValueError, TypeError, msgpack.UnpackException):
        pass
    out.torn = out.matched and end < len(data)
    out.records = list(live.slots.values())
    return out
