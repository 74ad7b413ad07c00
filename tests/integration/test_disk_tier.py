"""The disk tier alone: real files under tmp_path, real I/O threads, a real ``kill -9``."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import signal
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pegaflow.storage_node.blocks import BlockKey
from pegaflow.storage_node.disk_files import DiskInUse, DiskIO
from pegaflow.storage_node.disk_format import HEADER_BYTES, RECORD_BYTES
from pegaflow.storage_node.disk_tier import DiskTier

from pegaflow.checksum import checksum
from pegaflow.errors import BadRequest, IncompatibleFormat

KiB = 1 << 10
BLOCK = 64 * KiB + 100
"""not a multiple of 4 KiB: every read and write has a partial tail"""
STRIDE = 68 * KiB


def key(i: int) -> BlockKey:
    return ("ns", f"block-{i}".encode(), i % 3)


def payload(i: int, n: int = BLOCK) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


def open_tier(path: Path, slots: int, **kw: Any) -> DiskTier:
    return DiskTier(path, slots * STRIDE, BLOCK, **kw)


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[DiskTier]:
    t = open_tier(tmp_path / "disk", 16)
    t.recover()
    yield t
    t.close()


def spill_all(t: DiskTier, ids: Sequence[int]) -> None:
    for i in ids:
        assert t.spill(key(i), i, payload(i))
        assert t.flush(30)


class FaultyIO(DiskIO):
    """Raises ``OSError(err)`` on writes or reads of the slab files while armed."""

    def __init__(self) -> None:
        self.write_err = 0
        self.read_err = 0
        self.slab_fds: set[int] = set()
        self.gate = threading.Event()
        self.gate.set()

    def pwritev(self, fd: int, bufs: Sequence[Any], offset: int) -> int:
        self.gate.wait(30)
        if self.write_err and fd in self.slab_fds:
            raise OSError(self.write_err, os.strerror(self.write_err))
        return super().pwritev(fd, bufs, offset)

    def preadv(self, fd: int, bufs: Sequence[Any], offset: int) -> int:
        if self.read_err and fd in self.slab_fds:
            raise OSError(self.read_err, os.strerror(self.read_err))
        return super().preadv(fd, bufs, offset)


def faulty_tier(path: Path, slots: int, **kw: Any) -> tuple[DiskTier, FaultyIO]:
    io = FaultyIO()
    t = open_tier(path, slots, io=io, **kw)
    io.slab_fds = set(t._files.fds)
    t.recover()
    return t, io


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_spill_and_read_back_byte_exact_across_reopen(tmp_path: Path, direct: bool) -> None:
    """A working set of 48 blocks (3 MiB, past a memory budget of a few blocks) goes to
    disk and comes back byte-exact, through read, read_into (aligned and unaligned
    buffers), and after the tier is closed and reopened."""
    t = open_tier(tmp_path / "d", 64, file_bytes=20 * STRIDE, direct=direct)  # 4 slab files
    assert t.recover() == []
    ids = range(48)
    for i in ids:
        assert t.spill(key(i), i, payload(i))
        if i % 16 == 15:  # the queue holds 16 spills
            assert t.flush(60)
    futs = {i: t.read(key(i)) for i in ids}
    assert all(futs[i].result(30) == payload(i) for i in ids)
    aligned = np.zeros(STRIDE, dtype=np.uint8)  # numpy's large arrays are page-aligned
    odd = bytearray(BLOCK + 7)
    for i in ids:
        assert t.read_into(key(i), aligned).result(30) == BLOCK
        assert aligned[:BLOCK].tobytes() == payload(i)
        view = memoryview(odd)[3:]
        assert t.read_into(key(i), view).result(30) == BLOCK
        assert bytes(view[:BLOCK]) == payload(i)
    with pytest.raises(BadRequest):
        t.read_into(key(0), bytearray(10))
    st = t.stats()
    assert (st.blocks, st.spills, st.hits, st.misses, st.errors) == (48, 48, 144, 0, 0)
    assert st.write_bytes == 48 * STRIDE and st.read_bytes == 144 * STRIDE
    assert st.direct_io == direct  # tmp_path's file system allows O_DIRECT here
    assert t.read(key(999)).result(30) is None and t.stats().misses == 1
    t.close()

    t = open_tier(tmp_path / "d", 64, file_bytes=20 * STRIDE, direct=not direct)
    assert set(t.recover()) == {key(i) for i in ids}
    info = t.info(key(7))
    assert info is not None and (info.gen, info.length) == (7, BLOCK)
    assert info.xxh3 == checksum(payload(7)) and t.info(key(999)) is None
    assert all(t.read(key(i)).result(30) == payload(i) for i in ids)
    t.close()


def test_small_blocks_and_duplicates(tier: DiskTier) -> None:
    """Blocks shorter than a slot, a key spilled twice (written once), and bad sizes."""
    assert tier.spill(key(1), 1, b"x" * 10)
    assert tier.spill(key(1), 1, b"y" * 10)
    assert not tier.spill(key(2), 2, b"z" * (BLOCK + 1))
    assert not tier.spill(key(3), 3, b"")
    with pytest.raises(BadRequest):
        tier.spill(("bad namespace!", b"h", 0), 1, b"x")
    assert tier.flush(30)
    assert tier.read(key(1)).result(30) == b"x" * 10
    st = tier.stats()
    assert (st.spills, st.spill_drops, st.blocks) == (1, 2, 1)


def test_lru_eviction_order_and_callback(tmp_path: Path) -> None:
    evicted: list[BlockKey] = []
    t = open_tier(tmp_path / "d", 4, on_evict=evicted.append)
    t.recover()
    spill_all(t, [0, 1, 2, 3])
    assert t.read(key(0)).result(30) == payload(0)  # 0 is now the most recent
    spill_all(t, [4, 5])
    assert evicted == [key(1), key(2)]
    assert t.keys() == [key(3), key(0), key(4), key(5)]
    assert not t.contains(key(1)) and t.read(key(1)).result(30) is None
    assert t.discard(key(3)) and not t.discard(key(3))
    spill_all(t, [6])  # takes 3's freed slot: nothing evicted
    assert evicted == [key(1), key(2)] and t.stats().evictions == 2
    t.close()
    t = open_tier(tmp_path / "d", 4, on_evict=evicted.append)
    assert t.recover() == [key(0), key(4), key(5), key(6)]  # order of their writes
    t.close()


_KILL_CHILD = """
import os, signal, sys
import numpy as np
from pegaflow.storage_node.disk_files import DiskIO
from pegaflow.storage_node.disk_tier import DiskTier
from tests.integration.test_disk_tier import BLOCK, STRIDE, key, payload

