"""The asyncio client: lookups through the coordinator, blocks straight from the nodes.

:class:`PegaClient` is the asyncio API (:class:`~.sync.SyncPegaClient` offers it to
synchronous callers; :mod:`~.samehost` finds the nodes on this host).  Calls have
deadlines (:mod:`pegaflow.deadline`) and never hang; per-block failures of a get are
misses (``False``), not exceptions, because the caller's answer to a miss is always the
same: recompute.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections import defaultdict
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import replace
from typing import Any

from pegaflow.addresses import AUTO, client_host
from pegaflow.config import ClientConfig
from pegaflow.deadline import Deadline, Timeout
from pegaflow.errors import PegaError, Unavailable
from pegaflow.keys import NodeRecord
from pegaflow.observability import telemetry
from pegaflow.protocol.codec import LocatedBlocks
from pegaflow.protocol.coordinator import (
    LookupRequest,
    LookupResult,
    MissReport,
    NamespacePeersRequest,
    Op,
    PlaceRequest,
    encode_report_unreachable,
    namespace_peers_reply,
    nodes_reply,
    place_reply,
    report_unreachable_reply,
)
from pegaflow.protocol.node import Dropped
from pegaflow.transport.rpc_client import RpcClient

from .calls import deadline_of, operation
from .data import DataClient, GetOptions, PutOutcome
from .landing import Fetched
from .nodehealth import PROBE_TIMEOUT_S, NodeHealth, watch_down
from .samehost import LocalNode, PoolFile, nodes_here
from .session import NodeSession

log = logging.getLogger(__name__)

RECORDS_MAX_AGE_S = 1.0
"""how old the node records may be when a node this client holds no connection to is
dialled (:meth:`PegaClient._node`)"""

PutResult = PutOutcome

GetItem = tuple[str, bytes, int, Any]
"""(node id, block hash, shard, writable buffer of exactly the block's size)"""
PutItem = tuple[bytes, int, Any]
"""(block hash, shard, readable buffer)"""


async def _per_node(
    items: Sequence[tuple[Any, ...]],
    ask: Callable[[str, list[int]], Coroutine[Any, Any, list[bool]]],
) -> list[bool]:
    """``ask(node id, indexes)`` of the ``items`` of each node (their first field), the
    nodes in parallel; per item, what its node answered (False where it failed)."""
    by_node: dict[str, list[int]] = defaultdict(list)
    for i, item in enumerate(items):
        by_node[item[0]].append(i)
    ok = [False] * len(items)

    async def one(node_id: str, idx: list[int]) -> None:
        try:
            got = await ask(node_id, idx)
        except PegaError:
            return
        for i, g in zip(idx, got, strict=False):
            ok[i] = g

    await asyncio.gather(*(one(n, idx) for n, idx in by_node.items()))
    return ok


class PegaClient:
    """Async client of a PegaFlow cluster (one per event loop); ``token``: the cluster's
    or a tenant's; ``tls``: the coordinators are called over TLS verified by this
    context (:func:`pegaflow.tls.client_context`)."""

    def __init__(
        self, cfg: ClientConfig, token: str | None = None, *, tls: ssl.SSLContext | None = None
    ) -> None:
        if cfg.host == AUTO:  # decided once: a routing lookup (see pegaflow.addresses)
            cfg = replace(cfg, host=client_host(cfg.coordinators))
        self.cfg = cfg
        self._rpc = RpcClient(
            cfg.coordinators, token=token or None, timeout=cfg.rpc_timeout_s, tls=tls
        )
        self._token = token or None
        self._data = DataClient(token=self._token)
        self._sessions: dict[str, NodeSession] = {}
        self._nodes: dict[str, NodeRecord] = {}
        self._nodes_at = 0.0
        self.health = NodeHealth()
        """the nodes that failed this client's gets (:mod:`.nodehealth`)"""
        self._watch: asyncio.Task[None] | None = None

    async def close(self) -> None:
        """Close the coordinator connection, every node session and node endpoint."""
        if self._watch is not None:
            self._watch.cancel()
        await self._rpc.close()
        for s in self._sessions.values():
            s.close()
        await self._data.close()

    async def _call(self, op: Op, args: dict[str, Any], deadline: Deadline) -> Any:
        """The coordinator's answer to ``op`` (:mod:`pegaflow.protocol.coordinator`)."""
        return await self._rpc.call(op, args, timeout=deadline)

    def _deadline(self, op: str, timeout: Timeout) -> Deadline:
        """The deadline of operation ``op`` (:func:`~.calls.deadline_of`)."""
        return deadline_of(self.cfg, getattr(PegaClient, op), timeout)

    def session(self, node_id: str) -> NodeSession:
        """The session with node ``node_id`` (one per node, kept; on this client's loop):
        its ops, over UCX or, on the node's host, over its control socket."""
        s = self._sessions.get(node_id)
        if s is None:

            async def address(deadline: Deadline) -> str:
                return (await self._node(node_id, deadline)).ucx_address

            s = self._sessions[node_id] = NodeSession(
                node_id, self._data, address,
                token=self._token, local_control=self.cfg.local_control, cfg=self.cfg,
                refresh=lambda deadline: self.nodes(timeout=deadline),
            )  # fmt: skip
        return s

    @property
    def stale_misses(self) -> int:
        """Blocks of fenced gets (``get_blocks(..., generations=...)``) that were misses
        because their slot held another generation than the lookup returned."""
        return self._data.stale_misses

    def settled(self, buf: Any) -> bool:
        """Whether no receive of a zero-copy get (under way, or failed and unfinished)
        can write into ``buf``: a caller of ``get_blocks(..., zero_copy=True)`` reuses
        or reads a buffer only then (UCX cannot cancel a receive under way; see
        :mod:`pegaflow.client.data`).  Safe to call from any thread."""
        return self._data.settled(buf)

    # ---- control plane -------------------------------------------------------------

    @operation("lookup_timeout_s")
    async def lookup(
        self,
        ns: str,
        hashes: Sequence[bytes],
        shards: Sequence[int] = (0,),
        timeout: Timeout = None,
        generations: bool = False,
        warm_up: bool = False,
    ) -> LookupResult:
        """The longest prefix of ``hashes`` stored with all ``shards``, and where (with
        ``generations``, also the generation of each shard: see
        :attr:`LookupResult.generations`).  ``warm_up``: a lookup made only to connect
        (engine start), left out of the coordinator's lookup metrics.

        Raises a :class:`~pegaflow.errors.PegaError` on failure or after ``timeout``
        (default ``lookup_timeout_s``).
        """
        if not hashes:
            return LookupResult(0)
        attrs = (
            {"pegaflow.namespace": ns, "pegaflow.blocks": len(hashes)}
            if telemetry.tracing
            else None
        )
        with telemetry.span("pegaflow.client.lookup", attrs) as span:
            req = LookupRequest(ns, list(hashes), list(shards), generations, warm_up)
            res = await self._call(Op.LOOKUP, req.to_wire(), self._deadline("lookup", timeout))
            span.set_attribute("pegaflow.hits", int(res["hits"]))
        got = LookupResult.from_wire(res, len(shards), generations)
        self.learn_nodes(got.nodes)
        return got

    def learn_nodes(self, nodes: dict[str, NodeRecord]) -> None:
        """Keep node records a coordinator sent (on the client's loop)."""
        self._nodes.update(nodes)
        for nid, rec in nodes.items():
            self.health.moved(nid, rec.ucx_address)

    @property
    def coordinator_address(self) -> str:
        """The coordinator address calls go to now."""
        return self._rpc.current_address

    def open_transfers(self) -> None:
        """Open the UCX worker that this client's node connections use, now rather than
        at the first connection (on the client's loop; no network call).  UCX reads the
        process environment while it opens a worker; a process whose other threads may
        change the environment meanwhile (an engine starting) calls this while they
        wait (:meth:`SyncPegaClient.open_transfers <.sync.SyncPegaClient.open_transfers>`)."""
        self._data.worker  # noqa: B018 (made on first access)

    @operation("rpc_timeout_s")
    async def place(
        self, ns: str, count: int, block_bytes: int, timeout: Timeout = None
    ) -> NodeRecord:
        """The node the coordinator picks for ``count`` new blocks of ``block_bytes``."""
        req = PlaceRequest(ns, count, block_bytes, self.cfg.host)
        deadline = self._deadline("place", timeout)
        rec = place_reply(await self._call(Op.PLACE, req.to_wire(), deadline))
        self._nodes[rec.node_id] = rec
        return rec

    @operation("rpc_timeout_s")
    async def status(self, timeout: Timeout = None) -> dict[str, Any]:
        """The cluster status document (nodes, usage, index size)."""
        return await self._call(Op.STATUS, {}, self._deadline("status", timeout))

    @operation("rpc_timeout_s")
    async def nodes(self, timeout: Timeout = None) -> dict[str, NodeRecord]:
        """Every node of the cluster, by id."""
        recs = nodes_reply(await self._call(Op.NODES, {}, self._deadline("nodes", timeout)))
        self._nodes = {r.node_id: r for r in recs}
        self._nodes_at = time.monotonic()
        return dict(self._nodes)

    async def _node(self, node_id: str, deadline: Deadline) -> NodeRecord:
        """``node_id``'s record, learned anew (if the records are older than
        :data:`RECORDS_MAX_AGE_S`) when this client holds no connection to it: a node
        restarted at another address (a new port, a pod's new IP) is dialled there, not
        at the address it had.  A refresh that fails keeps the record known; it gets
        half of what is left of ``deadline``."""
        rec = self._nodes.get(node_id)
        stale = time.monotonic() - self._nodes_at > RECORDS_MAX_AGE_S
        if stale and (rec is None or not self._data.connected(rec.ucx_address)):
            try:
                await self.nodes(timeout=deadline.sub(deadline.left() / 2))
                rec = self._nodes.get(node_id)
            except PegaError:
                if rec is None:
                    raise
        if rec is None:
            raise Unavailable(f"node {node_id!r} is not a member of the cluster")
        return rec

    # ---- data plane ----------------------------------------------------------------

    @operation("transfer_timeout_s")
    async def get_blocks(
        self,
        ns: str,
        items: Sequence[GetItem],
        timeout: Timeout = None,
        generations: Sequence[int | None] | None = None,
        *,
        zero_copy: bool = False,
    ) -> list[bool]:
        """Fetch blocks into caller-owned buffers, batched per node, nodes in parallel.

        ``generations`` (optional, one per item, None for "any"): the generation each
        block had at lookup (:attr:`LookupResult.generations`); a node whose slot now
        holds another generation answers a miss.  Returns per item True when the block
        arrived (with that generation) and its checksum matched.

        Only those blocks are written into the caller's buffers, as the call's last
        step: once it returned (or was cancelled, or the blocking caller gave up on it),
        nothing writes them, whatever became of the transfers.  ``zero_copy``: UCX
        receives straight into the caller's buffers instead (no copy), and the receives
        of a get that gave up may write them long after it returned: for a caller that
        reuses or reads a buffer only once :meth:`settled` says so, as the connector
        does (see :mod:`pegaflow.client.data`).
        """
        deadline = self._deadline("get_blocks", timeout)
        got = await self._fetch_blocks(ns, items, GetOptions(generations, zero_copy), deadline)
        return got.deliver()

    async def _fetch_blocks(
        self, ns: str, items: Sequence[GetItem], opts: GetOptions, timeout: Timeout = None
    ) -> Fetched:
        """:meth:`get_blocks` but its last step: the caller's buffers are written only by
        :meth:`Fetched.deliver` (:meth:`DataClient.fetch`)."""
        gens = opts.gens
        if gens is not None and len(gens) != len(items):
            raise ValueError("generations must have one entry per item")
        deadline = self._deadline("get_blocks", timeout)
        parts: list[Fetched] = []

        async def get(node_id: str, idx: list[int]) -> list[bool]:
            attrs = (
                {"pegaflow.node": node_id, "pegaflow.blocks": len(idx)}
                if telemetry.tracing
                else None
            )
            if self.health.is_down(node_id):  # cut off or hung: a miss now, no wait
                self.health.skip(len(idx))
                return [False] * len(idx)
            # a get into a buffer a zero-copy get may still write is refused before it is
            # sent: it says nothing about the node
            sent = all(self._data.settled(items[i][3]) for i in idx)
            with telemetry.span("pegaflow.client.get", attrs) as span:
                got = await self.session(node_id).fetch(
                    ns,
                    [(items[i][1], items[i][2], items[i][3]) for i in idx],
                    replace(opts, gens=None if gens is None else [gens[i] for i in idx]),
                    deadline,
                )  # a failed get is misses; a node not a member raises
                parts.append(got)
                span.set_attribute("pegaflow.loaded", sum(got.ok))
            if sent:
                self._note_get(node_id, got.ok, deadline)
            return got.ok

        return Fetched.joined(await _per_node(items, get), parts)

    @operation("rpc_timeout_s")
    async def pin_blocks(
        self,
        ns: str,
        items: Sequence[tuple[str, bytes, int]],
        ttl_s: float = 5.0,
        timeout: Timeout = None,
    ) -> list[bool]:
        """Read pins: keep ``(node id, hash, shard)`` blocks from eviction for ``ttl_s``,
        between a lookup and the get that follows it.  Per item: stored and pinned.
        Best effort: failures are ``False``, never raised."""
        deadline = self._deadline("pin_blocks", timeout)

        async def pin(node_id: str, idx: list[int]) -> list[bool]:
            blocks = [(items[i][1], items[i][2]) for i in idx]
            return await self.session(node_id).pin(ns, blocks, ttl_s, deadline)

        return await _per_node(items, pin)

    @operation("transfer_timeout_s")
    async def put_blocks(
        self,
        ns: str,
        items: Sequence[PutItem],
        node_id: str | None = None,
        timeout: Timeout = None,
    ) -> PutResult:
        """Store blocks (two-phase) on ``node_id``, else the local node, else placement.

        Blocks the node already has are skipped.  Raises a typed error when the batch
        could not be stored at all.
        """
        if not items:
            return PutResult()
        deadline = self._deadline("put_blocks", timeout)
        target = node_id or self.cfg.local_node
        if target:
            rec = await self._node(target, deadline)
        else:
            rec = await self.place(
                ns, len(items), len(memoryview(items[0][2]).cast("B")), timeout=deadline
            )
        attrs = (
            {"pegaflow.node": rec.node_id, "pegaflow.blocks": len(items)}
            if telemetry.tracing
            else None
        )
        with telemetry.span("pegaflow.client.put", attrs) as span:
            out = await self.session(rec.node_id).put(ns, items, deadline)
            span.set_attribute("pegaflow.stored", out.stored)
        return out

    @operation("rpc_timeout_s")
    async def drop(self, node_id: str, ns: str, timeout: Timeout = None) -> Dropped:
        """Drop every block of namespace ``ns`` from ``node_id`` (an operator's op: it
        needs the cluster token; see :meth:`NodeSession.drop`)."""
        return await self.session(node_id).drop(ns, self._deadline("drop", timeout))

    # ---- same-host shortcut: the caller maps the node's pool file itself ------------

    @operation("rpc_timeout_s")
    async def local_pool(self, node_id: str, timeout: Timeout = None) -> PoolFile | None:
        """The pool file of ``node_id`` if the node offers it to this client (same-host
        shortcut; whether this process can open it is for the caller to check)."""
        deadline = self._deadline("local_pool", timeout)
        return await self.session(node_id).pool_file(deadline)

    @operation("rpc_timeout_s")
    async def local_nodes(self, timeout: Timeout = None) -> list[LocalNode]:
        """The nodes on this host: among every node the coordinator knows, those whose
        published pool file opens here as that file (:func:`~.samehost.may_be_here`: no
        other node is asked), and whose pool file offered in the data-plane handshake
        does too (:func:`~.samehost.open_pool_file`).  Largest pool first, then by id,
        so every process of an engine picks the same one.  Nodes that do not answer
        within ``timeout`` (default ``rpc_timeout_s``, for the whole call) are left out,
        and so is a node whose address another node answers at (two nodes publish one
        address: logged at WARNING, see :class:`~pegaflow.errors.WrongPeer`).  Each
        one's session then knows its control socket."""
        deadline = self._deadline("local_nodes", timeout)
        records = await self.nodes(timeout=deadline)

        async def hello(rec: NodeRecord) -> PoolFile | None:
            return await self._data.pool_file(rec.ucx_address, deadline, expect_node=rec.node_id)

        found = await nodes_here(records.values(), hello, deadline)
        for n in found:
            self.session(n.record.node_id).know(n.pool)
        return found

    @operation("rpc_timeout_s")
    async def locate(
        self,
        ns: str,
        node_id: str,
        hashes: Sequence[bytes],
        shard: int = 0,
        ttl_s: float = 5.0,
        timeout: Timeout = None,
    ) -> tuple[int, LocatedBlocks]:
        """:meth:`NodeSession.locate` on ``node_id``: pin blocks ``(h, shard)`` for
        ``ttl_s``; returns (pin id, where each block is in the pool file); release with
        :meth:`unpin`."""
        deadline = self._deadline("locate", timeout)
        return await self.session(node_id).locate(ns, hashes, shard, ttl_s, deadline)

    @operation("rpc_timeout_s")
    async def unpin(self, node_id: str, pin: int, timeout: Timeout = None) -> None:
        """Release a pin of :meth:`locate` early."""
        await self.session(node_id).unpin(pin, self._deadline("unpin", timeout))

    @operation("rpc_timeout_s")
    async def report_lookups(
        self,
        node_id: str,
        lookups: int,
        asked_blocks: int,
        hit_blocks: int,
        timeout: Timeout = None,
    ) -> None:
        """Report to ``node_id`` the ``lookups`` this client answered from that node
        alone (:meth:`locate` found every block: no coordinator was asked), with the
        blocks they asked for and found; the node counts them, and the coordinators
        add them to the cluster-wide hit rate."""
        deadline = self._deadline("report_lookups", timeout)
        await self.session(node_id).report_lookups(lookups, asked_blocks, hit_blocks, deadline)

    @operation("transfer_timeout_s")
    async def reserve_local(
        self,
        ns: str,
        node_id: str,
        blocks: Sequence[tuple[bytes, int, int]],
        pool: tuple[int, int],
        timeout: Timeout = None,
    ) -> tuple[int, list[int | None]]:
        """:meth:`NodeSession.reserve_local` on ``node_id``."""
        deadline = self._deadline("reserve_local", timeout)
        return await self.session(node_id).reserve_local(ns, blocks, pool, deadline)

    @operation("transfer_timeout_s")
    async def commit_local(
        self,
        node_id: str,
        seq: int,
        accepted: Sequence[bool],
        timeout: Timeout = None,
        digests: Sequence[int | None] | None = None,
        on_taken: Callable[[], None] | None = None,
    ) -> PutResult:
        """:meth:`NodeSession.commit_local` on ``node_id``."""
        deadline = self._deadline("commit_local", timeout)
        return await self.session(node_id).commit_local(seq, accepted, deadline, digests, on_taken)

    @operation("rpc_timeout_s")
    async def abort_local(self, node_id: str, seq: int, timeout: Timeout = None) -> None:
        """:meth:`NodeSession.abort_local` on ``node_id``."""
        deadline = self._deadline("abort_local", timeout)
        await self.session(node_id).abort_local(seq, deadline)

    # ---- node health: no get waits on a node that failed (see .nodehealth) ----------

    def _note_get(self, node_id: str, got: list[bool], deadline: Deadline) -> None:
        """Learn from a get to ``node_id``: a node that sent a block, or answered with its
        connection still up and the deadline not passed, is up; a get that got nothing
        and lost its connection or ran out its deadline failed on the node (a timeout
        closes the connection, a miss keeps it)."""
        rec = self._nodes.get(node_id)
        addr = rec.ucx_address if rec is not None else ""
        connected = bool(addr) and self._data.connected(addr)
        if any(got) or (connected and not deadline.expired):
            self.health.answered(node_id)
            return
        why = "its get timed out" if deadline.expired else "its connection failed"
        if self.health.failed(node_id, addr, why):
            self._start_watch()

    def _start_watch(self) -> None:
        if self._watch is None or self._watch.done():
            self._watch = asyncio.ensure_future(
                watch_down(self.health, self._refresh, self._probe, self._report_unreachable)
            )

    async def _refresh(self) -> None:
        await self.nodes(timeout=PROBE_TIMEOUT_S)

    async def _probe(self, node_id: str) -> None:
        """A hello to ``node_id`` at its latest record's address: up if it answers."""
        rec = self._nodes.get(node_id)
        if rec is None:
            return
        try:
            nid = await self._data.node_id(rec.ucx_address, Deadline.after(PROBE_TIMEOUT_S))
        except PegaError as e:
            log.debug("node %s still unreachable: %s", node_id, e)
            return
        if nid in ("", node_id):
            self.health.answered(node_id)

    async def _report_unreachable(self, node_id: str) -> None:
        """Tell the coordinators that ``node_id`` fails this client (best effort)."""
        try:
            await self.report_unreachable(
                node_id, timeout=min(PROBE_TIMEOUT_S, self.cfg.rpc_timeout_s)
            )
        except PegaError as e:
            log.debug("report of unreachable node %s failed: %s", node_id, e)

    @operation("rpc_timeout_s")
    async def namespace_peers(
        self, ns: str, factors: dict[str, str], timeout: Timeout = None
    ) -> list[dict[str, Any]]:
        """The other namespaces of ``ns``'s model that hold blocks, each ``{ns, blocks,
        factors}`` (``factors`` empty where no engine sent them), after sending this
        engine's ``factors`` of ``ns`` (see :mod:`pegaflow.coordinator.namespaces`)."""
        req = NamespacePeersRequest(ns, factors)
        deadline = self._deadline("namespace_peers", timeout)
        return namespace_peers_reply(await self._call(Op.NAMESPACE_PEERS, req.to_wire(), deadline))

    @operation("rpc_timeout_s")
    async def report_misses(self, report: MissReport, timeout: Timeout = None) -> int:
        """Send the coordinator this engine's missed blocks by cause since its last
        report (``miss_report``; :mod:`pegaflow.coordinator.enginemisses`); how many
        engines it now lists."""
        deadline = self._deadline("report_misses", timeout)
        res = await self._call(Op.MISS_REPORT, report.to_wire(), deadline)
        return int(res.get("engines", 0)) if isinstance(res, dict) else 0

    @operation("rpc_timeout_s")
    async def report_unreachable(self, node_id: str, timeout: Timeout = None) -> bool:
        """Tell the coordinator that ``node_id`` fails this client's gets: it leaves the
        node's blocks out of lookups for a while unless it reaches the node itself
        (``report_unreachable``; see :mod:`pegaflow.coordinator.suspects`).  Whether the
        coordinator now leaves the node out."""
        args = encode_report_unreachable(node_id)
        deadline = self._deadline("report_unreachable", timeout)
        return report_unreachable_reply(await self._call(Op.REPORT_UNREACHABLE, args, deadline))
