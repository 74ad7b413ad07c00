"""The client side of the node data plane (its protocol: :mod:`pegaflow.protocol.node`).

One :class:`DataClient` per event loop holds a UCX worker and one endpoint per node,
reused across calls.  Every block is checked against the node's xxh3 before it counts as
fetched.  A timeout or transport error closes the endpoint (without waiting on the node,
which may be hung) and turns the whole batch into misses.

Late bytes.  UCX cannot cancel a receive that is under way, and closing its endpoint does
not stop it: the bytes of a get that gave up may land in its buffers long after it
returned (at once over shared memory, or when a hung node resumes: 180-250 MiB of a
256 MiB get did, ``tests/integration/test_late_bytes.py``).  So a get receives into the client's own
*landing buffers* and copies each verified block into the caller's buffer as its last
step (:meth:`Fetched.deliver`): a caller's buffer is never a UCX target.  A landing buffer
goes back to its pool (:data:`LANDING_KEEP_BYTES` kept) only once UCX reports its receive
finished.  The copy costs: 0.60-0.83x the throughput of a zero-copy get (batches of 32
blocks of 2-8 MiB over shared memory and TCP, one client reusing its landing buffers;
a new client's first get also faults their pages in: 0.55-0.75x; 2-core machine,
interleaved A/B).

A caller that manages settlement itself (the vLLM connector, which receives into its own
staging memory and reuses a buffer only once settled) may pass ``zero_copy=True``: UCX
then receives straight into its buffers, which stay *unsettled* while the get is under
way and, after a failed get, until UCX reports each receive finished.
:meth:`DataClient.settled` tells it when a buffer may be reused, and a get into an
unsettled buffer is refused (all misses) rather than verified and then overwritten.

Which node answers: connections are kept per address, and the node that answers the
hello names itself (``node_id``).  A caller that means a given node passes its id
(``expect_node``) and every call checks it against the hello's, so a node record whose
address reaches another node (two nodes publishing one address, e.g. a loopback or
wildcard ``--node-host`` in a cluster of several hosts) fails with
:class:`~pegaflow.errors.WrongPeer` instead of storing on, reading from or pinning at
the node that happens to answer.  A put raises it; a get gives misses (gets never raise
for a node's failures) and logs it at WARNING, at most once a minute per address and
node.  The connection itself is kept: it is the node at that address, and a call meant
for that node may use it.  A caller that knows only an address (``expect_node`` empty)
is not checked, and neither is a node whose hello names no id (a node older than this
check: it cannot be told apart, so it is taken as the one meant).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pegaflow.checksum import checksum
from pegaflow.deadline import Deadline, Timeout
from pegaflow.errors import BadRequest, PegaError, Unavailable, WrongPeer, error_from_wire
from pegaflow.observability import telemetry
from pegaflow.protocol import node as proto
from pegaflow.protocol.codec import pack, unpack
from pegaflow.protocol.framing import parse_address
from pegaflow.transport.ucx import UcxWorker, as_array, close_endpoint, make_tag

log = logging.getLogger(__name__)

_MAX_REPLY = 16 << 20
_MAX_BLOCK = 1 << 30
_WRONG_NODE_LOG_S = 60.0
"""a get that reached the wrong node is logged at WARNING at most this often per address
and node meant"""
LANDING_KEEP_BYTES = 256 << 20
"""free landing buffers kept for the next gets (more are freed): one 256 MiB get reuses
its buffers without faulting in new pages"""


def wrong_node(addr: str, meant: str, answered: str) -> WrongPeer:
    """The error of a call meant for node ``meant`` whose hello at ``addr`` came from
    node ``answered``."""
    return WrongPeer(
        f"the node record of {meant} names address {addr}, where node {answered} answers: "
        "two nodes publish one address (e.g. a loopback or wildcard --node-host, "
        "[node] host); give each node its host's address"
    )


@dataclass
class PutOutcome:
    """What a put did: blocks stored, already present (skipped), failed."""

    stored: int = 0
    skipped: int = 0
    failed: int = 0


@dataclass(frozen=True)
class PoolFile:
    """Where a node keeps its pool (offered to same-host clients in the handshake)."""

    path: str
    dev: int
    ino: int
    size: int
    control: str | None = None
    """the node's same-host control socket (see :mod:`pegaflow.client.session`), if any"""

    @property
    def file_id(self) -> tuple[int, int]:
        """(device, inode): which file this is (a same-host reservation names it)."""
        return self.dev, self.ino

    @classmethod
    def from_wire(cls, d: Any) -> PoolFile | None:
        if not isinstance(d, dict):
            return None
        try:
            control = d.get("control")
            return cls(
                str(d["path"]),
                int(d["dev"]),
                int(d["ino"]),
                int(d["bytes"]),
                control if isinstance(control, str) and control else None,
            )
        except (KeyError, TypeError, ValueError):
            return None


