"""The pool's journal: what each slot holds, so a restarted node can re-attach its pool.

An append-only file next to the pool (``pegaflow-<node_id>.journal``) of msgpack
records: a header ``["pegaflow-journal", version, pool bytes, slab bytes]``, then
``["C", offset, stride, size, gen, xxh3, ns, hash, shard]`` when a block is committed
and ``["D", offset, gen]`` when it is dropped.  Replaying it gives the blocks the pool
should hold; the pool then checks each one against its checksum before trusting it, so
a torn or stale record can only lose a block, never serve a wrong one.  The journal is
rewritten compactly at every attach and whenever dead records dominate it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import msgpack

MAGIC = "pegaflow-journal"
VERSION = 1
_MAX_RECORD = 4096


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
        return msgpack.packb(
            [
                "C",
                self.offset,
                self.stride,
                self.size,
                self.gen,
                self.xxh3,
                self.ns,
                self.block_hash,
                self.shard,
            ],
            use_bin_type=True,
        )


class Journal:
    """Append-only record of commits and drops of one pool."""

    def __init__(self, path: Path, pool_bytes: int, slab_bytes: int) -> None:
        self.path = path
        self.pool_bytes = pool_bytes
        self.slab_bytes = slab_bytes
        self._fd: int | None = None
        self._records = 0
        self._live = 0

    def replay(self) -> list[SlotRecord]:
        """The blocks the journal says are committed (empty if absent or for another
        pool geometry).  Unreadable tails are ignored."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return []
        return list(self._live_records(_records(data), self.pool_bytes, self.slab_bytes))

    @staticmethod
    def _live_records(
        records: Iterator[list], pool_bytes: int, slab_bytes: int
    ) -> Iterator[SlotRecord]:
        header = next(records, None)
        if header != [MAGIC, VERSION, pool_bytes, slab_bytes]:
            return
        live: dict[int, SlotRecord] = {}
        for r in records:
            try:
                if r[0] == "C":
                    rec = SlotRecord(*r[1:9])
                    live[rec.offset] = rec
                elif r[0] == "D":
                    cur = live.get(r[1])
                    if cur is not None and cur.gen == r[2]:
                        del live[r[1]]
            except (TypeError, IndexError, ValueError):
                break  # a torn record: everything after it is suspect
        yield from live.values()

    def rewrite(self, live: Iterable[SlotRecord]) -> None:
        """Replace the journal by a compact one holding ``live``, then append to it."""
        self.close()
        tmp = self.path.with_suffix(".journal.tmp")
        parts = [msgpack.packb([MAGIC, VERSION, self.pool_bytes, self.slab_bytes])]
        parts += [r.pack() for r in live]
        tmp.write_bytes(b"".join(parts))
        os.replace(tmp, self.path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self._records = self._live = len(parts) - 1

    def committed(self, rec: SlotRecord) -> None:
        self._append(rec.pack())
        self._live += 1

    def dropped(self, offset: int, gen: int) -> None:
        self._append(msgpack.packb(["D", offset, gen]))
        self._live -= 1

    def needs_compaction(self) -> bool:
        """Whether dead records outnumber live ones by far (the caller rewrites)."""
        return self._records > 100_000 and self._records > 4 * self._live

    def _append(self, data: bytes) -> None:
        if self._fd is None:
            return
        os.write(self._fd, data)
        self._records += 1

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _records(data: bytes) -> Iterator[list]:
    unpacker = msgpack.Unpacker(
        raw=False,
        max_buffer_size=max(len(data), 1),
        max_bin_len=_MAX_RECORD,
        max_str_len=_MAX_RECORD,
    )
    unpacker.feed(data)
    try:
        for r in unpacker:
            if not isinstance(r, list):
                return
            yield r
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        return
