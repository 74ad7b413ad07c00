"""The control protocol's server (wire format: :mod:`~pegaflow.protocol.framing`).

Named handlers, run inline or as tasks under each request's deadline, several at once per
connection, with the handshake, tenant checks and back-pressure.

The event loop is shared fairly (:mod:`~pegaflow.transport.turns`): once some connection
has more work than ``slice_s``, tenants take turns of that long, round-robin, and each
tenant's connections share its turns.  Before, plain handlers ran as each request was read: a
client keeping four 65,536-block lookups in flight made 33 to 36 of 40 of another
tenant's 50 ms lookups fail, and 16 such clients 35 to 39 (0 now;
``tests/integration/test_lookup_fairness.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import logging
import os
import ssl
import time
from collections.abc import Awaitable, Callable, Coroutine, Generator
from types import GeneratorType
from typing import Any, cast

from pegaflow.auth import Authenticator, check_access
from pegaflow.errors import (
    BadRequest,
    DeadlineExceeded,
    Internal,
    PegaError,
    ProtocolError,
)
from pegaflow.protocol.codec import PROTOCOL_VERSION, pack, req_int, req_map, req_str
from pegaflow.protocol.framing import (
    DEFAULT_MAX_FRAME,
    FRAME_HEADER,
    MAX_DEADLINE_MS,
    FrameBuffer,
    encode_frame,
)
from pegaflow.transport.turns import Turns

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 10.0
LINGER_S = 2.0
"""After its last reply to a connection it closes, how long the server reads and drops
what the client still sends: a client still writing to a closed socket gets EPIPE, and
an asyncio stream then drops what it had received, the error reply it was sent too."""
_MAX_HELLO = 4096
SLICE_S = 0.002
"""Default of ``RpcServer(slice_s=...)``."""

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


def current_tenant() -> str | None:
    """The tenant of the connection whose request the running handler serves (None:
    cluster-wide access, an open service, or outside a request)."""
    session = _SESSION.get()
    return session.tenant if isinstance(session, _ServerConnection) else None


class Packed(bytes):
    """A handler result that is already msgpack: spliced into the reply unchanged, for
    hot paths that encode faster than a generic ``pack`` of the same value would."""

    __slots__ = ()


_REPLY_ID = b"\x83" + pack("id")  # a 3-entry map, then its first key
_REPLY_OK_RESULT = pack("ok") + pack(True) + pack("result")

_PLAIN = frozenset({Packed, dict, list, tuple, str, bytes, int, float, bool, type(None)})


class RpcServer:
    """Serves named handlers over the control protocol.

    Handlers take the request's ``args`` map and return a msgpack-ready result, or raise
    a :class:`PegaError`; anything else becomes ``internal`` and is logged.  ``async``
    handlers run as tasks, under the request's deadline, several at once per
    connection.  Plain (non-async) handlers run inline as the request is read, with no
    task: use them for fast, non-blocking ops such as index lookups.  A plain handler
    with much work to do returns a generator instead: it is run a step (one ``next``)
    at a time, in its connection's turns, and what it returns is the result.

    ``slice_s``: how long a turn on the event loop lasts (:class:`Turns`); a request
    that runs past it is not cut short, but a turn ends after the step of a generator
    that does.

    ``tls``: the TCP port speaks TLS with this context (:func:`pegaflow.tls.server_context`);
    the Unix socket stays plain.
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
        slice_s: float = SLICE_S,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.name = name
        self._tls = tls
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
        self._turns = Turns(slice_s)
        self._hello_ok = encode_frame({"ok": True, "version": PROTOCOL_VERSION, "server": name})

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (port 0 picks a free one); returns the bound port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _ServerConnection(self), host, port, ssl=self._tls,
            ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S if self._tls else None,
        )  # fmt: skip
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
        self._turns.close()
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

    def _run_sync(
        self, msg: dict[str, Any]
    ) -> bytes | Coroutine[Any, Any, bytes] | Generator[None, None, bytes]:
        """The reply frame of a request for a plain handler (or, when the handler
        returned an awaitable after all, a coroutine making it; when it returned a
        generator, a generator making it)."""
        rid = msg.get("id")
        op = "?"
        t0 = time.perf_counter()
        try:
            rid, op, handler, args, _deadline = self._parse(msg)
            result = handler(args)
            if type(result) not in _PLAIN:
                if type(result) is GeneratorType:
                    return self._run_steps(rid, op, result, t0)
                if inspect.isawaitable(result):
                    return self._finish(rid, op, result, t0)
            reply: dict[str, Any] = {"id": rid, "ok": True, "result": result}
        except Exception as e:
            reply = self._error_reply(rid, op, e)
        return self._encode(reply, op, t0)

    def _run_steps(
        self, rid: int, op: str, steps: Generator[None, None, Any], t0: float
    ) -> Generator[None, None, bytes]:
        try:
            reply: dict[str, Any] = {"id": rid, "ok": True, "result": (yield from steps)}
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
                return b"".join((FRAME_HEADER.pack(len(head) + len(result)), head, result))
            return encode_frame(reply)
        except (TypeError, ValueError, OverflowError) as e:  # a result msgpack refuses: a bug
            log.error("reply of %s cannot be encoded: %s", op, e)
            return encode_frame(self._error_reply(reply.get("id"), op, e))


