"""The scheduler's known-blocks cache: hashes believed stored in the cluster.

Lookups add their hits and drop their misses; a save skips a block already known, and
a failed save or load forgets it again.  Pure module: no vLLM import.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class KnownBlocks:
    """Bounded LRU set of hashes believed stored in the cluster (saves skip them)."""

    def __init__(self, capacity: int) -> None:
        self._cap = max(1024, capacity)
        self._d: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, h: bytes) -> bool:
        if h in self._d:
            self._d.move_to_end(h)
            return True
        return False

    def __len__(self) -> int:
        return len(self._d)

    def add(self, h: bytes) -> None:
        """Remember ``h`` (most recently used)."""
        self._d[h] = None
        self._d.move_to_end(h)
        while len(self._d) > self._cap:
            self._d.popitem(last=False)

    def discard(self, h: bytes) -> None:
        """Forget ``h``."""
        self._d.pop(h, None)

    def add_many(self, hs: Sequence[bytes]) -> None:
        """Remember each of ``hs`` (those already known keep their place)."""
        d = self._d
        d.update(dict.fromkeys(hs))
        for _ in range(len(d) - self._cap):
            d.popitem(last=False)

    def discard_many(self, hs: Sequence[bytes]) -> None:
        """Forget each of ``hs``."""
        pop = self._d.pop
        for h in hs:
            pop(h, None)
