"""The control protocol: msgpack frames over TCP with request ids, deadlines, typed errors.

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
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import inspect
import itertools
import logging
import struct
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

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
DEFAULT_MAX_FRAME = 16 << 20
MAX_DEADLINE_MS = 600_000

Handler = Callable[[dict[str, Any]], Awaitable[Any]]
SyncHandler = Callable[[dict[str, Any]], Any]
_WRITE_HIGH_WATER = 4 << 20


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


class RpcServer:
    """Serves named handlers over the control protocol.

    Handlers take the request's ``args`` map and return a msgpack-ready result, or raise
    a :class:`PegaError`; anything else becomes ``internal`` and is logged.  ``async``
    handlers run as tasks, under the request's deadline, several at once per
    connection.  Plain (non-async) handlers run inline in the connection's read loop,
    with no task: use them for fast, non-blocking ops such as index lookups.
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
    ) -> None:
        self.name = name
        self._handlers = handlers
        self._sync_ops = frozenset(
            op for op, h in handlers.items() if not inspect.iscoroutinefunction(h)
        )
        self._token = token
        self._max_frame = max_frame
        self._max_inflight = max_inflight_per_conn
        self._on_request = on_request
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (port 0 picks a free one); returns the bound port."""
        self._server = await asyncio.start_server(self._serve_conn, host, port)
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        """Stop listening and drop every connection."""
        if self._server is not None:
            self._server.close()
        for t in list(self._conns):
            t.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _handshake(self, reader: asyncio.StreamReader) -> None:
        hello = req_map(await asyncio.wait_for(read_frame(reader, 4096), 10))
        if hello.get("op") != "hello":
            raise ProtocolError("first frame must be hello")
        version = req_int(hello, "version", 0, 1 << 16)
        if version != PROTOCOL_VERSION:
            raise ProtocolError(
                f"protocol version {version} not supported (want {PROTOCOL_VERSION})"
            )
        if self._token is not None:
            got = hello.get("token")
            if not isinstance(got, str) or not hmac.compare_digest(got, self._token):
                raise Unauthorized("missing or wrong token")

    async def _serve_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        inflight: set[asyncio.Task[None]] = set()
        sem = asyncio.Semaphore(self._max_inflight)
        sync_ops = self._sync_ops
        transport = writer.transport
        try:
            try:
                await self._handshake(reader)
            except (PegaError, TimeoutError) as e:
                err = e if isinstance(e, PegaError) else ProtocolError("handshake timed out")
                writer.write(encode_frame({"ok": False, "error": err.to_wire()}))
                return
            hello = {"ok": True, "version": PROTOCOL_VERSION, "server": self.name}
            writer.write(encode_frame(hello))
            while True:
                try:
                    msg = await read_frame(reader, self._max_frame)
                except PegaError as e:  # unframeable: reply and close
                    writer.write(encode_frame({"id": None, "ok": False, "error": e.to_wire()}))
                    return
                op = msg.get("op") if type(msg) is dict else None
                coro: Coroutine[Any, Any, None] | None
                if type(op) is str and op in sync_ops:
                    coro = self._run_sync(msg, writer)
                else:
                    coro = self._run(msg, writer)
                if coro is not None:
                    await sem.acquire()
                    t = asyncio.create_task(coro)
                    inflight.add(t)
                    t.add_done_callback(inflight.discard)
                    t.add_done_callback(lambda _t: sem.release())
                if transport.get_write_buffer_size() > _WRITE_HIGH_WATER:
                    await writer.drain()  # a client that does not read its replies
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except asyncio.CancelledError:
            pass
        finally:
            for t in inflight:
                t.cancel()
            self._conns.discard(task)
            writer.close()

    def _parse(self, msg: Any) -> tuple[int, str, Handler | SyncHandler, dict[str, Any], int]:
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
        self, msg: dict[str, Any], writer: asyncio.StreamWriter
    ) -> Coroutine[Any, Any, None] | None:
        rid = msg.get("id")
        op = "?"
        t0 = time.perf_counter()
        try:
            rid, op, handler, args, _deadline = self._parse(msg)
            result = handler(args)
            if inspect.isawaitable(result):  # a plain function that returned a coroutine
                return self._finish_async(rid, op, result, t0, writer)
            reply: dict[str, Any] = {"id": rid, "ok": True, "result": result}
        except Exception as e:
            reply = self._error_reply(rid, op, e)
        self._send(writer, reply, op, t0)
        return None

    async def _finish_async(
        self, rid: int, op: str, aw: Awaitable[Any], t0: float, writer: asyncio.StreamWriter
    ) -> None:
        try:
            reply: dict[str, Any] = {"id": rid, "ok": True, "result": await aw}
        except Exception as e:
            reply = self._error_reply(rid, op, e)
        self._send(writer, reply, op, t0)

    async def _run(self, msg: Any, writer: asyncio.StreamWriter) -> None:
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
        self._send(writer, reply, op, t0)

    @staticmethod
    def _error_reply(rid: Any, op: str, e: Exception) -> dict[str, Any]:
        if not isinstance(e, PegaError):
            log.exception("handler %s failed", op, exc_info=e)
            e = Internal(f"{type(e).__name__}: {e}")
        return {"id": rid, "ok": False, "error": e.to_wire()}

    def _send(
        self, writer: asyncio.StreamWriter, reply: dict[str, Any], op: str, t0: float
    ) -> None:
        if self._on_request is not None:
            err = reply.get("error")
            self._on_request(op, time.perf_counter() - t0, err["code"] if err else None)
        if writer.is_closing():
            return
        try:
            frame = encode_frame(reply)
        except (TypeError, ValueError, OverflowError) as e:  # result not msgpack-able: a bug
            log.error("reply of %s cannot be encoded: %s", op, e)
            frame = encode_frame(self._error_reply(reply.get("id"), op, e))
        writer.write(frame)


@dataclass
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    reader_task: asyncio.Task[None]
    pending: dict[int, asyncio.Future[Any]]


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
        self._conn: _Conn | None = None
        self._connecting: asyncio.Lock | None = None

    @property
    def current_address(self) -> str:
        """The address calls go to now."""
        return self.addresses[self._current]

    async def close(self) -> None:
        """Close the connection; pending calls fail with ``Unavailable``."""
        conn, self._conn = self._conn, None
        if conn is not None:
            self._drop(conn, Unavailable("client closed"))

    def _drop(self, conn: _Conn, err: PegaError) -> None:
        conn.reader_task.cancel()
        conn.writer.close()
        for fut in conn.pending.values():
            if not fut.done():
                fut.set_exception(err)
        conn.pending.clear()
        if self._conn is conn:
            self._conn = None

    async def _open(self, addr: str, timeout: float) -> _Conn:
        host, port = parse_address(addr)
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        try:
            writer.write(
                encode_frame({"op": "hello", "version": PROTOCOL_VERSION, "token": self._token})
            )
            reply = req_map(await asyncio.wait_for(read_frame(reader, 65536), timeout))
        except BaseException:
            writer.close()
            raise
        if not reply.get("ok"):
            writer.close()
            raise error_from_wire(reply.get("error"))
        conn = _Conn(reader, writer, None, {})  # type: ignore[arg-type]
        conn.reader_task = asyncio.create_task(self._read_loop(conn))
        return conn

    async def _read_loop(self, conn: _Conn) -> None:
        err: PegaError = Unavailable("connection closed by server")
        try:
            while True:
                msg = await read_frame(conn.reader, self._max_frame)
                if not isinstance(msg, dict):
                    continue
                fut = conn.pending.pop(msg.get("id"), None)  # type: ignore[arg-type]
                if fut is None or fut.done():
                    continue
                if msg.get("ok"):
                    fut.set_result(msg.get("result"))
                else:
                    fut.set_exception(error_from_wire(msg.get("error")))
        except asyncio.CancelledError:
            return
        except (asyncio.IncompleteReadError, ConnectionError, OSError, PegaError) as e:
            err = Unavailable(f"connection to {self.current_address} lost: {e}")
        self._drop(conn, err)

    async def _connection(self, deadline: float) -> _Conn:
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
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    conn = await self._open(
                        self.addresses[idx], min(remaining, self._connect_timeout)
                    )
                except (Unauthorized, ProtocolError):
                    raise
                except (OSError, TimeoutError, PegaError, asyncio.IncompleteReadError) as e:
                    errors.append(f"{self.addresses[idx]}: {type(e).__name__} {e}")
                    continue
                self._current = idx
                self._conn = conn
                return conn
            raise Unavailable(
                "no service address reachable: " + "; ".join(errors or ["deadline passed"])
            )

    async def call(
        self, op: str, args: dict[str, Any] | None = None, timeout: float | None = None
    ) -> Any:
        """Run ``op`` remotely; fail over to another address once if the connection breaks."""
        budget = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + budget
        last: PegaError | None = None
        for _attempt in range(len(self.addresses) + 1):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                conn = await self._connection(deadline)
            except TimeoutError:
                break
            rid = next(self._ids)
            fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            conn.pending[rid] = fut
            frame = {
                "id": rid,
                "op": op,
                "args": args or {},
                "deadline_ms": max(1, int(remaining * 1000)),
            }
            try:
                conn.writer.write(encode_frame(frame))
                return await asyncio.wait_for(fut, remaining)
            except TimeoutError:
                conn.pending.pop(rid, None)
                raise DeadlineExceeded(
                    f"{op} to {self.current_address} exceeded {budget:.3f} s"
                ) from None
            except Unavailable as e:
                last = e
                self._current = (self._current + 1) % len(self.addresses)
                continue
            except (ConnectionError, OSError) as e:
                last = Unavailable(str(e))
                self._drop(conn, last)
                self._current = (self._current + 1) % len(self.addresses)
                continue
        if last is not None:
            raise last
        raise DeadlineExceeded(f"{op} exceeded {budget:.3f} s")
