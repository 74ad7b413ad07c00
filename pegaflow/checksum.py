"""The block checksum: xxh3-64 over the block's bytes, computed by writer and reader."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import xxhash


def checksum(buf: Any) -> int:
    """xxh3-64 of any C-contiguous buffer (bytes, memoryview, numpy array)."""
    return xxhash.xxh3_64_intdigest(memoryview(buf).cast("B"))


def checksums(bufs: Sequence[Any]) -> list[int]:
    """:func:`checksum` of each buffer (one call for a batch, e.g. on a worker thread)."""
    return [checksum(b) for b in bufs]
