"""A promotion into a full pool waits for the spill queue instead of dropping the blocks
its slots evict.

A real pool file, a real disk tier (real files, one write thread, a spill queue of one
block) and the node service on a real asyncio loop; the tier's I/O test hook holds the
slab writes back, so the promotion meets a full queue for certain.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
from pegaflow.storage_node.blocks import Entry
from pegaflow.storage_node.disk_tier import DiskTier
from pegaflow.storage_node.metrics import NodeMetrics
from pegaflow.storage_node.node import NullSink
from pegaflow.storage_node.node_service import NodeService
from pegaflow.storage_node.pool import BlockPool
from prometheus_client import CollectorRegistry

from pegaflow.checksum import checksum
from pegaflow.config import NodeConfig
from pegaflow.tools.devcluster import _temp_shm_dir
from tests.support.disk_node import HeldIO
from tests.support.waiting import wait_until

SLOT = 64 << 10
POOL_SLOTS = 8


def key(i: int) -> tuple[str, bytes, int]:
    return ("ns", i.to_bytes(16, "little"), 0)


async def test_a_promotion_into_a_full_pool_waits_for_the_spill_queue_and_drops_nothing(
    tmp_path: Path,
) -> None:
    io = HeldIO()
    io.open.set()
    disk = DiskTier(tmp_path / "disk", 32 * SLOT, SLOT, io=io, write_threads=1, queue_depth=1)
    io.slab_fds = set(disk._files.fds)
    disk.recover()
    pool: BlockPool

    def spill(e: Entry) -> bool:  # what the node does on an eviction
        return disk.contains(e.key) or disk.spill(e.key, e.gen, pool.view(e), e.xxh3)

    pool = BlockPool(
        Path(_temp_shm_dir()) / "promotion.pool",
        POOL_SLOTS * SLOT,
        4 * SLOT,
        node_id="p",
        on_spill=spill,
        persist=False,
    )
    svc = NodeService(pool, NodeConfig(), NullSink(), NodeMetrics(CollectorRegistry()), disk=disk)
    await svc.start()
    data = {i: np.random.default_rng(i).integers(0, 256, SLOT, dtype=np.uint8) for i in range(16)}

    def put(i: int) -> None:
        e = pool.reserve(key(i), SLOT, 30)
        assert e is not None
        pool.view(e)[:] = data[i]
        pool.commit(e, checksum(data[i]))

    try:
        for i in range(POOL_SLOTS):
            put(i)
        for i in range(POOL_SLOTS, 2 * POOL_SLOTS):  # each evicts one: written, one at a time
            put(i)
            await wait_until(lambda i=i: disk.contains(key(i - POOL_SLOTS)), "a spill written", 60)
        assert disk.spill_drops == 0
        io.open.clear()  # from here the writes wait
        # blocks 0-3 live on disk only; each promoted one evicts one of 8-15 (not on disk)
        promoting = asyncio.ensure_future(svc.promotion.promote([key(i) for i in range(4)]))
        await wait_until(lambda: pool.get(key(0)) is not None, "the first promotion", 60)
        await asyncio.sleep(0.3)
        assert disk.spill_drops == 0  # the second eviction would find the queue full
        assert not promoting.done()
        io.open.set()
        await asyncio.wait_for(promoting, 30)
        assert disk.spill_drops == 0
        for i in range(4):
            e = pool.get(key(i))
            assert e is not None and np.array_equal(pool.view(e), data[i])
        # what the promotions evicted was written, not lost
        await wait_until(
            lambda: all(disk.contains(key(i)) for i in range(8, 12)), "evictions written", 60
        )
    finally:
        io.open.set()
        await svc.close()
        disk.close()
        pool.close(unlink=True)
