"""The node's read path: finding blocks, a get's pins, ``check``, ``pin``, ``locate`` and
``unpin``.

A read pin belongs to its session (:mod:`~pegaflow.storage_node.sessions`); ``unpin`` of
another's is a no-op, except that any session with cluster-wide access may release a pin
taken with cluster-wide access on the same site (a connector's scheduler pins, its
worker releases).  Pins outlive their session until ``ttl_ms``.  A tenant's pins count
against its quotas.

Same-host reads (a client on the node's host that maps the pool file): ``locate`` pins
the present blocks for ``ttl_ms`` (no eviction while the reader copies them out of the
file) and says where they lie, packed (:class:`~pegaflow.wire.LocatedBlocks`): a
10k-token prefix is hundreds of blocks.

Blocks held only on the disk tier are promoted before a ``get``, ``pin`` or ``locate``
serves them (:mod:`~pegaflow.storage_node.promotion`); ``check`` counts a block on disk
as stored.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pegaflow.storage_node import protocol as proto
from pegaflow.storage_node.pool import Entry
from pegaflow.storage_node.protocol import Key
from pegaflow.storage_node.sessions import Pin, PinTable, Session

from pegaflow.wire import LocatedBlocks

if TYPE_CHECKING:
    from pegaflow.storage_node.node_service import NodeService


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
        ``shards``: one shard for every hash, or one per hash."""
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

    def open_get(
        self, keys: Sequence[Key], want: Sequence[int | None] | None
    ) -> tuple[list[Entry | None], list[Any]]:
        """What a get sends: per block its entry, pinned until :meth:`close_get` (None:
        a miss, or stale against ``want``), and the reply's entry for it."""
        found = self._find_keys(keys)
        pinned: list[Entry] = []
        header: list[Any] = []
        stale = 0
        for i, e in enumerate(found):
            if e is None:
                header.append(None)
            elif want is not None and want[i] is not None and e.gen != want[i]:
                header.append(proto.STALE)  # the slot holds another generation now
                found[i] = None
                stale += 1
            else:
                pinned.append(e)
                header.append(proto.get_hit(e.size, e.gen, e.xxh3))
        self.pool.pin_many(pinned)
        m = self.metrics.get_blocks
        if pinned:
            m.labels(result="hit").inc(len(pinned))
        if stale:
            m.labels(result="stale").inc(stale)
        if len(pinned) + stale < len(keys):
            m.labels(result="miss").inc(len(keys) - len(pinned) - stale)
        return found, header

    def close_get(self, sent: list[Entry | None], ok: bool) -> None:
        """A get of :meth:`open_get` is over (``ok``: every payload went out)."""
        held = [e for e in sent if e is not None]
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
        hits = self.metrics.get_blocks.labels(result="hit")
        n = len(found) - found.count(None)
        if self._svc.on_data_loop():
            hits.inc(n)
        else:
            self._svc.loop.call_soon_threadsafe(hits.inc, n)  # the metrics are the data loop's
        memo = self._located
        rows = [None if e is None else (memo.get(e) or self._row(e)) for e in found]
        return proto.encode_locate_reply(pin, rows)

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