@dataclass
class _NodeConn:
    addr: str
    ep: Any
    node_id: str = ""
    pool: PoolFile | None = None
    pending: dict[int, asyncio.Future[dict[str, Any]]] = field(default_factory=dict)
    reader: asyncio.Task[None] | None = None
    closed: bool = False


class _Landing:
    """The payloads of one get: each block's xxh3, taken the moment it lands, and one
    future that completes when every block has landed (or fails with the first error)."""

    __slots__ = ("fut", "left", "reqs", "sums", "views")

    def __init__(self, views: list[memoryview]) -> None:
        self.views = views
        self.sums: list[int | None] = [None] * len(views)
        self.left = len(views)
        self.fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.reqs: list[Any] = []
        """the receive requests, one per view"""

    def callback(self, i: int) -> Callable[[BaseException | None], None]:
        """The completion callback of block ``i``'s receive."""
        return functools.partial(self._landed, i)

    def _landed(self, i: int, err: BaseException | None) -> None:
        fut = self.fut
        if fut.done():
            return
        if err is not None:
            fut.set_exception(err)
            return
        self.sums[i] = checksum(self.views[i])
        self.left -= 1
        if not self.left:
            fut.set_result(None)


def _byte_view(buf: Any) -> memoryview:
    mv = memoryview(buf)
    if not mv.c_contiguous:
        raise BadRequest("block buffers must be C-contiguous")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def _span(view: memoryview) -> tuple[int, int]:
    """The address range ``[start, end)`` of a byte view."""
    start = as_array(view).ptr if len(view) else 0
    return start, start + len(view)


class _Unsettled:
    """The caller's buffers that receives of zero-copy gets may write (see the module
    docstring): while a get is under way, and after it failed until UCX reports its
    unfinished receives finished."""

    def __init__(self) -> None:
        self._spans: dict[int, list[tuple[int, int]]] = {}
        self._ids = itertools.count()
        self.bytes = 0
        """what failed gets' unfinished receives may still write (landing buffers too)"""

    def claim(self, views: Sequence[memoryview]) -> int | None:
        """Register the buffers of a zero-copy get; None (nothing registered) when one of
        them overlaps a buffer still registered."""
        spans = [_span(v) for v in views]
        if self._overlap(spans):
            return None
        key = next(self._ids)
        self._spans[key] = spans
        return key

    def release(self, key: int | None) -> None:
        """Nothing writes the buffers of claim ``key`` any more."""
        if key is not None:
            self._spans.pop(key, None)

    def hold(
        self,
        worker: UcxWorker,
        landing: _Landing,
        key: int | None,
        then: Callable[[list[int]], None] | None = None,
    ) -> list[int]:
        """After a failed get: the buffers of ``landing`` whose receives are unfinished
        are held until UCX reports those finished (the buffers of claim ``key`` stay
        registered until then, the claim's others are released now); ``then(indexes)``
        runs then.  Returns their indexes."""
        open_ = [i for i, r in enumerate(landing.reqs) if not r.completed]
        if not open_:
            self.release(key)
            return []
        if key is not None:
            self._spans[key] = [_span(landing.views[i]) for i in open_]
        n = sum(len(landing.views[i]) for i in open_)
        self.bytes += n
        log.warning(
            "%d bytes of a failed get may still be written by UCX; those buffers are held "
            "until their receives finish",
            n,
        )

        views = landing.views  # kept alive while UCX may write them

        def settled() -> None:
            views.clear()
            self.release(key)
            self.bytes -= n
            if then is not None:
                then(open_)

        worker.settle([landing.reqs[i] for i in open_], settled)
        return open_

    def overlaps(self, views: Sequence[memoryview]) -> bool:
        """Whether any byte of ``views`` may be written by a zero-copy get."""
        return bool(self._spans) and self._overlap([_span(v) for v in views])

    def _overlap(self, spans: Sequence[tuple[int, int]]) -> bool:
        if not self._spans:
            return False
        held = [sp for group in list(self._spans.values()) for sp in group]
        return any(a < hb and ha < b for a, b in spans for ha, hb in held)


