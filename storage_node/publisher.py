"""Publishes a storage node's membership and block inventory to etcd.

:class:`EtcdPublisher` is the cluster's :class:`~pegaflow.inventory.InventorySink`:

* It grants a lease (``[etcd] lease_ttl_s``), keeps it alive, and writes
  ``nodes/<id>`` and every ``blocks/<ns>/<hash>/<shard>`` key under it, so a dead
  node's entries vanish by themselves one TTL later.
* ``publish``/``unpublish`` only queue (:mod:`~pegaflow.storage_node.publish_queue`:
  a later write to the same key replaces an earlier one still queued).  Writer tasks
  drain the queue in transactions of ``[etcd] batch_size`` ops, several in flight at
  once; a key is never in two transactions at the same time, so writes to one key stay
  ordered.
* An unpublish is a delete *if the key is still on this node's lease*: a node never
  deletes an entry another node has overwritten since.
* When the queue is full, writes are dropped and counted.  When the lease is lost
  (expired during a partition, etcd rebuilt) or writes were dropped, the publisher
  *rotates*: it grants a new lease, rewrites the node record and the node's whole
  inventory (from the ``inventory`` callback) under it, then revokes the old lease,
  which deletes exactly the stale keys.  Lookups never see the inventory disappear.
* An etcd outage never raises into the node: calls fail, get logged and counted, and
  are retried with backoff; the queue keeps absorbing writes up to its bound.
* One node id, one live node: before its first registration the publisher checks
  that no other live node holds the node id (:mod:`~pegaflow.storage_node.node_claim`)
  and :meth:`start` raises :class:`~pegaflow.inventory.NodeIdInUse` when one does.  A
  check that cannot reach etcd at start is made again before the first registration; a
  refusal found then stops the publisher (:attr:`EtcdPublisher.refused`), which the
  node's health reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from pegaflow.storage_node.metrics import PublisherCollector
from pegaflow.storage_node.node_claim import NodeIdClaim
from pegaflow.storage_node.publish_queue import DELETE, Delete, Entries, PublishQueue
from prometheus_client import CollectorRegistry

from pegaflow.config import EtcdConfig
from pegaflow.errors import BadRequest, NotFound, PegaError, TooLarge
from pegaflow.etcd import EtcdClient, delete_if_lease_op, put_op
from pegaflow.etcd_lease import KeptLease
from pegaflow.inventory import NodeIdInUse
from pegaflow.keys import BlockLocation, Keyspace, NodeRecord
from pegaflow.lifecycle import Backoff, Supervised, close_all

log = logging.getLogger(__name__)

Inventory = Callable[[], Entries]


class EtcdPublisher:
    """Publishes one node's record and inventory to etcd (see the module docstring).

    ``inventory`` returns the node's complete current inventory as
    ``(namespace, hash, shard, location)``; it is called synchronously and its result
    is copied at once, so it may return a live view.  It must agree with what was
    passed to :meth:`publish`/:meth:`unpublish` so far.

    ``client``: an :class:`~pegaflow.etcd.EtcdClient` to share (default: its own).
    ``max_pending``: writes queued at most (about 250 bytes each) before dropping.
    ``concurrency``: transactions in flight at once.  ``registry``: where to register
    the ``pegaflow_node_etcd_*`` metrics (default: nowhere).
    """

    def __init__(
        self,
        etcd: EtcdConfig,
        inventory: Inventory,
        *,
        client: EtcdClient | None = None,
        max_pending: int = 1 << 18,
        concurrency: int = 4,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.cfg = etcd
        self.keys = Keyspace(etcd.prefix)
        self._inventory = inventory
        self._client = client
        self._own_client = client is None
        self._concurrency = max(1, concurrency)
        self._batch_size = max(1, etcd.batch_size)
        self._flush_interval = max(0.0, etcd.flush_interval_ms / 1000)
        self._ttl = max(1, int(etcd.lease_ttl_s))
        self._keepalive_s = max(0.2, self._ttl / 3)  # retried at the same pace

        self._record: NodeRecord | None = None
        self._node_key = b""
        self._writes = PublishQueue(self.keys, max_pending)
        self._inflight = 0
        self._drained = asyncio.Event()  # set while no batch is in flight
        self._drained.set()

        self._lease: KeptLease | None = None
        self._gen = 0
        self._old_lease = 0  # revoked once a rotation's snapshot is written
        self._rotate = True  # (re)register at the next chance
        self._lease_ok = asyncio.Event()
        self._work = asyncio.Event()
        self._idle = asyncio.Event()
        self._wake = asyncio.Event()
        self._registered = asyncio.Event()
        self._supervise_backoff = Backoff(0.1)
        self._supervisor = Supervised(
            "publisher-supervisor",
            self._supervise,
            on_error=self._supervise_failed,
            backoff=self._supervise_backoff,
        )
        self._tasks: list[Supervised] = []  # the supervisor and the writers, once started
        self._closing = False
        self._down_since: float | None = None
        self._claim: NodeIdClaim | None = None
        #: Why the node id was refused (another live node holds it), else None.
        self.refused: str | None = None

        self.published = 0
        self.unpublished = 0
        self.batches = 0
        self.keys_written = 0
        self.write_errors = 0
        self.keepalive_errors = 0
        self.lease_losses = 0
        self.rotations = 0
        if registry is not None:
            registry.register(PublisherCollector(self.stats))

    # -- InventorySink ----------------------------------------------------------------

    async def start(self, record: NodeRecord) -> None:
        """Start publishing as ``record``'s node.  Waits up to ``[etcd] timeout_s`` for
        the registration; if etcd is unreachable it logs and keeps trying in the
        background (never raises for an outage).  Raises
        :class:`~pegaflow.inventory.NodeIdInUse` when another live node holds the node
        id (this may first wait up to one lease TTL: see
        :mod:`~pegaflow.storage_node.node_claim`)."""
        if self._tasks:
            raise RuntimeError("EtcdPublisher already started")
        self._record = record
        self._node_key = self.keys.node_key(record.node_id)
        if self._client is None:
            self._client = EtcdClient(self.cfg)
        self._claim = NodeIdClaim(self._client, self._node_key)
        try:
            await self._claim.check(record)
        except PegaError as e:
            log.warning(
                "node %s: could not check in etcd that the node id is free (%s); checking "
                "again before registering",
                record.node_id,
                e,
            )
        self._tasks = [self._supervisor]
        for i in range(self._concurrency):
            backoff = Backoff(0.05)
            write = functools.partial(self._write_batch, backoff)
            self._tasks.append(
                Supervised(
                    f"publisher-writer-{i}", write, on_error=self._write_failed, backoff=backoff
                )
            )
        for t in self._tasks:
            t.start()
        try:
            await asyncio.wait_for(self._registered.wait(), self.cfg.timeout_s)
        except TimeoutError:
            log.warning(
                "node %s: not registered in etcd yet (%s); blocks stay queued and "
                "registration keeps retrying in the background",
                record.node_id,
                ", ".join(self.cfg.endpoints),
            )
        if self.refused is not None:
            raise NodeIdInUse(self.refused)

    async def update_node(self, record: NodeRecord) -> None:
        """Queue a new version of the node record (written with the next batch)."""
        self._record = record
        if self._node_key:
            self._queue(self._node_key, record.encode(), force=True)

    def publish(self, ns: str, block_hash: bytes, shard: int, loc: BlockLocation) -> None:
        """Queue: this committed block shard is on this node."""
        self.published += 1
        self._queue(self.keys.block_key(ns, block_hash, shard), loc.encode())

    def unpublish(self, ns: str, block_hash: bytes, shard: int, loc: BlockLocation) -> None:
        """Queue: this block shard is gone from this node."""
        self.unpublished += 1
        self._queue(self.keys.block_key(ns, block_hash, shard), DELETE)

    def publish_many(self, entries: Entries) -> int:
        """Queue many publishes at once (benchmarks, bulk loads); returns how many were
        queued (the rest were dropped: the queue was full)."""
        n = self._writes.put_many(entries)
        self.published += n
        if n:
            self._idle.clear()
            self._work.set()
        return n

    async def flush(self, timeout: float | None = None) -> bool:
        """Wait until the node is registered and everything queued so far is written
        (or dropped and counted).  Returns False if ``timeout`` passed first."""
        try:
            async with asyncio.timeout(timeout):
                while True:
                    await self._idle.wait()
                    if self._is_idle():
                        return True
                    self._idle.clear()
        except TimeoutError:
            return False

    async def close(self, *, revoke: bool = True, timeout: float | None = None) -> None:
        """Stop.  With ``revoke`` (the default) the lease is revoked so the node's
        entries vanish now; without it, queued writes are flushed (up to ``timeout``,
        default ``[etcd] timeout_s``) and the entries live until the lease expires,
        which is also how a crash looks to the cluster."""
        if self._closing:
            return
        if not revoke and self._tasks:
            await self.flush(self.cfg.timeout_s if timeout is None else timeout)
        self._closing = True
        await close_all(self._tasks)
        self._tasks = []
        client = self._client
        if client is not None and revoke:
            for lease in (self.lease_id, self._old_lease):
                if lease:
                    try:
                        await client.revoke(lease)
                    except NotFound:
                        pass
                    except PegaError as e:
                        log.warning("could not revoke lease %x (%s); entries expire in %d s",
                                    lease, e, self._ttl)  # fmt: skip
        self._lease, self._old_lease = None, 0
        if client is not None and self._own_client:
            await client.close()

    # -- introspection ----------------------------------------------------------------

    @property
    def lease_id(self) -> int:
        """The current lease (0 while unregistered)."""
        return self._lease.id if self._lease is not None else 0

    @property
    def registered(self) -> bool:
        """Whether the node record is in etcd under a live lease (as far as we know)."""
        return self._lease_ok.is_set()

    @property
    def pending(self) -> int:
        """Writes queued and not yet sent."""
        return len(self._writes)

    @property
    def dropped(self) -> int:
        """Writes dropped so far (the queue was full)."""
        return self._writes.dropped

    def stats(self) -> dict[str, Any]:
        """Counters for status pages and tests."""
        return {
            "registered": self.registered,
            "lease_id": self.lease_id,
            "pending": len(self._writes),
            "inflight_batches": self._inflight,
            "published": self.published,
            "unpublished": self.unpublished,
            "dropped": self.dropped,
            "batches": self.batches,
            "keys_written": self.keys_written,
            "write_errors": self.write_errors,
            "keepalive_errors": self.keepalive_errors,
            "lease_losses": self.lease_losses,
            "rotations": self.rotations,
        }

    # -- queue ------------------------------------------------------------------------

    def _queue(self, key: bytes, value: bytes | Delete, *, force: bool = False) -> None:
        if self._writes.put(key, value, force=force):
            self._idle.clear()
            self._work.set()

    def _is_idle(self) -> bool:
        return (
            self._lease_ok.is_set()
            and not self._writes.pending
            and self._writes.snapshot is None
            and self._inflight == 0
            and not self._old_lease
        )

    def _check_idle(self) -> None:
        if self._is_idle():
            self._idle.set()
        if self._old_lease or self._writes.overflowed:
            self._wake.set()

    # -- tasks ------------------------------------------------------------------------

    async def _write_batch(self, backoff: Backoff) -> bool:
        """One writer's round: one transaction of queued writes (or a wait for some);
        False (pause by ``backoff``) after a failed one."""
        await self._lease_ok.wait()
        if (
            self._flush_interval
            and self._writes.snapshot is None
            and 0 < len(self._writes) < self._batch_size
        ):
            await asyncio.sleep(self._flush_interval)  # let a batch fill up
            if not self._lease_ok.is_set():
                return True
        batch = self._writes.take(self._batch_size)
        if not batch:
            self._work.clear()
            self._check_idle()
            await self._work.wait()
            return True
        lease, gen = self.lease_id, self._gen
        ops = [
            put_op(k, v, lease) if type(v) is bytes else delete_if_lease_op(k, lease)
            for k, v in batch
        ]
        self._inflight += 1
        self._drained.clear()
        try:
            assert self._client is not None
            await self._client.txn(ops)
        except NotFound as e:
            # The lease is gone: the rotation rewrites the whole inventory, this
            # batch included, under a new one.
            self._lease_lost(gen, e)
        except (BadRequest, TooLarge) as e:
            if self._batch_size > 1:
                self._batch_size = max(1, self._batch_size // 2)
                log.warning(
                    "etcd refused a %d-op transaction (%s): using %d ops per "
                    "transaction; raise etcd's --max-txn-ops or lower [etcd] batch_size",
                    len(ops),
                    e,
                    self._batch_size,
                )
                self._writes.requeue(batch)
            else:
                self.write_errors += 1
                log.error("etcd refused a write (%s); dropping it", e)
        except PegaError as e:
            self.write_errors += 1
            self._writes.requeue(batch)
            self._note_down(e)
            return False
        else:
            backoff.reset()
            self.batches += 1
            self.keys_written += len(batch)
            self._note_up()
        finally:
            self._inflight -= 1
            if not self._inflight:
                self._drained.set()
            self._writes.landed(batch)
            self._check_idle()
        return True

    def _write_failed(self, e: Exception) -> None:
        log.exception("publisher writer failed; retrying")

    def _lease_lost(self, gen: int, why: object) -> None:
        if gen != self._gen or not self._lease_ok.is_set():
            return
        self.lease_losses += 1
        log.warning(
            "node %s: etcd lease %x lost (%s); re-registering and republishing the inventory",
            self._record.node_id if self._record else "?",
            self.lease_id,
            why,
        )
        self._lease = None  # nothing to revoke
        self._rotate = True
        self._lease_ok.clear()
        self._wake.set()

    def _note_down(self, e: Exception) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
            log.warning(
                "etcd writes failing (%s); %d writes queued, retrying with backoff", e, self.pending
            )

    def _note_up(self) -> None:
        if self._down_since is not None:
            log.info("etcd writes resumed after %.1f s", time.monotonic() - self._down_since)
            self._down_since = None

    async def _supervise(self) -> bool:
        """Registers, keeps the lease alive, rotates it when lost or after drops (one
        round: one duty, then a wait for the next keep-alive or a wake-up)."""
        try:
            if self._rotate:
                await self._rotate_lease()
                self._supervise_backoff.reset()
            elif self._old_lease and self._writes.snapshot is None and self._inflight == 0:
                await self._revoke_old()
            elif (
                self._writes.overflowed
                and len(self._writes) < self._writes.max_pending // 2
                and self._writes.snapshot is None
            ):
                log.info("republishing the inventory after %d dropped writes", self.dropped)
                self._writes.overflowed = False
                self._rotate = True
                return True
            if self._lease is not None and self._lease.due_in() <= 0:
                await self._keepalive(self._lease)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                wait = self._lease.due_in() if self._lease is not None else 0.0
                async with asyncio.timeout(wait):
                    await self._wake.wait()
        except NodeIdInUse as e:
            self.refused = str(e)
            log.error("%s; this node publishes nothing", e)
            self._registered.set()
            self._supervisor.finish()
        return True

    def _supervise_failed(self, e: Exception) -> None:
        if isinstance(e, PegaError):
            self._note_down(e)
        else:
            log.exception("publisher supervisor failed; retrying")

    async def _keepalive(self, lease: KeptLease) -> None:
        try:
            alive = await lease.refresh()
        except PegaError as e:
            self.keepalive_errors += 1
            self._note_down(e)
            return
        if not alive:
            self._lease_lost(self._gen, "keepalive: lease not found")

    async def _rotate_lease(self) -> None:
        """Grant a new lease and rewrite the node record and whole inventory under it."""
        assert self._client is not None and self._record is not None
        assert self._claim is not None
        self._lease_ok.clear()
        # Batches in flight under the old lease must land before the snapshot is taken.
        await self._drained.wait()
        if self._claim.rev is None and not self.rotations:
            await self._claim.check(self._record)
        every = self._keepalive_s
        lease = await KeptLease.grant(self._client, self._ttl, interval_s=every, min_retry_s=every)
        try:
            if self._claim.rev is not None:
                await self._claim.register(self._record, lease.id)
            else:
                await self._client.put(self._node_key, self._record.encode(), lease.id)
        except (PegaError, NodeIdInUse):
            with contextlib.suppress(PegaError):
                await lease.revoke()
            raise
        snapshot = list(self._inventory())
        self._writes.restart(snapshot)  # it supersedes everything queued so far
        if self._lease is not None:
            self._old_lease = self._lease.id
        self._lease = lease
        self._gen += 1
        self._rotate = False
        self.rotations += 1
        self._lease_ok.set()
        self._registered.set()
        self._work.set()
        self._idle.clear()
        self._note_up()
        log.info(
            "node %s registered in etcd (lease %x, ttl %d s), publishing %d blocks",
            self._record.node_id,
            lease.id,
            self._ttl,
            len(snapshot),
        )

    async def _revoke_old(self) -> None:
        assert self._client is not None
        old, self._old_lease = self._old_lease, 0
        try:
            await self._client.revoke(old)
        except NotFound:
            pass
        except PegaError:
            self._old_lease = old
            raise
        self._check_idle()
