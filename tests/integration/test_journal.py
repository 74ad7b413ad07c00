"""The pool's journal: validated replay, a fuzz of replay, and ENOSPC on a real file system.

The ENOSPC tests mount a tiny tmpfs of their own (root only; skipped otherwise) and fill
it for real: no fake ``os.write`` in them.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pegaflow.storage_node.blocks import Entry
from pegaflow.storage_node.journal import Journal, parse
from pegaflow.storage_node.pool import BlockPool

from pegaflow.checksum import checksum
from tests.support.journal import (
    HEAD,
    POOL,
    SLAB,
    KiB,
    fill,
    frame,
    pack_v1,
    tmpfs,
    unframe,
    unpack_v1,
    v1_journal,
)


def commit(pool: BlockPool, name: bytes, size: int, ns: str = "ns") -> Entry:
    """Store a block of ``size`` bytes derived from ``name``; returns its entry."""
    e = pool.reserve((ns, name, 0), size, 30)
    assert e is not None
    rng = np.random.default_rng(list(name))
    pool.view(e)[:] = rng.integers(0, 255, size, dtype=np.uint8)
    pool.commit(e, checksum(pool.view(e)))
    return e


FORMATS = {
    "v1": (pack_v1, unpack_v1),
    "v2": (lambda objs: b"".join(map(frame, objs)), unframe),
}


# ---- validated replay ------------------------------------------------------------

Stored = dict[tuple[str, bytes, int], bytes]


@pytest.fixture(params=["v1", "v2"])
def journaled(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, Stored, str]:
    """A closed pool with 8 committed blocks (two size classes) and its journal, in
    either format."""
    pool = BlockPool(tmp_path / "p.pool", POOL, SLAB, node_id="n")
    stored, entries = {}, []
    for i in range(8):
        e = commit(pool, bytes([i]) * 32, 5000 if i % 2 else 20000)
        stored[e.key] = bytes(pool.view(e))
        entries.append(e)
    pool.close()
    if request.param == "v1":
        (tmp_path / "p.journal").write_bytes(v1_journal(entries))
    return tmp_path / "p.pool", stored, request.param


def _c_records(objs: list[Any]) -> list[int]:
    return [i for i, r in enumerate(objs) if isinstance(r, list) and r and r[0] == "C"]


@pytest.mark.parametrize(
    "field,value",
    [
        (1, "0"),  # offset as str
        (2, 4096.0),  # stride as float
        (3, None),  # size
        (3, 1 << 63),  # a size far beyond the slot
        (4, b"gen"),  # gen as bytes
        (5, -1),  # xxh3 negative
        (6, 7),  # ns as int
        (7, "hash"),  # hash as str
        (8, [0]),  # shard as a list
        (8, 1 << 40),  # shard out of range
        (1, True),  # a bool is no offset
        (7, b"x" * 65),  # a hash longer than any block hash
        (6, "a/b"),  # not a namespace
    ],
)
def test_a_type_changed_record_is_skipped_and_counted(
    journaled: tuple[Path, Stored, str],
    field: int,
    value: object,
    caplog: pytest.LogCaptureFixture,
) -> None:
    path, stored, fmt = journaled
    pack, unpack = FORMATS[fmt]
    jpath = path.with_suffix(".journal")
    objs = unpack(jpath.read_bytes())
    victim = _c_records(objs)[3]
    bad_key = (objs[victim][6], objs[victim][7], objs[victim][8])
    objs[victim][field] = value
    jpath.write_bytes(pack(objs))
    with caplog.at_level(logging.WARNING):
        pool = BlockPool(path, POOL, SLAB, node_id="n")  # replay must not raise
    try:
        assert {e.key for e in pool.recovered} == set(stored) - {bad_key}
        assert pool.journal is not None and pool.journal.bad_records == 1
        assert any(
            r.levelno == logging.WARNING and "1 bad record" in r.getMessage()
            for r in caplog.records
        )
    finally:
        pool.close(unlink=True)


def test_a_flipped_bit_in_a_size_field_loses_one_block_at_most(
    journaled: tuple[Path, Stored, str],
) -> None:
    path, stored, fmt = journaled
    pack, unpack = FORMATS[fmt]
    jpath = path.with_suffix(".journal")
    data = jpath.read_bytes()
    objs = unpack(data)
    victim = objs[_c_records(objs)[2]]
    size_at = data.index(pack([victim])) + len(pack([victim[:3]]))
    if fmt == "v2":
        size_at -= HEAD.size  # the frame header was counted twice
    for bit in range(24):  # every bit of the size (a uint16: type byte and two bytes)
        corrupt = bytearray(data)
        corrupt[size_at + bit // 8] ^= 1 << (bit % 8)
        jpath.write_bytes(bytes(corrupt))
        pool = BlockPool(path, POOL, SLAB, node_id="n")
        try:
            got = {e.key for e in pool.recovered}
            if fmt == "v2":  # the crc catches it: exactly that block is lost
                assert got == set(stored) - {(victim[6], victim[7], victim[8])}
            else:  # no frames: the blocks journaled after it may be lost, never garbled
                assert got <= set(stored)
            for e in pool.recovered:
                assert bytes(pool.view(e)) == stored[e.key]
        finally:
            pool.close()
        jpath.write_bytes(data)


def test_a_damaged_frame_mid_journal_does_not_hide_later_records(tmp_path: Path) -> None:
    pool = BlockPool(tmp_path / "p.pool", POOL, SLAB, node_id="n")
    keys = [commit(pool, bytes([i]) * 32, 5000).key for i in range(8)]
    pool.close()
    jpath = tmp_path / "p.journal"
    data = jpath.read_bytes()
    objs = unframe(data)
    victim = frame(objs[_c_records(objs)[1]])
    at = data.index(victim)
    for corrupt in (
        data[: at + len(victim) // 2] + data[at + len(victim) :],  # torn (a short write)
        data[:at] + b"\xc1" + data[at + 1 :],  # its magic damaged
        data[: at + 2] + b"\xff\x0f" + data[at + 4 :],  # its length damaged (4 KiB)
        data[: at + 9] + b"\xdb\xff\xff\xff\xff" + data[at + 14 :],  # a 4 GiB str header
        data[:at] + b"PJ\x05\x00\x00\x00\x00\x00junk" + data[at:],  # junk frame inserted
    ):
        jpath.write_bytes(corrupt)
        j = Journal(jpath, POOL, SLAB)
        got = {(r.ns, r.block_hash, r.shard) for r in j.replay()}
        assert got >= set(keys) - {keys[1]} and j.bad_records == 1 and not j.torn_tail


def test_a_torn_tail_is_the_end_and_not_counted(journaled: tuple[Path, Stored, str]) -> None:
    path, stored, _ = journaled
    jpath = path.with_suffix(".journal")
    data = jpath.read_bytes()
    for cut in range(1, 40):
        jpath.write_bytes(data[:-cut])
        j = Journal(jpath, POOL, SLAB)
        assert len(j.replay()) == len(stored) - 1 and j.bad_records == 0 and j.torn_tail


def test_a_journal_of_another_geometry_or_with_a_damaged_header_is_not_replayed(
    journaled: tuple[Path, Stored, str],
) -> None:
    path, stored, _ = journaled
    jpath = path.with_suffix(".journal")
    assert len(Journal(jpath, POOL, SLAB).replay()) == len(stored)
    assert Journal(jpath, POOL, SLAB // 2).replay() == []
    data = bytearray(jpath.read_bytes())
    data[5] ^= 0x10
    jpath.write_bytes(bytes(data))
    assert Journal(jpath, POOL, SLAB).replay() == []


def test_the_pool_id_survives_reattach(tmp_path: Path) -> None:
    pool = BlockPool(tmp_path / "p.pool", POOL, SLAB, node_id="n")
    first = pool.pool_id
    pool.close()
    pool = BlockPool(tmp_path / "p.pool", POOL, SLAB, node_id="n")
    assert pool.pool_id == first
    pool.close(unlink=True)
    pool = BlockPool(tmp_path / "p.pool", POOL, SLAB, node_id="n")
    assert pool.pool_id != first  # a new pool file is a new pool
    pool.close(unlink=True)


# ---- fuzz ------------------------------------------------------------------------

_VALUES: list[Any] = [
    None, True, False, 0, -1, 1, 4095, 4096, 1 << 31, 1 << 32, (1 << 63) - 1, 1 << 63,
    (1 << 64) - 1, -(1 << 63), 0.5, float("inf"), "", "ns", "C", "D", "x" * 300, b"",
    b"\x00" * 32, b"y" * 64, b"z" * 65, [], [1, 2], {}, {"a": 1},
]  # fmt: skip
_HUGE = [
    b"\xdb\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff",
    b"\xdf\xff\xff\xff\xff", b"\xc9\xff\xff\xff\xff\x01", b"\xdc\xff\xff",
    b"PJ\xff\xff\x00\x00\x00\x00", b"PJ\x00\x10\x00\x00\x00\x00",
]  # fmt: skip


def _mutations(
    journals: list[tuple[bytes, str]], rng: random.Random
) -> Iterator[tuple[str, bytes]]:
    while True:
        real, fmt = rng.choice(journals)
        pack, unpack = FORMATS[fmt]
        objs = unpack(real)
        header = pack(objs[:1])
        kind = rng.randrange(7)
        if kind == 0:
            yield "random", rng.randbytes(rng.randrange(0, 600))
        elif kind == 1:
            yield "random-after-header", header + rng.randbytes(rng.randrange(0, 600))
        elif kind == 2:
            b = bytearray(real)
            for _ in range(rng.randrange(1, 4)):
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            yield "bitflip", bytes(b)
        elif kind == 3:
            for _ in range(rng.randrange(1, 3)):
                r = objs[rng.randrange(1, len(objs))]
                r[rng.randrange(len(r))] = rng.choice(_VALUES)
            yield "type-change", pack(objs)
        elif kind == 4:
            yield "truncated", real[: rng.randrange(len(real))]
        elif kind == 5:
            i = rng.randrange(len(header), len(real))
            yield "huge", real[:i] + rng.choice(_HUGE) + real[i:]
        else:
            body = objs[1:]
            pick = [rng.choice(body) for _ in range(rng.randrange(0, 2 * len(body)))]
            yield "spliced", pack([objs[0], *pick])


@pytest.fixture
def shm_path() -> Iterator[Path]:
    """A fresh directory in /dev/shm (where pools live; faster than a disk for 1000s
    of small writes), removed afterwards."""
    d = tempfile.mkdtemp(
        prefix="pegaflow-test-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
    )
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def test_fuzz_replay_never_raises_and_the_pool_trusts_only_verified_blocks(
    shm_path: Path,
) -> None:
    path = shm_path / "f.pool"
    pool = BlockPool(path, POOL, SLAB, node_id="n")
    ever: Stored = {}
    entries = []
    for i in range(16):
        e = commit(pool, i.to_bytes(2, "big") * 16, (3000, 9000, 40000)[i % 3])
        ever[e.key] = bytes(pool.view(e))
        entries.append(e)
    for e in entries[::4]:
        pool.drop(e)
    for i in range(16, 20):  # reuse dropped slots
        e = commit(pool, i.to_bytes(2, "big") * 16, 3000)
        ever[e.key] = bytes(pool.view(e))
    live = list(pool.committed())
    pool.close()
    jpath = path.with_suffix(".journal")
    journals = [(jpath.read_bytes(), "v2"), (v1_journal(live), "v1")]
    rng = random.Random(20260)
    kinds: dict[str, int] = {}
    for n, (kind, data) in enumerate(_mutations(journals, rng)):
        if n >= 10_000:
            break
        kinds[kind] = kinds.get(kind, 0) + 1
        for r in parse(data, POOL, SLAB).records:  # never raises; all of it fits the pool
            assert 0 <= r.offset and r.offset + r.stride <= POOL
            assert 0 < r.size <= r.stride <= SLAB and r.stride % 4096 == 0
            assert (r.offset % SLAB) % r.stride == 0
        if n % 16 == 0:  # and the pool adopts only blocks whose bytes verify
            jpath.write_bytes(data)
            p = BlockPool(path, POOL, SLAB, node_id="n")
            try:
                spans = []
                for e in p.recovered:
                    view = bytes(p.view(e))
                    assert checksum(view) == e.xxh3
                    if e.key in ever:
                        assert view == ever[e.key]
                    spans.append((e.offset, e.offset + e.stride))
                spans.sort()
                assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
            finally:
                p.close()
    assert len(kinds) == 7 and min(kinds.values()) > 1000


# ---- ENOSPC on a real file system -------------------------------------------------


def test_a_full_file_system_truncates_the_journal_to_its_last_record(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with tmpfs(POOL + 256 * KiB) as d:
        path = d / "p.pool"
        pool = BlockPool(path, POOL, SLAB, node_id="n")
        filler = fill(d, leave=3 * KiB)  # room for a few dozen records
        stored: dict[Any, bytes] = {}
        with caplog.at_level(logging.WARNING):
            for i in range(200):  # 200 records do not fit: commits keep working
                e = commit(pool, i.to_bytes(2, "big") * 16, 4096)
                stored[e.key] = bytes(pool.view(e))
        assert pool.journal is not None and pool.journal.degraded
        assert any(r.levelno == logging.ERROR and "free space" in r.getMessage().lower()
                   for r in caplog.records)  # fmt: skip
        # what reached the disk ends at a record boundary and replays in full
        j = Journal(path.with_suffix(".journal"), POOL, SLAB)
        journaled = {(r.ns, r.block_hash, r.shard) for r in j.replay()}
        assert 10 < len(journaled) < 200 and j.bad_records == 0 and not j.torn_tail
        # space comes back: the journal is rewritten from the live blocks
        filler.unlink()
        pool.journal.retry_at = 0.0
        pool.maintain_journal()
        assert not pool.journal.degraded
        e = commit(pool, b"after", 4096)
        stored[e.key] = bytes(pool.view(e))
        pool.close()
        pool = BlockPool(path, POOL, SLAB, node_id="n")
        try:
            assert {e.key for e in pool.recovered} == set(stored)
            for e in pool.recovered:
                assert bytes(pool.view(e)) == stored[e.key]
        finally:
            pool.close(unlink=True)


def test_no_room_even_for_the_compact_rewrite_keeps_the_old_journal() -> None:
    with tmpfs(POOL + 128 * KiB) as d:
        path = d / "p.pool"
        pool = BlockPool(path, POOL, SLAB, node_id="n")
        first = commit(pool, b"first", 4096)
        pool.close()
        fill(d, leave=0)
        pool = BlockPool(path, POOL, SLAB, node_id="n")  # the attach rewrite fails
        try:
            assert [e.key for e in pool.recovered] == [first.key]
            assert pool.journal is not None and pool.journal.degraded
            commit(pool, b"second", 4096)  # serving goes on
            assert not list(d.glob("*.tmp"))
        finally:
            pool.close()
        (d / "filler").unlink()
        pool = BlockPool(path, POOL, SLAB, node_id="n")
        try:  # the old journal survived: the first block is still replayable
            assert first.key in {e.key for e in pool.recovered}
        finally:
            pool.close(unlink=True)


def test_short_writes_are_completed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A unit test of the write loop: os.write may write less than asked."""
    import pegaflow.storage_node.journal as journal_mod

    pool = BlockPool(tmp_path / "p.pool", POOL, SLAB, node_id="n")
    real_write = os.write

    def short_write(fd: int, data: Any) -> int:
        return real_write(fd, bytes(data)[: max(1, len(data) // 3)])

    monkeypatch.setattr(journal_mod.os, "write", short_write)
    keys = {commit(pool, bytes([i]) * 8, 4096).key for i in range(5)}
    monkeypatch.undo()
    pool.close()
    pool = BlockPool(tmp_path / "p.pool", POOL, SLAB, node_id="n")
    try:
        assert {e.key for e in pool.recovered} == keys
    finally:
        pool.close(unlink=True)
