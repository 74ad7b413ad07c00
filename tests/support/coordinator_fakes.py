"""A fake node that registers with a real coordinator, and a poll for coordinator state."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from pegaflow.storage_node.publisher import EtcdPublisher

from pegaflow.config import EtcdConfig
from pegaflow.keys import BlockLocation, NodeRecord

NS = "llama-tiny:bf16:bs16"


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


class FakeNode:
    """A node's inventory, published through an EtcdPublisher."""

    def __init__(self, etcd: EtcdConfig, node_id: str, **kw: Any) -> None:
        self.node_id = node_id
        self.blocks: dict[tuple[str, bytes, int], BlockLocation] = {}
        self.publisher = EtcdPublisher(etcd, self.inventory, **kw)
        self.record = NodeRecord(
            node_id=node_id, host="127.0.0.1", ucx_port=9000, capacity_bytes=1 << 30
        )

    def inventory(self) -> Iterable[tuple[str, bytes, int, BlockLocation]]:
        return [(ns, bh, s, loc) for (ns, bh, s), loc in self.blocks.items()]

    async def start(self) -> FakeNode:
        await self.publisher.start(self.record)
        return self

    def put(self, hashes: Iterable[int], shard: int = 0, ns: str = NS) -> None:
        for i in hashes:
            loc = BlockLocation(self.node_id, slot=i, gen=1, size=4096, xxh3=i * 7)
            self.blocks[(ns, h(i), shard)] = loc
            self.publisher.publish(ns, h(i), shard, loc)

    def evict(self, hashes: Iterable[int], shard: int = 0, ns: str = NS) -> None:
        for i in hashes:
            loc = self.blocks.pop((ns, h(i), shard))
            self.publisher.unpublish(ns, h(i), shard, loc)

    async def flush(self) -> None:
        assert await self.publisher.flush(timeout=90), self.publisher.stats()  # etcd on a busy disk


async def eventually(
    check: Callable[[], Awaitable[bool]], timeout: float = 60.0, what: str = ""
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if await check():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.1)
