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
it waits on the first.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pegaflow.storage_node.protocol import Key

from pegaflow.errors import PegaError

if TYPE_CHECKING:
    from pegaflow.storage_node.node_service import NodeService

log = logging.getLogger(__name__)


class Promotion:
    """The promotions of a :class:`~.node_service.NodeService` (they run on its data
    loop)."""

    def __init__(self, service: NodeService) -> None:
        self._svc = service
        self.pool = service.pool
        self._promoting: dict[Key, asyncio.Future[bool]] = {}

    def disk_only(self, keys: Sequence[Key]) -> list[Key]:
        """The keys held on the disk tier and not in the pool (to :meth:`promote`)."""
        disk = self._svc.disk
        if disk is None:
            return []
        pool = self.pool
        return [k for k in keys if disk.contains(k) and pool.get(k) is None]

    async def promote(self, keys: Sequence[Key]) -> None:
        """Bring the blocks of ``keys`` held only on the disk tier into the pool (on the
        data loop; a block that cannot come back stays a miss)."""
        todo = self.disk_only(keys)
        if todo:
            await asyncio.gather(*(asyncio.shield(self.promotion(k)) for k in todo))

    def promote_threadsafe(self, keys: Sequence[Key]) -> asyncio.Future[None]:
        """:meth:`promote` on the data loop, awaitable from another loop."""
        loop = self._svc.loop
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self.promote(keys), loop))

    async def then(self, keys: Sequence[Key], then: Callable[[], Any]) -> Any:
        """``then()`` once the blocks of ``keys`` only on disk are promoted (awaited on
        the data loop, from any loop)."""
        if self._svc.on_data_loop():
            await self.promote(keys)
        else:
            await self.promote_threadsafe(keys)
        return then()

    def promotion(self, key: Key) -> asyncio.Future[bool]:
        """The promotion of ``key`` under way, or a new one (one per key at a time; on
        the data loop): its result says whether the block came into the pool."""
        fut = self._promoting.get(key)
        if fut is None:
            fut = self._promoting[key] = asyncio.ensure_future(self._promote(key))
            fut.add_done_callback(lambda _: self._promoting.pop(key, None))
        return fut

    async def _promote(self, key: Key) -> bool:
        svc = self._svc
        disk = svc.disk
        info = disk.info(key) if disk is not None else None
        if disk is None or info is None:
            return False
        pool = self.pool
        try:
            e = pool.reserve(key, info.length, 2 * svc.cfg.reserve_timeout_s)
        except PegaError as err:  # the pool is full of pinned or reserved blocks
            log.debug("cannot promote a block from disk now: %s", err)
            return False
        if e is None:
            return False  # stored or being written meanwhile
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
        svc.sink.publish(key[0], key[1], key[2], loc)
        svc.metrics.disk_promotions.inc()
        svc.changed()
        return True
