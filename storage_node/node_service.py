"""The node's block service: pins, reservations, commits and lookups over the pool.

It knows no transport.  Sites in front of it (the UCX site,
:mod:`~pegaflow.storage_node.ucx_site`, and the same-host control socket,
:mod:`~pegaflow.storage_node.local_control`) decode nothing of their own but their
transport ops (``hello``, ``get``); every other op of the protocol table
(:data:`~.protocol.OPS`) they pass to :meth:`NodeService.call` with the
:class:`Session` that asks it: one UCX connection, or one session of the control socket.

Ownership and quotas.  A reservation belongs to the session that made it: ``commit`` of
another's ``seq`` is ``bad_request`` as for an unknown one, ``abort`` of it is a no-op
(``{}``, as for an expired one) and touches nothing; the end of a session drops its
reservations, but for those whose commit was taken (the node carries those out).  A read
pin belongs to its session too; ``unpin`` of another's is a no-op, except that any
session with cluster-wide access may release a pin taken with cluster-wide access on the
same site (a connector's scheduler pins, its worker releases).  Pins outlive their
session until ``ttl_ms``.  Bytes reserved (not yet committed or aborted) are bounded per
session by ``[node] conn_quota_share`` of the pool and, over all of a tenant's sessions,
by ``tenant_quota_share``; a tenant's read pins are bounded the same way by the bytes of
the distinct blocks they hold.  A request past a bound gets ``quota``
(:class:`~pegaflow.errors.QuotaExceeded`) and holds nothing.  ``stats``, ``locate`` and
``report`` need cluster-wide access (a tenant gets ``unauthorized``).

Same-host writes and reads (a client on the node's host that maps the pool file):

* ``reserve`` with ``local: true`` posts no receives and answers ``offsets``: the writer
  fills the slots through the file, then ``commit``s; its ``xxh3`` entries may be None,
  and the node's own hash of each slot becomes the block's checksum (no transport lies
  between writer and slot: hashing the same bytes twice would check nothing);
* ``commit`` may carry ``digest``, a signed 64-bit digest per block the writer computed
  on its device; the node keeps it with the block (not journaled) and ``locate`` returns
  it, so a GPU reader can verify what landed in its KV cache on the device;
* ``locate`` pins the present blocks for ``ttl_ms`` (no eviction while the reader copies
  them out of the file) and says where they lie, packed
  (:class:`~pegaflow.wire.LocatedBlocks`): a 10k-token prefix is hundreds of blocks.

Disk tier (``[node] disk_path``, :mod:`~pegaflow.storage_node.disk_tier`): a block
evicted from the pool may live on in the tier.  ``get``, ``pin`` and ``locate`` of a block
held only there first *promote* it (:meth:`NodeService.promote`): a pool slot is
reserved, the block is read into it (verified against its checksum) and committed with
the generation it had, so a reader's fenced get still matches, and the disk copy stays
(evicting it again writes nothing).  Reads run on the tier's read threads, all of a
request's at once; a block that fails its read is a miss.  ``check`` counts a block on
disk as stored.

A reservation whose payloads come over a transport carries that transport's
:class:`Inflow` (from its session's :attr:`Session.receive`): the service waits on it
before it verifies, and asks it, when the reservation is dropped early, to give the
transport up and to say when no payload can land in the slots any more.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pegaflow.storage_node import protocol as proto
from pegaflow.storage_node.disk_tier import DiskTier
from pegaflow.storage_node.drop import drop_op
from pegaflow.storage_node.metrics import NodeMetrics
from pegaflow.storage_node.pool import BlockPool, Entry
from pegaflow.storage_node.protocol import OPS, Key, Op

from pegaflow.checksum import checksums
from pegaflow.config import NodeConfig
from pegaflow.errors import BadRequest, PegaError, QuotaExceeded, Unauthorized
from pegaflow.inventory import InventorySink
from pegaflow.wire import LocatedBlocks, check_namespace

log = logging.getLogger(__name__)

_SWEEP_S = 1.0


class Inflow(Protocol):
    """A reservation's payloads arriving over a transport into its slots."""

    done: asyncio.Future[None]
    """every payload landed (an exception: some never will)"""

    def cut(self) -> None:
        """Give the transport up: the payloads will not be waited for."""

    def landing(self) -> bool:
        """Whether a payload may still land in the slots."""

    def when_landed(self, then: Callable[[], None]) -> None:
        """Call ``then()`` once no payload can land in the slots any more."""


