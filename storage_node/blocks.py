"""A block's key, the 4 KiB alignment of its slot, and its entry in the memory pool."""

from __future__ import annotations

from dataclasses import dataclass

from pegaflow.keys import BlockLocation

BlockKey = tuple[str, bytes, int]
"""(namespace, block hash, shard): a block's key in the pool and the disk tier"""

ALIGN = 4096
"""slots (in the pool and on disk), and O_DIRECT buffers, lengths and offsets, are
multiples of it"""


def align_up(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`: the slot (stride) a block of
    ``n`` bytes takes.  Quotas charge this, not the size asked."""
    return -(-n // ALIGN) * ALIGN


@dataclass(slots=True, eq=False)
class Entry:
    """One block in the pool."""

    key: BlockKey
    offset: int
    size: int
    stride: int
    gen: int = 0
    xxh3: int = 0
    committed: bool = False
    pins: int = 0
    reserve_deadline: float = 0.0
    digest: int | None = None
    """the writer's device digest of the block (same-host GPU readers check it on the
    device); kept in memory only: after a restart readers fall back to the xxh3"""
    spilling: bool = False
    """being written to the disk tier ahead of eviction (out of the LRU meanwhile)"""

    def location(self, node_id: str) -> BlockLocation:
        """Where readers find this block on node ``node_id``."""
        return BlockLocation(node_id, self.offset, self.gen, self.size, self.xxh3)
