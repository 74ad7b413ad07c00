"""The node's block service: its ops over the pool, for any site, in one table.

It knows no transport.  Sites in front of it (the UCX site,
:mod:`~pegaflow.storage_node.ucx_site`, and the same-host control socket,
:mod:`~pegaflow.storage_node.local_control`) decode nothing of their own but their
transport ops (``hello``, ``get``); every other op of the protocol table
(:data:`~.protocol.OPS`) they pass to :meth:`NodeService.call` with the
:class:`~.sessions.Session` that asks it: one UCX connection, or one session of the
control socket.  ``stats``, ``locate`` and ``report`` need cluster-wide access (a tenant
gets ``unauthorized``).

The service composes rooms of one job each:

* :mod:`~pegaflow.storage_node.sessions`: who asks, and the quotas on what each holds;
* :mod:`~pegaflow.storage_node.puts`: ``reserve``, ``commit``, ``taken``, ``abort`` and
  the expiry of reservations;
* :mod:`~pegaflow.storage_node.reads`: finding blocks, a get's pins, ``check``, ``pin``,
  ``locate`` and ``unpin``;
* :mod:`~pegaflow.storage_node.promotion`: blocks held only on the disk tier brought
  back into the pool before they are served;
* :mod:`~pegaflow.storage_node.drop`: ``drop`` of a namespace.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, InitVar, dataclass
from typing import Any

from pegaflow.storage_node.blocks import Entry
from pegaflow.storage_node.disk_tier import DiskTier
from pegaflow.storage_node.drop import drop_op
from pegaflow.storage_node.metrics import NodeMetrics
from pegaflow.storage_node.pool import BlockPool
from pegaflow.storage_node.promotion import Promotion
from pegaflow.storage_node.puts import Puts
from pegaflow.storage_node.reads import OpenGet, Reads
from pegaflow.storage_node.sessions import Handler, PinTable, Quotas, Session

from pegaflow.config import NodeConfig
from pegaflow.errors import Unauthorized
from pegaflow.inventory import InventorySink
from pegaflow.protocol import node as proto
from pegaflow.protocol.node import OPS, Key, Op


@dataclass(eq=False, repr=False)
class NodeService:
    """The node's ops over a :class:`~pegaflow.storage_node.pool.BlockPool`, for any
    site: :meth:`call` runs one (plain, or an awaitable of its reply).

    ``start`` and ``close`` run on the data loop, where every op but ``locate`` and
    ``unpin`` must run (those two may run on another site's loop too)."""

    pool: BlockPool
    cfg: NodeConfig
    sink: InventorySink
    metrics: NodeMetrics
    _: KW_ONLY
    on_change: InitVar[Callable[[], None] | None] = None
    disk: DiskTier | None = None
    """the disk tier under the pool (None: memory only)"""

    def __post_init__(self, on_change: Callable[[], None] | None) -> None:
        self._on_change = on_change
        self._loop: asyncio.AbstractEventLoop | None = None
        self.quotas = Quotas(self.cfg, self.pool, self.metrics)
        self.promotion = Promotion(self)
        self.reads = Reads(self)
        self.puts = Puts(self)
        r, p = self.reads, self.puts
        self.ops: dict[Op, Handler] = {
            Op.CHECK: r.check, Op.RESERVE: p.reserve, Op.COMMIT: p.commit,
            Op.ABORT: p.abort, Op.TAKEN: p.taken, Op.PIN: r.pin,
            Op.LOCATE: r.locate, Op.UNPIN: r.unpin, Op.STATS: self._stats,
            Op.REPORT: self._report, Op.DROP: drop_op(self),
        }  # fmt: skip
        """the handler of each op of :data:`~.protocol.OPS` that is not a transport's"""

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The data loop (where the service started)."""
        assert self._loop is not None, "the service has not started"
        return self._loop

    def on_data_loop(self) -> bool:
        """Whether the running loop is the data loop."""
        return asyncio.get_running_loop() is self._loop

    def changed(self) -> None:
        """What the node holds changed: its record is due to be published again."""
        if self._on_change is not None:
            self._on_change()

    async def start(self) -> None:
        """Start expiring reservations (on the data loop)."""
        self._loop = asyncio.get_running_loop()
        self.puts.start()

    async def finish_commits(self) -> None:
        """Wait for the commits taken, at most ``reserve_timeout_s`` (their payloads may
        still need their transport: sites wait here before they close it)."""
        await self.puts.finish_commits()

    async def close(self) -> None:
        """Stop (after the sites): finish the commits taken, stop expiring, stop hashing."""
        await self.finish_commits()
        self.puts.close()

    # ---- sessions ------------------------------------------------------------------

    def pin_table(self) -> PinTable:
        """A pin table for the sessions a site serves on one loop."""
        return PinTable()

    def admit(self, session: Session, tenant: str | None) -> None:
        """``session`` authenticated as ``tenant`` (None: cluster-wide access)."""
        self.quotas.admit(session, tenant)

    def end_session(self, session: Session) -> None:
        """``session`` ended: its reservations go, but for those whose commit was taken
        (its pins expire)."""
        session.gone = True
        self.puts.end_session(session)

    def release_pins(self, table: PinTable) -> None:
        """Release every pin of ``table`` (its site is closing, on its loop)."""
        self.reads.release_pins(table)

    def check_access(self, op: Op, session: Session) -> None:
        """Refuse a tenant's session what needs cluster-wide access."""
        what = OPS[op].cluster_only
        if what is not None and session.tenant is not None:
            raise Unauthorized(f"a tenant's connection may not {what}")

    def call(self, op: Op, msg: dict[str, Any], session: Session) -> Any:
        """Run ``op`` for ``session`` (its reply, or an awaitable of it)."""
        self.check_access(op, session)
        return self.ops[op](msg, session)

    # ---- the read path, for the sites ----------------------------------------------

    def forget(self, e: Entry) -> None:
        """``e`` left the pool (evicted or dropped)."""
        self.reads.forget(e)

    def find(self, ns: str, hashes: Sequence[bytes], shards: int | Sequence[int]) -> list[Any]:
        """The committed entry of each ``(ns, hash, shard)``, or None (see
        :meth:`.reads.Reads.find`)."""
        return self.reads.find(ns, hashes, shards)

    def open_get(self, keys: Sequence[Key], want: Sequence[int | None] | None) -> OpenGet:
        """What a get sends, block by block (see :class:`.reads.OpenGet`), pinned until
        :meth:`close_get`."""
        return self.reads.open_get(keys, want)

    def close_get(self, get: OpenGet, ok: bool) -> None:
        """A get of :meth:`open_get` is over (``ok``: every payload went out)."""
        self.reads.close_get(get, ok)

    # ---- node-wide ops -------------------------------------------------------------

    def _stats(self, msg: dict[str, Any], s: Session) -> dict[str, Any]:
        return vars(self.pool.stats())

    def _report(self, msg: dict[str, Any], s: Session) -> dict[str, Any]:
        """A connector's same-host lookups (answered by this node alone): counted."""
        lookups, asked, hits = proto.decode_report(msg)
        m = self.metrics
        m.same_host_lookups.inc(lookups)
        m.same_host_hit_blocks.inc(hits)
        m.same_host_miss_blocks.inc(asked - hits)
        if lookups:
            self.changed()  # the record carries them to the coordinators
        return {}
