"""The control protocol: msgpack frames over TCP (or a Unix socket) with request ids,
deadlines, typed errors.

Framing: every frame is a 4-byte big-endian length followed by one msgpack map.

* The client opens with ``{"op": "hello", "version": 1, "token": str | None}``; the
  server answers ``{"ok": True, "version": 1, "server": name}`` or a typed error and
  closes.  A version mismatch or a bad token ends the connection.
* Requests: ``{"id": int, "op": str, "args": map, "deadline_ms": int}``.
* Replies: ``{"id": int, "ok": True, "result": any}`` or
  ``{"id": int, "ok": False, "error": {"code": str, "message": str}}``.

Requests on one connection run concurrently (bounded per connection); replies may come
out of order and are matched by id.  A frame over the size limit gets a ``too_large``
error and the connection is closed (its length prefix cannot be trusted to resync).

Both ends are :class:`asyncio.Protocol` implementations rather than streams: frames are
cut out of one receive buffer without a coroutine per frame, and every reply (or
request) produced in one pass goes out in one ``write``, so a busy connection costs a
few system calls per batch of requests rather than per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import itertools
import logging
import os
import struct
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, cast

from pegaflow.auth import Authenticator, check_access
from pegaflow.deadline import Deadline, Timeout
from pegaflow.errors import (
    BadRequest,
    DeadlineExceeded,
    Internal,
    PegaError,
    ProtocolError,
    TooLarge,
    Unauthorized,
    Unavailable,
    error_from_wire,
)
from pegaflow.wire import PROTOCOL_VERSION, pack, req_int, req_map, req_str, unpack

log = logging.getLogger(__name__)

_LEN = struct.Struct("!I")
UNIX_PREFIX = "unix:"
"""an address ``unix:<path>`` names a Unix socket (see :meth:`RpcServer.start_unix`)"""
DEFAULT_MAX_FRAME = 16 << 20
MAX_DEADLINE_MS = 600_000
HANDSHAKE_TIMEOUT_S = 10.0
_MAX_HELLO = 4096

Handler = Callable[[dict[str, Any]], Awaitable[Any]]
SyncHandler = Callable[[dict[str, Any]], Any]

_SESSION: contextvars.ContextVar[object | None] = contextvars.ContextVar(
    "pegaflow_rpc_session", default=None
)


def current_session() -> object | None:
    """The server connection whose request the running handler serves (None outside
    one): handlers key per-connection state by it; ``RpcServer(on_disconnect=...)``
    says when it ends."""
    return _SESSION.get()


class Packed(bytes):
    """A handler result that is already msgpack: spliced into the reply unchanged, for
    hot paths that encode faster than a generic ``pack`` of the same value would."""

    __slots__ = ()


_REPLY_ID = b"\x83" + pack("id")  # a 3-entry map, then its first key
_REPLY_OK_RESULT = pack("ok") + pack(True) + pack("result")

_PLAIN = frozenset({Packed, dict, list, tuple, str, bytes, int, float, bool, type(None)})


def encode_frame(obj: Any) -> bytes:
    """One length-prefixed msgpack frame."""
    body = pack(obj)
    return _LEN.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader, max_bytes: int) -> Any:
    """Read and decode one frame; raises TooLarge, BadRequest or IncompleteReadError."""
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if n > max_bytes:
        raise TooLarge(f"frame of {n} bytes exceeds the limit of {max_bytes}")
    return unpack(await reader.readexactly(n), max_bytes)


def parse_address(addr: str, default_port: int | None = None) -> tuple[str, int]:
    """``host:port`` (or ``[v6]:port``) into a tuple."""
    host, sep, port = addr.rpartition(":")
    if not sep:
        if default_port is None:
            raise ValueError(f"address {addr!r} has no port")
        return addr, default_port
    return host.strip("[]"), int(port)


class _FrameBuffer:
    """Cuts length-prefixed msgpack frames out of received bytes."""

    __slots__ = ("buf",)

    def __init__(self) -> None:
        self.buf = bytearray()

    def frames(self, limit: Callable[[], int]) -> Any:
        """Yield each complete frame's decoded message; raises TooLarge for a length
        over ``limit()`` and BadRequest for undecodable msgpack (the connection cannot
        be trusted after either).  Consumed bytes are dropped when the caller stops."""
        buf = self.buf
        pos = 0
        try:
            while len(buf) - pos >= 4:
                (n,) = _LEN.unpack_from(buf, pos)
                max_bytes = limit()
                if n > max_bytes:
                    raise TooLarge(f"frame of {n} bytes exceeds the limit of {max_bytes}")
                end = pos + 4 + n
                if len(buf) < end:
                    break
                with memoryview(buf) as mv, mv[pos + 4 : end] as body:
                    msg = unpack(body, max_bytes)
                pos = end
                yield msg
        finally:
            del buf[:pos]


class RpcServer:
    """Serves named handlers over the control protocol.

    Handlers take the request's ``args`` map and return a msgpack-ready result, or raise
    a :class:`PegaError`; anything else becomes ``internal`` and is logged.  ``async``
    handlers run as tasks, under the request's deadline, several at once per
    connection.  Plain (non-async) handlers run inline as the request is read, with no
    task: use them for fast, non-blocking ops such as index lookups.
    """

    def __init__(
        self,
        name: str,
        handlers: dict[str, Handler | SyncHandler],
        *,
        token: str | None = None,
        max_frame: int = DEFAULT_MAX_FRAME,
        max_inflight_per_conn: int = 64,
        on_request: Callable[[str, float, str | None], None] | None = None,
        auth: Authenticator | None = None,
        on_disconnect: Callable[[object], None] | None = None,
    ) -> None:
        self.name = name
        self._auth = auth if auth is not None else Authenticator(token)
        self._handlers = handlers
        self._sync_ops = frozenset(
            op for op, h in handlers.items() if not inspect.iscoroutinefunction(h)
        )
        self._max_frame = max_frame
        self._max_inflight = max(1, max_inflight_per_conn)
        self._on_request = on_request
        self._on_disconnect = on_disconnect
        self._server: asyncio.base_events.Server | None = None
        self._path: str | None = None
        self._conns: set[_ServerConnection] = set()
        self._hello_ok = encode_frame({"ok": True, "version": PROTOCOL_VERSION, "server": name})

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (port 0 picks a free one); returns the bound port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _ServerConnection(self), host, port)
        return self._server.sockets[0].getsockname()[1]

    async def start_unix(self, path: str) -> None:
        """Listen on a Unix socket at ``path`` (replacing a stale one), which only this
        process's user may connect to; clients dial it as ``unix:<path>``."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        loop = asyncio.get_running_loop()
        old = os.umask(0o077)
        try:
            self._server = await loop.create_unix_server(lambda: _ServerConnection(self), path)
        finally:
            os.umask(old)
        self._path = path

    async def close(self) -> None:
        """Stop listening and drop every connection."""
        if self._server is not None:
            self._server.close()
        tasks: list[asyncio.Task[None]] = []
        for conn in list(self._conns):
            tasks += conn.abort()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)
        if self._path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._path)
            self._path = None

    def _check_hello(self, hello: Any) -> str | None:
        """Validate the handshake; returns the connection's tenant (None: all access)."""
        hello = req_map(hello)
        if hello.get("op") != "hello":
            raise ProtocolError("first frame must be hello")
        version = req_int(hello, "version", 0, 1 << 16)
        if version != PROTOCOL_VERSION:
            raise ProtocolError(
                f"protocol version {version} not supported (want {PROTOCOL_VERSION})"
            )
        return self._auth.authenticate(hello.get("token"))

    def _foreign_ns(self, msg: Any, tenant: str) -> bytes | None:
        """The error reply for a request outside ``tenant``'s namespaces, else None."""
        args = msg.get("args") if type(msg) is dict else None
        if type(args) is dict and "ns" in args:
            try:
                check_access(args["ns"], tenant)
            except PegaError as e:
                op = msg.get("op")
                op = op if type(op) is str and op in self._handlers else "?"  # no peer's label
                return self._encode(
                    self._error_reply(msg.get("id"), op, e), op, time.perf_counter()
                )
        return None

    def _parse(self, msg: Any) -> tuple[int, str, Handler | SyncHandler, dict[str, Any], int]:
        if type(msg) is dict:  # the well-formed case, checked without helper calls
            rid, op, args = msg.get("id"), msg.get("op"), msg.get("args", {})
            deadline_ms = msg.get("deadline_ms", 30_000)
            if (
                type(rid) is int
                and 0 <= rid < 2**63
                and type(op) is str
                and type(args) is dict
                and type(deadline_ms) is int
                and 0 < deadline_ms <= MAX_DEADLINE_MS
            ):
                handler = self._handlers.get(op)
                if handler is not None:
                    return rid, op, handler, args, deadline_ms
        msg = req_map(msg)
        rid = req_int(msg, "id", 0, 2**63 - 1)
        op = req_str(msg, "op", 64)
        handler = self._handlers.get(op)
        if handler is None:
            raise BadRequest(f"unknown op {op!r}")
        args = msg.get("args", {})
        if not isinstance(args, dict):
            raise BadRequest("args must be a map")
        deadline_ms = msg.get("deadline_ms", 30_000)
        if (
            not isinstance(deadline_ms, int)
            or isinstance(deadline_ms, bool)
            or not 0 < deadline_ms <= MAX_DEADLINE_MS
        ):
            raise BadRequest(f"deadline_ms must be in (0, {MAX_DEADLINE_MS}]")
        return rid, op, handler, args, deadline_ms

    def _run_sync(self, msg: dict[str, Any]) -> bytes | Coroutine[Any, Any, bytes]:
        """The reply frame of a request for a plain handler (or, when the handler
        returned an awaitable after all, a coroutine making it)."""
        rid = msg.get("id")
        op = "?"
        t0 = time.perf_counter()
        try:
            rid, op, handler, args, _deadline = self._parse(msg)
            result = handler(args)
            if type(result) not in _PLAIN and inspect.isawaitable(result):
                return self._finish(rid, op, result, t0)
            reply: dict[str, Any] = {"id": rid, "ok": True, "result": result}
        except Exception as e:
            reply = self._error_reply(rid, op, e)
        return self._encode(reply, op, t0)

    async def _finish(self, rid: int, op: str, aw: Awaitable[Any], t0: float) -> bytes:
        try:
            reply: dict[str, Any] = {"id": rid, "ok": True, "result": await aw}
        except Exception as e:
            reply = self._error_reply(rid, op, e)
        return self._encode(reply, op, t0)

    async def _run(self, msg: Any) -> bytes:
        """The reply frame of a request for an async handler, under its deadline."""
        rid = msg.get("id") if isinstance(msg, dict) else None
        op = "?"
        t0 = time.perf_counter()
        try:
            rid, op, handler, args, deadline_ms = self._parse(msg)
            try:
                async with asyncio.timeout(deadline_ms / 1000) as cm:
                    result = await handler(args)
            except TimeoutError:
                if not cm.expired():
                    raise
                raise DeadlineExceeded(f"{op} exceeded its {deadline_ms} ms deadline") from None
            reply: dict[str, Any] = {"id": rid, "ok": True, "result": result}
        except Exception as e:
            reply = self._error_reply(rid, op, e)
        return self._encode(reply, op, t0)

    @staticmethod
    def _error_reply(rid: Any, op: str, e: Exception) -> dict[str, Any]:
        if not isinstance(e, PegaError):
            log.exception("handler %s failed", op, exc_info=e)
            e = Internal(f"{type(e).__name__}: {e}")
        if not isinstance(rid, int) or isinstance(rid, bool):
            rid = None
        return {"id": rid, "ok": False, "error": e.to_wire()}

    def _encode(self, reply: dict[str, Any], op: str, t0: float) -> bytes:
        if self._on_request is not None:
            err = reply.get("error")
            self._on_request(op, time.perf_counter() - t0, err["code"] if err else None)
        try:
            result = reply.get("result")
            if type(result) is Packed:
                # {"id": rid, "ok": true, "result": <result>}, spliced (one copy)
                head = _REPLY_ID + pack(reply["id"]) + _REPLY_OK_RESULT
                return b"".join((_LEN.pack(len(head) + len(result)), head, result))
            return encode_frame(reply)
        except (TypeError, ValueError, OverflowError) as e:  # a result msgpack refuses: a bug
            log.error("reply of %s cannot be encoded: %s", op, e)
            return encode_frame(self._error_reply(reply.get("id"), op, e))


