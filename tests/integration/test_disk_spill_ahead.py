"""Spill-ahead: the node keeps ``[node] disk_spill_ahead_bytes`` of its pool free by
writing its least recently used blocks to the disk tier in the background, straight
from their pool slots, so that a put into a "full" pool finds a free slot and pays no
eviction copy.

The node test runs a real ``pegaflow-server`` (a 2 MiB pool, a disk tier in a real
directory, real UCX puts and gets).  The others run a real pool file, a real disk
tier (real files, real write threads) and the spill-ahead on a real asyncio loop,
with the tier's I/O test hook holding the writes back, so that what happens *during*
a write is seen for certain: a get is served from memory, the slot is neither evicted
nor reused, a drop meanwhile keeps no copy on disk."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pegaflow.storage_node.blocks import Entry
from pegaflow.storage_node.disk_tier import DiskTier
from pegaflow.storage_node.pool import BlockPool
from pegaflow.storage_node.spill_ahead import SpillAhead, reserve_bytes

from pegaflow.checksum import checksum
from pegaflow.tools.devcluster import Proc, _temp_shm_dir
from tests.support.disk_node import (
    BATCH,
    POOL_BLOCKS,
    WORKING_SET,
    HeldIO,
    blocks,
    client,
    get_all,
    metrics,
    present,
    server,
)
from tests.support.disk_node import shm as shm  # a fixture
from tests.support.waiting import wait_for

pytestmark = pytest.mark.ucx

NS = "disk-tier"
BLOCK = 64 << 10
AHEAD = "pegaflow_node_disk_spill_ahead_blocks_total"
COPIES = "pegaflow_node_disk_spill_copies_total"
DROPS = "pegaflow_node_disk_spill_drops_total"


def test_default_reserve_is_a_share_of_the_pool_capped() -> None:
    assert reserve_bytes(256 << 20, 64 << 30) == 256 << 20
    assert reserve_bytes(256 << 20, 2 << 20) == 256 << 10  # an eighth of a small pool
    assert reserve_bytes(0, 64 << 30) == 0  # off


def test_puts_at_a_pace_the_disk_keeps_up_with_never_evict_with_a_copy(
    tmp_path: Path, shm: str, procs: list[Proc]
) -> None:
    """A working set 4x the pool, put two blocks at a time (within the 4-block reserve),
    each put once the spill-ahead has made room again: every block that left memory was
    written ahead (none copied at eviction, none dropped), all stay published, and every
    one comes back byte-exact."""
    p = server(tmp_path / "disk", shm, extra=["--node-disk-spill-ahead-bytes", "256KiB"])
    procs.append(p)
    c = client(p)
    reserve = 4  # 256 KiB of 64 KiB blocks
    try:
        hashes, data = blocks(WORKING_SET, seed=21)
        for i in range(0, WORKING_SET, 2):
            assert c.put_blocks(NS, [(hashes[j], 0, data[j]) for j in (i, i + 1)]).stored == 2
            room = i + 2 - (POOL_BLOCKS - reserve)  # blocks that must have left memory
            wait_for(lambda room=room: metrics(p)[AHEAD] >= room, "the reserve made free again")
        m = metrics(p)
        assert m[AHEAD] >= WORKING_SET - POOL_BLOCKS
        assert m[COPIES] == 0 and m[DROPS] == 0
        assert m["pegaflow_node_disk_blocks"] >= WORKING_SET - POOL_BLOCKS
        assert all(present(c, hashes))
        ok, out = get_all(c, hashes)
        assert all(ok) and np.array_equal(out, data)
        assert metrics(p)["pegaflow_node_disk_errors_total"] == 0
    finally:
        c.close()


def test_unpaced_puts_past_the_reserve_fall_back_and_lose_nothing(
    tmp_path: Path, shm: str, procs: list[Proc]
) -> None:
    """Puts faster than the disk (whole batches, no waiting): the reserve runs out and
    puts evict as before; whatever path each block took, every one is served
    byte-exact, also while the writes go on."""
    p = server(tmp_path / "disk", shm, extra=["--node-disk-spill-ahead-bytes", "256KiB"])
    procs.append(p)
    c = client(p)
    try:
        hashes, data = blocks(WORKING_SET, seed=22)
        for i in range(0, WORKING_SET, BATCH):
            idx = range(i, i + BATCH)
            assert c.put_blocks(NS, [(hashes[j], 0, data[j]) for j in idx]).stored == BATCH
            # the batch before: in memory (perhaps being written ahead) or on disk
            back = range(max(0, i - BATCH), i)
            out = np.zeros((len(back), BLOCK), dtype=np.uint8)
            got = c.get_blocks(
                NS, [("disk-node", hashes[j], 0, out[k]) for k, j in enumerate(back)]
            )
            for k, j in enumerate(back):
                assert not got[k] or np.array_equal(out[k], data[j])
        wait_for(lambda: metrics(p)["pegaflow_node_disk_blocks"] > 0, "spills written")
        m = metrics(p)
        assert m[AHEAD] > 0
        kept = present(c, hashes)
        assert kept.count(False) <= m[DROPS]  # only blocks whose spill was dropped are gone
        ok, out = get_all(c, hashes)
        for j in range(WORKING_SET):
            assert ok[j] or not kept[j]
            if ok[j]:
                assert np.array_equal(out[j], data[j])
    finally:
        c.close()


# ---- the pool, the tier and the spill-ahead on a real loop, the writes held back ----

SLOT = 64 << 10
POOL_SLOTS = 8


class Rig:
    """A pool of 8 slots of 64 KiB with a disk tier of 32 blocks of ``disk_block``,
    its writes held back until ``io.open`` is set, and a spill-ahead keeping 2 slots
    free (``post`` runs on ``loop``)."""

    def __init__(self, root: Path, loop: asyncio.AbstractEventLoop, disk_block: int = SLOT) -> None:
        self.io = HeldIO()
        self.disk = DiskTier(root / "disk", 32 * SLOT, disk_block, io=self.io, write_threads=2)
        self.io.slab_fds = set(self.disk._files.fds)
        self.disk.recover()
        self.loop = loop
        self.evicted: list[Entry] = []
        self.pool = BlockPool(
            Path(_temp_shm_dir()) / "rig.pool",
            POOL_SLOTS * SLOT,
            4 * SLOT,
            node_id="rig",
            on_evict=self.evicted.append,
            on_spill=self._spill,
            persist=False,
        )
        self.ahead = SpillAhead(self.pool, self.disk, 2 * SLOT, self.post, max_inflight=4)
        self.data: dict[int, np.ndarray] = {}

    def post(self, fn: Any, *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def _spill(self, e: Entry) -> bool:  # what the node does on an eviction
        if self.disk.contains(e.key):
            return True
        return self.disk.spill(e.key, e.gen, self.pool.view(e), e.xxh3)

    @staticmethod
    def key(i: int) -> tuple[str, bytes, int]:
        return ("ns", i.to_bytes(16, "little"), 0)

    def put(self, i: int, size: int = SLOT) -> Entry:
        e = self.pool.reserve(self.key(i), size, 30)
        assert e is not None
        self.data[i] = np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)
        self.pool.view(e)[:] = self.data[i]
        self.pool.commit(e, checksum(self.data[i]))
        return e

    async def settle(self) -> None:
        for _ in range(20):
            await asyncio.sleep(0)

    def close(self) -> None:
        self.io.open.set()
        self.ahead.close()
        self.disk.close()
        self.pool.close(unlink=True)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    loop = asyncio.new_event_loop()
    r = Rig(tmp_path, loop)
    yield r
    r.close()
    loop.close()


def run(rig: Rig, coro: Any) -> Any:
    return rig.loop.run_until_complete(asyncio.wait_for(coro, 60))


def test_a_block_being_written_ahead_is_served_from_memory_and_never_reused(rig: Rig) -> None:
    async def go() -> None:
        entries = [rig.put(i) for i in range(7)]  # 1 slot free: below the 2 kept free
        await rig.settle()
        assert rig.io.waiting.acquire(timeout=30)  # block 0 is being written, held back
        e0 = entries[0]
        assert e0.spilling and rig.pool.stats().spilling == 1
        got = rig.pool.get(rig.key(0))
        assert got is e0 and np.array_equal(rig.pool.view(got), rig.data[0])  # a get: memory
        rig.pool.pin(e0)  # a reader holds it through the write
        for i in range(7, 10):  # the put after the free slot evicts block 1, never block 0
            rig.put(i)
        assert rig.pool.get(rig.key(0)) is e0
        assert np.array_equal(rig.pool.view(e0), rig.data[0])  # its slot was not reused
        assert rig.disk.stats().spill_copies >= 1  # the reserve ran out: the old path
        rig.io.open.set()
        assert await asyncio.to_thread(rig.disk.flush, 30)
        await rig.settle()
        assert rig.disk.contains(rig.key(0))
        assert rig.pool.get(rig.key(0)) is e0 and not e0.spilling  # pinned: stays, clean
        rig.pool.unpin(e0)
        assert await asyncio.wrap_future(rig.disk.read(rig.key(0))) == rig.data[0].tobytes()
        for i in range(10, 20):
            rig.put(i)
            await rig.settle()
            assert await asyncio.to_thread(rig.disk.flush, 30)
        await rig.settle()
        for i in range(20):
            e = rig.pool.get(rig.key(i))
            if e is not None:
                assert np.array_equal(rig.pool.view(e), rig.data[i])
            else:
                got = await asyncio.wrap_future(rig.disk.read(rig.key(i)))
                assert got == rig.data[i].tobytes(), i
        assert rig.disk.stats().spill_ahead > 0
        assert rig.pool.stats().used_bytes <= (POOL_SLOTS - 2) * SLOT  # the reserve is back

    run(rig, go())


def test_a_block_dropped_while_written_ahead_leaves_no_copy_and_frees_its_slot(
    rig: Rig,
) -> None:
    async def go() -> None:
        entries = [rig.put(i) for i in range(7)]
        await rig.settle()
        assert rig.io.waiting.acquire(timeout=30)
        e0 = entries[0]
        assert e0.spilling
        rig.pool.drop(e0)  # e.g. a namespace drop while the write is under way
        assert rig.pool.get(rig.key(0)) is None
        assert rig.evicted == [e0]  # unpublished at once, as any drop
        used = rig.pool.stats().used_bytes
        assert used == 7 * SLOT  # its slot is still taken: the write reads it
        rig.io.open.set()
        assert await asyncio.to_thread(rig.disk.flush, 30)
        await rig.settle()
        assert not rig.disk.contains(rig.key(0))  # written, then discarded: not resurrected
        assert rig.pool.stats().used_bytes < used  # and the slot is free again

    run(rig, go())


def test_a_block_too_large_for_the_tier_does_not_hold_up_those_behind_it(
    tmp_path: Path,
) -> None:
    """Slots of 68 KiB, a tier of blocks of at most 64 KiB + 100: the least recently
    used block is too large to write, so the spill-ahead writes the next one."""
    loop = asyncio.new_event_loop()
    r = Rig(tmp_path, loop, disk_block=SLOT + 100)
    r.io.open.set()
    try:

        async def go() -> None:
            r.put(0, SLOT + 4000)  # too large for the tier, in the same slot size
            for i in range(1, 6):  # 6 slots of 68 KiB: now below the 2 x 64 KiB kept free
                r.put(i, SLOT + 50)
            await r.settle()
            assert await asyncio.to_thread(r.disk.flush, 30)
            await r.settle()
            assert r.disk.stats().spill_ahead == 1
            assert r.disk.contains(r.key(1)) and r.pool.get(r.key(1)) is None
            assert r.pool.get(r.key(0)) is not None  # left for the eviction path
            got = await asyncio.wrap_future(r.disk.read(r.key(1)))
            assert got == r.data[1].tobytes()

        run(r, go())
    finally:
        r.close()
        loop.close()
