"""The inventory sink of a node that shares its process with the coordinator: block
changes go straight into the coordinator's :class:`~pegaflow.coordinator.index.BlockIndex`,
no etcd in between (the single-host ``pegaflow-server``, tests)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from pegaflow.coordinator.index import BlockIndex

from pegaflow.keys import DISK_SLOT, BlockLocation, NodeRecord
from pegaflow.transport.loopthread import LoopThread


class InProcessSink:
    """An :class:`~pegaflow.inventory.InventorySink` writing straight into a
    :class:`~pegaflow.coordinator.index.BlockIndex`: the single-host ``pegaflow-server``
    runs its node with this sink and needs no etcd.

    ``owner``: the event loop thread the index lives on, when it is not the caller's
    (the server's coordinator runs on its own); changes are then queued and applied
    there in order, a batch per wake-up, and by every lookup before it reads (a block
    committed before a lookup is always seen).  Without one every call takes effect at
    once.
    """

    def __init__(self, index: BlockIndex, owner: LoopThread | None = None) -> None:
        self.index = index
        self._owner = owner
        self._node_id: str | None = None
        self._queued: list[tuple[bool, str, bytes, int, str, int, bool]] = []
        self._lock = threading.Lock()
        if owner is not None:
            index.catch_up = self._drain

    async def start(self, record: NodeRecord) -> None:
        """Register the node."""
        self._node_id = record.node_id
        await self._on_owner(self.index.set_node, record)

    async def update_node(self, record: NodeRecord) -> None:
        """Refresh the node record."""
        await self._on_owner(self.index.set_node, record)

    def publish(self, ns: str, block_hash: bytes, shard: int, loc: BlockLocation) -> None:
        """The block's shard is now on ``loc.node`` with generation ``loc.gen``."""
        self._queue((True, ns, block_hash, shard, loc.node, loc.gen, loc.slot == DISK_SLOT))

    def unpublish(self, ns: str, block_hash: bytes, shard: int, loc: BlockLocation) -> None:
        """The block's shard is gone from ``loc.node`` (no-op if another node holds it)."""
        self._queue((False, ns, block_hash, shard, loc.node, 0, False))

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until every change queued so far is in the index."""
        await self._on_owner(self._drain)

    async def close(self) -> None:
        """Unregister the node and drop its entries."""
        if self._node_id is not None:
            node, self._node_id = self._node_id, None
            await self._on_owner(self._remove_node, node)

    def _queue(self, change: tuple[bool, str, bytes, int, str, int, bool]) -> None:
        if self._owner is None:
            self._apply([change])
            return
        with self._lock:
            self._queued.append(change)
            first = len(self._queued) == 1
        if first:
            self._owner.call(self._drain)

    def _drain(self) -> None:
        with self._lock:
            changes, self._queued = self._queued, []
        self._apply(changes)

    def _apply(self, changes: list[tuple[bool, str, bytes, int, str, int, bool]]) -> None:
        index = self.index
        evictions, now = index.evictions, time.monotonic()
        for add, ns, block_hash, shard, node, gen, disk in changes:
            if add:
                index.add(ns, block_hash, shard, node, gen, disk)
                if evictions is not None:
                    evictions.saved(block_hash, now)
            else:
                if evictions is not None:
                    evictions.removing(ns, block_hash, shard, now, node)
                index.remove(ns, block_hash, shard, node)

    def _remove_node(self, node: str) -> None:
        self._drain()
        self.index.remove_node(node)

    async def _on_owner(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._owner is None:
            fn(*args)
            return

        async def call() -> None:
            fn(*args)

        await self._owner.run(call())