class _ServerConnection(asyncio.Protocol):
    """One client connection of an :class:`RpcServer`."""

    def __init__(self, server: RpcServer) -> None:
        self._server = server
        self._frames = _FrameBuffer()
        self._transport: asyncio.Transport | None = None
        self._ready = False
        self._closing = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._out: list[bytes] = []
        self._batching = False
        self._paused_for_tasks = False
        self._paused_for_writes = False
        self._timer: asyncio.TimerHandle | None = None
        self._tenant: str | None = None

    # -- asyncio.Protocol -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        self._server._conns.add(self)
        self._timer = asyncio.get_running_loop().call_later(
            HANDSHAKE_TIMEOUT_S, self._fail, ProtocolError("handshake timed out")
        )

    def data_received(self, data: bytes) -> None:
        self._frames.buf += data
        self._process()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        if self._timer is not None:
            self._timer.cancel()
        for t in self._tasks:
            t.cancel()
        self._server._conns.discard(self)
        if self._ready and self._server._on_disconnect is not None:
            self._server._on_disconnect(self)

    def pause_writing(self) -> None:
        # The client does not read its replies: stop reading its requests.
        self._paused_for_writes = True
        self._update_reading()

    def resume_writing(self) -> None:
        self._paused_for_writes = False
        self._update_reading()

    # -- frames -----------------------------------------------------------------------

    def _limit(self) -> int:
        return self._server._max_frame if self._ready else _MAX_HELLO

    def _process(self) -> None:
        if self._closing:
            return
        server = self._server
        sync_ops = server._sync_ops
        self._batching = True
        frames = self._frames.frames(self._limit)
        session = _SESSION.set(self)  # handlers run inline or as tasks made here
        try:
            for msg in frames:
                if not self._ready:
                    if not self._hello(msg):
                        return
                    continue
                if self._tenant is not None:
                    denied = server._foreign_ns(msg, self._tenant)
                    if denied is not None:
                        self._out.append(denied)
                        continue
                op = msg.get("op") if type(msg) is dict else None
                if type(op) is str and op in sync_ops:
                    reply = server._run_sync(msg)
                    if type(reply) is bytes:
                        self._out.append(reply)
                        continue
                    coro = reply
                else:
                    coro = server._run(msg)
                t = asyncio.get_running_loop().create_task(self._respond(coro))  # type: ignore[arg-type]
                self._tasks.add(t)
                t.add_done_callback(self._task_done)
                if len(self._tasks) >= server._max_inflight:
                    self._paused_for_tasks = True
                    self._update_reading()
                    break
        except PegaError as e:  # unframeable: reply and close
            self._fail(e)
        finally:
            _SESSION.reset(session)
            frames.close()  # drops the consumed bytes
            self._batching = False
            self._flush()

    def _hello(self, msg: Any) -> bool:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        try:
            self._tenant = self._server._check_hello(msg)
        except PegaError as e:
            self._out.append(encode_frame({"ok": False, "error": e.to_wire()}))
            self._close()
            return False
        self._ready = True
        self._out.append(self._server._hello_ok)
        return True

    async def _respond(self, coro: Coroutine[Any, Any, bytes]) -> None:
        frame = await coro
        if not self._closing:
            self._out.append(frame)
            if not self._batching:
                self._flush()

    def _task_done(self, t: asyncio.Task[None]) -> None:
        self._tasks.discard(t)
        if self._paused_for_tasks and len(self._tasks) < self._server._max_inflight:
            self._paused_for_tasks = False
            self._update_reading()
            self._process()  # frames already received while paused

    def _update_reading(self) -> None:
        t = self._transport
        if t is None or self._closing or t.is_closing():
            return
        if self._paused_for_tasks or self._paused_for_writes:
            if t.is_reading():
                t.pause_reading()
        elif not t.is_reading():
            t.resume_reading()

    def _flush(self) -> None:
        if self._out and self._transport is not None and not self._transport.is_closing():
            out = self._out
            self._transport.write(out[0] if len(out) == 1 else b"".join(out))
        self._out.clear()
        if self._closing and self._transport is not None:
            self._transport.close()

    def _fail(self, e: PegaError) -> None:
        self._out.append(encode_frame({"id": None, "ok": False, "error": e.to_wire()}))
        self._close()

    def _close(self) -> None:
        """Close once what is queued has been written."""
        self._closing = True
        if not self._batching:
            self._flush()

    def abort(self) -> list[asyncio.Task[None]]:
        """Drop the connection now; returns its tasks (cancelled)."""
        self._closing = True
        if self._transport is not None:
            self._transport.abort()
        for t in self._tasks:
            t.cancel()
        return list(self._tasks)


