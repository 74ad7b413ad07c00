"""The node's data plane: batched get and two-phase put over UCX.

The protocol (its ops, their fields, bounds and replies, and which transport serves
each) is :mod:`~pegaflow.storage_node.protocol`; both transports here, UCX and the
same-host control socket, dispatch through its table :data:`~.protocol.OPS`.  A UCX
connection that has not said ``hello`` within ``[node] hello_timeout_s`` is closed (in
an open cluster, one that has sent nothing), and at most ``[node] max_unauthenticated``
wait for it at once (past that the oldest is closed).  ``stats``, ``locate`` and
``report`` need cluster-wide access (a tenant gets ``unauthorized``).

Ownership and quotas.  A reservation belongs to the connection that made it (a
session of the control socket, below, is a connection of its own): ``commit`` of
another's ``seq`` is ``bad_request`` as for an unknown one, ``abort`` of it is a no-op
(``{}``, as for an expired one) and touches nothing.  A read pin belongs to its
connection too; ``unpin`` of another's is a no-op, except that any connection with the
cluster token may release a pin taken with the cluster token (a connector's scheduler
pins, its worker releases).  Pins outlive their connection until ``ttl_ms``.  Bytes
reserved (not yet committed or aborted) are bounded per connection by ``[node]
conn_quota_share`` of the pool and, over all of a tenant's connections, by
``tenant_quota_share``; a tenant's read pins are bounded the same way by the bytes of
the distinct blocks they hold.  A request past a bound gets ``quota``
(:class:`~pegaflow.errors.QuotaExceeded`) and holds nothing.

Same-host shortcut (a client on the node's own host that can open the pool file, e.g. a
GPU connector copying straight between the pool and its device):

* the ``hello`` reply carries ``pool {path, dev, ino, bytes, control}`` (only to
  connections with cluster-wide access, never to a tenant's: the file holds every
  tenant's blocks); ``control`` is the node's Unix socket that answers ``locate``,
  ``unpin`` and local ``reserve``/``commit``/``abort`` faster than UCX does on loopback
  (:mod:`~pegaflow.storage_node.local_control`; a reservation made on one session of
  it is that session's, and is dropped when the session ends);
* ``locate {id, ns, ttl_ms, shard, hash_len, hashes: bytes}`` -> ``{pin, flags, cols}``
  pins the present blocks for ``ttl_ms`` (no eviction while the reader copies them out
  of the file and checks them) and says where they are: per block a flag byte and five
  uint64 (offset, size, gen, xxh3, digest), packed (:class:`~pegaflow.wire.LocatedBlocks`)
  because a 10k-token prefix is hundreds of blocks; cluster token only (a tenant, which
  never learns where blocks lie, gets ``unauthorized`` over UCX too);
* ``unpin {id, pin}`` releases such a pin (or one taken by ``pin``) early;
* ``reserve`` with ``local: true`` posts no receives and answers ``offsets`` too: the
  writer fills the slots through the file, then ``commit``; a writer whose blocks share
  one shard and size may send them packed (``shard, size, hash_len, hashes: bytes``)
  and gets ``{seq, offsets: bytes}``, a little-endian uint64 per block (``NO_SLOT``
  where the block is stored already); its ``xxh3`` entries may be
  None, and the node's own hash of each slot becomes the block's checksum (no transport
  lies between writer and slot: hashing the same bytes twice would check nothing);
* ``commit`` may carry ``digest: [int | None]``, a signed 64-bit digest per block that
  the writer computed on its device (see ``KVBlockIO.digest``); the node keeps it with
  the block (not journaled) and ``locate`` returns it as a fifth field, so a GPU reader
  can verify what landed in its KV cache on the device instead of hashing on the CPU.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import itertools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pegaflow.storage_node import protocol as proto
from pegaflow.storage_node.local_control import SOCKET_SUFFIX, LocalControl
from pegaflow.storage_node.metrics import NodeMetrics
from pegaflow.storage_node.netdev import ucx_net_devices
from pegaflow.storage_node.protocol import (
    MAX_HELLO_BYTES,
    OPS,
    UNKNOWN_OP,
    Loop,
    Op,
    Site,
    op_label,
)

from pegaflow import telemetry
from pegaflow.auth import Authenticator, check_access
from pegaflow.checksum import checksums
from pegaflow.config import NodeConfig
from pegaflow.errors import (
    BadRequest,
    DeadlineExceeded,
    PegaError,
    ProtocolError,
    QuotaExceeded,
    Unauthorized,
)
from pegaflow.inventory import InventorySink
from pegaflow.loopthread import LoopThread
from pegaflow.ucx import DEFAULT_TLS, SHARED_TLS, UcxWorker, close_endpoint, make_tag
from pegaflow.wire import LocatedBlocks, check_namespace, pack, req_map, req_str, unpack

log = logging.getLogger(__name__)

IDLE_TIMEOUT_S = 600.0
MAX_INFLIGHT_PER_CONN = 32
_DROP_LOG_EVERY_S = 60.0
_PROBE_FIRST_S = 0.00025
_PROBE_MAX_S = 0.05
_EMPTY = np.empty(0, dtype=np.uint8)


@dataclass(eq=False)
class _Usage:
    """What one connection, or one tenant over all its connections, holds on the node."""

    reserved: int = 0
    """bytes of its reservations not yet committed or aborted"""
    pinned: int = 0
    """bytes of the distinct blocks its read pins hold (counted for tenants only)"""
    pins: dict[Any, int] = field(default_factory=dict)
    """per pinned entry, how many of its pins hold it"""


@dataclass(eq=False)
class _Owner:
    """Whom reservations and read pins belong to: one UCX connection or one session of
    the same-host control socket."""

    tenant: str | None = None
    """None: cluster-wide access"""
    use: _Usage = field(default_factory=_Usage)
    tenant_use: _Usage | None = None
    """the tenant's usage over all its connections (None: cluster-wide access)"""
    gone: bool = False
    """its connection or session closed"""