class _LandingPool:
    """The client's own receive buffers, one per block (see the module docstring): taken
    by a get, given back once copied out or once no receive can write them any more;
    up to :data:`LANDING_KEEP_BYTES` of them kept.  Thread-safe: a blocking caller
    delivers on its own thread."""

    def __init__(self) -> None:
        self._free: dict[int, list[np.ndarray]] = {}
        self._kept = 0
        self._lock = threading.Lock()

    def take(self, sizes: Sequence[int]) -> list[np.ndarray]:
        """One buffer of each size (kept ones first)."""
        with self._lock:
            got = [self._pop(n) for n in sizes]
        return [np.empty(n, np.uint8) if b is None else b for b, n in zip(got, sizes, strict=True)]

    def _pop(self, n: int) -> np.ndarray | None:
        free = self._free.get(n)
        if not free:
            return None
        self._kept -= n
        return free.pop()

    def give(self, bufs: Sequence[np.ndarray]) -> None:
        """Buffers no receive can write any more (freed beyond what is kept)."""
        with self._lock:
            for b in bufs:
                if self._kept + b.nbytes <= LANDING_KEEP_BYTES:
                    self._free.setdefault(b.nbytes, []).append(b)
                    self._kept += b.nbytes


class Fetched:
    """A get's answer before its last step: per item, whether its block arrived whole and
    matched its checksum (:attr:`ok`), with the copies of those blocks from the client's
    landing buffers into the caller's that only :meth:`deliver` makes (none for a
    zero-copy get).  Whoever answers the caller delivers, or discards when the caller
    gave up: nothing else ever writes the caller's buffers."""

    __slots__ = ("_copies", "_then", "ok")

    def __init__(
        self,
        ok: list[bool],
        copies: Sequence[tuple[np.ndarray, np.ndarray]] = (),
        then: Sequence[Callable[[], None]] = (),
    ) -> None:
        self.ok = ok
        self._copies = list(copies)
        """(caller's buffer, landing buffer) of each verified block"""
        self._then = list(then)
        """what gives the landing buffers back"""

    @classmethod
    def joined(cls, ok: list[bool], parts: Sequence[Fetched]) -> Fetched:
        """Several gets' answers (of disjoint items) as one; ``ok``: per item of all."""
        return cls(
            ok,
            [c for p in parts for c in p._copies],
            [t for p in parts for t in p._then],
        )

    def deliver(self) -> list[bool]:
        """Copy each verified block into the caller's buffer (once); :attr:`ok`."""
        for dst, src in self._copies:
            np.copyto(dst, src)
        self.discard()
        return self.ok

    def discard(self) -> None:
        """Give the landing buffers back without writing the caller's."""
        then, self._copies, self._then = self._then, [], []
        for t in then:
            t()