class _Expired(Exception):
    """A call's deadline passed (turned into DeadlineExceeded by the caller)."""


class _ClientConnection(asyncio.Protocol):
    """One connection of an :class:`RpcClient`: sends frames, resolves replies by id,
    fails calls whose deadline passed.

    One timer serves all calls: it is armed for the earliest deadline and, when it
    fires, fails what expired and re-arms for the next one, so a call costs two dict
    entries rather than a timer of its own.
    """

    def __init__(self, client: RpcClient, address: str) -> None:
        self._client = client
        self.address = address
        self._loop = asyncio.get_running_loop()
        self._frames = _FrameBuffer()
        self.transport: asyncio.Transport | None = None
        self.pending: dict[int, asyncio.Future[Any]] = {}
        self._deadlines: dict[int, float] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self.hello: asyncio.Future[Any] = self._loop.create_future()
        self._out: list[bytes] = []
        self._flush_scheduled = False
        self.lost = False
        self.last_rx = self._loop.time()
        """when the server last sent anything (loop time)"""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        self.last_rx = self._loop.time()
        self._frames.buf += data
        pending = self.pending
        deadlines = self._deadlines
        frames = self._frames.frames(self._limit)
        try:
            for msg in frames:
                if not self.hello.done():
                    self.hello.set_result(msg)
                    continue
                if type(msg) is not dict:
                    continue
                rid = msg.get("id")
                if type(rid) is not int:
                    if rid is None and not msg.get("ok"):
                        # The server refused a frame it could not take and closes: the
                        # calls in flight get its error rather than a bare "lost".
                        err = error_from_wire(msg.get("error"))
                        for fut in pending.values():
                            if not fut.done():
                                fut.set_exception(err)
                    continue
                fut = pending.pop(rid, None)
                deadlines.pop(rid, None)
                if fut is None or fut.done():
                    continue
                if msg.get("ok"):
                    fut.set_result(msg.get("result"))
                else:
                    fut.set_exception(error_from_wire(msg.get("error")))
        except PegaError as e:
            self.drop(Unavailable(f"bad reply from {self.address}: {e}"))
        finally:
            frames.close()

    def _limit(self) -> int:
        return self._client._max_frame

    def connection_lost(self, exc: Exception | None) -> None:
        why = exc or "closed by the server"
        self._fail_all(Unavailable(f"connection to {self.address} lost: {why}"))

    def request(self, rid: int, frame: bytes, deadline: float) -> asyncio.Future[Any]:
        """Send a request frame; the future gets the reply, or ``_Expired`` at
        ``deadline`` (loop time)."""
        fut = self._loop.create_future()
        self.pending[rid] = fut
        self._deadlines[rid] = deadline
        if self._timer is None or deadline < self._timer_at:
            self._arm(deadline)
        self._out.append(frame)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)
        return fut

    def send(self, frame: bytes) -> None:
        """Queue a frame; frames queued in one loop iteration go out in one write."""
        self._out.append(frame)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def forget(self, rid: int) -> None:
        """Stop waiting for a reply."""
        self.pending.pop(rid, None)
        self._deadlines.pop(rid, None)

    def _arm(self, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_at(at, self._expire)
        self._timer_at = at

    def _expire(self) -> None:
        self._timer = None
        now = self._loop.time()
        nxt = 0.0
        for rid, at in list(self._deadlines.items()):
            if at <= now:
                del self._deadlines[rid]
                fut = self.pending.pop(rid, None)
                if fut is not None and not fut.done():
                    fut.set_exception(_Expired())
            elif not nxt or at < nxt:
                nxt = at
        if nxt:
            self._arm(nxt)

    def _flush(self) -> None:
        self._flush_scheduled = False
        out = self._out
        if out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))
        out.clear()

    def _fail_all(self, err: PegaError) -> None:
        self.lost = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.hello.done():
            self.hello.set_exception(err)
            self.hello.exception()  # retrieved: nobody may be waiting any more
        pending, self.pending = self.pending, {}
        self._deadlines = {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(err)
        self._client._lost(self)

    def drop(self, err: PegaError) -> None:
        """Close the connection; pending calls fail with ``err``."""
        if self.transport is not None:
            self.transport.abort()
        self._fail_all(err)


class RpcClient:
    """A client of one logical service reachable at several addresses (failover).

    Calls go to the current address; when it cannot be reached, the next one is tried
    within the same deadline.  A call never hangs: it returns, or raises a typed
    :class:`PegaError` (``Unavailable`` when no address answers, ``DeadlineExceeded``
    when the deadline passes).
    """

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        token: str | None = None,
        timeout: float = 5.0,
        connect_timeout: float = 1.0,
        max_frame: int = DEFAULT_MAX_FRAME,
    ) -> None:
        if not addresses:
            raise ValueError("RpcClient needs at least one address")
        self.addresses = list(addresses)
        self._token = token
        self.timeout = timeout
        self._connect_timeout = connect_timeout
        self._max_frame = max_frame
        self._ids = itertools.count(1)
        self._current = 0
        self._conn: _ClientConnection | None = None
        self._connecting: asyncio.Lock | None = None

    @property
    def current_address(self) -> str:
        """The address calls go to now."""
        return self.addresses[self._current]

    async def close(self) -> None:
        """Close the connection; pending calls fail with ``Unavailable``."""
        self.close_now()

    def close_now(self) -> None:
        """:meth:`close`, callable outside a coroutine (on the loop's thread)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.drop(Unavailable("client closed"))

    def _move_on_from(self, addr: str) -> None:
        """Make the next address current, unless a concurrent call already moved on."""
        if self.addresses[self._current] == addr:
            self._current = (self._current + 1) % len(self.addresses)

    def _lost(self, conn: _ClientConnection) -> None:
        if self._conn is conn:
            self._conn = None

    async def _open(self, addr: str, timeout: float) -> _ClientConnection:
        loop = asyncio.get_running_loop()
        conn = _ClientConnection(self, addr)
        async with asyncio.timeout(timeout):
            if addr.startswith(UNIX_PREFIX):
                await loop.create_unix_connection(lambda: conn, addr[len(UNIX_PREFIX) :])
            else:
                host, port = parse_address(addr)
                await loop.create_connection(lambda: conn, host, port)
            try:
                hello = {"op": "hello", "version": PROTOCOL_VERSION, "token": self._token}
                conn.send(encode_frame(hello))
                reply = req_map(await conn.hello)
            except BaseException:
                if conn.transport is not None:
                    conn.transport.abort()
                raise
        if not reply.get("ok"):
            conn.drop(Unavailable("handshake refused"))
            raise error_from_wire(reply.get("error"))
        return conn

    async def _connection(self, deadline: Deadline) -> _ClientConnection:
        if self._conn is not None:
            return self._conn
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._conn is not None:
                return self._conn
            errors: list[str] = []
            for i in range(len(self.addresses)):
                idx = (self._current + i) % len(self.addresses)
                remaining = deadline.remaining()
                if remaining <= 0:
                    break
                try:
                    conn = await self._open(
                        self.addresses[idx], min(remaining, self._connect_timeout)
                    )
                except (Unauthorized, ProtocolError):
                    raise
                except (OSError, TimeoutError, PegaError) as e:
                    errors.append(f"{self.addresses[idx]}: {type(e).__name__} {e}")
                    continue
                self._current = idx
                self._conn = conn
                return conn
            raise Unavailable(
                "no service address reachable: " + "; ".join(errors or ["deadline passed"])
            )

    async def call(
        self, op: str, args: dict[str, Any] | None = None, timeout: Timeout = None
    ) -> Any:
        """Run ``op`` remotely within ``timeout`` (default: the client's); fail over to
        another address if the connection breaks."""
        deadline = Deadline.of(timeout, self.timeout)
        loop = asyncio.get_running_loop()
        last: PegaError | None = None
        for _attempt in range(len(self.addresses) + 1):
            conn = self._conn
            if conn is None:
                try:
                    async with asyncio.timeout(deadline.left()):
                        conn = await self._connection(deadline)
                except TimeoutError:
                    break
            remaining = deadline.remaining()
            if remaining <= 0:
                break
            rid = next(self._ids)
            frame = {
                "id": rid,
                "op": op,
                "args": args or {},
                "deadline_ms": max(1, int(remaining * 1000)),
            }
            sent_at = loop.time()
            fut = conn.request(rid, encode_frame(frame), sent_at + remaining)
            try:
                return await fut
            except _Expired:
                addr = self.current_address
                if len(self.addresses) > 1 and conn.last_rx < sent_at and not conn.lost:
                    # not a byte back for a whole deadline: a hung server (a frozen
                    # process, a partition) keeps its connection open; later calls go on
                    # to the next address instead of waiting on it again
                    self._move_on_from(addr)
                    log.warning(
                        "%s: no answer from %s within %.3f s; failing over to %s",
                        op, addr, remaining, self.current_address,
                    )  # fmt: skip
                    conn.drop(Unavailable(f"{addr} sent nothing within a deadline"))
                raise DeadlineExceeded(
                    f"{op} to {addr} got no answer within {remaining:.3f} s"
                ) from None
            except Unavailable as e:
                if not conn.lost:  # the server's own answer
                    raise
                last = e
                self._move_on_from(conn.address)
            except asyncio.CancelledError:
                conn.forget(rid)
                raise
        if last is not None:
            raise last
        raise DeadlineExceeded(f"{op} passed its deadline")
