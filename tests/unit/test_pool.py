"""Unit tests of the block pool's allocator, LRU and pins (pure logic, a real shm file)."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pegaflow.storage_node.blocks import Entry
from pegaflow.storage_node.pool import BlockPool

from pegaflow.errors import NoSpace, TooLarge

MiB = 1 << 20


@pytest.fixture
def evicted() -> list[Entry]:
    return []


def make_pool(
    tmp_path: Path, evicted: list[Entry], pool: int = 4 * MiB, slab: int = MiB
) -> BlockPool:
    return BlockPool(tmp_path / "pool", pool, slab, node_id="n", on_evict=evicted.append)


def put(pool: BlockPool, name: bytes, size: int, fill: int = 1) -> Entry:
    e = pool.reserve(("ns", name, 0), size, 30)
    assert e is not None
    pool.view(e)[:] = fill
    pool.commit(e, fill)
    return e


def test_reserve_commit_and_duplicate(tmp_path: Path, evicted: list[Entry]) -> None:
    pool = make_pool(tmp_path, evicted)
    e = pool.reserve(("ns", b"a", 0), 1000, 30)
    assert e is not None and pool.get(e.key) is None  # reserved blocks are invisible
    assert pool.reserve(("ns", b"a", 0), 1000, 30) is None  # in flight: refused
    loc = pool.commit(e, 42)
    assert pool.get(e.key) is e and loc.size == 1000 and loc.xxh3 == 42
    assert pool.reserve(("ns", b"a", 0), 1000, 30) is None  # stored: refused
    assert e.stride == 4096


def test_lru_evicts_oldest_and_reports(tmp_path: Path, evicted: list[Entry]) -> None:
    pool = make_pool(tmp_path, evicted)
    blocks = [put(pool, bytes([i]), 512 << 10, fill=i) for i in range(8)]  # fills 4 MiB
    assert pool.stats().free_slabs == 0
    pool.pin(blocks[1])
    pool.unpin(blocks[1])  # a read refreshes recency: block 1 is now the newest
    put(pool, b"new", 512 << 10)
    assert evicted == [blocks[0]]
    put(pool, b"new2", 512 << 10)
    assert evicted[-1] is blocks[2]
    assert pool.get(blocks[1].key) is blocks[1]


def test_pinned_blocks_survive_a_full_pool(tmp_path: Path, evicted: list[Entry]) -> None:
    pool = make_pool(tmp_path, evicted, pool=MiB, slab=MiB)
    a = put(pool, b"a", 512 << 10, fill=7)
    b = put(pool, b"b", 512 << 10, fill=8)
    pool.pin(a)
    pool.pin(b)
    with pytest.raises(NoSpace):
        pool.reserve(("ns", b"c", 0), 512 << 10, 30)
    pool.unpin(b)
    put(pool, b"c", 512 << 10)
    assert evicted == [b]
    assert pool.get(a.key) is a and np.all(pool.view(a) == 7)


def test_reserved_slots_are_never_evicted_and_expire(tmp_path: Path, evicted: list[Entry]) -> None:
    pool = make_pool(tmp_path, evicted, pool=MiB, slab=MiB)
    r = pool.reserve(("ns", b"r", 0), MiB, ttl_s=0.0)
    assert r is not None
    with pytest.raises(NoSpace):
        pool.reserve(("ns", b"x", 0), MiB, 30)
    assert pool.reclaim_expired() == 1
    assert pool.reserve(("ns", b"x", 0), MiB, 30) is not None
    assert evicted == []  # a reservation is not a block: nothing to unpublish


def test_slab_moves_between_size_classes(tmp_path: Path, evicted: list[Entry]) -> None:
    pool = make_pool(tmp_path, evicted, pool=2 * MiB, slab=MiB)
    small = [put(pool, bytes([i]), 256 << 10) for i in range(8)]
    big = put(pool, b"big", MiB)  # needs a whole slab: one small-block slab is emptied
    assert len(evicted) == 4 and all(e in small for e in evicted)
    assert pool.get(big.key) is big


def test_too_large_block(tmp_path: Path, evicted: list[Entry]) -> None:
    pool = make_pool(tmp_path, evicted)
    with pytest.raises(TooLarge):
        pool.reserve(("ns", b"a", 0), 2 * MiB, 30)


def test_abort_frees_the_slot(tmp_path: Path, evicted: list[Entry]) -> None:
    pool = make_pool(tmp_path, evicted, pool=MiB, slab=MiB)
    r = pool.reserve(("ns", b"a", 0), MiB, 30)
    assert r is not None
    pool.abort(r)
    assert pool.stats().used_bytes == 0
    assert pool.reserve(("ns", b"a", 0), MiB, 30) is not None


def test_reattach_recovers_verified_blocks(tmp_path: Path, evicted: list[Entry]) -> None:
    from pegaflow.checksum import checksum

    pool = make_pool(tmp_path, evicted)
    entries = []
    for i in range(6):
        e = pool.reserve(("ns", bytes([i]), 0), 300_000, 30)
        assert e is not None
        pool.view(e)[:] = i + 1
        pool.commit(e, checksum(pool.view(e)))
        entries.append(e)
    pool.drop(entries[0])  # dropped blocks stay dropped
    pool.view(entries[1])[5] ^= 0xFF  # a corrupted slot is detected, never served
    gens = {e.key: e.gen for e in entries}
    pool.close()

    pool = make_pool(tmp_path, evicted)
    got = {e.key: e for e in pool.recovered}
    assert set(got) == {e.key for e in entries[2:]}
    for key, e in got.items():
        assert e.gen == gens[key] and np.all(pool.view(e) == key[1][0] + 1)
    # the recovered pool keeps working: new blocks get fresh slots and newer generations
    new = pool.reserve(("ns", b"new", 0), 300_000, 30)
    assert new is not None and new.offset not in {e.offset for e in got.values()}
    assert pool.commit(new, 1).gen > max(gens.values())
    pool.close(unlink=True)


def test_torn_journal_tail_is_ignored(tmp_path: Path, evicted: list[Entry]) -> None:
    from pegaflow.checksum import checksum

    pool = make_pool(tmp_path, evicted)
    e = pool.reserve(("ns", b"a", 0), 4096, 30)
    assert e is not None
    pool.view(e)[:] = 3
    pool.commit(e, checksum(pool.view(e)))
    pool.close()
    with open(tmp_path / "pool.journal", "ab") as f:
        f.write(b"\x99\x00garbage")
    pool = make_pool(tmp_path, evicted)
    assert [x.key for x in pool.recovered] == [("ns", b"a", 0)]
    pool.close(unlink=True)


def test_a_pool_file_serves_one_process(tmp_path: Path, evicted: list[Entry]) -> None:
    from pegaflow.storage_node.shm_file import PoolInUse

    pool = make_pool(tmp_path, evicted)
    with pytest.raises(PoolInUse):
        make_pool(tmp_path, evicted)
    pool.close()
    make_pool(tmp_path, evicted).close(unlink=True)  # free again once closed


# ---- preparing a pool (#14): progress, a fresh start, the file's mode ---------------


def test_preparing_a_pool_logs_its_progress(
    tmp_path: Path, evicted: list[Entry], caplog: pytest.LogCaptureFixture, monkeypatch: Any
) -> None:
    from pegaflow.storage_node import shm_file as pool_mod

    monkeypatch.setattr(pool_mod, "PROGRESS_S", 0.0)  # a progress line at every chunk
    monkeypatch.setattr(pool_mod, "PREPARE_CHUNK", MiB)
    with caplog.at_level(logging.INFO, logger=pool_mod.__name__):
        pool = make_pool(tmp_path, evicted)
    lines = [r.getMessage() for r in caplog.records]
    assert any(f"preparing pool of 4 MiB in {tmp_path}" in x for x in lines), lines
    assert [x for x in lines if "%" in x] == [
        f"pool {tmp_path / 'pool'}: {p}% prepared" for p in (25, 50, 75, 100)
    ]
    assert any(x.startswith("pool of 4 MiB ready in ") for x in lines), lines
    pool.close()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=pool_mod.__name__):
        make_pool(tmp_path, evicted).close(unlink=True)
    assert any("re-attaching pool of 4 MiB" in r.getMessage() for r in caplog.records)


def test_a_fresh_pool_forgets_what_the_old_file_held(tmp_path: Path, evicted: list[Entry]) -> None:
    pool = make_pool(tmp_path, evicted)
    e = put(pool, b"a", 1000)
    pool_id = pool.pool_id
    pool.close()
    again = BlockPool(tmp_path / "pool", 4 * MiB, MiB, node_id="n", fresh=True)
    assert again.created and not again.recovered and again.get(("ns", b"a", 0)) is None
    assert again.pool_id != pool_id and not again.buf[e.offset : e.offset + e.size].any()
    again.close()
    assert not make_pool(tmp_path, evicted).recovered  # its journal went too


def test_a_fresh_pool_never_takes_a_live_pool_file(tmp_path: Path, evicted: list[Entry]) -> None:
    from pegaflow.storage_node.shm_file import PoolInUse

    live = make_pool(tmp_path, evicted)
    put(live, b"a", 1000)
    with pytest.raises(PoolInUse):
        BlockPool(tmp_path / "pool", 4 * MiB, MiB, node_id="n", fresh=True)
    assert live.get(("ns", b"a", 0)) is not None and (tmp_path / "pool").exists()
    live.close(unlink=True)


def test_the_pool_file_is_owner_only_or_open_to_its_access_group(tmp_path: Path) -> None:
    gid = os.getgroups()[0] if os.getgroups() else os.getgid()
    pool = BlockPool(tmp_path / "pool", 4 * MiB, MiB, node_id="n", access_gid=gid)
    st = (tmp_path / "pool").stat()
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == gid
    pool.close()
    BlockPool(tmp_path / "pool", 4 * MiB, MiB, node_id="n").close()  # re-attached, no group
    assert stat.S_IMODE((tmp_path / "pool").stat().st_mode) == 0o600


def test_what_a_pool_needs_is_memory_and_space_less_what_its_file_holds() -> None:
    from pegaflow.storage_node.shm_file import MEM_HEADROOM, room_problem

    GiB = 1 << 30
    mem = (10 * GiB, "available")
    assert room_problem(8 * GiB, 0, "/dev/shm", 20 * GiB, mem, "--pool-size") is None
    why = room_problem(12 * GiB, 0, "/dev/shm", 20 * GiB, mem, "--pool-size")
    assert why == (
        "pool of 12.0 GiB does not fit: 10.0 GiB of memory available (256 MiB of it left "
        "to the host), 20.0 GiB free in /dev/shm; lower --pool-size, or make room"
    )
    assert room_problem(10 * GiB, 0, "/x", 20 * GiB, mem, "f") is not None  # the headroom
    assert room_problem(10 * GiB - MEM_HEADROOM, 0, "/x", 20 * GiB, mem, "f") is None
    assert "free in /x" in (room_problem(8 * GiB, 0, "/x", 4 * GiB, None, "f") or "")
    # a pool re-attached needs only what its file does not hold yet
    assert room_problem(12 * GiB, 6 * GiB, "/x", 7 * GiB, mem, "f") is None
    assert "(6.0 GiB more than its file holds)" in (
        room_problem(12 * GiB, 6 * GiB, "/x", 5 * GiB, mem, "f") or ""
    )


def test_preparing_a_pool_touches_its_pages_without_the_gil(
    tmp_path: Path, evicted: list[Entry], monkeypatch: Any
) -> None:
    """The pool's pages are touched through ctypes (which lets go of the GIL), not
    ``mmap.madvise`` (which holds it): the all-in-one server's coordinator thread goes
    on answering while its node prepares a large pool."""
    from pegaflow.storage_node import shm_file as pool_mod

    monkeypatch.setattr(pool_mod, "PREPARE_CHUNK", MiB)
    calls: list[tuple[int, int]] = []
    real = pool_mod._libc.madvise

    def madvise(addr: int, n: int, advice: int) -> int:
        calls.append((n, advice))
        return int(real(addr, n, advice))

    monkeypatch.setattr(pool_mod._libc, "madvise", madvise)
    pool = make_pool(tmp_path, evicted)
    assert calls == [(MiB, pool_mod._MADV_POPULATE_WRITE)] * 4
    pool.close(unlink=True)  # preparing left no export of the mapping behind
