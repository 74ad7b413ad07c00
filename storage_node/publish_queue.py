"""The etcd publisher's queue: the writes waiting for etcd, and a rotation's snapshot.

A dict keyed by etcd key (a later write to the same key replaces an earlier one still
queued), bounded by ``max_pending``: past it writes are dropped, counted, and mark the
queue *overflowed* (the publisher then republishes the whole inventory).  A key taken
for a transaction stays out of the next ones until :meth:`PublishQueue.landed`, so
writes to one key stay ordered.  A rotation's snapshot (the node's whole inventory)
supersedes everything queued and is drained first.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from itertools import islice

from pegaflow.keys import BlockLocation, Keyspace

log = logging.getLogger(__name__)

Entries = Iterable[tuple[str, bytes, int, BlockLocation]]
"""(namespace, hash, shard, location) of blocks on the node"""


class Delete:
    """A queued unpublish (a put is queued as its value bytes)."""

    __slots__ = ()


DELETE = Delete()

Write = tuple[bytes, bytes | Delete]
"""(etcd key, value bytes or :data:`DELETE`)"""


class PublishQueue:
    """Writes waiting for etcd (see the module docstring)."""

    def __init__(self, keys: Keyspace, max_pending: int) -> None:
        self.keys = keys
        self.max_pending = max_pending
        self.pending: dict[bytes, bytes | Delete] = {}
        self.snapshot: Iterator[tuple[str, bytes, int, BlockLocation]] | None = None
        self._inflight_keys: set[bytes] = set()
        self.dropped = 0
        self.overflowed = False
        """writes were dropped since the last republish"""

    def __len__(self) -> int:
        return len(self.pending)

    def put(self, key: bytes, value: bytes | Delete, *, force: bool = False) -> bool:
        """Queue a write (``force``: even past the bound); False when it was dropped."""
        pending = self.pending
        if not force and len(pending) >= self.max_pending and key not in pending:
            self._drop()
            return False
        pending[key] = value
        return True

    def put_many(self, entries: Entries) -> int:
        """Queue a publish of each entry; returns how many were queued (the rest were
        dropped: the queue was full)."""
        pending = self.pending
        block_key = self.keys.block_key
        room = self.max_pending - len(pending)
        n = 0
        for ns, h, shard, loc in entries:
            key = block_key(ns, h, shard)
            if room <= 0 and key not in pending:
                self._drop()
                continue
            if key not in pending:
                room -= 1
            pending[key] = loc.encode()
            n += 1
        return n

    def _drop(self) -> None:
        if not self.dropped or self.dropped % 10000 == 0:
            log.warning(
                "etcd publish queue full (%d writes): dropping (%d so far); the inventory "
                "will be republished when etcd catches up",
                self.max_pending,
                self.dropped + 1,
            )
        self.dropped += 1
        self.overflowed = True

    def take(self, n: int) -> list[Write]:
        """Up to ``n`` writes for one transaction (of the snapshot first), none of a key
        already in flight; their keys are in flight until :meth:`landed`."""
        inflight = self._inflight_keys
        if self.snapshot is not None:
            block_key = self.keys.block_key
            items: list[Write] = [
                (block_key(ns, h, shard), loc.encode())
                for ns, h, shard, loc in islice(self.snapshot, n)
            ]
            if len(items) < n:
                self.snapshot = None
            inflight.update(k for k, _ in items)
            return items
        pending = self.pending
        if not pending:
            return []
        keys: list[bytes] = []
        for k in pending:
            if k not in inflight:
                keys.append(k)
                if len(keys) >= n:
                    break
        inflight.update(keys)
        return [(k, pending.pop(k)) for k in keys]

    def requeue(self, batch: list[Write]) -> None:
        """Queue a failed transaction's writes again (a newer write to a key wins)."""
        setdefault = self.pending.setdefault
        for k, v in batch:
            setdefault(k, v)

    def landed(self, batch: list[Write]) -> None:
        """A transaction of ``batch`` ended (written, refused or requeued)."""
        self._inflight_keys.difference_update(k for k, _ in batch)

    def restart(self, snapshot: list[tuple[str, bytes, int, BlockLocation]]) -> None:
        """Write ``snapshot`` (the node's whole inventory) in place of everything
        queued so far."""
        self.pending.clear()
        self.snapshot = iter(snapshot)
        self.overflowed = False