class TearAndDie(DiskIO):
    armed = False
    def pwritev(self, fd, bufs, offset):
        if self.armed and fd != tier._files.index_fd:
            half = bytes(bufs[0])[: len(bufs[0]) // 2]
            os.pwrite(fd, half, offset)  # a torn write: half the payload, then gone
            os.kill(os.getpid(), signal.SIGKILL)
        return super().pwritev(fd, bufs, offset)

io = TearAndDie()
tier = DiskTier(sys.argv[1], 8 * STRIDE, BLOCK, io=io, direct=False)
tier.recover()
for i in range(12):
    tier.spill(key(i), i, payload(i))
    tier.flush(30)
io.armed = True
tier.spill(key(12), 12, payload(12))
tier.flush(30)
print("not killed", flush=True)
"""


def test_kill_9_mid_spill_keeps_only_verified_blocks(tmp_path: Path) -> None:
    """A process killed by SIGKILL in the middle of a payload write (into the slot of the
    block it evicted): after recover, exactly the blocks whose writes completed remain,
    each byte-exact; neither the torn block nor the one it displaced comes back."""
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", _KILL_CHILD, str(tmp_path / "d")],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    t = open_tier(tmp_path / "d", 8)
    kept = t.recover()  # records only: the torn slot's record was cleared before it
    assert kept == [key(i) for i in range(5, 12)]  # 0-3 evicted, 4 displaced by the tear
    assert t.scrub().result(60) == []  # every payload left verifies
    assert all(t.read(key(i)).result(30) == payload(i) for i in range(5, 12))
    st = t.stats()
    assert st.errors == 0 and st.blocks == 7
    spill_all(t, [20])  # the torn slot is usable again
    assert t.read(key(20)).result(30) == payload(20)
    t.close()


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_corrupt_payload_is_a_miss_and_dropped(tmp_path: Path) -> None:
    evicted: list[BlockKey] = []
    t = open_tier(tmp_path / "d", 4)
    t.recover()
    spill_all(t, [0, 1, 2])
    t.close()
    slab = tmp_path / "d" / "pegaflow-disk.0.slab"
    _flip(slab, HEADER_BYTES + 0 * STRIDE + 1000)  # slot 0: block 0
    _flip(slab, HEADER_BYTES + 1 * STRIDE + BLOCK - 1)  # slot 1: block 1's last byte

    t = open_tier(tmp_path / "d", 4, on_evict=evicted.append)
    assert len(t.recover()) == 3  # records verify; payloads are checked at first read
    assert t.read(key(0)).result(30) is None
    buf = np.zeros(STRIDE, dtype=np.uint8)
    assert t.read_into(key(1), buf).result(30) is None
    assert t.read(key(2)).result(30) == payload(2)
    st = t.stats()
    assert (st.errors, st.misses, st.hits, st.blocks) == (2, 2, 1, 1)
    assert evicted == [key(0), key(1)]
    assert not t.contains(key(0)) and t.read(key(0)).result(30) is None
    t.close()

    t = open_tier(tmp_path / "d", 4)  # the dropped slots' records were cleared
    assert t.recover() == [key(2)]
    t.close()


def test_recover_verify_drops_corrupt_payloads_up_front(tmp_path: Path) -> None:
    t = open_tier(tmp_path / "d", 4)
    t.recover()
    spill_all(t, [0, 1])
    t.close()
    _flip(tmp_path / "d" / "pegaflow-disk.0.slab", HEADER_BYTES + STRIDE + 5)
    evicted: list[BlockKey] = []
    t = open_tier(tmp_path / "d", 4, on_evict=evicted.append)
    assert t.recover(verify=True) == [key(0)]
    assert evicted == [key(1)] and t.stats().errors == 1
    t.close()


def test_corrupt_record_is_refused(tmp_path: Path) -> None:
    t = open_tier(tmp_path / "d", 4)
    t.recover()
    spill_all(t, [0, 1, 2])
    t.close()
    index = tmp_path / "d" / "pegaflow-disk.index"
    _flip(index, HEADER_BYTES + 1 * RECORD_BYTES + 60)  # slot 1's namespace
    _flip(index, HEADER_BYTES + 2 * RECORD_BYTES + 8)  # slot 2's slot number
    t = open_tier(tmp_path / "d", 4)
    assert t.recover() == [key(0)]
    st = t.stats()
    assert st.recover_dropped == 2 and st.blocks == 1
    spill_all(t, [3, 4, 5])  # the dropped slots are free again: nothing evicted
    assert t.stats().evictions == 0
    t.close()


def test_truncated_index_loses_only_the_cut_records(tmp_path: Path) -> None:
    t = open_tier(tmp_path / "d", 4)
    t.recover()
    spill_all(t, [0, 1, 2])
    t.close()
    index = tmp_path / "d" / "pegaflow-disk.index"
    os.truncate(index, HEADER_BYTES + RECORD_BYTES + 100)  # cut inside slot 1's record
    t = open_tier(tmp_path / "d", 4)
    assert t.recover() == [key(0)] and t.stats().recover_dropped == 1
    spill_all(t, [3, 4, 5])  # slots 1-3 are free again: nothing evicted
    assert t.stats().evictions == 0 and t.read(key(5)).result(30) == payload(5)
    t.close()


def test_incompatible_header_is_refused_and_left_alone(tmp_path: Path) -> None:
    t = open_tier(tmp_path / "d", 4)
    t.recover()
    spill_all(t, [0])
    t.close()
    index = tmp_path / "d" / "pegaflow-disk.index"
    good = index.read_bytes()

    with pytest.raises(IncompatibleFormat, match="written for blocks of"):
        DiskTier(tmp_path / "d", 4 * STRIDE, BLOCK + 8192)  # another block size
    with pytest.raises(IncompatibleFormat, match="written for blocks of"):
        open_tier(tmp_path / "d", 5)  # another capacity

    bad = bytearray(good)
    struct.pack_into("<I", bad, 16, 2)  # format version 2
    index.write_bytes(bytes(bad))
    with pytest.raises(IncompatibleFormat, match="format version 2, this build reads version 1"):
        open_tier(tmp_path / "d", 4)
    assert index.read_bytes() == bytes(bad)  # refused, not rewritten

    bad = bytearray(good)
    bad[40] ^= 1  # inside the header: checksum mismatch
    index.write_bytes(bytes(bad))
    with pytest.raises(IncompatibleFormat, match="damaged"):
        open_tier(tmp_path / "d", 4)

    index.write_bytes(b"something else entirely" * 200)
    with pytest.raises(IncompatibleFormat, match="not a pegaflow disk tier"):
        open_tier(tmp_path / "d", 4)

    index.write_bytes(good)  # the lock was released by every refused open
    t = open_tier(tmp_path / "d", 4)
    assert t.recover() == [key(0)] and t.read(key(0)).result(30) == payload(0)
    t.close()


def test_second_process_refused_while_in_use(tier: DiskTier) -> None:
    with pytest.raises(DiskInUse, match="in use by another process"):
        DiskTier(tier.path, 16 * STRIDE, BLOCK)


def test_write_errors_are_counted_and_blocks_stay_readable(tmp_path: Path) -> None:
    """A full disk (ENOSPC on every payload write): spills fail, are counted, and nothing
    raises; what is on disk keeps being served; the tier works again once there is room."""
    done: list[tuple[BlockKey, bool]] = []
    t, io = faulty_tier(tmp_path / "d", 8, on_spilled=lambda k, ok: done.append((k, ok)))
    spill_all(t, [0, 1])
    io.write_err = errno.ENOSPC
    for i in range(2, 6):
        assert t.spill(key(i), i, payload(i))
    assert t.flush(30)
    st = t.stats()
    assert (st.errors, st.spill_drops, st.spills, st.blocks) == (4, 4, 2, 2)
    assert not t.contains(key(2)) and t.read(key(2)).result(30) is None
    assert sorted(done) == sorted((key(i), i < 2) for i in range(6))  # 2 write threads
    assert t.read(key(1)).result(30) == payload(1)
    io.write_err = 0
    spill_all(t, [2])
    assert t.read(key(2)).result(30) == payload(2)
    t.close()


def test_read_error_is_a_counted_miss(tmp_path: Path) -> None:
    evicted: list[BlockKey] = []
    t, io = faulty_tier(tmp_path / "d", 8, on_evict=evicted.append)
    spill_all(t, [0, 1])
    io.read_err = errno.EIO
    assert t.read(key(0)).result(30) is None
    st = t.stats()
    assert (st.errors, st.misses, st.blocks) == (1, 1, 1) and evicted == [key(0)]
    io.read_err = 0
    assert t.read(key(1)).result(30) == payload(1)
    t.close()


def test_full_queue_drops_spills_without_blocking(tmp_path: Path) -> None:
    t, io = faulty_tier(tmp_path / "d", 32, queue_depth=4)
    io.gate.clear()  # the disk stalls: writes queue up
    results = [t.spill(key(i), i, payload(i)) for i in range(10)]
    assert results == [True] * 4 + [False] * 6
    assert t.stats().spill_drops == 6
    io.gate.set()
    assert t.flush(30)
    assert t.stats().spills == 4 and all(t.contains(key(i)) for i in range(4))
    t.close()


_FSIZE_CHILD = """
import json, resource, signal, sys
from pegaflow.storage_node.disk_tier import DiskTier
from tests.integration.test_disk_tier import BLOCK, STRIDE, key, payload

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
tier = DiskTier(sys.argv[1], 16 * STRIDE, BLOCK, preallocate=False)
tier.recover()
resource.setrlimit(resource.RLIMIT_FSIZE, (8 * STRIDE, 8 * STRIDE))
for i in range(16):
    tier.spill(key(i), i, payload(i))
    tier.flush(30)
ok = [i for i in range(16) if tier.read(key(i)).result(30) == payload(i)]
print(json.dumps({"ok": ok, "errors": tier.stats().errors}))
"""


def test_file_size_limit_is_counted_not_a_crash(tmp_path: Path) -> None:
    """A real write failure from the kernel (EFBIG past RLIMIT_FSIZE on sparse files,
    as a full disk would give ENOSPC): the process keeps going, the blocks that fit are
    served, the rest are counted errors."""
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", _FSIZE_CHILD, str(tmp_path / "d")],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["ok"] == list(range(7))  # the 4 KiB header + 7 slots fit under 8 strides
    assert out["errors"] == 9


def test_concurrent_reads_and_evicting_spills_never_return_wrong_bytes(tmp_path: Path) -> None:
    """Reads race spills that evict the very blocks being read (pinned slots are never
    reused under a read): every hit is byte-exact, nothing is counted as an error."""
    t = open_tier(tmp_path / "d", 6, read_threads=4, write_threads=2)
    t.recover()
    stop = threading.Event()
    wrong: list[int] = []

    def reader() -> None:
        while not stop.is_set():
            for i in range(40):
                got = t.read(key(i)).result(30)
                if got is not None and got != payload(i):
                    wrong.append(i)

    readers = [threading.Thread(target=reader) for _ in range(2)]
    for r in readers:
        r.start()
    for i in range(40):
        while not t.spill(key(i), i, payload(i)):
            t.flush(30)
    t.flush(30)
    stop.set()
    for r in readers:
        r.join(60)
    st = t.stats()
    assert wrong == [] and st.errors == 0 and st.hits > 0 and st.blocks == 6
    t.close()


async def _read_async(t: DiskTier, i: int) -> bytes | None:
    return await asyncio.wrap_future(t.read(key(i)))


def test_reads_from_asyncio_and_a_lost_slab_file(tmp_path: Path) -> None:
    """Futures await in a loop; a slab file deleted while the tier was closed loses its
    blocks (records cleared at recover) without failing the rest."""
    t = open_tier(tmp_path / "missing" / "d", 4, file_bytes=HEADER_BYTES + 2 * STRIDE)
    t.recover()
    spill_all(t, [0, 1, 2, 3])

    async def main() -> list[bytes | None]:
        return await asyncio.gather(*(_read_async(t, i) for i in range(5)))

    assert asyncio.run(main()) == [*(payload(i) for i in range(4)), None]
    t.close()
    (tmp_path / "missing" / "d" / "pegaflow-disk.1.slab").unlink()
    t = open_tier(tmp_path / "missing" / "d", 4, file_bytes=HEADER_BYTES + 2 * STRIDE)
    assert t.recover() == [key(0), key(1)] and t.stats().recover_dropped == 2
    spill_all(t, [5])
    assert t.read(key(5)).result(30) == payload(5)
    t.close()


def test_the_start_says_what_it_opens_and_how_far_it_got(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Opening a tier of many slots takes seconds (4.5 s for 12 GiB of 4 KiB blocks):
    a start line, then progress lines while the files are made and the index read."""
    from pegaflow.storage_node import disk_files

    monkeypatch.setattr(disk_files, "PROGRESS_S", 0.0)  # every step shows
    monkeypatch.setattr(disk_files, "_SCAN_RECORDS", 16)
    with caplog.at_level(logging.INFO, logger="pegaflow.storage_node"):
        t = DiskTier(tmp_path, 64 * STRIDE, BLOCK, file_bytes=16 * STRIDE + HEADER_BYTES)
        try:
            t.recover()
        finally:
            t.close()
    msgs = [r.getMessage() for r in caplog.records]
    assert any(f"opening 4 MiB in 64 slots of {STRIDE} bytes" in m for m in msgs), msgs
    assert any("slab files opened: 50%" in m for m in msgs), msgs
    assert any("reading the records of 64 slots" in m for m in msgs), msgs
    assert any("index records read: 75%" in m for m in msgs), msgs
