"""The disk tier's on-disk format: a versioned header and one fixed-size record a slot.

Files in the tier's directory:

* ``pegaflow-disk.index``: a 4 KiB header, then one :data:`RECORD_BYTES` record per
  slot (slot ``i`` at ``HEADER_BYTES + i * RECORD_BYTES``).  It is written through the
  page cache (records are small), read in one sequential pass at recovery.
* ``pegaflow-disk.<n>.slab``: a 4 KiB header, then ``slots_per_file`` slots of
  ``stride`` bytes (the block size rounded up to 4 KiB), written and read with
  ``O_DIRECT`` where the file system allows it.
* ``pegaflow-disk.lock``: held (``flock``) by the one process using the directory.

Header (little-endian): magic (16 bytes, :data:`INDEX_MAGIC` or :data:`SLAB_MAGIC`),
format version (u32) first, at the same place in every version, so that a file of
another version is recognised and refused before anything else is read; then record
bytes (u32), block size, stride, slot count, slots per file (u64 each), file count,
file number (u32 each), the tier id (16 random bytes, the same in all files of one
tier) and an xxh3-64 of all of it.

Record: ``b"PFDR"``, record version (u16), flags (u16), slot, seq, gen, length, xxh3 of
the payload (u64 each), shard (u32), namespace length, hash length (u16 each), the
namespace and hash bytes, zero padding, and an xxh3-64 of the record's first 504 bytes
in its last 8.  An all-zero record is an empty slot (a *tombstone*).  ``seq`` orders
the tier's writes (a later write of the same key wins; recovery rebuilds the LRU
order from it).  A record is written only after its payload write completed, and a
slot's record is cleared before the slot is reused, so a process killed mid-write
leaves either no record or one whose payload is whole.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from pegaflow.storage_node.blocks import BlockKey

from pegaflow.checksum import checksum
from pegaflow.errors import BadRequest, IncompatibleFormat
from pegaflow.protocol.codec import MAX_HASH_BYTES, SHARD_LIMIT, check_namespace

FORMAT_VERSION = 1
INDEX_MAGIC = b"PEGAFLOW-DISKIDX"
SLAB_MAGIC = b"PEGAFLOW-DISKSLB"
HEADER_BYTES = 4096
RECORD_BYTES = 512
EMPTY_RECORD = bytes(RECORD_BYTES)

_HEAD = struct.Struct("<16sI")
_HEADER = struct.Struct("<16sIIQQQQII16s")
_HEADER_SUM = struct.Struct("<Q")
_RECORD_MAGIC = b"PFDR"
_RECORD_VERSION = 1
_RECORD = struct.Struct("<4sHHQQQQQIHH")
_RECORD_SUM_AT = RECORD_BYTES - 8


class CorruptRecord(ValueError):
    """A slot record that does not verify (torn, flipped bits, out of range)."""


@dataclass(frozen=True, slots=True)
class Header:
    """The geometry of a tier, as written at the start of each of its files."""

    block_size: int
    stride: int
    slot_count: int
    slots_per_file: int
    file_count: int
    tier_id: bytes
    file_no: int = 0
    """which slab file this header heads (0 in the index)"""

    def encode(self, magic: bytes) -> bytes:
        body = _HEADER.pack(
            magic,
            FORMAT_VERSION,
            RECORD_BYTES,
            self.block_size,
            self.stride,
            self.slot_count,
            self.slots_per_file,
            self.file_count,
            self.file_no,
            self.tier_id,
        )
        body += _HEADER_SUM.pack(checksum(body))
        return body + bytes(HEADER_BYTES - len(body))

    @classmethod
    def decode(cls, buf: bytes, magic: bytes, where: str) -> Header:
        """Parse a header; raises :class:`IncompatibleFormat` naming ``where`` when it is
        not a tier file, was written by another format version, or is damaged."""
        if len(buf) < _HEADER.size + _HEADER_SUM.size:
            raise IncompatibleFormat(f"{where}: too short to be a pegaflow disk tier file")
        got_magic, version = _HEAD.unpack_from(buf)
        if got_magic != magic:
            raise IncompatibleFormat(f"{where}: not a pegaflow disk tier file (bad magic)")
        if version != FORMAT_VERSION:
            raise IncompatibleFormat(
                f"{where}: written by disk format version {version}, this build reads "
                f"version {FORMAT_VERSION}; run the matching PegaFlow version, or remove "
                "the directory's pegaflow-disk.* files to start the tier empty"
            )
        (want,) = _HEADER_SUM.unpack_from(buf, _HEADER.size)
        if checksum(buf[: _HEADER.size]) != want:
            raise IncompatibleFormat(
                f"{where}: header checksum mismatch (damaged); remove the directory's "
                "pegaflow-disk.* files to start the tier empty"
            )
        f = _HEADER.unpack_from(buf)
        if f[2] != RECORD_BYTES:
            raise IncompatibleFormat(f"{where}: record size {f[2]}, expected {RECORD_BYTES}")
        return cls(
            block_size=f[3],
            stride=f[4],
            slot_count=f[5],
            slots_per_file=f[6],
            file_count=f[7],
            file_no=f[8],
            tier_id=f[9],
        )


@dataclass(frozen=True, slots=True)
class SlotRecord:
    """What one slot holds."""

    slot: int
    key: BlockKey
    seq: int
    gen: int
    length: int
    xxh3: int


def check_key(key: BlockKey) -> None:
    """Raise BadRequest unless ``key`` is one the wire accepts (so its record fits)."""
    ns, h, shard = key
    check_namespace(ns)
    if not isinstance(h, bytes) or not 0 < len(h) <= MAX_HASH_BYTES:
        raise BadRequest(f"block hash must be 1-{MAX_HASH_BYTES} bytes")
    if not isinstance(shard, int) or not 0 <= shard < SHARD_LIMIT:
        raise BadRequest(f"shard {shard!r} must be an integer in [0, {SHARD_LIMIT})")


def encode_record(r: SlotRecord) -> bytes:
    """The :data:`RECORD_BYTES` bytes of ``r`` (raises BadRequest for a bad key)."""
    check_key(r.key)
    ns, h, shard = r.key
    nsb = ns.encode()
    head = _RECORD.pack(
        _RECORD_MAGIC,
        _RECORD_VERSION,
        0,
        r.slot,
        r.seq,
        r.gen,
        r.length,
        r.xxh3,
        shard,
        len(nsb),
        len(h),
    )
    body = head + nsb + h
    body += bytes(_RECORD_SUM_AT - len(body))
    return body + _HEADER_SUM.pack(checksum(body))


def decode_record(buf: bytes | memoryview, slot: int, block_size: int) -> SlotRecord | None:
    """The record in ``buf`` for slot ``slot``: None for an empty slot; raises
    :class:`CorruptRecord` when it does not verify."""
    if buf[:4] != _RECORD_MAGIC:
        if bytes(buf) == EMPTY_RECORD:
            return None
        raise CorruptRecord(f"slot {slot}: bad record magic")
    (want,) = _HEADER_SUM.unpack_from(buf, _RECORD_SUM_AT)
    if checksum(buf[:_RECORD_SUM_AT]) != want:
        raise CorruptRecord(f"slot {slot}: record checksum mismatch")
    _, ver, _flags, at, seq, gen, length, xxh3, shard, ns_len, h_len = _RECORD.unpack_from(buf)
    if ver != _RECORD_VERSION:
        raise CorruptRecord(f"slot {slot}: record version {ver}")
    if at != slot or not 0 < length <= block_size or shard >= SHARD_LIMIT:
        raise CorruptRecord(f"slot {slot}: record out of range")
    if not 0 < h_len <= MAX_HASH_BYTES or _RECORD.size + ns_len + h_len > _RECORD_SUM_AT:
        raise CorruptRecord(f"slot {slot}: record key out of range")
    nsb = bytes(buf[_RECORD.size : _RECORD.size + ns_len])
    h = bytes(buf[_RECORD.size + ns_len : _RECORD.size + ns_len + h_len])
    try:
        ns = check_namespace(nsb.decode())
    except (UnicodeDecodeError, BadRequest):
        raise CorruptRecord(f"slot {slot}: bad namespace") from None
    return SlotRecord(slot, (ns, h, shard), seq, gen, length, xxh3)
