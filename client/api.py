"""The client library: lookups through the coordinator, blocks straight from the nodes.

:class:`PegaClient` is the asyncio API; :class:`SyncPegaClient` runs one on a private
event-loop thread for synchronous callers (the vLLM connector, scripts).  Calls have
deadlines and never hang; per-block failures of a get are misses (``False``), not
exceptions, because the caller's answer to a miss is always the same: recompute.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import ipaddress
import logging
import os
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import uvloop

from pegaflow import telemetry
from pegaflow.config import ClientConfig
from pegaflow.errors import PegaError, Unavailable
from pegaflow.keys import NodeRecord
from pegaflow.rpc import RpcClient

from .data import DataClient, LocatedBlocks, PoolFile, PutOutcome

T = TypeVar("T")

log = logging.getLogger(__name__)

PutResult = PutOutcome

GetItem = tuple[str, bytes, int, Any]
"""(node id, block hash, shard, writable buffer of exactly the block's size)"""
PutItem = tuple[bytes, int, Any]
"""(block hash, shard, readable buffer)"""


@dataclass
class LookupResult:
    """Answer of a lookup: the first ``hits`` blocks are stored with every shard asked for."""

    hits: int
    nodes: dict[str, NodeRecord] = field(default_factory=dict)
    blocks: list[list[str]] = field(default_factory=list)
    """node id per shard, for each of the first ``hits`` blocks"""
    generations: list[list[int]] = field(default_factory=list)
    """with ``lookup(..., generations=True)``: the generation of each shard of each of
    the first ``hits`` blocks when it was published (same shape as ``blocks``); pass
    them to :meth:`PegaClient.get_blocks` to fence the read (empty otherwise)"""


@dataclass(frozen=True)
class LocalNode:
    """A storage node on this host: its record and the pool file this process can open."""

    record: NodeRecord
    pool: PoolFile


def open_pool_file(info: PoolFile, flags: int = os.O_RDWR) -> int:
    """Open a node's pool file and check that it is the file the node described (same
    device and inode, at least as large); returns the descriptor (the caller closes it).

    Raises ``OSError`` when it cannot be opened or is another file: another host's path,
    another mount namespace's ``/dev/shm``, a pool replaced since the node described it.
    """
    fd = os.open(info.path, flags)
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (info.dev, info.ino) or st.st_size < info.size:
            raise OSError(f"{info.path} is not the node's pool file (another host's?)")
    except BaseException:
        os.close(fd)
        raise
    return fd


def on_this_host(host: str) -> bool:
    """Whether ``host`` (a node's data-plane address) can be an address of this machine.

    An IP address is this machine's when a socket can bind to it (a local system call:
    nothing is sent); a name only when it is ``localhost`` or this machine's host name
    (names are not resolved: no DNS query per node).  The pool file check that follows
    (:func:`open_pool_file`) is what decides; this only spares connecting to every
    node of a large cluster.
    """
    host = host.strip().strip("[]")
    if not host:
        return False
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        name = host.lower().rstrip(".")
        mine = socket.gethostname().lower()
        return name in ("localhost", mine) or name.split(".")[0] == mine.split(".")[0]
    if ip.is_unspecified or ip.is_loopback:
        return True
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((str(ip), 0))
    except OSError as e:
        if e.errno not in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
            log.debug("cannot tell whether %s is an address of this host: %s", host, e)
        return False
    return True


def _same_file(info: PoolFile) -> bool:
    try:
        os.close(open_pool_file(info))
    except OSError:
        return False
    return True


def _by_node(items: Sequence[tuple[Any, ...]]) -> dict[str, list[int]]:
    """Indexes of ``items`` grouped by their first field, the node id."""
    by_node: dict[str, list[int]] = defaultdict(list)
    for i, item in enumerate(items):
        by_node[item[0]].append(i)
    return by_node


class PegaClient:
    """Async client of a PegaFlow cluster (one per event loop)."""

    def __init__(self, cfg: ClientConfig, token: str | None = None) -> None:
        self.cfg = cfg
        self._rpc = RpcClient(cfg.coordinators, token=token or None, timeout=cfg.rpc_timeout_s)
        self._data = DataClient(token=token or None, local_control=cfg.local_control)
        self._nodes: dict[str, NodeRecord] = {}
        self._nodes_at = 0.0

    async def close(self) -> None:
        """Close the coordinator connection and every node endpoint."""
        await self._rpc.close()
        await self._data.close()

    @property
    def stale_misses(self) -> int:
        """Blocks of fenced gets (``get_blocks(..., generations=...)``) that were misses
        because their slot held another generation than the lookup returned."""
        return self._data.stale_misses

    def settled(self, buf: Any) -> bool:
        """Whether no receive of an earlier, failed get can still write into ``buf``:
        reuse a get's buffer for anything else only then (UCX cannot cancel a receive
        under way; see :mod:`pegaflow.client.data`).  Safe to call from any thread."""
        return self._data.settled(buf)

    # ---- control plane -------------------------------------------------------------

    async def lookup(
        self,
        ns: str,
        hashes: Sequence[bytes],
        shards: Sequence[int] = (0,),
        timeout: float | None = None,
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
            args: dict[str, Any] = {"ns": ns, "hashes": list(hashes), "shards": list(shards)}
            if generations:
                args["gens"] = True
            if warm_up:
                args["warm_up"] = True
            res = await self._rpc.call(
                "lookup", args, timeout=self.cfg.lookup_timeout_s if timeout is None else timeout
            )
            span.set_attribute("pegaflow.hits", int(res["hits"]))
        nodes = {nid: NodeRecord.from_wire(rec) for nid, rec in res.get("nodes", {}).items()}
        self._nodes.update(nodes)
        hits = int(res["hits"])
        gens: list[list[int]] = []
        if generations:
            flat, k = res.get("gens") or [], len(shards)
            if len(flat) != hits * k:
                raise Unavailable("malformed lookup reply (generations)")
            gens = [flat[i : i + k] for i in range(0, hits * k, k)]
        return LookupResult(hits, nodes, [list(b) for b in res.get("blocks", [])], gens)

    async def place(
        self, ns: str, count: int, block_bytes: int, timeout: float | None = None
    ) -> NodeRecord:
        """The node the coordinator picks for ``count`` new blocks of ``block_bytes``."""
        res = await self._rpc.call(
            "place",
            {"ns": ns, "count": count, "block_bytes": block_bytes, "client_host": self.cfg.host},
            timeout=timeout,
        )
        rec = NodeRecord.from_wire(res["node"])
        self._nodes[rec.node_id] = rec
        return rec

    async def status(self, timeout: float | None = None) -> dict[str, Any]:
        """The cluster status document (nodes, usage, index size)."""
        return await self._rpc.call("status", {}, timeout=timeout)

    async def nodes(self, timeout: float | None = None) -> dict[str, NodeRecord]:
        """Every node of the cluster, by id."""
        res = await self._rpc.call("nodes", {}, timeout=timeout)
        recs = [NodeRecord.from_wire(r) for r in res.get("nodes", [])]
        self._nodes = {r.node_id: r for r in recs}
        self._nodes_at = time.monotonic()
        return dict(self._nodes)

    async def _node(self, node_id: str, timeout: float) -> NodeRecord:
        rec = self._nodes.get(node_id)
        if rec is None and time.monotonic() - self._nodes_at > 1.0:
            await self.nodes(timeout=timeout)
            rec = self._nodes.get(node_id)
        if rec is None:
            raise Unavailable(f"node {node_id!r} is not a member of the cluster")
        return rec

    # ---- data plane ----------------------------------------------------------------

    async def get_blocks(
        self,
        ns: str,
        items: Sequence[GetItem],
        timeout: float | None = None,
        generations: Sequence[int | None] | None = None,
    ) -> list[bool]:
        """Fetch blocks into caller-owned buffers, batched per node, nodes in parallel.

        ``generations`` (optional, one per item, None for "any"): the generation each
        block had at lookup (:attr:`LookupResult.generations`); a node whose slot now
        holds another generation answers a miss.  Returns per item True when the block
        arrived (with that generation) and its checksum matched.
        """
        if generations is not None and len(generations) != len(items):
            raise ValueError("generations must have one entry per item")
        budget = self.cfg.transfer_timeout_s if timeout is None else timeout
        by_node = _by_node(items)
        ok = [False] * len(items)

        async def one(node_id: str, idx: list[int]) -> None:
            try:
                rec = await self._node(node_id, budget)
            except Exception:
                return
            attrs = (
                {"pegaflow.node": node_id, "pegaflow.blocks": len(idx)}
                if telemetry.tracing
                else None
            )
            with telemetry.span("pegaflow.client.get", attrs) as span:
                got = await self._data.get(
                    rec.ucx_address,
                    ns,
                    [(items[i][1], items[i][2], items[i][3]) for i in idx],
                    budget,
                    None if generations is None else [generations[i] for i in idx],
                )
                span.set_attribute("pegaflow.loaded", sum(got))
            for i, g in zip(idx, got, strict=True):
                ok[i] = g

        await asyncio.gather(*(one(n, idx) for n, idx in by_node.items()))
        return ok

    async def pin_blocks(
        self,
        ns: str,
        items: Sequence[tuple[str, bytes, int]],
        ttl_s: float = 5.0,
        timeout: float | None = None,
    ) -> list[bool]:
        """Read pins: keep ``(node id, hash, shard)`` blocks from eviction for ``ttl_s``,
        between a lookup and the get that follows it.  Per item: stored and pinned.
        Best effort: failures are ``False``, never raised."""
        budget = self.cfg.rpc_timeout_s if timeout is None else timeout
        by_node = _by_node(items)
        ok = [False] * len(items)

        async def one(node_id: str, idx: list[int]) -> None:
            try:
                rec = await self._node(node_id, budget)
                got = await self._data.pin(
                    rec.ucx_address, ns, [(items[i][1], items[i][2]) for i in idx], ttl_s, budget
                )
            except PegaError:
                return
            for i, g in zip(idx, got, strict=False):
                ok[i] = g

        await asyncio.gather(*(one(n, idx) for n, idx in by_node.items()))
        return ok

    async def put_blocks(
        self,
        ns: str,
        items: Sequence[PutItem],
        node_id: str | None = None,
        timeout: float | None = None,
    ) -> PutResult:
        """Store blocks (two-phase) on ``node_id``, else the local node, else placement.

        Blocks the node already has are skipped.  Raises a typed error when the batch
        could not be stored at all.
        """
        if not items:
            return PutResult()
        budget = self.cfg.transfer_timeout_s if timeout is None else timeout
        target = node_id or self.cfg.local_node
        if target:
            rec = await self._node(target, budget)
        else:
            rec = await self.place(
                ns, len(items), len(memoryview(items[0][2]).cast("B")), timeout=budget
            )
        attrs = (
            {"pegaflow.node": rec.node_id, "pegaflow.blocks": len(items)}
            if telemetry.tracing
            else None
        )
        with telemetry.span("pegaflow.client.put", attrs) as span:
            out = await self._data.put(rec.ucx_address, ns, items, budget)
            span.set_attribute("pegaflow.stored", out.stored)
        return out

    # ---- same-host shortcut: the caller maps the node's pool file itself ------------

    async def local_pool(self, node_id: str, timeout: float | None = None) -> PoolFile | None:
        """The pool file of ``node_id`` if the node offers it to this client (same-host
        shortcut; whether this process can open it is for the caller to check)."""
        budget = self.cfg.rpc_timeout_s if timeout is None else timeout
        rec = await self._node(node_id, budget)
        return await self._data.pool_file(rec.ucx_address, budget)

    async def local_nodes(self, timeout: float | None = None) -> list[LocalNode]:
        """The nodes on this host: among every node the coordinator knows, those whose
        address may be this machine's (:func:`on_this_host`) and whose pool file, offered
        in the data-plane handshake, this process can open as the same file
        (:func:`open_pool_file`).  Largest pool first, then by id, so every process of
        an engine picks the same one.  Nodes that do not answer within ``timeout``
        (default ``rpc_timeout_s``, for the whole call) are left out."""
        budget = self.cfg.rpc_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + budget
        records = await self.nodes(timeout=budget)

        async def probe(rec: NodeRecord) -> LocalNode | None:
            try:
                pool = await self._data.pool_file(
                    rec.ucx_address, max(0.001, deadline - time.monotonic())
                )
            except PegaError as e:
                log.debug("node %s (%s): no handshake: %s", rec.node_id, rec.ucx_address, e)
                return None
            if pool is None or not _same_file(pool):
                return None
            return LocalNode(rec, pool)

        candidates = [r for r in records.values() if on_this_host(r.host)]
        if not candidates:
            return []
        try:
            got = await asyncio.wait_for(
                asyncio.gather(*(probe(r) for r in candidates)),
                max(0.001, deadline - time.monotonic()),
            )
        except TimeoutError:
            raise Unavailable(f"nodes on this host did not answer within {budget:.3f} s") from None
        found = [n for n in got if n is not None]
        found.sort(key=lambda n: (-n.record.capacity_bytes, n.record.node_id))
        return found

    async def locate(
        self,
        ns: str,
        node_id: str,
        hashes: Sequence[bytes],
        shard: int = 0,
        ttl_s: float = 5.0,
        timeout: float | None = None,
    ) -> tuple[int, LocatedBlocks]:
        """Pin blocks ``(h, shard)`` on ``node_id`` for ``ttl_s``; returns (pin id,
        where each block is in the pool file).  See :meth:`DataClient.locate`; release
        with :meth:`unpin`."""
        budget = self.cfg.rpc_timeout_s if timeout is None else timeout
        rec = await self._node(node_id, budget)
        return await self._data.locate(rec.ucx_address, ns, hashes, shard, ttl_s, budget)

    async def unpin(self, node_id: str, pin: int, timeout: float | None = None) -> None:
        """Release a pin of :meth:`locate` early."""
        budget = self.cfg.rpc_timeout_s if timeout is None else timeout
        rec = await self._node(node_id, budget)
        await self._data.unpin(rec.ucx_address, pin, budget)

    async def report_lookups(
        self,
        node_id: str,
        lookups: int,
        asked_blocks: int,
        hit_blocks: int,
        timeout: float | None = None,
    ) -> None:
        """Report to ``node_id`` the ``lookups`` this client answered from that node
        alone (:meth:`locate` found every block: no coordinator was asked), with the
        blocks they asked for and found; the node counts them, and the coordinators
        add them to the cluster-wide hit rate."""
        budget = self.cfg.rpc_timeout_s if timeout is None else timeout
        rec = await self._node(node_id, budget)
        await self._data.report(rec.ucx_address, lookups, asked_blocks, hit_blocks, budget)

    async def reserve_local(
        self,
        ns: str,
        node_id: str,
        blocks: Sequence[tuple[bytes, int, int]],
        timeout: float | None = None,
    ) -> tuple[int, list[int | None]]:
        """Reserve slots for ``(hash, shard, size)`` blocks written through the pool file;
        returns (reservation, slot offset or None if already stored)."""
        budget = self.cfg.transfer_timeout_s if timeout is None else timeout
        rec = await self._node(node_id, budget)
        return await self._data.reserve_local(rec.ucx_address, ns, blocks, budget)

    async def commit_local(
        self,
        node_id: str,
        seq: int,
        accepted: Sequence[bool],
        timeout: float | None = None,
        digests: Sequence[int | None] | None = None,
        on_taken: Callable[[], None] | None = None,
    ) -> PutResult:
        """Commit a :meth:`reserve_local` reservation (``accepted``: which blocks it
        reserved); the node hashes every slot (``digests``: optional device digests
        kept with the blocks).  ``on_taken``: called, on the client's loop, once the
        node holds the commit and carries it out whatever happens to this process
        (see :meth:`DataClient.commit`)."""
        budget = self.cfg.transfer_timeout_s if timeout is None else timeout
        rec = await self._node(node_id, budget)
        return await self._data.commit(rec.ucx_address, seq, accepted, budget, digests, on_taken)

    async def abort_local(self, node_id: str, seq: int, timeout: float | None = None) -> None:
        """Drop a :meth:`reserve_local` reservation."""
        budget = self.cfg.rpc_timeout_s if timeout is None else timeout
        rec = await self._node(node_id, budget)
        await self._data.abort(rec.ucx_address, seq, budget)


class SyncPegaClient:
    """A thread-safe, blocking facade over a :class:`PegaClient` on its own loop thread."""

    def __init__(self, cfg: ClientConfig, token: str | None = None) -> None:
        self.cfg = cfg
        # uvloop: a call from another thread reaches the loop and comes back faster than
        # on asyncio's own loop (52 / 264 us p50 / p90 against 84 / 774 us, one-off probe;
        # docs/benchmarks.md, "Same-host control")
        self._loop = uvloop.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="pegaflow-client", daemon=True
        )
        self._thread.start()
        self._client: PegaClient = self._run(self._make(cfg, token), None)

    @staticmethod
    async def _make(cfg: ClientConfig, token: str | None) -> PegaClient:
        return PegaClient(cfg, token)

    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        # bind_context: the caller's trace context follows the call onto the loop thread
        return asyncio.run_coroutine_threadsafe(telemetry.bind_context(coro), self._loop)

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        fut = self._submit(coro)
        try:
            # the coroutine enforces its own deadline; this only guards a wedged loop
            return fut.result(None if timeout is None else timeout + 1.0)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise Unavailable("client event loop did not answer in time") from None

    def call(self, fn: Callable[[PegaClient], Coroutine[Any, Any, T]], timeout: float) -> T:
        """Run ``fn(async_client)`` on the client's loop and wait (at most ``timeout``
        plus a second) for its result; for the async API's less common calls."""
        return self._run(fn(self._client), timeout)

    def submit(
        self, fn: Callable[[PegaClient], Coroutine[Any, Any, T]]
    ) -> concurrent.futures.Future[T]:
        """:meth:`call` without waiting (the coroutine keeps its own deadline)."""
        return self._submit(fn(self._client))

    def lookup(
        self,
        ns: str,
        hashes: Sequence[bytes],
        shards: Sequence[int] = (0,),
        timeout: float | None = None,
        generations: bool = False,
    ) -> LookupResult:
        """See :meth:`PegaClient.lookup`."""
        t = self.cfg.lookup_timeout_s if timeout is None else timeout
        return self._run(self._client.lookup(ns, hashes, shards, t, generations), t)

    def get_blocks(
        self,
        ns: str,
        items: Sequence[GetItem],
        timeout: float | None = None,
        generations: Sequence[int | None] | None = None,
    ) -> list[bool]:
        """See :meth:`PegaClient.get_blocks`."""
        t = self.cfg.transfer_timeout_s if timeout is None else timeout
        return self._run(self._client.get_blocks(ns, items, t, generations), t)

    def put_blocks(
        self,
        ns: str,
        items: Sequence[PutItem],
        node_id: str | None = None,
        timeout: float | None = None,
    ) -> PutResult:
        """See :meth:`PegaClient.put_blocks`."""
        t = self.cfg.transfer_timeout_s if timeout is None else timeout
        return self._run(self._client.put_blocks(ns, items, node_id, t), t)

    def submit_get_blocks(
        self,
        ns: str,
        items: Sequence[GetItem],
        timeout: float | None = None,
        generations: Sequence[int | None] | None = None,
    ) -> concurrent.futures.Future[list[bool]]:
        """:meth:`get_blocks` without waiting."""
        return self._submit(self._client.get_blocks(ns, items, timeout, generations))

    def settled(self, buf: Any) -> bool:
        """See :meth:`PegaClient.settled`."""
        return self._client.settled(buf)

    def submit_pin_blocks(
        self, ns: str, items: Sequence[tuple[str, bytes, int]], ttl_s: float = 5.0
    ) -> concurrent.futures.Future[list[bool]]:
        """:meth:`PegaClient.pin_blocks` without waiting (fire and forget after a lookup)."""
        return self._submit(self._client.pin_blocks(ns, items, ttl_s))

    def submit_put_blocks(
        self,
        ns: str,
        items: Sequence[PutItem],
        node_id: str | None = None,
        timeout: float | None = None,
    ) -> concurrent.futures.Future[PutResult]:
        """:meth:`put_blocks` without waiting."""
        return self._submit(self._client.put_blocks(ns, items, node_id, timeout))

    def status(self, timeout: float | None = None) -> dict[str, Any]:
        """See :meth:`PegaClient.status`."""
        t = self.cfg.rpc_timeout_s if timeout is None else timeout
        return self._run(self._client.status(t), t)

    def nodes(self, timeout: float | None = None) -> dict[str, NodeRecord]:
        """See :meth:`PegaClient.nodes`."""
        t = self.cfg.rpc_timeout_s if timeout is None else timeout
        return self._run(self._client.nodes(t), t)

    def local_nodes(self, timeout: float | None = None) -> list[LocalNode]:
        """See :meth:`PegaClient.local_nodes`."""
        t = self.cfg.rpc_timeout_s if timeout is None else timeout
        return self._run(self._client.local_nodes(t), t)

    async def _shutdown(self) -> None:
        await self._client.close()
        # calls still in flight (fire-and-forget unpins, say) end here, not in the GC
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in rest:
            t.cancel()
        await asyncio.gather(*rest, return_exceptions=True)

    def close(self) -> None:
        """Close the client and stop its thread."""
        if not self._loop.is_running():
            return
        try:
            self._run(self._shutdown(), 5.0)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            self._loop.close()
