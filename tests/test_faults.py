"""Fault injection against real processes: node crash and restart, corrupted slots."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from pegaflow.client import PegaClient

from pegaflow.config import ClientConfig, EtcdConfig
from pegaflow.devcluster import Proc, start_node
from tests.etcd_fixture import CoordinatorFactory
from tests.test_cluster import NS, blocks, wait_for


@pytest.fixture
def shm_dir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="pegaflow-test-", dir="/dev/shm")
    yield d
    shutil.rmtree(d, ignore_errors=True)


async def _hits(c: PegaClient, hashes: list[bytes], want: int) -> bool:
    return (await c.lookup(NS, hashes)).hits == want


async def test_node_restart_serves_the_same_verified_blocks(
    etcd_config: EtcdConfig, coordinators: CoordinatorFactory, shm_dir: str
) -> None:
    coord = await coordinators.start(etcd_config)
    procs: list[Proc] = []

    def node() -> Proc:
        p = start_node(
            "r1",
            etcd=etcd_config.endpoints[0],
            prefix=etcd_config.prefix,
            pool="64MiB",
            slab="4MiB",
            shm_dir=shm_dir,
        )
        procs.append(p)
        return p

    node()
    c = PegaClient(ClientConfig(coordinators=[coord.address], local_node="r1", lookup_timeout_s=2))
    try:
        await wait_for(lambda: _node_known(c, "r1"), 15, "node r1 registered")
        hashes, data = blocks(12, 11)
        assert (
            await c.put_blocks(NS, [(h, 0, data[i]) for i, h in enumerate(hashes)])
        ).stored == 12
        await wait_for(lambda: _hits(c, hashes, 12), 10, "blocks visible")

        procs[-1].kill()  # kill -9: no clean shutdown, the pool file stays in shm
        # corrupt one stored block behind the node's back: it must never be served again
        _corrupt_first_block(Path(shm_dir) / "pegaflow-r1.pool")

        node()
        await wait_for(lambda: _hits(c, hashes[1:], 11), 20, "re-attached blocks republished")
        # the corrupted block (the first slot) is not republished: once the dead
        # process's lease expires, the prefix stops right at it
        await wait_for(
            lambda: _hits(c, hashes, 0), etcd_config.lease_ttl_s * 3 + 5, "old lease gone"
        )
        res = await c.lookup(NS, hashes[1:])
        assert res.hits == 11
        out = np.zeros_like(data[1:])
        ok = await c.get_blocks(
            NS, [(res.blocks[i][0], h, 0, out[i]) for i, h in enumerate(hashes[1:])]
        )
        assert all(ok) and np.array_equal(out, data[1:])
        again = await c.put_blocks(NS, [(h, 0, data[i]) for i, h in enumerate(hashes)])
        assert (again.stored, again.skipped) == (1, 11)
    finally:
        await c.close()
        for p in procs:
            p.kill()


async def _node_known(c: PegaClient, node_id: str) -> bool:
    return node_id in await c.nodes()


def _corrupt_first_block(pool_file: Path) -> None:
    first = np.fromfile(pool_file, dtype=np.uint8, count=1 << 20)
    with open(pool_file, "r+b") as f:
        f.seek(int(np.flatnonzero(first)[0]) + 17)
        f.write(b"\x00\x01\x02")


async def test_node_killed_during_batched_get_gives_misses_not_garbage(shm_dir: str) -> None:
    node = start_node("k1", pool="512MiB", slab="64MiB", shm_dir=shm_dir)
    addr = node.ready["ucx"]
    c = PegaClient(ClientConfig(coordinators=["127.0.0.1:1"]))
    try:
        rng = np.random.default_rng(5)
        data = rng.integers(0, 255, size=(32, 8 << 20), dtype=np.uint8)
        hashes = [bytes([i]) * 32 for i in range(32)]
        assert (
            await c._data.put(addr, NS, [(h, 0, data[i]) for i, h in enumerate(hashes)], 30)
        ).stored == 32
        out = np.zeros_like(data)
        get = asyncio.ensure_future(
            c._data.get(addr, NS, [(h, 0, out[i]) for i, h in enumerate(hashes)], 5)
        )
        await asyncio.sleep(0.01)
        node.kill()
        ok = await get  # returns (no hang, no exception) within its deadline
        assert len(ok) == 32
        for i, good in enumerate(ok):
            if good:  # anything reported fetched is exactly right
                assert np.array_equal(out[i], data[i])
        # the client recovers: a dead node is a miss, promptly, every time
        assert await c._data.get(addr, NS, [(hashes[0], 0, out[0])], 2) == [False]
    finally:
        await c.close()
        node.kill()
