"""Promotion: blocks held only on the disk tier come back into the pool to be served.

Disk tier (``[node] disk_path``, :mod:`~pegaflow.storage_node.disk_tier`): a block
evicted from the pool may live on in the tier.  ``get``, ``pin`` and ``locate`` of a block
held only there first *promote* it (:meth:`Promotion.promotion`): a pool slot is
reserved, the block is read into it (verified against its checksum) and committed with
the generation it had, so a reader's fenced get still matches, and the disk copy stays
(evicting it again writes nothing).  Reads run on the tier's read threads: a ``pin`` or
``locate`` promotes all of its blocks at once (:meth:`Promotion.promote`), a ``get``
a few ahead of its sends (:class:`~pegaflow.storage_node.reads.OpenGet`).  A block that
fails its read is a miss.  One promotion of a key runs at a time: a second request for
it waits on the first.  A promoted block is pinned from its commit until its waiters
took it (each pins it in a done callback of the promotion: the get's send; or, for
``pin`` and ``locate``, :class:`Held` until their reply is made), so no eviction can
take it in between.  A promotion that finds no slot while blocks are being written
ahead to the disk (:mod:`~pegaflow.storage_node.spill_ahead`: their slots are freed when
those writes end) waits for them, up to ``[node] reserve_timeout_s``.  So does one whose
slot would evict a block while the spill queue is full, which would drop that block:
a large promotion into a full pool goes at the pace of the disk's writes.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pegaflow.storage_node.blocks import Entry
from pegaflow.storage_node.pool import BlockPool

from pegaflow.errors import NoSpace, PegaError
from pegaflow.protocol.node import Key

if TYPE_CHECKING:
    from pegaflow.storage_node.node_service import NodeService

log = logging.getLogger(__name__)

_SPILL_WAIT_S = 0.002
"""how often a promotion short of a slot looks again while blocks are written ahead"""


class Held:
    """Promoted blocks pinned for a caller until :meth:`release` (by the caller once it
    took its own pins, from any thread; or by a timer, should the caller go away)."""

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool
        self._lock = threading.Lock()
        self._entries: list[Entry] = []
        self._released = False

    def take(self, e: Entry | None) -> None:
        """Pin ``e`` (on the data loop) unless it is gone or this was released."""
        with self._lock:
            if e is not None and not self._released:
                self._pool.pin(e)
                self._entries.append(e)

    def release(self) -> None:
        """Unpin what was taken (once; later calls do nothing)."""
        with self._lock:
            entries, self._entries, self._released = self._entries, [], True
        self._pool.unpin_many(entries)


class Promotion:
    """The promotions of a :class:`~.node_service.NodeService` (they run on its data
    loop)."""

    def __init__(self, service: NodeService) -> None:
        self._svc = service
        self.pool = service.pool
        self._promoting: dict[Key, asyncio.Future[bool]] = {}
        self._committed: dict[Key, Entry] = {}
        """promoted blocks pinned from their commit until their waiters took them"""

    def disk_only(self, keys: Sequence[Key]) -> list[Key]:
        """The keys held on the disk tier and not in the pool (to :meth:`promote`)."""
        disk = self._svc.disk
        if disk is None:
            return []
        pool = self.pool
        return [k for k in keys if disk.contains(k) and pool.get(k) is None]

    async def promote(self, keys: Sequence[Key], held: Held | None = None) -> None:
        """Bring the blocks of ``keys`` held only on the disk tier into the pool (on the
        data loop; a block that cannot come back stays a miss); ``held`` pins those
        that came (the caller releases it)."""
        todo = self.disk_only(keys)
        if not todo:
            return
        futs = [self.promotion(k) for k in todo]
        if held is not None:
            for k, f in zip(todo, futs, strict=True):
                f.add_done_callback(lambda f, k=k: f.cancelled() or held.take(self.pool.get(k)))
        await asyncio.gather(*(asyncio.shield(f) for f in futs))

    def promote_threadsafe(
        self, keys: Sequence[Key], held: Held | None = None
    ) -> asyncio.Future[None]:
        """:meth:`promote` on the data loop, awaitable from another loop."""
        loop = self._svc.loop
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self.promote(keys, held), loop))

    async def then(self, keys: Sequence[Key], then: Callable[[], Any]) -> Any:
        """``then()`` once the blocks of ``keys`` only on disk are promoted (awaited on
        the data loop, from any loop); they stay pinned until ``then()`` returned."""
        held = Held(self.pool)
        svc = self._svc
        # a backstop should this caller go away with the pins taken (cancelled)
        svc.loop.call_soon_threadsafe(svc.loop.call_later, svc.cfg.reserve_timeout_s, held.release)
        try:
            if svc.on_data_loop():
                await self.promote(keys, held)
            else:
                await self.promote_threadsafe(keys, held)
            return then()
        finally:
            held.release()

    def promotion(self, key: Key) -> asyncio.Future[bool]:
        """The promotion of ``key`` under way, or a new one (one per key at a time; on
        the data loop): its result says whether the block came into the pool."""
        fut = self._promoting.get(key)
        if fut is None:
            fut = self._promoting[key] = asyncio.ensure_future(self._promote(key))
            fut.add_done_callback(lambda _: self._promoted(key))
        return fut

    def _promoted(self, key: Key) -> None:
        """The first done callback of ``key``'s promotion: the promotion's own pin goes
        after the callbacks of its waiters (scheduled after this one), which pin it."""
        self._promoting.pop(key, None)
        e = self._committed.pop(key, None)
        if e is not None:
            self._svc.loop.call_soon(self.pool.unpin, e)

    async def _promote(self, key: Key) -> bool:
        svc = self._svc
        disk = svc.disk
        info = disk.info(key) if disk is not None else None
        if disk is None or info is None:
            return False
        pool = self.pool
        e = await self._reserve(key, info.length)
        if e is None:
            return False  # no room, or stored or being written meanwhile
        read = disk.read_into(key, pool.view(e))
        try:
            n = await asyncio.shield(asyncio.wrap_future(read))
        except asyncio.CancelledError:
            pool.quarantine(e)  # the read thread may still write the slot
            read.add_done_callback(
                lambda _: svc.loop.call_soon_threadsafe(pool.release_quarantined, e)
            )
            raise
        if n is None:  # a miss: failed its checksum, or an I/O error (counted by the tier)
            pool.abort(e)
            return False
        loc = pool.commit(e, info.xxh3, gen=info.gen)
        pool.pin(e)  # until its waiters took it (_promoted)
        self._committed[key] = e
        svc.sink.publish(key[0], key[1], key[2], loc)
        svc.metrics.disk_promotions.inc()
        svc.changed()
        return True

    async def _reserve(self, key: Key, length: int) -> Entry | None:
        """A slot for ``key`` (None: stored or being written meanwhile, or no room: the
        pool is full of pinned or reserved blocks); while only blocks being written
        ahead hold the room, or while the eviction it needs would find the spill queue
        full, waits for the writes (up to ``reserve_timeout_s``; then it evicts anyway)."""
        pool, cfg, disk = self.pool, self._svc.cfg, self._svc.disk
        loop = asyncio.get_running_loop()
        deadline = loop.time() + cfg.reserve_timeout_s
        while True:
            if (
                disk is not None
                and pool.free_bytes() < length
                and disk.spill_queue_full()
                and loop.time() < deadline
            ):
                await asyncio.sleep(_SPILL_WAIT_S)
                continue
            try:
                return pool.reserve(key, length, 2 * cfg.reserve_timeout_s)
            except NoSpace as err:
                if not pool.spilling or loop.time() >= deadline:
                    log.debug("cannot promote a block from disk now: %s", err)
                    return None
            except PegaError as err:
                log.debug("cannot promote a block from disk now: %s", err)
                return None
            await asyncio.sleep(_SPILL_WAIT_S)