@dataclass(eq=False)
class _Caller:
    """Who asks an op, and through which transport."""

    owner: _Owner
    conn: _Conn | None
    """the UCX connection; None: a session of the same-host control socket"""
    pins: dict[int, _Pin]
    """the read pins of the transport's thread"""


_Handler = Callable[[dict[str, Any], _Caller], Any]


@dataclass
class _Reservation:
    ns: str
    entries: list[Any]  # Entry | None per requested block
    recv_done: asyncio.Future[None]
    conn: _Conn | None
    """the UCX connection that made it; None: made on the same-host control socket"""
    owner: _Owner
    """who may commit or abort it"""
    deadline: float
    local: bool = False
    """written through the pool file (no transport between writer and slot)"""
    nbytes: int = 0
    """bytes charged to its owner's quota"""
    recvs: list[Any] = field(default_factory=list)
    """the UCX receives posted into its slots"""
    committing: bool = False
    """its commit was taken: the node carries it out, its owner's end does not drop it"""


@dataclass(eq=False)
class _Pin:
    entries: list[Any]
    timer: asyncio.TimerHandle
    owner: _Owner


@dataclass(eq=False)
class _Conn:
    ep: Any
    authed: bool
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    closed: bool = False
    owner: _Owner = field(default_factory=_Owner)
    caller: _Caller | None = None
    said_hello: bool = False
    # requests in flight on this connection; the reader stops reading at the bound
    slots: asyncio.Semaphore = field(
        default_factory=lambda: asyncio.Semaphore(MAX_INFLIGHT_PER_CONN)
    )


