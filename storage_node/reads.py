"""The node's read path: finding blocks, a get's pins, ``check``, ``pin``, ``locate`` and
``unpin``.

A read pin belongs to its session (:mod:`~pegaflow.storage_node.sessions`); ``unpin`` of
another's is a no-op, except that any session with cluster-wide access may release a pin
taken with cluster-wide access on the same site (a connector's scheduler pins, its
worker releases).  Pins outlive their session until ``ttl_ms``.  A tenant's pins count
against its quotas.

Same-host reads (a client on the node's host that maps the pool file): ``locate`` pins
the present blocks for ``ttl_ms`` (no eviction while the reader copies them out of the
file) and says where they lie, packed (:class:`~pegaflow.protocol.codec.LocatedBlocks`): a
10k-token prefix is hundreds of blocks.

Blocks held only on the disk tier are promoted before a ``pin`` or ``locate`` serves
them (:mod:`~pegaflow.storage_node.promotion`); a ``get`` streams them, each sent as
soon as its own promotion is done (:class:`OpenGet`); ``check`` counts a block on disk
as stored.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pegaflow.storage_node.blocks import Entry
from pegaflow.storage_node.sessions import Pin, PinTable, Session

from pegaflow.protocol import node as proto
from pegaflow.protocol.codec import LocatedBlocks
from pegaflow.protocol.node import Key

if TYPE_CHECKING:
    from pegaflow.storage_node.node_service import NodeService

log = logging.getLogger(__name__)

STREAM_WINDOW_PER_THREAD = 2
"""a streamed get keeps this many disk reads a read thread going ahead of its sends"""


class OpenGet:
    """The blocks of one get, each pinned from the moment it is ready to send.

    ``found[i]``: block ``i``'s entry once it is ready (None: a miss, or stale against
    ``want``), and ``header[i]`` the reply's word on it.  Blocks in the pool are ready at
    once.  Those held only on the disk tier are promoted (read, verified, committed:
    :mod:`~pegaflow.storage_node.promotion`), at most ``window`` ahead of the send
    cursor, and each is ready as soon as its own promotion is done: a get sends its
    first blocks while later ones are still being read (:meth:`waiting`).  A block whose
    read fails is a miss for that block only.
    """

    def __init__(self, reads: Reads, keys: Sequence[Key], want: Sequence[int | None] | None):
        self._reads = reads
        self._keys = keys
        self._want = want
        self.found: list[Entry | None] = reads._find_keys(keys)
        self.header: list[Any] = [None] * len(keys)
        self._held: list[Entry] = []
        self._closed = False
        svc = reads._svc
        disk = svc.disk
        self._disk: list[int] = []
        """the blocks held only on disk, in the request's order"""
        if disk is not None:
            self._disk = [
                i for i, e in enumerate(self.found) if e is None and disk.contains(keys[i])
            ]
        self._rank = {i: r for r, i in enumerate(self._disk)}
        for i, e in enumerate(self.found):
            if e is not None:
                self._take(i, e)
        reads.pool.pin_many(self._held)
        self._ready: dict[int, asyncio.Future[None]] = {}
        self._launched = 0
        self.window = STREAM_WINDOW_PER_THREAD * (disk.read_threads if disk is not None else 1)
        self._launch(0)

    def waiting(self, i: int) -> asyncio.Future[None] | None:
        """None when block ``i`` is ready to send (send it now), else a future done once
        its disk read is done, verified and committed, or failed (a miss): then ask
        again."""
        rank = self._rank.get(i)
        if rank is None:
            return None  # in the pool, or a miss
        self._launch(rank)
        fut = self._ready[i]
        if not fut.done():
            return fut
        disk = self._disk
        later = self._launched < len(disk) or any(
            not self._ready[disk[r]].done() for r in range(rank + 1, self._launched)
        )
        if later and self.found[i] is not None:
            self._reads.metrics.disk_streamed.inc()  # sent ahead of a later disk read
        return None

    def _launch(self, cursor: int) -> None:
        """Start the promotions of the disk blocks up to ``window`` past the
        ``cursor``-th one (on the data loop)."""
        end = min(len(self._disk), cursor + self.window)
        if self._launched >= end:
            return
        promotion = self._reads._svc.promotion
        loop = asyncio.get_running_loop()
        while self._launched < end:
            i = self._disk[self._launched]
            self._launched += 1
            ready = self._ready[i] = loop.create_future()
            promotion.promotion(self._keys[i]).add_done_callback(
                lambda f, i=i, ready=ready: self._arrived(f, i, ready)
            )

    def _arrived(self, done: asyncio.Future[bool], i: int, ready: asyncio.Future[None]) -> None:
        """Block ``i``'s promotion is over: pin it now (it is sent when its turn
        comes), or it is a miss."""
        if not done.cancelled() and done.exception() is not None:
            log.error("promoting a block from disk failed: a miss", exc_info=done.exception())
        if self._closed:
            return
        e = self._reads.pool.get(self._keys[i])
        if e is not None and self._take(i, e):
            self._reads.pool.pin_many([e])
        ready.set_result(None)

    def _take(self, i: int, e: Entry) -> bool:
        """Block ``i`` is ``e``: whether it is sent (held: to pin), not stale against
        ``want``."""
        want = self._want
        if want is not None and want[i] is not None and e.gen != want[i]:
            self.header[i] = proto.STALE  # the slot holds another generation now
            self.found[i] = None
            return False
        self.found[i] = e
        self.header[i] = proto.get_hit(e.size, e.gen, e.xxh3)
        self._held.append(e)
        return True

    def close(self) -> list[Entry]:
        """The get is over: count its blocks; the entries it pinned (to unpin)."""
        self._closed = True
        for fut in self._ready.values():
            fut.cancel()
        m = self._reads.metrics.get_blocks
        hits = len(self._held)
        stale = self.header.count(proto.STALE)
        if hits:
            m.labels(result="hit").inc(hits)
        if stale:
            m.labels(result="stale").inc(stale)
        if hits + stale < len(self._keys):
            m.labels(result="miss").inc(len(self._keys) - hits - stale)
        return self._held


