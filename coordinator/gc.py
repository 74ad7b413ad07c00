"""The index garbage collector: a singleton duty of the elected coordinator.

Index entries normally leave etcd with their node (its lease) or when the node evicts
the block (its publisher deletes the key).  An entry can still outlive its block: a
delete dropped while the node's write queue overflowed, an entry written without a lease
or by a tool, a node that came back without a block it had published.  Lookups would
keep sending readers to such an entry, and every get of it would be a miss.

While this coordinator leads (:class:`~pegaflow.coordinator.election.Election`), a pass
every ``[coordinator] gc_interval_s`` walks the in-memory index in batches and asks each
live node, with one batched ``check`` op on its data plane, whether it still holds each
entry's block *with the generation the entry names*.  Entries the node denies wait a
grace period (``grace_s``: a node's own delete of an evicted block lands within
milliseconds, so the GC does not race it), then the GC re-reads their keys from etcd
and deletes those that still name that node and generation and were not written since
(a nested compare on the mod revision), in transactions fenced by the election (a
deposed leader deletes nothing).  A node that does
not answer is skipped: the GC never deletes on doubt.  Entries of nodes without a live
record are left alone (they are never served, and their lease removes them).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from dataclasses import KW_ONLY, InitVar, dataclass
from itertools import islice
from typing import TYPE_CHECKING, Any

from pegaflow.errors import PegaError
from pegaflow.etcd import EtcdClient, delete_if_unmodified_op, range_op
from pegaflow.keys import BlockLocation, Keyspace
from pegaflow.lifecycle import Supervised

from .election import Election
from .index import BlockIndex

if TYPE_CHECKING:
    from pegaflow.client.data import DataClient

log = logging.getLogger(__name__)


@dataclass(eq=False, repr=False)
class IndexGC:
    """Deletes index entries whose block is gone from its node (module docstring).

    ``interval_s``: seconds between passes (the first one ``interval_s`` after
    leadership is won);
    ``batch``: entries per ``check`` request; ``entries_per_s``: pace of a pass (it
    sleeps between batches so lookups keep their CPU); ``token``: the cluster token
    for the nodes' data plane; ``check_timeout_s``: deadline of one ``check``;
    ``grace_s``: how long a denied entry waits before it is re-read and deleted.
    """

    #: Denied entries held for one grace period at most (then deleted, mid-pass).
    MAX_PENDING = 50_000

    index: BlockIndex
    client: EtcdClient
    keys: Keyspace
    election: Election
    _: KW_ONLY
    interval_s: float
    batch: int = 1024
    entries_per_s: int = 100_000
    token: InitVar[str | None] = None
    check_timeout_s: float = 5.0
    grace_s: float = 1.0

    def __post_init__(self, token: str | None) -> None:
        self.batch = max(1, self.batch)
        self.entries_per_s = max(1, self.entries_per_s)
        self._token = token
        self._data: DataClient | None = None
        self._loop = Supervised("index-gc", self._round, on_error=self._pass_failed)
        self.passes = 0
        self.checked = 0
        self.deleted = 0
        self.errors = 0
        self.running = False
        self.last_pass_s = 0.0
        self.last_pass_deleted = 0

    async def start(self) -> None:
        """Run passes in the background whenever this coordinator leads."""
        if self.interval_s > 0:
            self._loop.start()

    async def close(self) -> None:
        """Stop (a pass in progress is abandoned between two batches)."""
        await self._loop.close()
        if self._data is not None:
            await self._data.close()
            self._data = None

    def status(self) -> dict[str, Any]:
        """The GC's counters for status pages."""
        names = ("interval_s", "running", "passes", "checked", "deleted", "errors")
        out: dict[str, Any] = {name: getattr(self, name) for name in names}
        out["last_pass_s"] = round(self.last_pass_s, 3)
        out["last_pass_deleted"] = self.last_pass_deleted
        return out

    async def _round(self) -> bool:
        await self.election.wait_leader()
        await asyncio.sleep(self.interval_s)  # a new leader waits one interval too
        if self.election.is_leader:
            await self.run_pass()
        return True

    def _pass_failed(self, e: Exception) -> None:
        self.errors += 1
        log.exception("index GC pass failed")

    def _data_client(self) -> DataClient:
        if self._data is None:
            from pegaflow.client.data import DataClient  # UCX only where the GC runs

            self._data = DataClient(token=self._token)
        return self._data

    async def run_pass(self) -> int:
        """One pass over the whole index (abandoned if leadership is lost); returns the
        number of entries deleted."""
        t0 = time.monotonic()
        self.running = True
        deleted = 0
        pending: list[tuple[str, str, list[tuple[bytes, int, int]]]] = []
        try:
            for ns in self.index.namespaces():
                hashes = iter(self.index.hashes(ns))
                while chunk := list(islice(hashes, self.batch)):
                    if not self.election.is_leader:
                        return deleted
                    entries = self.index.entries(ns, chunk)
                    pending += await self._check_batch(ns, entries)
                    self.checked += len(entries)
                    if sum(len(p[2]) for p in pending) >= self.MAX_PENDING:
                        deleted += await self._delete_after_grace(pending)
                        pending = []
                    await asyncio.sleep(len(entries) / self.entries_per_s)
            deleted += await self._delete_after_grace(pending)
        finally:
            self.running = False
            self.passes += 1
            self.deleted += deleted
            self.last_pass_deleted = deleted
            self.last_pass_s = time.monotonic() - t0
            if deleted:
                log.info("index GC deleted %d stale entries", deleted)
        return deleted

    async def _delete_after_grace(
        self, pending: list[tuple[str, str, list[tuple[bytes, int, int]]]]
    ) -> int:
        if not pending:
            return 0
        await asyncio.sleep(self.grace_s)
        deleted = 0
        for ns, node, stale in pending:
            if not self.election.is_leader:
                break
            deleted += await self._delete(ns, node, stale)
        return deleted

    async def _check_batch(
        self, ns: str, entries: list[tuple[bytes, int, str, int]]
    ) -> list[tuple[str, str, list[tuple[bytes, int, int]]]]:
        """Ask each entry's node; returns ``(ns, node, entries it denied)``."""
        by_node: dict[str, list[tuple[bytes, int, int]]] = defaultdict(list)
        for h, shard, node, gen in entries:
            by_node[node].append((h, shard, gen))
        denied = []
        for node, items in by_node.items():
            rec = self.index.node(node)
            if rec is None:
                continue  # no live record: never served, its lease removes it
            try:
                valid = await self._data_client().check(
                    rec.ucx_address, ns, items, self.check_timeout_s, expect_node=node
                )  # another node answering there (WrongPeer) is not asked: skipped
            except PegaError as e:
                self.errors += 1
                log.info("index GC: node %s did not answer a check (%s); skipped", node, e)
                continue
            stale = [it for it, ok in zip(items, valid, strict=True) if not ok]
            if stale:
                denied.append((ns, node, stale))
        return denied

    async def _delete(self, ns: str, node: str, stale: list[tuple[bytes, int, int]]) -> int:
        """Delete the etcd keys of ``stale`` entries that still name ``node`` and their
        generation, unless rewritten meanwhile; fenced by the election."""
        deleted = 0
        step = max(1, self.client.cfg.batch_size)
        for i in range(0, len(stale), step):
            part = stale[i : i + step]
            keys = [self.keys.block_key(ns, h, shard) for h, shard, _ in part]
            read = await self.client.txn([range_op(k) for k in keys])
            ops = []
            for key, (_, _, gen), resp in zip(keys, part, read.responses, strict=True):
                kvs = resp.response_range.kvs
                if not kvs:
                    continue
                try:
                    loc = BlockLocation.decode(kvs[0].value)
                except (PegaError, TypeError, ValueError):
                    continue  # not ours to judge
                if loc.node == node and loc.gen == gen:
                    ops.append(delete_if_unmodified_op(key, kvs[0].mod_revision))
            if not ops:
                continue
            if not self.election.is_leader:
                return deleted
            r = await self.client.txn(ops, compare=[self.election.fence()])
            if not r.succeeded:
                log.warning("index GC: leadership lost before a delete; nothing deleted")
                return deleted
            deleted += sum(1 for x in r.responses if x.response_txn.succeeded)
        return deleted