class DataServer:
    """Serves a :class:`~pegaflow.storage_node.pool.BlockPool` over UCX."""

    def __init__(
        self,
        pool: Any,
        cfg: NodeConfig,
        sink: InventorySink,
        metrics: NodeMetrics,
        *,
        auth: Authenticator | None = None,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.pool = pool
        self.cfg = cfg
        self.sink = sink
        self.metrics = metrics
        self._auth = auth if auth is not None else Authenticator()
        self._on_change = on_change
        self._worker: UcxWorker | None = None
        self._listener: asyncio.Server | None = None
        self._control: LocalControl | None = None
        self._conns: set[_Conn] = set()
        self._reservations: dict[int, _Reservation] = {}
        self._commits: dict[int, tuple[_Owner, asyncio.Task[dict[str, Any]]]] = {}
        """commits taken and not yet carried out, by reservation"""
        self._sweeper: asyncio.Task[None] | None = None
        self._pins: dict[int, _Pin] = {}
        """read pins taken over UCX (the data loop's)"""
        self._socket_pins: dict[int, _Pin] = {}
        """read pins taken over the control socket (its thread's)"""
        self._pin_ids = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        """the data loop (UCX, reservations, commits)"""
        self._control_thread: LoopThread | None = None
        # connections that have not said hello yet (oldest first), with their timers
        self._unauthed: dict[_Conn, asyncio.TimerHandle] = {}
        self._dropped_unauthed = 0
        self._drop_log_at = 0.0
        self._sessions: dict[object, _Caller] = {}  # control-socket sessions
        self._ops: dict[Op, _Handler] = {
            Op.HELLO: self._hello, Op.GET: self._get, Op.CHECK: self._check,
            Op.RESERVE: self._reserve, Op.COMMIT: self._commit, Op.ABORT: self._abort_own,
            Op.PIN: self._pin, Op.LOCATE: self._locate, Op.UNPIN: self._unpin,
            Op.STATS: self._stats, Op.REPORT: self._report, Op.TAKEN: self._taken,
        }  # fmt: skip
        """the handler of each op of :data:`~.protocol.OPS`, for every transport"""
        self._tenant_use: dict[str, _Usage] = {}
        for name in ("conn_quota_share", "tenant_quota_share"):
            share = getattr(cfg, name)
            if not 0 < share <= 1:
                raise ValueError(f"[node] {name} must be in (0, 1], not {share}")
        self._conn_quota = int(cfg.conn_quota_share * pool.capacity)
        self._tenant_quota = int(cfg.tenant_quota_share * pool.capacity)
        # xxh3 releases the GIL: verify puts off the loop thread
        self._hash_threads = cfg.hash_threads or min(8, os.cpu_count() or 1)
        self._hasher = concurrent.futures.ThreadPoolExecutor(self._hash_threads, "pegaflow-xxh3")

    @property
    def port(self) -> int:
        assert self._listener is not None
        return int(self._listener.sockets[0].getsockname()[1])

    async def start(self) -> None:
        """Create the UCX worker (on the devices of ``[node] ucx_net_devices``) and
        listen on the configured port."""
        devices = ucx_net_devices(self.cfg.ucx_net_devices, self.cfg.host)
        if devices:
            log.info("UCX network devices: %s", devices)
        options = {"NET_DEVICES": devices} if devices else {}
        if self.cfg.access_group and os.environ.get("UCX_TLS") == DEFAULT_TLS:
            options["TLS"] = SHARED_TLS  # else an engine of another user cannot connect
        self._worker = UcxWorker(options or None)
        self._listener = await self._worker.serve(self.cfg.host, self.cfg.ucx_port, self._accept)
        self._sweeper = asyncio.create_task(self._sweep())
        self._loop = asyncio.get_running_loop()
        if self.cfg.local_access:
            await self._start_control()

    async def _start_control(self) -> None:
        """Serve the same-host control socket on a thread and event loop of its own:
        locates and pins are answered there at once, however busy the data loop is with
        bulk transfers; the ops on reservations go on to the data loop, in the order
        they arrive, with the session's end behind them."""
        loop = self._loop
        assert loop is not None
        thread = LoopThread("pegaflow-node-control")
        thread.start()
        handlers = {
            op.value: (self._on_control if spec.loop is Loop.CONTROL else self._on_data_loop)(op)
            for op, spec in OPS.items()
            if Site.SOCKET in spec.sites
        }
        control = LocalControl(
            str(self.pool.path) + SOCKET_SUFFIX,
            handlers,
            self._auth.cluster_only(),
            self.cfg.max_request_bytes,
            lambda *a: loop.call_soon_threadsafe(self._observe_local, *a),
            lambda key: loop.call_soon_threadsafe(self._session_ended, key),
        )
        if await thread.run(control.start()):
            self._control, self._control_thread = control, thread
        else:
            thread.stop()

    def _on_control(self, op: Op) -> Callable[[dict[str, Any]], Any]:
        """A control-socket handler of ``op`` run on the socket's thread."""
        return lambda msg: self._dispatch(op, msg, self._session())

    def _on_data_loop(self, op: Op) -> Callable[[dict[str, Any]], asyncio.Future[Any]]:
        """A control-socket handler (run on the socket's thread) that reads the
        request's session there and has ``op`` run on the data loop, in the order of
        the requests (its result awaited there when it is awaitable)."""
        loop = self._loop
        assert loop is not None

        def handler(msg: dict[str, Any]) -> asyncio.Future[Any]:
            caller = self._session()
            done: concurrent.futures.Future[Any] = concurrent.futures.Future()

            def run() -> None:
                try:
                    result = self._dispatch(op, msg, caller)
                except BaseException as e:
                    done.set_exception(e)
                    return
                if not inspect.isawaitable(result):
                    done.set_result(result)
                    return
                asyncio.ensure_future(result).add_done_callback(lambda t: _settle(done, t))

            loop.call_soon_threadsafe(run)
            return asyncio.wrap_future(done)

        return handler

    def _dispatch(self, op: Op, msg: dict[str, Any], caller: _Caller) -> Any:
        """Run ``op``'s handler (plain, or an awaitable of its result)."""
        what = OPS[op].cluster_only
        if what is not None:
            _cluster_only(caller.owner, what)
        return self._ops[op](msg, caller)

    async def close(self) -> None:
        """Finish the commits taken (bounded by ``reserve_timeout_s``), then close every
        connection and the worker."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._commits:
            await asyncio.wait(
                [t for _, t in self._commits.values()], timeout=self.cfg.reserve_timeout_s
            )
        for conn in list(self._conns):
            self._close_conn(conn)
        for pin in list(self._pins):
            self._release_pin(pin)
        if self._control is not None and self._control_thread is not None:
            await self._control_thread.run(self._close_control(self._control))
            self._control_thread.stop()
            self._control, self._control_thread = None, None

    async def _close_control(self, control: LocalControl) -> None:
        """On the control thread: stop serving the socket, release its pins."""
        await control.close()
        for pin in list(self._socket_pins):
            self._release_pin(pin, self._socket_pins)
        if self._listener is not None:
            self._listener.close()
        self._listener = None
        if self._worker is not None:
            self._worker.close()
        self._hasher.shutdown(wait=False)

    # ---- connections ---------------------------------------------------------------

    def _accept(self, ep: Any) -> None:
        conn = _Conn(ep=ep, authed=not self._auth.required)
        conn.caller = _Caller(conn.owner, conn, self._pins)
        self._conns.add(conn)
        self.metrics.connections.inc()
        self._await_hello(conn)
        t = asyncio.get_running_loop().create_task(self._serve(conn))
        conn.tasks.add(t)
        t.add_done_callback(conn.tasks.discard)

    def _await_hello(self, conn: _Conn) -> None:
        """Close ``conn`` unless it says hello within ``hello_timeout_s``; at most
        ``max_unauthenticated`` connections wait at once (past that, the oldest goes)."""
        while len(self._unauthed) >= max(1, self.cfg.max_unauthenticated):
            self._drop_unauthed(next(iter(self._unauthed)), "limit")
        self._unauthed[conn] = asyncio.get_running_loop().call_later(
            self.cfg.hello_timeout_s, self._drop_unauthed, conn, "timeout"
        )

    def _hello_done(self, conn: _Conn) -> None:
        """``conn`` no longer waits for its hello (it said it, or it closed)."""
        timer = self._unauthed.pop(conn, None)
        if timer is not None:
            timer.cancel()

    def _drop_unauthed(self, conn: _Conn, reason: str) -> None:
        self._hello_done(conn)
        self.metrics.unauthenticated_closed.labels(reason=reason).inc()
        self._dropped_unauthed += 1
        now = time.monotonic()
        if now >= self._drop_log_at:
            self._drop_log_at = now + _DROP_LOG_EVERY_S
            log.warning(
                "closed %d data connection(s) that did not say hello within [node] "
                "hello_timeout_s (%.1f s) or were the oldest of more than [node] "
                "max_unauthenticated (%d) waiting at once: clients with no or a wrong "
                "token, or a flood of handshakes (pegaflow_node_unauthenticated_closed_total)",
                self._dropped_unauthed, self.cfg.hello_timeout_s, self.cfg.max_unauthenticated,
            )  # fmt: skip
            self._dropped_unauthed = 0
        self._close_conn(conn)

    def _close_conn(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        conn.owner.gone = True
        self._conns.discard(conn)
        self._hello_done(conn)
        self.metrics.connections.dec()
        for seq, r in list(self._reservations.items()):
            if r.conn is conn and not r.committing:
                self._abort(seq)
        close_endpoint(conn.ep)
        for t in list(conn.tasks):
            if t is not asyncio.current_task():
                t.cancel()

    async def _serve(self, conn: _Conn) -> None:
        w = self._worker
        assert w is not None
        try:
            while not conn.closed and conn in self._unauthed:
                # until the hello, messages are taken one at a time
                await self._message_waiting(conn)
                req = w.am_recv(conn.ep)  # completes at once
                await w.wait(req, self.cfg.reserve_timeout_s)
                if not self._auth.required:
                    self._hello_done(conn)  # an open cluster: any first message will do
                await self._handle(conn, req.recv_buffer)
            while not conn.closed:
                req = w.am_recv(conn.ep)
                try:
                    await w.wait(req, IDLE_TIMEOUT_S)
                except DeadlineExceeded:
                    log.info("closing an idle data connection")
                    break
                data = req.recv_buffer
                await conn.slots.acquire()
                t = asyncio.create_task(self._handle(conn, data))
                conn.tasks.add(t)
                t.add_done_callback(conn.tasks.discard)
                t.add_done_callback(lambda _t, c=conn: c.slots.release())
        except PegaError as e:
            log.debug("data connection ended: %s", e)
        finally:
            self._close_conn(conn)

    async def _message_waiting(self, conn: _Conn) -> None:
        """Return once a message from ``conn``'s peer has arrived, probing for it.

        A connection that has not said hello posts no receive: ucxx (0.52) keeps a
        receive cancelled by closing its endpoint queued under the endpoint's handle,
        which UCX hands to the next endpoint, and that endpoint's first message then
        vanishes into it; the silent connections closed here would each cost a later
        client its hello.  Probes back off from 0.25 ms to 50 ms: a client's hello is
        seen within about a millisecond, a silent connection costs a few dozen probes.
        """
        delay = _PROBE_FIRST_S
        while not conn.ep.am_probe():
            await asyncio.sleep(delay)
            delay = min(2 * delay, _PROBE_MAX_S)

    async def _reply(self, conn: _Conn, msg: dict[str, Any]) -> None:
        w = self._worker
        assert w is not None
        if conn.closed:
            return
        try:
            await w.wait(w.am_send(conn.ep, pack(msg)), self.cfg.reserve_timeout_s)
        except PegaError:
            self._close_conn(conn)

    async def _handle(self, conn: _Conn, data: Any) -> None:
        rid: Any = None
        op = UNKNOWN_OP
        t0 = time.perf_counter()
        owner = conn.owner
        try:
            limit = self.cfg.max_request_bytes if conn.authed else MAX_HELLO_BYTES
            msg = req_map(unpack(memoryview(data).cast("B"), limit))
            rid = msg.get("id")
            op = req_str(msg, "op", 32)
            if owner.tenant is not None and "ns" in msg:
                check_access(msg["ns"], owner.tenant)
            if op != Op.HELLO and not conn.authed:
                raise Unauthorized("send hello with the cluster token first")
            spec = OPS.get(op)  # type: ignore[call-overload]
            if spec is None or Site.UCX not in spec.sites:
                raise BadRequest(f"unknown op {op!r}")
            assert conn.caller is not None
            with (
                telemetry.remote_span(spec.span, msg.get(telemetry.TRACEPARENT_KEY))
                if spec.span is not None
                else contextlib.nullcontext()
            ):
                result = self._dispatch(Op(op), msg, conn.caller)
                if inspect.isawaitable(result):
                    result = await result
            if result is None:
                return  # a get: it replied itself, ahead of its payloads
            await self._reply(conn, {"id": rid, "ok": True, **result})
        except PegaError as e:
            self.metrics.request_errors.labels(op=op_label(op), code=e.code).inc()
            await self._reply(conn, {"id": rid, "ok": False, "error": e.to_wire()})
        except Exception as e:  # a bug: report it, keep serving
            log.exception("data-plane %s failed", op_label(op))
            self.metrics.request_errors.labels(op=op_label(op), code="internal").inc()
            err = {"code": "internal", "message": f"{type(e).__name__}: {e}"}
            await self._reply(conn, {"id": rid, "ok": False, "error": err})
        finally:
            self.metrics.request_seconds.labels(op=op_label(op)).observe(time.perf_counter() - t0)

    def _hello(self, msg: dict[str, Any], caller: _Caller) -> dict[str, Any]:
        conn = caller.conn
        assert conn is not None, "hello is said over UCX"
        if conn.said_hello:
            raise ProtocolError("hello was said already on this connection")
        tenant = self._auth.authenticate(proto.decode_hello(msg))
        conn.owner.tenant = tenant
        if tenant is not None:
            conn.owner.tenant_use = self._tenant_use.setdefault(tenant, _Usage())
        conn.authed = conn.said_hello = True
        self._hello_done(conn)
        reply: dict[str, Any] = {"node_id": self.pool.node_id, "version": proto.PROTOCOL_VERSION}
        if self.cfg.local_access and tenant is None:
            st = os.stat(self.pool.path)
            reply["pool"] = {
                "path": str(self.pool.path),
                "dev": st.st_dev,
                "ino": st.st_ino,
                "bytes": self.pool.capacity,
            }
            if self._control is not None:
                reply["pool"]["control"] = self._control.path
        return reply

    # ---- get -----------------------------------------------------------------------

    async def _get(self, msg: dict[str, Any], caller: _Caller) -> None:
        w = self._worker
        conn = caller.conn
        assert w is not None and conn is not None, "get is asked over UCX"
        rid = msg.get("id")
        _, seq, keys, want = proto.decode_get(msg, self.cfg.max_batch)
        pool = self.pool
        ep = conn.ep
        pinned: list[Any] = []
        header: list[Any] = []
        reqs: list[Any] = []
        stale = 0
        try:
            # Every index gets a message so that the reader's pre-posted receives all
            # complete: the block, or an empty message for a miss.  Each send is posted
            # as its block is found; a rendezvous send only announces itself (a small
            # RTS), so all of them reach the reader before any payload, the reader
            # answers them at once and the payloads then stream back to back.
            for i, key in enumerate(keys):
                e = pool.get(key)
                if e is None:
                    header.append(None)
                elif want is not None and want[i] is not None and e.gen != want[i]:
                    header.append(proto.STALE)  # the slot holds another generation now
                    stale += 1
                    e = None
                else:
                    pool.pin(e)
                    pinned.append(e)
                    header.append(proto.get_hit(e.size, e.gen, e.xxh3))
                reqs.append(w.tag_send(ep, _EMPTY if e is None else pool.view(e), make_tag(seq, i)))
            # the reply goes right behind the announcements, ahead of every payload (the
            # reader has it before the last block lands), then payloads start moving now
            # (the reader's answers may be in), not once the loop has come round
            reqs.append(w.am_send(ep, pack({"id": rid, "ok": True, "blocks": header})))
            w.worker.progress()
            w.kick()
            # metrics once per batch, not per block
            if pinned:
                self.metrics.get_blocks.labels(result="hit").inc(len(pinned))
            if stale:
                self.metrics.get_blocks.labels(result="stale").inc(stale)
            if len(pinned) + stale < len(keys):
                self.metrics.get_blocks.labels(result="miss").inc(len(keys) - len(pinned) - stale)
            await w.wait_all(reqs, self.cfg.reserve_timeout_s)
            self.metrics.get_bytes.inc(sum(e.size for e in pinned))
        except PegaError as e:
            self.metrics.transfer_errors.labels(kind=e.code).inc()
            self._close_conn(conn)
        except BaseException:
            # sends may still read these slots: they die with the connection before
            # the blocks are unpinned
            self._close_conn(conn)
            raise
        finally:
            for e in pinned:
                pool.unpin(e)

    def _check(self, msg: dict[str, Any], caller: _Caller) -> dict[str, Any]:
        """Whether each block is stored and committed (with the generation given)."""
        _, keys, want = proto.decode_check(msg, self.cfg.max_batch)
        valid = []
        for i, key in enumerate(keys):
            e = self.pool.get(key)
            valid.append(e is not None and (want is None or want[i] in (None, e.gen)))
        return {"valid": valid}

    def _pin(self, msg: dict[str, Any], caller: _Caller) -> dict[str, Any]:
        """Read pins: keep the named blocks from eviction for ``ttl_ms`` (between a
        reader's lookup and its get), so a hit is not lost to a racing writer."""
        ttl_ms, keys = proto.decode_pin(msg, self.cfg.max_batch)
        found = [self.pool.get(k) for k in keys]
        pin = self._hold(found, ttl_ms, caller.owner, caller.pins)
        return {"pinned": [e is not None for e in found], "pin": pin}

    def _locate(self, msg: dict[str, Any], caller: _Caller) -> dict[str, Any]:
        """Same-host reads: pin the named blocks and say where they lie in the pool file
        (``hashes``: ``hash_len``-byte hashes back to back, all of one ``shard``)."""
        ns, ttl_ms, shard, hashes = proto.decode_locate(msg, self.cfg.max_batch)
        found = self.pool.get_many(ns, hashes, shard)
        pin = self._hold(found, ttl_ms, caller.owner, caller.pins)
        hits = self.metrics.get_blocks.labels(result="hit")
        n = len(found) - found.count(None)
        if caller.pins is self._socket_pins and self._loop is not None:
            self._loop.call_soon_threadsafe(hits.inc, n)  # the metrics are the data loop's
        else:
            hits.inc(n)
        return proto.encode_locate_reply(pin, [e and _wire(e) for e in found])

    def _hold(self, found: list[Any], ttl_ms: int, owner: _Owner, table: dict[int, _Pin]) -> int:
        """Pin the entries found until the pin is released or ``ttl_ms`` passes (a
        timer on the calling thread's loop; ``table``: that thread's pins)."""
        pinned = [e for e in found if e is not None]
        if owner.tenant is not None:
            self._charge_pins(owner, pinned)
        self.pool.pin_many(pinned)
        pin = next(self._pin_ids)
        timer = asyncio.get_running_loop().call_later(ttl_ms / 1000, self._release_pin, pin, table)
        table[pin] = _Pin(pinned, timer, owner)
        return pin

    def _unpin(self, msg: dict[str, Any], caller: _Caller) -> dict[str, Any]:
        """Release a pin of the caller's (or, with cluster-wide access, any pin taken
        with it on the same transport); another's pin is left alone, as an unknown or
        expired one is."""
        owner, table = caller.owner, caller.pins
        pin = proto.decode_unpin(msg)
        held = table.get(pin)
        if held is not None and (
            held.owner is owner or (held.owner.tenant is None and owner.tenant is None)
        ):
            self._release_pin(pin, table)
        return {}

    def _stats(self, msg: dict[str, Any], caller: _Caller) -> dict[str, Any]:
        return vars(self.pool.stats())

    def _report(self, msg: dict[str, Any], caller: _Caller) -> dict[str, Any]:
        """A connector's same-host lookups (answered by this node alone): counted."""
        lookups, asked, hits = proto.decode_report(msg)
        m = self.metrics
        m.same_host_lookups.inc(lookups)
        m.same_host_hit_blocks.inc(hits)
        m.same_host_miss_blocks.inc(asked - hits)
        if self._on_change is not None and lookups:
            self._on_change()  # the record carries them to the coordinators
        return {}

    def _session(self) -> _Caller:
        """The control-socket session whose request is being served."""
        key = LocalControl.session()
        assert key is not None, "called outside a control-socket request"
        caller = self._sessions.get(key)
        if caller is None:
            caller = self._sessions[key] = _Caller(_Owner(), None, self._socket_pins)
        return caller

    def _session_ended(self, key: object) -> None:
        """A control-socket session closed: its reservations go, but for those whose
        commit was taken (its pins expire)."""
        caller = self._sessions.pop(key, None)
        if caller is None:
            return
        owner = caller.owner
        owner.gone = True
        for seq, r in list(self._reservations.items()):
            if r.owner is owner and not r.committing:
                self._abort(seq)

    def _observe_local(self, op: str, seconds: float, error: str | None) -> None:
        """Metrics of a request on the same-host control socket (as for UCX ones)."""
        label = op_label(op)
        self.metrics.request_seconds.labels(op=label).observe(seconds)
        if error is not None:
            self.metrics.request_errors.labels(op=label, code=error).inc()

    def _release_pin(self, pin: int, pins: dict[int, _Pin] | None = None) -> None:
        held = (self._pins if pins is None else pins).pop(pin, None)
        if held is None:
            return  # expired already, or never existed: releasing is idempotent
        held.timer.cancel()
        self.pool.unpin_many(held.entries)
        if held.owner.tenant is not None:
            self._uncharge_pins(held.owner, held.entries)

    # ---- quotas --------------------------------------------------------------------

    def _quotas(self, owner: _Owner) -> list[tuple[_Usage, int, str]]:
        """(usage, bound, scope) of each quota ``owner`` is under."""
        out = [(owner.use, self._conn_quota, "connection")]
        if owner.tenant_use is not None:
            out.append((owner.tenant_use, self._tenant_quota, "tenant"))
        return out

    def _refuse(self, kind: str, scope: str, owner: _Owner, held: int, more: int) -> None:
        self.metrics.quota_refusals.labels(kind=kind, scope=scope).inc()
        bound, setting = (
            (self._conn_quota, "conn_quota_share")
            if scope == "connection"
            else (self._tenant_quota, "tenant_quota_share")
        )
        who = "this connection" if scope == "connection" else f"tenant {owner.tenant!r}"
        raise QuotaExceeded(
            f"{more} more bytes {kind} would take {who} past its quota ({held} of {bound} "
            f"bytes held; [node] {setting}); commit, abort or unpin what it holds first"
        )

    def _charge_reserve(self, owner: _Owner, parsed: list[tuple[Any, int]]) -> None:
        """Refuse a reservation of ``parsed`` blocks that would take ``owner`` past a
        quota (blocks stored already reserve nothing and are not counted)."""
        quotas = self._quotas(owner)
        upper = sum(size for _, size in parsed)
        if all(use.reserved + upper <= bound for use, bound, _ in quotas):
            return
        need = sum(size for key, size in parsed if not self.pool.contains(key))
        for use, bound, scope in quotas:
            if use.reserved + need > bound:
                self._refuse("reserved", scope, owner, use.reserved, need)

    def _take_reservation(self, seq: int) -> _Reservation | None:
        """Remove reservation ``seq`` and give its bytes back to its owner's quotas."""
        res = self._reservations.pop(seq, None)
        if res is not None and res.nbytes:
            for use, _, _ in self._quotas(res.owner):
                use.reserved -= res.nbytes
        return res

    def _charge_pins(self, owner: _Owner, entries: list[Any]) -> None:
        """Count a tenant's new pin on ``entries`` (the bytes of distinct blocks), or
        refuse it past a quota."""
        quotas = self._quotas(owner)
        distinct = set(entries)
        for use, bound, scope in quotas:
            more = sum(e.size for e in distinct if e not in use.pins)
            if use.pinned + more > bound:
                self._refuse("pinned", scope, owner, use.pinned, more)
        for use, _, _ in quotas:
            counts = use.pins
            for e in entries:
                n = counts.get(e, 0)
                if not n:
                    use.pinned += e.size
                counts[e] = n + 1

    def _uncharge_pins(self, owner: _Owner, entries: list[Any]) -> None:
        for use, _, _ in self._quotas(owner):
            counts = use.pins
            for e in entries:
                n = counts.pop(e) - 1
                if n:
                    counts[e] = n
                else:
                    use.pinned -= e.size

    # ---- put -----------------------------------------------------------------------

    def _reserve(self, msg: dict[str, Any], caller: _Caller) -> dict[str, Any]:
        """A reservation of the caller's (who may commit or abort it, charged for its
        bytes); on the control socket a same-host one only."""
        w = self._worker
        assert w is not None
        conn, owner = caller.conn, caller.owner
        ns = check_namespace(msg.get("ns"))
        local = proto.reserve_is_local(msg)
        if conn is None and not local:
            raise BadRequest("the control socket takes same-host (local) reservations only")
        if local and (not self.cfg.local_access or owner.tenant is not None):
            raise Unauthorized("this connection may not write the pool file directly")
        parsed = proto.decode_reserve_blocks(ns, msg, self.cfg.max_batch)
        self._charge_reserve(owner, parsed)
        seq = w.next_seq()
        entries: list[Any] = []
        reqs = []
        try:
            for i, (key, size) in enumerate(parsed):
                # the pool's own expiry is a backstop behind ours (_sweep -> _abort),
                # which knows whether receives may still write the slot
                e = self.pool.reserve(key, size, 2 * self.cfg.reserve_timeout_s)
                entries.append(e)
                if e is not None and conn is not None and not local:
                    reqs.append(w.tag_recv(conn.ep, self.pool.view(e), make_tag(seq, i)))
        except PegaError:
            for e in entries:
                if e is not None:
                    self.pool.abort(e)
            raise
        w.kick()
        done = asyncio.ensure_future(w.wait_all(reqs, self.cfg.reserve_timeout_s))
        nbytes = sum(e.size for e in entries if e is not None)
        for use, _, _ in self._quotas(owner):
            use.reserved += nbytes
        res = _Reservation(
            ns, entries, done, conn, owner,
            time.monotonic() + self.cfg.reserve_timeout_s, local, nbytes,
        )  # fmt: skip
        res.recvs = reqs
        self._reservations[seq] = res

        def _failed(f: asyncio.Future[None]) -> None:
            failed = not f.cancelled() and f.exception() is not None
            if failed and conn is not None and seq in self._reservations:
                # payloads never came: the connection's receives must die with it
                self._close_conn(conn)

        done.add_done_callback(_failed)
        return proto.encode_reserve_reply(msg, seq, [e and e.offset for e in entries])

    def _commit(self, msg: dict[str, Any], caller: _Caller) -> asyncio.Future[dict[str, Any]]:
        """Take a commit: checked here, then carried out by :meth:`_carry_out` in a task
        of its own, which neither the end of the caller's connection or session nor its
        deadline cancels.  Returns a future of the answer.  Plain, not async: the commit
        is taken as soon as the data loop sees it, before the caller's next request (a
        ``taken`` right behind it) or its end."""
        owner = caller.owner
        seq, sums, digests = proto.decode_commit(msg, self.cfg.max_batch)
        res = self._reservations.get(seq)
        if res is None or res.owner is not owner or res.committing:
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
        self._commits[seq] = (owner, task)
        task.add_done_callback(lambda t: self._commit_done(seq, res, t))
        return asyncio.shield(task)

    def _taken(self, msg: dict[str, Any], caller: _Caller) -> dict[str, Any]:
        """``taken``: whether the caller's commit of ``seq`` is held (being carried out)."""
        held = self._commits.get(proto.decode_seq(msg))
        return {"taken": held is not None and held[0] is caller.owner}

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
        """Wait for the payloads, verify (or, for a local reservation, hash) every
        block, commit and publish them."""
        try:
            await asyncio.shield(res.recv_done)
        except PegaError as e:
            self._abort(seq)
            self.metrics.transfer_errors.labels(kind=e.code).inc()
            raise
        if self._take_reservation(seq) is not res:  # aborted or committed meanwhile
            raise BadRequest(f"reservation {seq} was dropped while its payloads arrived")
        got_sums = await self._checksums([self.pool.view(e) for e in res.entries if e is not None])
        got_iter = iter(got_sums)
        stored, failed, nbytes = 0, [], 0
        for i, (e, want) in enumerate(zip(res.entries, sums, strict=True)):
            if e is None:
                continue
            got = next(got_iter)
            if not (res.local and want is None) and (not isinstance(want, int) or got != want):
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

    def _abort_own(self, msg: dict[str, Any], caller: _Caller) -> dict[str, Any]:
        """``abort``: drop reservation ``seq`` if it is the caller's; another's is left
        alone, as an unknown or expired one is."""
        seq = proto.decode_seq(msg)
        res = self._reservations.get(seq)
        if res is not None and res.owner is caller.owner and not res.committing:
            self._abort(seq)
        return {}

    def _abort(self, seq: int) -> None:
        res = self._take_reservation(seq)
        if res is None:
            return
        if not res.local and res.conn is not None and not res.recv_done.done():
            self._close_conn(res.conn)
        held = [e for e in res.entries if e is not None]
        open_recvs = [r for r in res.recvs if not r.completed]
        if not open_recvs:
            for e in held:
                self.pool.abort(e)
            return
        # the writer's bytes may still land in these slots (closing its endpoint does not
        # stop them): the slots stay out of use until UCX reports every receive finished
        assert self._worker is not None
        for e in held:
            self.pool.quarantine(e)
        self._worker.settle(open_recvs, lambda: self._release_quarantined(held))

    def _release_quarantined(self, entries: list[Any]) -> None:
        for e in entries:
            self.pool.release_quarantined(e)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for seq, r in list(self._reservations.items()):
                if r.deadline < now:
                    log.info("reservation %d expired; reclaiming its slots", seq)
                    self._abort(seq)
            self.pool.reclaim_expired(now)


def _cluster_only(owner: _Owner, what: str) -> None:
    """Refuse a tenant's connection what needs cluster-wide access."""
    if owner.tenant is not None:
        raise Unauthorized(f"a tenant's connection may not {what}")


def _wire(e: Any) -> tuple[int, bytes]:
    """A committed entry's ``locate`` answer, computed once."""
    if e.wire is None:
        e.wire = LocatedBlocks.wire_row(e.offset, e.size, e.gen, e.xxh3, e.digest)
    return e.wire


def _settle(done: concurrent.futures.Future[Any], task: asyncio.Future[Any]) -> None:
    """Pass ``task``'s outcome to ``done`` (another thread waits on it)."""
    if task.cancelled():
        done.cancel()
    elif task.exception() is not None:
        done.set_exception(task.exception())  # type: ignore[arg-type]
    else:
        done.set_result(task.result())
