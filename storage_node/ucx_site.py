"""The node's UCX site: connections, hello, and the streaming of gets and puts.

Each UCX connection is a :class:`~pegaflow.storage_node.sessions.Session` of the
node service; the site serves the transport's own ops (``hello``, and ``get``, whose
payloads it streams straight from the pool, each block held only on the disk tier
as soon as it is promoted into it) and passes every other op of the protocol
table (:data:`~.protocol.OPS`) to the service, posting the receives of a reservation's
payloads into its slots when the service asks.  A connection that has not said
``hello`` within ``[node] hello_timeout_s`` is closed (in an open cluster, one that has
sent nothing), and at most ``[node] max_unauthenticated`` wait for it at once (past that
the oldest is closed).

The ``hello`` reply carries ``pool {path, dev, ino, bytes, control}`` (only to
connections with cluster-wide access, never to a tenant's: the file holds every
tenant's blocks); ``control`` is the node's same-host control socket
(:mod:`~pegaflow.storage_node.local_control`), which answers ``locate``, ``unpin`` and
same-host ``reserve``/``commit``/``abort`` faster than UCX does on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, InitVar, dataclass, field
from functools import partial
from typing import Any

import numpy as np
from pegaflow.storage_node.metrics import NodeMetrics
from pegaflow.storage_node.netdev import ucx_net_devices
from pegaflow.storage_node.node_service import NodeService
from pegaflow.storage_node.sessions import Session

from pegaflow.auth import Authenticator, check_access
from pegaflow.config import NodeConfig
from pegaflow.deadline import Deadline
from pegaflow.errors import BadRequest, DeadlineExceeded, PegaError, ProtocolError, Unauthorized
from pegaflow.observability import telemetry
from pegaflow.protocol import node as proto
from pegaflow.protocol.codec import pack, req_map, req_str, unpack
from pegaflow.protocol.node import MAX_HELLO_BYTES, OPS, UNKNOWN_OP, Op, Site, op_label
from pegaflow.transport.ucx import DEFAULT_TLS, SHARED_TLS, UcxWorker, close_endpoint, make_tag

log = logging.getLogger(__name__)

IDLE_TIMEOUT_S = 600.0
MAX_INFLIGHT_PER_CONN = 32
_DROP_LOG_EVERY_S = 60.0
_PROBE_FIRST_S = 0.00025
_PROBE_MAX_S = 0.05
_EMPTY = np.empty(0, dtype=np.uint8)


@dataclass(eq=False)
class _Conn:
    ep: Any
    authed: bool
    session: Session
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    closed: bool = False
    said_hello: bool = False
    # requests in flight on this connection; the reader stops reading at the bound
    slots: asyncio.Semaphore = field(
        default_factory=lambda: asyncio.Semaphore(MAX_INFLIGHT_PER_CONN)
    )


@dataclass(eq=False)
class _UcxInflow:
    """A reservation's payloads coming over one connection (an
    :class:`~pegaflow.storage_node.sessions.Inflow`): ``recvs`` by slot index, each
    receive posted with tag ``(seq, index)``."""

    site: UcxSite
    conn: _Conn
    seq: int
    recvs: dict[int, Any]
    done: asyncio.Future[None]
    drained: bool = False

    def cut(self) -> None:
        """Close the connection and stop the receives no sender matched yet."""
        self.site._close_conn(self.conn)
        if not self.drained:
            self.drained = True
            self.site._drain(self)

    def landing(self) -> list[int]:
        return [i for i, r in self.recvs.items() if not r.completed]

    def when_landed(self, index: int, then: Callable[[], None]) -> None:
        assert self.site._worker is not None
        self.site._worker.settle([self.recvs[index]], then)


def self_endpoint(w: UcxWorker) -> Any:
    """An endpoint from ``w`` to itself (UCX's ``self`` transport, or loopback)."""
    import ucxx._lib.libucxx as ucx_api  # configured by pegaflow.transport.ucx, imported above

    address = ucx_api.UCXAddress.create_from_buffer(w.address)
    return ucx_api.UCXEndpoint.create_from_worker_address(w.worker, address, False)


_SiteHandler = Callable[[dict[str, Any], _Conn], Any]


@dataclass(eq=False, repr=False)
class UcxSite:
    """Serves a :class:`~pegaflow.storage_node.node_service.NodeService` over UCX."""

    service: NodeService
    cfg: NodeConfig
    metrics: NodeMetrics
    auth: InitVar[Authenticator]
    _: KW_ONLY
    control_path: InitVar[str | None] = None
    """the same-host control socket, advertised in hello replies"""

    def __post_init__(self, auth: Authenticator, control_path: str | None) -> None:
        self._auth = auth
        self._control_path = control_path
        self._worker: UcxWorker | None = None
        self._listener: asyncio.Server | None = None
        self._conns: set[_Conn] = set()
        self._self_ep: Any = None
        """an endpoint to our own worker, for :meth:`_drain`"""
        self._pins = self.service.pin_table()
        # connections that have not said hello yet (oldest first), with their timers
        self._unauthed: dict[_Conn, asyncio.TimerHandle] = {}
        self._dropped_unauthed = 0
        self._drop_log_at = 0.0
        self._ops: dict[Op, _SiteHandler] = {Op.HELLO: self._hello, Op.GET: self._get}
        """the transport's own ops; the others are the service's"""
        assert set(OPS) == set(self._ops) | set(self.service.ops)

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

    async def close(self) -> None:
        """Stop accepting, let the commits taken finish (bounded by
        ``reserve_timeout_s``: their payloads may still be arriving), then close every
        connection and the worker."""
        if self._listener is not None:
            self._listener.close()
        await self.service.finish_commits()
        for conn in list(self._conns):
            self._close_conn(conn)
        self.service.release_pins(self._pins)
        if self._self_ep is not None:
            close_endpoint(self._self_ep)
        if self._worker is not None:
            self._worker.close()

    # ---- connections ---------------------------------------------------------------

    def _accept(self, ep: Any) -> None:
        session = Session(self._pins)
        conn = _Conn(ep, not self._auth.required, session)
        session.receive = partial(self._receive, conn)
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
        self._conns.discard(conn)
        self._hello_done(conn)
        self.metrics.connections.dec()
        self.service.end_session(conn.session)
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
        try:
            limit = self.cfg.max_request_bytes if conn.authed else MAX_HELLO_BYTES
            msg = req_map(unpack(memoryview(data).cast("B"), limit))
            rid = msg.get("id")
            op = req_str(msg, "op", 32)
            tenant = conn.session.tenant
            if tenant is not None and "ns" in msg:
                check_access(msg["ns"], tenant)
            if op != Op.HELLO and not conn.authed:
                raise Unauthorized("send hello with the cluster token first")
            spec = OPS.get(op)  # type: ignore[call-overload]
            if spec is None or Site.UCX not in spec.sites:
                raise BadRequest(f"unknown op {op!r}")
            with (
                telemetry.remote_span(spec.span, msg.get(telemetry.TRACEPARENT_KEY))
                if spec.span is not None
                else contextlib.nullcontext()
            ):
                result = self._dispatch(Op(op), msg, conn)
                if inspect.isawaitable(result):
                    result = await result
            if result is None:
                return  # a get: it replied itself, ahead of its payloads
            await self._reply(conn, {"id": rid, "ok": True, **result})
        except PegaError as e:
            self.metrics.request_failed(op, e.code)
            await self._reply(conn, {"id": rid, "ok": False, "error": e.to_wire()})
        except Exception as e:  # a bug: report it, keep serving
            log.exception("data-plane %s failed", op_label(op))
            self.metrics.request_failed(op, "internal")
            err = {"code": "internal", "message": f"{type(e).__name__}: {e}"}
            await self._reply(conn, {"id": rid, "ok": False, "error": err})
        finally:
            self.metrics.request_done(op, time.perf_counter() - t0)

    def _dispatch(self, op: Op, msg: dict[str, Any], conn: _Conn) -> Any:
        """Run ``op``: the transport's own, or the service's."""
        own = self._ops.get(op)
        if own is None:
            return self.service.call(op, msg, conn.session)
        self.service.check_access(op, conn.session)
        return own(msg, conn)

    def _hello(self, msg: dict[str, Any], conn: _Conn) -> dict[str, Any]:
        if conn.said_hello:
            raise ProtocolError("hello was said already on this connection")
        tenant = self._auth.authenticate(proto.decode_hello(msg))
        self.service.admit(conn.session, tenant)
        conn.authed = conn.said_hello = True
        self._hello_done(conn)
        pool = self.service.pool
        reply: dict[str, Any] = {"node_id": pool.node_id, "version": proto.PROTOCOL_VERSION}
        if self.cfg.local_access and tenant is None:
            dev, ino = pool.file_id
            reply["pool"] = {
                "path": str(pool.path),
                "dev": dev,
                "ino": ino,
                "bytes": pool.capacity,
                "slab": pool.slab_bytes,
            }
            if self._control_path is not None:
                reply["pool"]["control"] = self._control_path
        return reply

    # ---- get and put payloads --------------------------------------------------------

    async def _get(self, msg: dict[str, Any], conn: _Conn) -> None:
        w = self._worker
        assert w is not None
        rid = msg.get("id")
        _, seq, keys, want = proto.decode_get(msg, self.cfg.max_batch)
        # blocks only on the disk tier are read as the sends go: each is sent once its
        # own read is verified and committed, while the later ones are still being read
        get = self.service.open_get(keys, want)
        deadline = Deadline.after(self.cfg.reserve_timeout_s)
        found = get.found
        pool = self.service.pool
        ep = conn.ep
        ok = False
        try:
            # Every index gets a message so that the reader's pre-posted receives all
            # complete: the block, or an empty message for a miss.  A rendezvous send
            # only announces itself (a small RTS), so the reader answers each at once
            # and the payloads then stream back to back.
            reqs = []
            for i in range(len(keys)):
                while (ready := get.waiting(i)) is not None:
                    w.worker.progress()  # what is posted starts moving meanwhile
                    w.kick()
                    try:
                        await asyncio.wait_for(ready, deadline.left())
                    except TimeoutError:
                        raise DeadlineExceeded("a get's disk reads ran past its deadline") from None
                e = found[i]
                reqs.append(w.tag_send(ep, _EMPTY if e is None else pool.view(e), make_tag(seq, i)))
            # the reply goes right behind the announcements, ahead of the payloads not
            # yet sent (the reader has it before the last block lands), then payloads
            # start moving now, not once the loop has come round
            reqs.append(w.am_send(ep, pack({"id": rid, "ok": True, "blocks": get.header})))
            w.worker.progress()
            w.kick()
            await w.wait_all(reqs, deadline)
            ok = True
        except PegaError as e:
            self.metrics.transfer_errors.labels(kind=e.code).inc()
            self._close_conn(conn)
        except BaseException:
            # sends may still read these slots: they die with the connection before
            # the blocks are unpinned
            self._close_conn(conn)
            raise
        finally:
            self.service.close_get(get, ok)

    def _receive(self, conn: _Conn, seq: int, slots: list[tuple[int, Any]]) -> _UcxInflow:
        """Post the receives of reservation ``seq``'s payloads (tag ``(seq, index)``)
        into its slots."""
        w = self._worker
        assert w is not None
        recvs = {i: w.tag_recv(conn.ep, view, make_tag(seq, i)) for i, view in slots}
        w.kick()
        done = asyncio.ensure_future(w.wait_all(list(recvs.values()), self.cfg.reserve_timeout_s))
        return _UcxInflow(self, conn, seq, recvs, done)

    def _drain(self, inflow: _UcxInflow) -> None:
        """Stop the receives of a given-up reservation that no sender has matched yet.

        Closing an endpoint leaves its tag receives posted on the worker (UCX matches
        tags worker-wide), and the Python binding cannot cancel one: a writer that went
        away before sending them would keep their slots quarantined until the node
        restarts.  So the node sends each unfinished receive an empty message of its
        own tag over an endpoint to its own worker: one no sender matched completes at
        once, writing nothing; one a sender matched is not taken by it (that empty
        message stays unexpected, a few bytes, its tag never posted again) and keeps
        its slot quarantined until UCX reports the receive finished.
        """
        w = self._worker
        if w is None:
            return
        open_ = [i for i, r in inflow.recvs.items() if not r.completed]
        if not open_:
            return
        if self._self_ep is None:
            try:
                self._self_ep = self_endpoint(w)
            except Exception:
                log.warning("cannot open an endpoint to the node's own worker", exc_info=True)
                return
        for i in open_:
            w.tag_send(self._self_ep, _EMPTY, make_tag(inflow.seq, i))
        w.kick()
