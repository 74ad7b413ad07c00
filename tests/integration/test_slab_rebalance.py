"""Slabs move between size classes (issue 36, defect 9: slab calcification).

A pool filled with one block size kept a single slab for any other size for good:
after 1 MiB blocks, only one slab's worth of 256 KiB blocks stayed, whatever was
stored.  Now a size class that runs out of slots below its fair share of the slabs takes
the coldest evictable slab of the class holding the most (unit tests of
:class:`~pegaflow.storage_node.pool.BlockPool` on a temp file)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
from pegaflow.client.data import DataClient
from pegaflow.storage_node.blocks import BlockKey, Entry
from pegaflow.storage_node.pool import BlockPool

from pegaflow.checksum import checksum
from pegaflow.tools.devcluster import Proc, start_node

pytestmark = pytest.mark.ucx

MiB = 1 << 20
KiB = 1 << 10
SLAB = 16 * MiB
SLABS = 8
BIG = MiB
SMALL = 256 * KiB


@pytest.fixture
def evicted() -> list[Entry]:
    return []


def make_pool(tmp_path: Path, evicted: list[Entry], persist: bool = True) -> BlockPool:
    return BlockPool(
        tmp_path / "pool", SLABS * SLAB, SLAB, node_id="n", on_evict=evicted.append,
        persist=persist,
    )  # fmt: skip


def key(tag: str, i: int) -> BlockKey:
    return ("ns", f"{tag}{i}".encode(), 0)


def fill_of(i: int) -> int:
    return i % 251


def put(pool: BlockPool, k: BlockKey, size: int, fill: int) -> Entry:
    e = pool.reserve(k, size, 30)
    assert e is not None
    pool.view(e)[:] = fill
    pool.commit(e, checksum(pool.view(e)))
    return e


def fill_big(pool: BlockPool) -> list[Entry]:
    """Fill the whole pool with 1 MiB blocks."""
    blocks = [put(pool, key("big", i), BIG, fill_of(i)) for i in range(SLABS * SLAB // BIG)]
    assert pool.stats().free_slabs == 0
    return blocks


def stored(pool: BlockPool, tag: str, n: int, size: int) -> int:
    """How many of blocks ``tag`` 0..n-1 the pool holds, checking their bytes."""
    held = 0
    for i in range(n):
        e = pool.get(key(tag, i))
        if e is not None:
            assert e.size == size and np.all(pool.view(e) == fill_of(i))
            held += 1
    return held


def slabs_of(pool: BlockPool, size: int) -> int:
    return len(pool._classes[size].slabs)


def check_evictions_reported(
    pool: BlockPool,
    evicted: list[Entry],
    n_big: int,
    never_stored: frozenset[BlockKey] = frozenset(),
) -> None:
    """Every 1 MiB block no longer held was reported to ``on_evict`` (unpublished),
    exactly once, and none still held was."""
    gone = {k for i in range(n_big) if pool.get(k := key("big", i)) is None} - never_stored
    reported = [e.key for e in evicted if e.size == BIG]
    assert len(reported) == len(set(reported))
    assert set(reported) == gone


def test_a_pool_full_of_one_size_gives_another_size_its_fair_share(
    tmp_path: Path, evicted: list[Entry]
) -> None:
    """Fill a 128 MiB pool (8 slabs) with 1 MiB blocks, then store 256 KiB blocks, more
    than the pool holds: half the slabs now serve 256 KiB blocks (one slab, 64 blocks,
    before), the 1 MiB blocks keep the other half, and every 1 MiB block evicted was
    reported to ``on_evict``."""
    pool = make_pool(tmp_path, evicted)
    n_big = len(fill_big(pool))
    n_small = 2 * SLABS * SLAB // SMALL  # twice the pool
    for i in range(n_small):
        put(pool, key("small", i), SMALL, fill_of(i))
    small = stored(pool, "small", n_small, SMALL)
    assert small * SMALL >= pool.capacity // 3, f"only {small} blocks of 256 KiB stayed"
    assert slabs_of(pool, SMALL) == SLABS // 2 and slabs_of(pool, BIG) == SLABS // 2
    assert stored(pool, "big", n_big, BIG) == (SLABS // 2) * SLAB // BIG
    check_evictions_reported(pool, evicted, n_big)
    # the most recent 256 KiB blocks are the ones kept
    assert all(pool.get(key("small", i)) is not None for i in range(n_small - small, n_small))
    # the shares hold: more 1 MiB blocks take no slab back from the 256 KiB blocks
    for i in range(n_big, n_big + 64):
        put(pool, key("big", i), BIG, fill_of(i))
    assert slabs_of(pool, SMALL) == SLABS // 2 and slabs_of(pool, BIG) == SLABS // 2
    pool.close(unlink=True)


def test_a_size_class_not_used_lately_gives_up_all_its_slabs(
    tmp_path: Path, evicted: list[Entry]
) -> None:
    """A size class not reserved within ``rebalance_window_s`` has no share: the size
    in use takes every slab, one cold slab at a time."""
    pool = make_pool(tmp_path, evicted)
    pool.rebalance_window_s = 0.0
    n_big = len(fill_big(pool))
    time.sleep(0.01)
    n_small = 2 * SLABS * SLAB // SMALL
    for i in range(n_small):
        put(pool, key("small", i), SMALL, fill_of(i))
    assert slabs_of(pool, SMALL) == SLABS and slabs_of(pool, BIG) == 0
    assert stored(pool, "small", n_small, SMALL) == SLABS * SLAB // SMALL
    assert stored(pool, "big", n_big, BIG) == 0
    check_evictions_reported(pool, evicted, n_big)
    pool.close(unlink=True)


def test_slabs_holding_pinned_reserved_quarantined_or_spilling_blocks_are_not_taken(
    tmp_path: Path, evicted: list[Entry]
) -> None:
    """A slab is taken only when all its blocks can be evicted: one pinned by a read,
    reserved by a put, quarantined or being spilled keeps its slab (and itself); once
    they are released the slabs move."""
    pool = make_pool(tmp_path, evicted)
    per_slab = SLAB // BIG
    big: list[Entry] = []
    reserved = quarantined = None
    for i in range(SLABS * per_slab):
        slab, slot = divmod(i, per_slab)
        if slot == per_slab - 1 and slab == 6:
            reserved = pool.reserve(key("big", i), BIG, 3600)
            assert reserved is not None
            continue
        if slot == per_slab - 1 and slab == 7:
            quarantined = pool.reserve(key("big", i), BIG, 3600)
            assert quarantined is not None
            pool.quarantine(quarantined)
            continue
        big.append(put(pool, key("big", i), BIG, fill_of(i)))
    assert reserved is not None and quarantined is not None
    assert [e.offset // SLAB for e in big[::per_slab]] == list(range(SLABS))
    pinned = [big[s * per_slab + 3] for s in range(1, 5)]  # one in each of slabs 1-4
    pool.pin_many(pinned)
    spilling = pool.take_for_spill(lambda e: e.offset // SLAB != 5, scan=1000)
    assert spilling is not None and spilling.offset // SLAB == 5
    n_small = 4 * SLAB // SMALL
    for i in range(n_small):
        put(pool, key("small", i), SMALL, fill_of(i))
    # slab 0 went (the class had no slot yet), no other
    assert slabs_of(pool, SMALL) == 1
    for e in (*pinned, spilling):
        assert pool.get(e.key) is e and np.all(pool.view(e) == fill_of(int(e.key[1][3:])))
    assert pool._by_offset.get(reserved.offset) is reserved
    assert pool._by_offset.get(quarantined.offset) is quarantined
    assert not {e.key for e in evicted} & {e.key for e in (*pinned, spilling)}
    # released: the 256 KiB blocks take their fair share
    pool.unpin_many(pinned)
    assert pool.end_spill(spilling, on_disk=False)
    pool.commit(reserved, 0)
    pool.release_quarantined(quarantined)
    for i in range(n_small, 4 * n_small):
        put(pool, key("small", i), SMALL, fill_of(i))
    assert slabs_of(pool, SMALL) == SLABS // 2
    check_evictions_reported(pool, evicted, SLABS * per_slab, frozenset([quarantined.key]))
    pool.close(unlink=True)


def test_a_reattached_pool_keeps_the_blocks_of_moved_slabs(
    tmp_path: Path, evicted: list[Entry]
) -> None:
    """The journal follows slabs that moved: after a restart the pool re-attaches the
    blocks of both sizes that were held, and no evicted one."""
    pool = make_pool(tmp_path, evicted)
    n_big = len(fill_big(pool))
    n_small = 2 * SLABS * SLAB // SMALL
    for i in range(n_small):
        put(pool, key("small", i), SMALL, fill_of(i))
    held = {e.key for e in pool.committed()}
    pool.close()
    again = make_pool(tmp_path, [])
    assert {e.key for e in again.recovered} == held
    assert stored(again, "small", n_small, SMALL) == (SLABS // 2) * SLAB // SMALL
    assert stored(again, "big", n_big, BIG) == (SLABS // 2) * SLAB // BIG
    again.close(unlink=True)


async def test_a_real_node_keeps_a_fair_share_of_a_second_block_size(procs: list[Proc]) -> None:
    """The same against a real node and a UCX client: after 128 blocks of 1 MiB fill
    its 128 MiB pool, 512 blocks of 256 KiB (the pool twice over) leave 256 of them
    stored and readable byte-exact (64 before)."""
    node = start_node("rebalance", pool="128MiB", slab="16MiB")
    procs.append(node)
    addr = node.ready["ucx"]
    rng = np.random.default_rng(9)
    c = DataClient()
    try:
        for _ in range(8):
            big = [
                (os.urandom(32), 0, rng.integers(0, 255, BIG, dtype=np.uint8)) for _ in range(16)
            ]
            assert (await c.put(addr, "rebalance", big, 20)).stored == 16
        small: list[tuple[bytes, int, np.ndarray]] = []
        for _ in range(16):
            batch = [
                (os.urandom(32), 0, rng.integers(0, 255, SMALL, dtype=np.uint8)) for _ in range(64)
            ]
            assert (await c.put(addr, "rebalance", batch, 20)).stored == 64
            small += batch
        held = await c.check(addr, "rebalance", [(h, s, None) for h, s, _ in small], 20)
        assert sum(held) * SMALL >= SLABS * SLAB // 3, f"only {sum(held)} blocks of 256 KiB"
        kept = [item for item, ok in zip(small, held, strict=True) if ok][-64:]
        bufs = [np.zeros(SMALL, dtype=np.uint8) for _ in kept]
        want = [(h, s, b) for (h, s, _), b in zip(kept, bufs, strict=True)]
        got = await c.get(addr, "rebalance", want, 20)
        assert all(got)
        assert all(np.array_equal(b, data) for b, (_, _, data) in zip(bufs, kept, strict=True))
    finally:
        await c.close()