class _ServerConnection(asyncio.Protocol):
    """One client connection of an :class:`RpcServer`."""

    def __init__(self, server: RpcServer) -> None:
        self._server = server
        self._frames = FrameBuffer()
        self._transport: asyncio.Transport | None = None
        self._ready = False
        self._closing = False
        self._lingering = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._out: list[bytes] = []
        self._batching = False
        self._paused_for_tasks = False
        self._paused_for_writes = False
        self._waiting = False  # for a turn (see Turns)
        self._steps: Generator[None, None, bytes] | None = None  # a request being run
        self._timer: asyncio.TimerHandle | None = None
        self.tenant: str | None = None

    # -- asyncio.Protocol -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        self._server._conns.add(self)
        self._timer = asyncio.get_running_loop().call_later(
            HANDSHAKE_TIMEOUT_S, self._fail, ProtocolError("handshake timed out")
        )

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return  # lingering (see LINGER_S): dropped
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
        """Serve what was received now, or wait for a turn (see :class:`Turns`)."""
        if self._closing:
            return
        if self._waiting:
            self._update_reading()
            return
        turns = self._server._turns
        if turns.waiting and self.tenant in turns.waiting:
            if not self._frame_ready():
                return  # nothing to run yet
            busy = False
        elif self._serve(time.perf_counter() + turns.slice_s):
            busy = True
        else:
            return
        self._waiting = True
        self._update_reading()
        turns.wait(self, busy)

    def take_turn(self, until: float) -> bool:
        """Serve until ``until`` (``time.perf_counter``); whether it needs another turn."""
        self._waiting = self._serve(until)
        self._update_reading()
        return self._waiting

    def _serve(self, until: float) -> bool:
        """Run the requests received, until ``until`` has passed; whether it stopped
        there, with work left."""
        if self._closing:
            return False
        server = self._server
        sync_ops = server._sync_ops
        self._batching = True
        frames = self._frames.frames(self._limit)
        session = _SESSION.set(self)  # handlers run inline or as tasks made here
        try:
            if self._steps is not None and self._step(until):
                return True
            for msg in frames:
                if not self._ready:
                    if not self._hello(msg):
                        return False
                    continue
                if self.tenant is not None:
                    denied = server._foreign_ns(msg, self.tenant)
                    if denied is not None:
                        self._out.append(denied)
                        continue
                op = msg.get("op") if type(msg) is dict else None
                if type(op) is str and op in sync_ops:
                    reply = server._run_sync(msg)
                    if type(reply) is bytes:
                        self._out.append(reply)
                        if time.perf_counter() >= until:
                            return True
                        continue
                    if type(reply) is GeneratorType:
                        self._steps = reply
                        if time.perf_counter() >= until or self._step(until):
                            return True
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
        return False

    def _step(self, until: float) -> bool:
        """Run the request in progress step by step until it ends or ``until`` has
        passed; whether it goes on."""
        steps = self._steps
        assert steps is not None
        try:
            while True:
                next(steps)
                if time.perf_counter() >= until:
                    return True
        except StopIteration as end:
            self._steps = None
            self._out.append(end.value)
            return False

    def _hello(self, msg: Any) -> bool:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        try:
            self.tenant = self._server._check_hello(msg)
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

    def _frame_ready(self) -> bool:
        """Whether a whole request (or a header past the size limit) has been received."""
        buf = self._frames.buf
        if len(buf) < FRAME_HEADER.size:
            return False
        (n,) = FRAME_HEADER.unpack_from(buf)
        return len(buf) - FRAME_HEADER.size >= n or n > self._limit()

    def _update_reading(self) -> None:
        t = self._transport
        if t is None or self._closing or t.is_closing():
            return
        # waiting for a turn, it reads on until it has a request to run in it
        if (
            self._paused_for_tasks
            or self._paused_for_writes
            or (self._waiting and self._frame_ready())
        ):
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
            self._linger(self._transport)

    def _linger(self, t: asyncio.Transport) -> None:
        """Close after the replies queued: send EOF, then drop what the client still sends
        until its own EOF or :data:`LINGER_S`, so that its writes do not fail before it
        has read the replies."""
        if t.is_closing() or self._lingering:
            return
        self._lingering = True
        if not t.can_write_eof():
            t.close()
            return
        t.write_eof()
        if not t.is_reading():
            t.resume_reading()
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(LINGER_S, t.close)

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
