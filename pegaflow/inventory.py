"""How a storage node's inventory reaches the global index.

A node reports every committed block and every eviction to an :class:`InventorySink`.
In a cluster the sink is :class:`pegaflow.storage_node.publisher.EtcdPublisher`
(batched etcd transactions under the node's lease); in the single-host
``pegaflow-server`` it is the coordinator's in-memory index itself
(:class:`pegaflow.coordinator.inprocess_sink.InProcessSink`).  Sinks must not block the caller:
``publish``/``unpublish`` only queue; delivery is the sink's business.
"""

from __future__ import annotations

from typing import Protocol

from pegaflow.keys import BlockLocation, NodeRecord


class NodeIdInUse(Exception):
    """Another live node is registered under this node's id (raised by
    :meth:`InventorySink.start`)."""


class InventorySink(Protocol):
    """Receives a node's membership and block inventory."""

    async def start(self, record: NodeRecord) -> None:
        """Register the node (attach a lease, write its record); raises
        :class:`NodeIdInUse` when another live node holds the node id."""

    async def update_node(self, record: NodeRecord) -> None:
        """Refresh the node record (usage figures)."""

    def publish(self, ns: str, block_hash: bytes, shard: int, loc: BlockLocation) -> None:
        """Queue: this committed block is now on this node."""

    def unpublish(self, ns: str, block_hash: bytes, shard: int, loc: BlockLocation) -> None:
        """Queue: this block is gone from this node (evicted or invalid)."""

    async def flush(self) -> None:
        """Wait until everything queued so far is delivered (or dropped and counted)."""

    async def close(self) -> None:
        """Stop; in a cluster, revoke the lease so the node's entries vanish now."""