Receive = Callable[[int, list[tuple[int, Any]]], Inflow]
"""A transport's receiving of reservation ``seq``'s payloads into ``(index, slot view)``."""


@dataclass(eq=False)
class Usage:
    """What one session, or one tenant over all its sessions, holds on the node."""

    reserved: int = 0
    """bytes of its reservations not yet committed or aborted"""
    pinned: int = 0
    """bytes of the distinct blocks its read pins hold (counted for tenants only)"""
    pins: dict[Entry, int] = field(default_factory=dict)
    """per pinned entry, how many of its pins hold it"""


@dataclass(eq=False)
class Pin:
    entries: list[Entry]
    timer: asyncio.TimerHandle
    owner: Session


class PinTable(dict[int, Pin]):
    """The read pins taken on one site's loop (their expiry timers run there)."""


@dataclass(eq=False)
class Session:
    """Who asks: one UCX connection or one session of the control socket.  Its
    reservations and read pins are its own."""

    pins: PinTable
    """the pin table of the loop its site serves it on"""
    receive: Receive | None = None
    """how payloads of its reservations reach the slots; None: same-host writes only"""
    tenant: str | None = None
    """None: cluster-wide access"""
    use: Usage = field(default_factory=Usage)
    tenant_use: Usage | None = None
    """the tenant's usage over all its sessions (None: cluster-wide access)"""
    gone: bool = False
    """it ended"""


@dataclass(eq=False)
class _Reservation:
    ns: str
    entries: list[Entry | None]
    """per requested block; None: stored already"""
    owner: Session
    deadline: float
    inflow: Inflow | None
    """None: written through the pool file (no transport between writer and slot)"""
    nbytes: int = 0
    """bytes charged to its owner's quotas"""
    committing: bool = False
    """its commit was taken: the node carries it out, its owner's end does not drop it"""


Handler = Callable[[dict[str, Any], Session], Any]