class DataClient:
    """Batched get/put against storage nodes over UCX, and every other request a node
    serves over UCX (:meth:`call`); a :class:`~pegaflow.client.session.NodeSession`
    speaks to one node through it.  ``ucx_config``: UCX options for this client's worker
    only (see :class:`~pegaflow.transport.ucx.UcxWorker`).
    """

    def __init__(
        self,
        *,
        token: str | None = None,
        connect_timeout: float = 2.0,
        ucx_config: dict[str, str] | None = None,
    ) -> None:
        self._ucx_config = ucx_config
        self._token = token or None
        self._worker: UcxWorker | None = None
        self._conns: dict[str, _NodeConn] = {}
        self._connecting: dict[str, asyncio.Future[_NodeConn]] = {}
        self._ids = itertools.count(1)
        self._hasher = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="pegaflow-xxh3")
        self._unsettled = _Unsettled()
        self._landings = _LandingPool()
        self.connect_timeout = connect_timeout
        """how long a connection (and its hello) may take, whatever the call's deadline"""
        #: Blocks a node answered ``"stale"`` for: their slot now holds another
        #: generation than the one the caller expected (counted as misses).
        self.stale_misses = 0
        self._wrong_logged: dict[tuple[str, str], float] = {}
        """(address, node meant) -> when a get that reached another node was logged"""

    def settled(self, buf: Any) -> bool:
        """Whether no receive of a zero-copy get (under way, or failed and unfinished) can
        write into ``buf``: only then may its caller reuse it for anything (a get into an
        unsettled buffer is refused).  Always true of a buffer only ever given to gets
        without ``zero_copy``.  Safe to call from any thread."""
        return not self._unsettled.overlaps([_byte_view(buf)])

    def connected(self, addr: str) -> bool:
        """Whether a connection to the node at ``addr`` is open now (a failed transfer
        or a timeout closes it; a miss keeps it)."""
        return addr in self._conns

    def reconnect(self, addr: str) -> None:
        """Close the connection to ``addr``, if any: the next request opens another and
        learns the node's handshake (its pool file) again."""
        conn = self._conns.get(addr)
        if conn is not None:
            self._drop(conn, Unavailable(f"connection to {addr} closed to say hello again"))

    @property
    def unsettled_bytes(self) -> int:
        """Bytes held because a failed get's receives are unfinished: landing buffers
        kept from reuse, and the caller's buffers of zero-copy gets."""
        return self._unsettled.bytes

    @property
    def worker(self) -> UcxWorker:
        if self._worker is None:
            self._worker = UcxWorker(self._ucx_config)
        return self._worker

    async def close(self) -> None:
        """Close every endpoint and the worker."""
        for conn in list(self._conns.values()):
            self._drop(conn, Unavailable("client closed"))
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        self._hasher.shutdown(wait=False)

    # ---- connections ---------------------------------------------------------------

    def _drop(self, conn: _NodeConn, err: PegaError) -> None:
        if conn.closed:
            return
        conn.closed = True
        if self._conns.get(conn.addr) is conn:
            del self._conns[conn.addr]
        for fut in conn.pending.values():
            if not fut.done():
                fut.set_exception(err)
        conn.pending.clear()
        close_endpoint(conn.ep)
        if conn.reader is not None and conn.reader is not asyncio.current_task():
            conn.reader.cancel()

    async def _read_loop(self, conn: _NodeConn) -> None:
        w = self.worker
        try:
            while not conn.closed:
                req = w.am_recv(conn.ep)
                fut = w.track(req)
                try:
                    await fut
                finally:
                    if not fut.done() or fut.cancelled():
                        w.forget([fut])
                msg = unpack(memoryview(req.recv_buffer).cast("B"), _MAX_REPLY)
                if not isinstance(msg, dict):
                    continue
                waiter = conn.pending.pop(msg.get("id"), None)  # type: ignore[arg-type]
                if waiter is not None and not waiter.done():
                    waiter.set_result(msg)
        except asyncio.CancelledError:
            pass
        except PegaError as e:
            self._drop(conn, Unavailable(f"data connection to {conn.addr} failed: {e}"))

    async def _connection(self, addr: str, deadline: Deadline, expect_node: str = "") -> _NodeConn:
        """The connection to the node at ``addr`` (opened and greeted if needed); with
        ``expect_node``, raises :class:`WrongPeer` when another node answers there (see
        the module docstring)."""
        conn = self._conns.get(addr)
        if conn is None:
            conn = await self._connect(addr, deadline)
        if expect_node and conn.node_id and conn.node_id != expect_node:
            raise wrong_node(addr, expect_node, conn.node_id)
        return conn

    async def _connect(self, addr: str, deadline: Deadline) -> _NodeConn:
        pending = self._connecting.get(addr)
        if pending is None:
            # the connection outlives this call: it gets the connect timeout, not our budget
            pending = asyncio.ensure_future(self._open(addr, Deadline.after(self.connect_timeout)))
            self._connecting[addr] = pending
            pending.add_done_callback(lambda _f: self._connecting.pop(addr, None))
            pending.add_done_callback(retrieve)
        try:
            return await asyncio.wait_for(asyncio.shield(pending), deadline.left())
        except TimeoutError:
            raise Unavailable(f"connecting to {addr} took longer than the deadline") from None

    async def _open(self, addr: str, deadline: Deadline) -> _NodeConn:
        host, port = parse_address(addr)
        ep = await self.worker.connect(host, port, deadline)
        conn = _NodeConn(addr, ep)
        conn.reader = asyncio.create_task(self._read_loop(conn))
        try:
            hello = await self._request(conn, proto.encode_hello(self._token), deadline)
        except PegaError:
            self._drop(conn, Unavailable(f"handshake with {addr} failed"))
            raise
        conn.node_id = str(hello.get("node_id", ""))
        conn.pool = PoolFile.from_wire(hello.get("pool"))
        self._conns[addr] = conn
        return conn

    async def _request(
        self, conn: _NodeConn, msg: dict[str, Any], deadline: Deadline
    ) -> dict[str, Any]:
        rid = next(self._ids)
        msg["id"] = rid
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        conn.pending[rid] = fut
        w = self.worker

        def sent(err: BaseException | None) -> None:
            # the reply implies the request left; only a failed send needs reporting.  The
            # endpoint is dead then (its peer died, or restarted on the same port): the
            # next request must open another connection
            if err is not None:
                self._drop(conn, Unavailable(f"sending {msg['op']} to {conn.addr} failed: {err}"))
                if not fut.done():
                    fut.set_exception(err)

        w.on_done(w.am_send(conn.ep, pack(msg)), sent)
        try:
            await asyncio.wait_for(fut, deadline.left())
        except PegaError:
            conn.pending.pop(rid, None)
            raise
        except TimeoutError:
            conn.pending.pop(rid, None)
            self._drop(conn, Unavailable(f"{msg['op']} to {conn.addr} timed out"))
            raise Unavailable(
                f"{msg['op']} to {conn.addr} timed out (its deadline passed)"
            ) from None
        reply = fut.result()
        if not reply.get("ok"):
            raise error_from_wire(reply.get("error"))
        return reply

    # ---- operations ----------------------------------------------------------------

    async def get(
        self,
        addr: str,
        ns: str,
        items: Sequence[tuple[bytes, int, Any]],
        timeout: Timeout,
        gens: Sequence[int | None] | None = None,
        *,
        expect_node: str = "",
        zero_copy: bool = False,
    ) -> list[bool]:
        """Fetch ``(hash, shard, buffer)`` blocks from the node at ``addr``.

        ``gens`` (optional, per item): the generation the block must still have (from a
        lookup); the node answers a typed miss (``"stale"``) for a block whose slot now
        holds another generation.  ``expect_node``: the id of the node meant (see the
        module docstring).  Returns, per item, True when the block arrived whole and its
        checksum matched.  Failures (missing, stale, wrong size, corrupt, node down,
        timeout, another node answering) are False, never raised.

        Only those blocks are written into the caller's buffers, as the get's last step:
        once it returned, nothing writes them.  ``zero_copy``: UCX receives straight
        into the caller's buffers instead, and after a get that failed may write them
        for a while longer: only for a caller that reuses or reads a buffer of a failed
        get only once :meth:`settled` says so (see the module docstring).
        """
        got = await self.fetch(
            addr, ns, items, timeout, gens, expect_node=expect_node, zero_copy=zero_copy
        )
        return got.deliver()

    async def fetch(
        self,
        addr: str,
        ns: str,
        items: Sequence[tuple[bytes, int, Any]],
        timeout: Timeout,
        gens: Sequence[int | None] | None = None,
        *,
        expect_node: str = "",
        zero_copy: bool = False,
    ) -> Fetched:
        """:meth:`get` but its last step: the blocks verified in landing buffers, copied
        into the caller's only by :meth:`Fetched.deliver` (a blocking caller delivers on
        its own thread, and not at all once it gave up on the call)."""
        misses = Fetched([False] * len(items))
        if not items:
            return misses
        deadline = Deadline.of(timeout)
        views = [_byte_view(b) for _, _, b in items]
        if zero_copy:
            key = self._unsettled.claim(views)
            refused = key is None
        else:
            key, refused = None, self._unsettled.overlaps(views)
        if refused:
            log.warning(
                "get of %d blocks from %s refused: its buffers may still be written by a "
                "zero-copy get (reuse a buffer once settled() says so)",
                len(items), addr,
            )  # fmt: skip
            return misses
        landings = None if zero_copy else self._landings.take([len(v) for v in views])
        landed = _Landing(views if landings is None else [memoryview(b) for b in landings])
        try:
            reply = await self._receive(addr, ns, items, gens, landed, deadline, expect_node)
            ok = self._verified(addr, reply, landed, gens)
        except BaseException as e:
            self._give_up(landed, key, landings)
            if isinstance(e, WrongPeer):
                self._log_wrong_node(addr, expect_node, len(items), e)
            elif isinstance(e, PegaError):
                log.info("get of %d blocks from %s failed: %s", len(items), addr, e)
            else:
                raise
            return misses
        self._unsettled.release(key)
        if landings is None:
            return Fetched(ok)
        copies = [(np.frombuffer(views[i], np.uint8), landings[i]) for i, g in enumerate(ok) if g]
        return Fetched(ok, copies, [functools.partial(self._landings.give, landings)])

    async def _receive(
        self,
        addr: str,
        ns: str,
        items: Sequence[tuple[bytes, int, Any]],
        gens: Sequence[int | None] | None,
        landed: _Landing,
        deadline: Deadline,
        expect_node: str,
    ) -> dict[str, Any]:
        """Ask the node at ``addr`` for ``items`` into ``landed``'s buffers; its reply once
        every payload landed.  Raises when the get fails (a failure mid-transfer closes
        the connection)."""
        conn = await self._connection(addr, deadline, expect_node)
        w = self.worker
        seq = w.next_seq()
        # Receives go up before the request, so payloads land as expected messages
        # straight in their buffers; the node answers every index (a miss is an empty
        # message), so none of them is left posted.  Each block is hashed the moment
        # it lands, on the loop thread inside the worker's progress (xxh3 of a block
        # still in cache, no task or thread hand-off), while the next payloads keep
        # arriving in the socket buffer.
        for i, v in enumerate(landed.views):
            req = w.tag_recv(conn.ep, v, make_tag(seq, i))
            landed.reqs.append(req)
            w.on_done(req, landed.callback(i), landed.fut)
        try:
            msg = proto.encode_get(ns, seq, [(h, s) for h, s, _ in items], gens)
            msg.update(telemetry.wire_context())
            reply = await self._request(conn, msg, deadline)
            await asyncio.wait_for(landed.fut, deadline.left())
        except BaseException as e:
            w.forget([landed.fut])
            if not landed.fut.cancelled():
                landed.fut.exception()  # a transfer error nobody awaited: retrieved
            self._drop(conn, Unavailable(f"get from {addr} failed mid-transfer"))
            if isinstance(e, TimeoutError):
                raise Unavailable(f"get from {addr} timed out") from None
            raise
        return reply

    def _verified(
        self, addr: str, reply: dict[str, Any], landed: _Landing, gens: Sequence[int | None] | None
    ) -> list[bool]:
        """Per item of a get's ``reply``: whether its block arrived whole, with the
        generation asked for, and matched its checksum."""
        views, sums = landed.views, landed.sums
        ok = [False] * len(views)
        for i, h in enumerate(proto.get_reply(reply, len(views))):
            if not isinstance(h, tuple) or h[0] != len(views[i]):
                if h == proto.STALE:
                    self.stale_misses += 1
                continue
            if gens is not None and gens[i] is not None and h[1] != gens[i]:
                self.stale_misses += 1  # a node that ignored the expected generation
                continue
            ok[i] = sums[i] == h[2]
            if not ok[i]:
                log.warning("checksum mismatch on a block from %s: treated as a miss", addr)
        return ok

    def _give_up(
        self, landed: _Landing, key: int | None, landings: list[np.ndarray] | None
    ) -> None:
        """After a failed get: what its unfinished receives may write is held until UCX
        reports them finished (the caller's buffers of claim ``key``, or landing
        buffers); landing buffers go back to the pool once nothing can write them."""
        if landings is None:
            self._unsettled.hold(self.worker, landed, key)
            return
        pool = self._landings
        late = set(
            self._unsettled.hold(
                self.worker, landed, None, lambda idx: pool.give([landings[i] for i in idx])
            )
        )
        pool.give([b for i, b in enumerate(landings) if i not in late])

    def _log_wrong_node(self, addr: str, meant: str, n: int, e: WrongPeer) -> None:
        """A get that reached another node than ``meant``: WARNING, rate-limited."""
        key = (addr, meant)
        now = time.monotonic()
        last = self._wrong_logged.get(key)
        if last is not None and now - last < _WRONG_NODE_LOG_S:
            log.debug("get of %d blocks from %s: misses: %s", n, addr, e)
            return
        if len(self._wrong_logged) > 1024:
            self._wrong_logged.clear()
        self._wrong_logged[key] = now
        log.warning("get of %d blocks from node %s gives misses: %s", n, meant, e)

    async def put(
        self,
        addr: str,
        ns: str,
        items: Sequence[tuple[bytes, int, Any]],
        timeout: Timeout,
        *,
        expect_node: str = "",
    ) -> PutOutcome:
        """Store ``(hash, shard, buffer)`` blocks on the node at ``addr`` (two-phase).

        Raises a typed error when the node cannot be reached or refuses the batch, and
        :class:`WrongPeer` (nothing sent) when another node than ``expect_node``
        answers at ``addr``.
        """
        if not items:
            return PutOutcome()
        deadline = Deadline.of(timeout)
        views = [_byte_view(b) for _, _, b in items]
        loop = asyncio.get_running_loop()
        # checksums are computed off the loop thread while the reservation round-trips
        hashing = asyncio.gather(*(loop.run_in_executor(self._hasher, checksum, v) for v in views))
        try:
            conn = await self._connection(addr, deadline, expect_node)
            w = self.worker
            blocks = [(h, s, len(v)) for (h, s, _), v in zip(items, views, strict=True)]
            msg = proto.encode_reserve(ns, blocks)
            msg.update(telemetry.wire_context())
            reply = await self._request(conn, msg, deadline)
            try:
                seq, accept = proto.reserve_reply(reply, len(items))
            except Unavailable as e:
                self._drop(conn, e)
                raise
            futs = [
                w.track(w.tag_send(conn.ep, v, make_tag(seq, i)))
                for i, v in enumerate(views)
                if accept[i]
            ]
            sums = await hashing
            # the node waits for the payloads before it verifies and commits
            msg = proto.encode_commit(
                seq, [x if a else None for x, a in zip(sums, accept, strict=True)]
            )
            msg.update(telemetry.wire_context())
            commit = asyncio.ensure_future(self._request(conn, msg, deadline))
            sent = asyncio.gather(*futs)
            try:
                _, done = await asyncio.wait_for(asyncio.gather(sent, commit), deadline.left())
            except BaseException as e:
                w.forget(futs)
                for f in (commit, sent):
                    f.cancel()
                    f.add_done_callback(retrieve)
                self._drop(conn, Unavailable(f"put to {addr} failed mid-transfer"))
                if isinstance(e, TimeoutError):
                    raise Unavailable(f"put to {addr} timed out") from None
                raise
        except BaseException:
            hashing.cancel()
            hashing.add_done_callback(retrieve)
            raise
        stored = proto.commit_reply(done)
        n_accepted = sum(1 for a in accept if a)
        return PutOutcome(
            stored=stored, skipped=len(items) - n_accepted, failed=n_accepted - stored
        )

    async def pin(
        self,
        addr: str,
        ns: str,
        blocks: Sequence[tuple[bytes, int]],
        ttl_s: float,
        timeout: Timeout,
        *,
        expect_node: str = "",
    ) -> list[bool]:
        """Ask the node to keep blocks from eviction for ``ttl_s`` (a read pin between
        lookup and get); per block, whether it is stored and now pinned."""
        if not blocks:
            return []
        msg = proto.encode_pin(ns, blocks, ttl_s)
        return proto.pin_reply(await self.call(addr, msg, timeout, expect_node=expect_node))

    async def call(
        self, addr: str, msg: dict[str, Any], timeout: Timeout, *, expect_node: str = ""
    ) -> dict[str, Any]:
        """One request (a message of :mod:`~pegaflow.protocol.node`) to the node
        at ``addr`` within ``timeout``, connecting first if needed; its reply, or the
        node's error raised as its type (:class:`WrongPeer` when another node than
        ``expect_node`` answers there)."""
        deadline = Deadline.of(timeout)
        conn = await self._connection(addr, deadline, expect_node)
        return await self._request(conn, msg, deadline)

    async def check(
        self,
        addr: str,
        ns: str,
        blocks: Sequence[tuple[bytes, int, int | None]],
        timeout: Timeout,
        *,
        expect_node: str = "",
    ) -> list[bool]:
        """Per ``(hash, shard, generation or None)``: whether the node at ``addr`` holds
        that block committed (with that generation).  Raises a typed error when the node
        cannot answer, :class:`WrongPeer` when another node than ``expect_node``
        answers there (never guess: the index GC deletes what this says is gone)."""
        if not blocks:
            return []
        deadline = Deadline.of(timeout)
        conn = await self._connection(addr, deadline, expect_node)
        reply = await self._request(conn, proto.encode_check(ns, blocks), deadline)
        return proto.check_reply(reply, len(blocks), addr)

    async def node_id(self, addr: str, timeout: Timeout) -> str:
        """The id the node at ``addr`` announced in its handshake."""
        return (await self._connection(addr, Deadline.of(timeout))).node_id

    # ---- same-host shortcut (the caller maps the node's pool file itself) ----------

    async def pool_file(
        self, addr: str, timeout: Timeout, *, expect_node: str = ""
    ) -> PoolFile | None:
        """The node's pool file, if it offers direct access to this client
        (:class:`WrongPeer` when another node than ``expect_node`` answers at ``addr``)."""
        return (await self._connection(addr, Deadline.of(timeout), expect_node)).pool


def retrieve(fut: asyncio.Future[Any]) -> None:
    """Mark a future's failure as seen (it was given up on; its caller has its error)."""
    if not fut.cancelled():
        fut.exception()