class Reads:
    """The read path of a :class:`~.node_service.NodeService` (``locate`` and ``unpin``
    may run on another site's loop than the data loop)."""

    def __init__(self, service: NodeService) -> None:
        self._svc = service
        self.pool = service.pool
        self.cfg = service.cfg
        self.metrics = service.metrics
        self._pin_ids = itertools.count(1)
        self._located: dict[Entry, tuple[int, bytes]] = {}
        """each committed entry's ``locate`` row, once computed (it never changes)"""

    def find(self, ns: str, hashes: Sequence[bytes], shards: int | Sequence[int]) -> list[Any]:
        """The committed entry of each ``(ns, hash, shard)``, or None: the one place a
        block is found for serving (``get``, ``check``, ``pin``, ``locate``).
        ``shards``: one shard for every hash, or one per hash.  Nothing is found once
        the pool file was truncated (:meth:`~.pool.BlockPool.check_file`)."""
        if self.pool.check_file() is not None:
            return [None] * len(hashes)
        if isinstance(shards, int):
            return self.pool.get_many(ns, hashes, shards)
        get = self.pool.get
        return [get((ns, h, s)) for h, s in zip(hashes, shards, strict=True)]

    def _find_keys(self, keys: Sequence[Key]) -> list[Any]:
        ns = keys[0][0] if keys else ""
        return self.find(ns, [k[1] for k in keys], [k[2] for k in keys])

    def forget(self, e: Entry) -> None:
        """``e`` left the pool (evicted or dropped)."""
        self._located.pop(e, None)

    def open_get(self, keys: Sequence[Key], want: Sequence[int | None] | None) -> OpenGet:
        """What a get sends, block by block (see :class:`OpenGet`), pinned until
        :meth:`close_get`."""
        return OpenGet(self, keys, want)

    def close_get(self, get: OpenGet, ok: bool) -> None:
        """A get of :meth:`open_get` is over (``ok``: every payload went out)."""
        held = get.close()
        if ok:
            self.metrics.get_bytes.inc(sum(e.size for e in held))
        self.pool.unpin_many(held)

    def check(self, msg: dict[str, Any], s: Session) -> dict[str, Any]:
        """Whether each block is stored and committed (with the generation given)."""
        _, keys, want = proto.decode_check(msg, self.cfg.max_batch)
        found = self._find_keys(keys)
        disk = self._svc.disk
        if disk is not None:
            found = [e if e is not None else disk.info(k) for e, k in zip(found, keys, strict=True)]
        return {
            "valid": [
                e is not None and (want is None or want[i] in (None, e.gen))
                for i, e in enumerate(found)
            ]
        }

    def pin(self, msg: dict[str, Any], s: Session) -> Any:
        """Read pins: keep the named blocks from eviction for ``ttl_ms`` (between a
        reader's lookup and its get), so a hit is not lost to a racing writer (blocks
        only on disk are promoted first)."""
        ttl_ms, keys = proto.decode_pin(msg, self.cfg.max_batch)
        promotion = self._svc.promotion
        if promotion.disk_only(keys):
            return promotion.then(keys, lambda: self._pin_now(ttl_ms, keys, s))
        return self._pin_now(ttl_ms, keys, s)

    def _pin_now(self, ttl_ms: int, keys: Sequence[Key], s: Session) -> dict[str, Any]:
        found = self._find_keys(keys)
        pin = self._hold(found, ttl_ms, s)
        return {"pinned": [e is not None for e in found], "pin": pin}

    def locate(self, msg: dict[str, Any], s: Session) -> Any:
        """Same-host reads: pin the named blocks and say where they lie in the pool file
        (``hashes``: ``hash_len``-byte hashes back to back, all of one ``shard``)."""
        ns, ttl_ms, shard, hashes = proto.decode_locate(msg, self.cfg.max_batch)
        if self._svc.disk is not None:
            keys = [(ns, h, shard) for h in hashes]
            promotion = self._svc.promotion
            if promotion.disk_only(keys):
                return promotion.then(keys, lambda: self._locate_now(ns, ttl_ms, shard, hashes, s))
        return self._locate_now(ns, ttl_ms, shard, hashes, s)

    def _locate_now(
        self, ns: str, ttl_ms: int, shard: int, hashes: Sequence[bytes], s: Session
    ) -> dict[str, Any]:
        found = self.find(ns, hashes, shard)
        pin = self._hold(found, ttl_ms, s)
        held = [e for e in found if e is not None]
        if self._svc.on_data_loop():
            self._count_located(held)
        else:  # the metrics are the data loop's
            self._svc.loop.call_soon_threadsafe(self._count_located, held)
        memo = self._located
        rows = [None if e is None else (memo.get(e) or self._row(e)) for e in found]
        return proto.encode_locate_reply(pin, rows, self.pool.file_id)

    def _count_located(self, held: list[Entry]) -> None:
        """Blocks a same-host reader was shown: hits and bytes served, as a get's are."""
        self.metrics.get_blocks.labels(result="hit").inc(len(held))
        self.metrics.get_bytes.inc(sum(e.size for e in held))

    def _row(self, e: Entry) -> tuple[int, bytes]:
        """A committed entry's ``locate`` row, computed once (it never changes)."""
        row = self._located[e] = LocatedBlocks.wire_row(e.offset, e.size, e.gen, e.xxh3, e.digest)
        return row

    def _hold(self, found: list[Any], ttl_ms: int, s: Session) -> int:
        """Pin the entries found until the pin is released or ``ttl_ms`` passes (a
        timer on the running loop: that of ``s``'s site)."""
        pinned = [e for e in found if e is not None]
        if s.tenant is not None:
            self._svc.quotas.charge_pins(s, pinned)
        self.pool.pin_many(pinned)
        pin = next(self._pin_ids)
        table = s.pins
        timer = asyncio.get_running_loop().call_later(ttl_ms / 1000, self._release_pin, pin, table)
        table[pin] = Pin(pinned, timer, s)
        return pin

    def unpin(self, msg: dict[str, Any], s: Session) -> dict[str, Any]:
        """Release a pin of the session's (or, with cluster-wide access, any pin taken
        with it on the same site); another's pin is left alone, as an unknown or expired
        one is."""
        pin = proto.decode_unpin(msg)
        held = s.pins.get(pin)
        if held is not None and (
            held.owner is s or (held.owner.tenant is None and s.tenant is None)
        ):
            self._release_pin(pin, s.pins)
        return {}

    def release_pins(self, table: PinTable) -> None:
        """Release every pin of ``table`` (its site is closing, on its loop)."""
        for pin in list(table):
            self._release_pin(pin, table)

    def _release_pin(self, pin: int, table: PinTable) -> None:
        held = table.pop(pin, None)
        if held is None:
            return  # expired already, or never existed: releasing is idempotent
        held.timer.cancel()
        self.pool.unpin_many(held.entries)
        if held.owner.tenant is not None:
            self._svc.quotas.uncharge_pins(held.owner, held.entries)