class NodeService:
    """The node's ops over a :class:`~pegaflow.storage_node.pool.BlockPool`, for any
    site: :meth:`call` runs one (plain, or an awaitable of its reply).

    ``start`` and ``close`` run on the data loop, where every op but ``locate`` and
    ``unpin`` must run (those two may run on another site's loop too)."""

    def __init__(
        self,
        pool: BlockPool,
        cfg: NodeConfig,
        sink: InventorySink,
        metrics: NodeMetrics,
        *,
        on_change: Callable[[], None] | None = None,
        disk: DiskTier | None = None,
    ) -> None:
        self.pool = pool
        self.disk = disk
        """the disk tier under the pool (None: memory only)"""
        self._promoting: dict[Key, asyncio.Future[bool]] = {}
        self.cfg = cfg
        self.sink = sink
        self.metrics = metrics
        self._on_change = on_change
        for name in ("conn_quota_share", "tenant_quota_share"):
            share = getattr(cfg, name)
            if not 0 < share <= 1:
                raise ValueError(f"[node] {name} must be in (0, 1], not {share}")
        self._session_quota = int(cfg.conn_quota_share * pool.capacity)
        self._tenant_quota = int(cfg.tenant_quota_share * pool.capacity)
        self._tenant_use: dict[str, Usage] = {}
        self._reservations: dict[int, _Reservation] = {}
        self._commits: dict[int, tuple[Session, asyncio.Task[dict[str, Any]]]] = {}
        """commits taken and not yet carried out, by reservation"""
        self._seqs = itertools.count(1)
        self._pin_ids = itertools.count(1)
        self._located: dict[Entry, tuple[int, bytes]] = {}
        """each committed entry's ``locate`` row, once computed (it never changes)"""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sweeper: asyncio.Task[None] | None = None
        # xxh3 releases the GIL: verify puts off the loop thread
        self._hash_threads = cfg.hash_threads or min(8, os.cpu_count() or 1)
        self._hasher = concurrent.futures.ThreadPoolExecutor(self._hash_threads, "pegaflow-xxh3")
        self.ops: dict[Op, Handler] = {
            Op.CHECK: self._check, Op.RESERVE: self._reserve, Op.COMMIT: self._commit,
            Op.ABORT: self._abort_own, Op.TAKEN: self._taken, Op.PIN: self._pin,
            Op.LOCATE: self._locate, Op.UNPIN: self._unpin, Op.STATS: self._stats,
            Op.REPORT: self._report, Op.DROP: drop_op(self),
        }  # fmt: skip
        """the handler of each op of :data:`~.protocol.OPS` that is not a transport's"""

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The data loop (where the service started)."""
        assert self._loop is not None, "the service has not started"
        return self._loop

    async def start(self) -> None:
        """Start expiring reservations (on the data loop)."""
        self._loop = asyncio.get_running_loop()
        self._sweeper = asyncio.create_task(self._sweep())

    async def finish_commits(self) -> None:
        """Wait for the commits taken, at most ``reserve_timeout_s`` (their payloads may
        still need their transport: sites wait here before they close it)."""
        if self._commits:
            await asyncio.wait(
                [t for _, t in self._commits.values()], timeout=self.cfg.reserve_timeout_s
            )

    async def close(self) -> None:
        """Stop (after the sites): finish the commits taken, stop expiring, stop hashing."""
        await self.finish_commits()
        if self._sweeper is not None:
            self._sweeper.cancel()
        self._hasher.shutdown(wait=False)

    # ---- sessions ------------------------------------------------------------------

    def pin_table(self) -> PinTable:
        """A pin table for the sessions a site serves on one loop."""
        return PinTable()

    def admit(self, session: Session, tenant: str | None) -> None:
        """``session`` authenticated as ``tenant`` (None: cluster-wide access)."""
        session.tenant = tenant
        if tenant is not None:
            session.tenant_use = self._tenant_use.setdefault(tenant, Usage())

    def end_session(self, session: Session) -> None:
        """``session`` ended: its reservations go, but for those whose commit was taken
        (its pins expire)."""
        session.gone = True
        for seq, r in list(self._reservations.items()):
            if r.owner is session and not r.committing:
                self._abort(seq)

    def release_pins(self, table: PinTable) -> None:
        """Release every pin of ``table`` (its site is closing, on its loop)."""
        for pin in list(table):
            self._release_pin(pin, table)

    def check_access(self, op: Op, session: Session) -> None:
        """Refuse a tenant's session what needs cluster-wide access."""
        what = OPS[op].cluster_only
        if what is not None and session.tenant is not None:
            raise Unauthorized(f"a tenant's connection may not {what}")

    def call(self, op: Op, msg: dict[str, Any], session: Session) -> Any:
        """Run ``op`` for ``session`` (its reply, or an awaitable of it)."""
        self.check_access(op, session)
        return self.ops[op](msg, session)

    def forget(self, e: Entry) -> None:
        """``e`` left the pool (evicted or dropped)."""
        self._located.pop(e, None)

    # ---- lookup --------------------------------------------------------------------

    def find(self, ns: str, hashes: Sequence[bytes], shards: int | Sequence[int]) -> list[Any]:
        """The committed entry of each ``(ns, hash, shard)``, or None: the one place a
        block is found for serving (``get``, ``check``, ``pin``, ``locate``).
        ``shards``: one shard for every hash, or one per hash."""
        if isinstance(shards, int):
            return self.pool.get_many(ns, hashes, shards)
        get = self.pool.get
        return [get((ns, h, s)) for h, s in zip(hashes, shards, strict=True)]

    def disk_only(self, keys: Sequence[Key]) -> list[Key]:
        """The keys held on the disk tier and not in the pool (to :meth:`promote`)."""
        disk = self.disk
        if disk is None:
            return []
        pool = self.pool
        return [k for k in keys if disk.contains(k) and pool.get(k) is None]

    async def promote(self, keys: Sequence[Key]) -> None:
        """Bring the blocks of ``keys`` held only on the disk tier into the pool (on the
        data loop; a block that cannot come back stays a miss)."""
        todo = self.disk_only(keys)
        if todo:
            await asyncio.gather(*(asyncio.shield(self._promotion(k)) for k in todo))

    def promote_threadsafe(self, keys: Sequence[Key]) -> asyncio.Future[None]:
        """:meth:`promote` on the data loop, awaitable from another loop."""
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self.promote(keys), self.loop))

    def _promotion(self, key: Key) -> asyncio.Future[bool]:
        """The promotion of ``key`` under way, or a new one (one per key at a time)."""
        fut = self._promoting.get(key)
        if fut is None:
            fut = self._promoting[key] = asyncio.ensure_future(self._promote(key))
            fut.add_done_callback(lambda _: self._promoting.pop(key, None))
        return fut

    async def _promote(self, key: Key) -> bool:
        disk = self.disk
        info = disk.info(key) if disk is not None else None
        if disk is None or info is None:
            return False
        try:
            e = self.pool.reserve(key, info.length, 2 * self.cfg.reserve_timeout_s)
        except PegaError as err:  # the pool is full of pinned or reserved blocks
            log.debug("cannot promote a block from disk now: %s", err)
            return False
        if e is None:
            return False  # stored or being written meanwhile
        read = disk.read_into(key, self.pool.view(e))
        try:
            n = await asyncio.shield(asyncio.wrap_future(read))
        except asyncio.CancelledError:
            self.pool.quarantine(e)  # the read thread may still write the slot
            read.add_done_callback(
                lambda _: self.loop.call_soon_threadsafe(self._release_quarantined, [e])
            )
            raise
        if n is None:  # a miss: failed its checksum, or an I/O error (counted by the tier)
            self.pool.abort(e)
            return False
        loc = self.pool.commit(e, info.xxh3, gen=info.gen)
        self.sink.publish(key[0], key[1], key[2], loc)
        self.metrics.disk_promotions.inc()
        if self._on_change is not None:
            self._on_change()
        return True

    def _find_keys(self, keys: Sequence[Key]) -> list[Any]:
        ns = keys[0][0] if keys else ""
        return self.find(ns, [k[1] for k in keys], [k[2] for k in keys])

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

    def _check(self, msg: dict[str, Any], s: Session) -> dict[str, Any]:
        """Whether each block is stored and committed (with the generation given)."""
        _, keys, want = proto.decode_check(msg, self.cfg.max_batch)
        found = self._find_keys(keys)
        disk = self.disk
        if disk is not None:
            found = [e if e is not None else disk.info(k) for e, k in zip(found, keys, strict=True)]
        return {
            "valid": [
                e is not None and (want is None or want[i] in (None, e.gen))
                for i, e in enumerate(found)
            ]
        }

    def _pin(self, msg: dict[str, Any], s: Session) -> Any:
        """Read pins: keep the named blocks from eviction for ``ttl_ms`` (between a
        reader's lookup and its get), so a hit is not lost to a racing writer (blocks
        only on disk are promoted first)."""
        ttl_ms, keys = proto.decode_pin(msg, self.cfg.max_batch)
        if self.disk_only(keys):
            return self._after_promote(keys, lambda: self._pin_now(ttl_ms, keys, s))
        return self._pin_now(ttl_ms, keys, s)

    async def _after_promote(self, keys: Sequence[Key], then: Callable[[], Any]) -> Any:
        """``then()`` once the blocks of ``keys`` only on disk are promoted (awaited on
        the data loop, from any loop)."""
        if asyncio.get_running_loop() is self._loop:
            await self.promote(keys)
        else:
            await self.promote_threadsafe(keys)
        return then()

    def _pin_now(self, ttl_ms: int, keys: Sequence[Key], s: Session) -> dict[str, Any]:
        found = self._find_keys(keys)
        pin = self._hold(found, ttl_ms, s)
        return {"pinned": [e is not None for e in found], "pin": pin}

    def _locate(self, msg: dict[str, Any], s: Session) -> Any:
        """Same-host reads: pin the named blocks and say where they lie in the pool file
        (``hashes``: ``hash_len``-byte hashes back to back, all of one ``shard``)."""
        ns, ttl_ms, shard, hashes = proto.decode_locate(msg, self.cfg.max_batch)
        if self.disk is not None:
            keys = [(ns, h, shard) for h in hashes]
            if self.disk_only(keys):
                return self._after_promote(
                    keys, lambda: self._locate_now(ns, ttl_ms, shard, hashes, s)
                )
        return self._locate_now(ns, ttl_ms, shard, hashes, s)

    def _locate_now(
        self, ns: str, ttl_ms: int, shard: int, hashes: Sequence[bytes], s: Session
    ) -> dict[str, Any]:
        found = self.find(ns, hashes, shard)
        pin = self._hold(found, ttl_ms, s)
        hits = self.metrics.get_blocks.labels(result="hit")
        n = len(found) - found.count(None)
        if asyncio.get_running_loop() is self._loop:
            hits.inc(n)
        else:
            self.loop.call_soon_threadsafe(hits.inc, n)  # the metrics are the data loop's
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
            self._charge_pins(s, pinned)
        self.pool.pin_many(pinned)
        pin = next(self._pin_ids)
        table = s.pins
        timer = asyncio.get_running_loop().call_later(ttl_ms / 1000, self._release_pin, pin, table)
        table[pin] = Pin(pinned, timer, s)
        return pin

    def _unpin(self, msg: dict[str, Any], s: Session) -> dict[str, Any]:
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

    def _release_pin(self, pin: int, table: PinTable) -> None:
        held = table.pop(pin, None)
        if held is None:
            return  # expired already, or never existed: releasing is idempotent
        held.timer.cancel()
        self.pool.unpin_many(held.entries)
        if held.owner.tenant is not None:
            self._uncharge_pins(held.owner, held.entries)

    def _stats(self, msg: dict[str, Any], s: Session) -> dict[str, Any]:
        return vars(self.pool.stats())

    def _report(self, msg: dict[str, Any], s: Session) -> dict[str, Any]:
        """A connector's same-host lookups (answered by this node alone): counted."""
        lookups, asked, hits = proto.decode_report(msg)
        m = self.metrics
        m.same_host_lookups.inc(lookups)
        m.same_host_hit_blocks.inc(hits)
        m.same_host_miss_blocks.inc(asked - hits)
        if self._on_change is not None and lookups:
            self._on_change()  # the record carries them to the coordinators
        return {}

    # ---- quotas --------------------------------------------------------------------

    def _quotas(self, s: Session) -> list[tuple[Usage, int, str]]:
        """(usage, bound, scope) of each quota ``s`` is under."""
        out = [(s.use, self._session_quota, "connection")]
        if s.tenant_use is not None:
            out.append((s.tenant_use, self._tenant_quota, "tenant"))
        return out

    def _refuse(self, kind: str, scope: str, s: Session, held: int, more: int) -> None:
        self.metrics.quota_refusals.labels(kind=kind, scope=scope).inc()
        bound, setting = (
            (self._session_quota, "conn_quota_share")
            if scope == "connection"
            else (self._tenant_quota, "tenant_quota_share")
        )
        who = "this connection" if scope == "connection" else f"tenant {s.tenant!r}"
        raise QuotaExceeded(
            f"{more} more bytes {kind} would take {who} past its quota ({held} of {bound} "
            f"bytes held; [node] {setting}); commit, abort or unpin what it holds first"
        )

    def _charge_reserve(self, s: Session, parsed: list[tuple[Key, int]]) -> None:
        """Refuse a reservation of ``parsed`` blocks that would take ``s`` past a quota
        (blocks stored already reserve nothing and are not counted)."""
        quotas = self._quotas(s)
        upper = sum(size for _, size in parsed)
        if all(use.reserved + upper <= bound for use, bound, _ in quotas):
            return
        need = sum(size for key, size in parsed if not self.pool.contains(key))
        for use, bound, scope in quotas:
            if use.reserved + need > bound:
                self._refuse("reserved", scope, s, use.reserved, need)

    def _take_reservation(self, seq: int) -> _Reservation | None:
        """Remove reservation ``seq`` and give its bytes back to its owner's quotas."""
        res = self._reservations.pop(seq, None)
        if res is not None and res.nbytes:
            for use, _, _ in self._quotas(res.owner):
                use.reserved -= res.nbytes
        return res

    def _charge_pins(self, s: Session, entries: list[Entry]) -> None:
        """Count a tenant's new pin on ``entries`` (the bytes of distinct blocks), or
        refuse it past a quota."""
        quotas = self._quotas(s)
        distinct = set(entries)
        for use, bound, scope in quotas:
            more = sum(e.size for e in distinct if e not in use.pins)
            if use.pinned + more > bound:
                self._refuse("pinned", scope, s, use.pinned, more)
        for use, _, _ in quotas:
            counts = use.pins
            for e in entries:
                n = counts.get(e, 0)
                if not n:
                    use.pinned += e.size
                counts[e] = n + 1

    def _uncharge_pins(self, s: Session, entries: list[Entry]) -> None:
        for use, _, _ in self._quotas(s):
            counts = use.pins
            for e in entries:
                n = counts.pop(e) - 1
                if n:
                    counts[e] = n
                else:
                    use.pinned -= e.size

    # ---- put -----------------------------------------------------------------------

    def _reserve(self, msg: dict[str, Any], s: Session) -> dict[str, Any]:
        """A reservation of the session's (who may commit or abort it, charged for its
        bytes); its payloads come through the session's transport, or (``local``)
        through the pool file."""
        ns = check_namespace(msg.get("ns"))
        local = proto.reserve_is_local(msg)
        if s.receive is None and not local:
            raise BadRequest("the control socket takes same-host (local) reservations only")
        if local and (not self.cfg.local_access or s.tenant is not None):
            raise Unauthorized("this connection may not write the pool file directly")
        parsed = proto.decode_reserve_blocks(ns, msg, self.cfg.max_batch)
        self._charge_reserve(s, parsed)
        seq = next(self._seqs)
        entries: list[Entry | None] = []
        inflow: Inflow | None = None
        try:
            for key, size in parsed:
                # the pool's own expiry is a backstop behind ours (_sweep -> _abort),
                # which knows whether payloads may still land in the slot
                entries.append(self.pool.reserve(key, size, 2 * self.cfg.reserve_timeout_s))
            if not local:
                assert s.receive is not None
                slots = [(i, self.pool.view(e)) for i, e in enumerate(entries) if e is not None]
                inflow = s.receive(seq, slots)
        except PegaError:
            for e in entries:
                if e is not None:
                    self.pool.abort(e)
            raise
        nbytes = sum(e.size for e in entries if e is not None)
        for use, _, _ in self._quotas(s):
            use.reserved += nbytes
        deadline = time.monotonic() + self.cfg.reserve_timeout_s
        self._reservations[seq] = _Reservation(ns, entries, s, deadline, inflow, nbytes)
        if inflow is not None:
            inflow.done.add_done_callback(lambda f: self._inflow_ended(seq, inflow, f))
        return proto.encode_reserve_reply(msg, seq, [e and e.offset for e in entries])

    def _inflow_ended(self, seq: int, inflow: Inflow, f: asyncio.Future[None]) -> None:
        if not f.cancelled() and f.exception() is not None and seq in self._reservations:
            inflow.cut()  # payloads never came: the transport's receives must die with it

    def _commit(self, msg: dict[str, Any], s: Session) -> asyncio.Future[dict[str, Any]]:
        """Take a commit: checked here, then carried out by :meth:`_carry_out` in a task
        of its own, which neither the end of the session nor its deadline cancels.
        Returns a future of the reply.  Plain, not async: the commit is taken as soon as
        the data loop sees it, before the session's next request (a ``taken`` right
        behind it) or its end."""
        seq, sums, digests = proto.decode_commit(msg, self.cfg.max_batch)
        res = self._reservations.get(seq)
        if res is None or res.owner is not s or res.committing:
            raise BadRequest(
                f"no reservation {seq} on this connection (expired, aborted or committed?)"
            )
        if len(sums) != len(res.entries) or (
            digests is not None and (not isinstance(digests, list) or len(digests) != len(sums))
        ):
            self._abort(seq)
            raise BadRequest("commit must carry one checksum (and digest) per reserved block")
        res.committing = True
        task = asyncio.ensure_future(self._carry_out(seq, res, sums, digests))
        self._commits[seq] = (s, task)
        task.add_done_callback(lambda t: self._commit_done(seq, res, t))
        return asyncio.shield(task)

    def _taken(self, msg: dict[str, Any], s: Session) -> dict[str, Any]:
        """``taken``: whether the session's commit of ``seq`` is held (being carried out)."""
        held = self._commits.get(proto.decode_seq(msg))
        return {"taken": held is not None and held[0] is s}

    def _commit_done(self, seq: int, res: _Reservation, task: asyncio.Task[Any]) -> None:
        self._commits.pop(seq, None)
        if task.cancelled() or not res.owner.gone:
            return  # the writer has the outcome (or the node is closing)
        e = task.exception()
        if e is not None:
            log.warning(
                "reservation %d: the commit its writer sent before it went away failed "
                "(%s); its blocks are not stored",
                seq, e,
            )  # fmt: skip
        else:
            log.info(
                "reservation %d committed (%d blocks) after its writer went away",
                seq, task.result()["stored"],
            )  # fmt: skip

    async def _carry_out(
        self, seq: int, res: _Reservation, sums: list[Any], digests: list[Any] | None
    ) -> dict[str, Any]:
        """Wait for the payloads, verify (or, for a same-host reservation, hash) every
        block, commit and publish them."""
        if res.inflow is not None:
            try:
                await asyncio.shield(res.inflow.done)
            except PegaError as e:
                self._abort(seq)
                self.metrics.transfer_errors.labels(kind=e.code).inc()
                raise
        if self._take_reservation(seq) is not res:  # aborted or committed meanwhile
            raise BadRequest(f"reservation {seq} was dropped while its payloads arrived")
        got_sums = await self._checksums([self.pool.view(e) for e in res.entries if e is not None])
        got_iter = iter(got_sums)
        local = res.inflow is None
        stored, failed, nbytes = 0, [], 0
        for i, (e, want) in enumerate(zip(res.entries, sums, strict=True)):
            if e is None:
                continue
            got = next(got_iter)
            if not (local and want is None) and (not isinstance(want, int) or got != want):
                self.metrics.checksum_failures.inc()
                self.pool.abort(e)
                failed.append(i)
                continue
            d = None if digests is None else proto.digest_of(digests[i])
            loc = self.pool.commit(e, got, d)
            self.sink.publish(e.key[0], e.key[1], e.key[2], loc)
            stored += 1
            nbytes += e.size
        self.metrics.put_bytes.inc(nbytes)
        self.metrics.put_blocks.inc(stored)
        if self._on_change is not None:
            self._on_change()
        return {"stored": stored, "failed": failed}

    async def _checksums(self, views: list[Any]) -> list[int]:
        """xxh3 of each view, on the hashing threads: one task per thread, not per block
        (a 10k-token prefix is 625 blocks; a task each cost the loop more than a slice)."""
        if not views:
            return []
        loop = asyncio.get_running_loop()
        step = -(-len(views) // self._hash_threads)
        parts = await asyncio.gather(
            *(
                loop.run_in_executor(self._hasher, checksums, views[i : i + step])
                for i in range(0, len(views), step)
            )
        )
        return [x for part in parts for x in part]

    def _abort_own(self, msg: dict[str, Any], s: Session) -> dict[str, Any]:
        """``abort``: drop reservation ``seq`` if it is the session's; another's is left
        alone, as an unknown or expired one is."""
        seq = proto.decode_seq(msg)
        res = self._reservations.get(seq)
        if res is not None and res.owner is s and not res.committing:
            self._abort(seq)
        return {}

    def _abort(self, seq: int) -> None:
        res = self._take_reservation(seq)
        if res is None:
            return
        held = [e for e in res.entries if e is not None]
        inflow = res.inflow
        if inflow is not None and not inflow.done.done():
            inflow.cut()
        if inflow is None or not inflow.landing():
            for e in held:
                self.pool.abort(e)
            return
        # the writer's bytes may still land in these slots (giving the transport up does
        # not stop them): the slots stay out of use until none can
        for e in held:
            self.pool.quarantine(e)
        inflow.when_landed(lambda: self._release_quarantined(held))

    def _release_quarantined(self, entries: list[Entry]) -> None:
        for e in entries:
            self.pool.release_quarantined(e)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(_SWEEP_S)
            now = time.monotonic()
            for seq, r in list(self._reservations.items()):
                if r.deadline < now:
                    log.info("reservation %d expired; reclaiming its slots", seq)
                    self._abort(seq)
            self.pool.reclaim_expired(now)
