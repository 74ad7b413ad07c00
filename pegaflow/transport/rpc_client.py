"""The control protocol's client on an event loop (wire format: :mod:`~pegaflow.protocol.framing`).

:class:`RpcClient` runs on an event loop: one connection per service, shared by
concurrent calls matched by request id, each under a deadline, failing over between the
service's addresses (:class:`~pegaflow.transport.rpc_blocking.BlockingRpcClient` is the
blocking one, for a calling thread with no loop).

How :class:`RpcClient` connects: a connection attempt outlives the call that started it
(later calls wait on the same one), addresses are raced in a staggered way (the next
address is tried alongside once the last one failed or stayed silent for
:data:`CONNECT_STAGGER_S`, or a quarter of the caller's deadline if that is less; the
first to answer the hello wins, the others are closed), each attempt bounded by the
client's connect timeout, and an address that failed or was overtaken is tried last for
:data:`BACKOFF_S`.  Why: a lookup has a deadline of tens of milliseconds, and an address
whose packets are dropped (a dead host, a partition) never refuses a connection: trying
the addresses one after another within each call's deadline, starting at the same dead
one every time, lost every lookup of a fresh client whose first address was dead.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import ssl
from collections.abc import Sequence
from typing import Any, cast

from pegaflow.deadline import Deadline, Timeout
from pegaflow.errors import (
    DeadlineExceeded,
    PegaError,
    ProtocolError,
    Unauthorized,
    Unavailable,
    error_from_wire,
)
from pegaflow.protocol.codec import PROTOCOL_VERSION, req_map
from pegaflow.protocol.framing import (
    DEFAULT_MAX_FRAME,
    UNIX_PREFIX,
    FrameBuffer,
    encode_frame,
    parse_address,
)
from pegaflow.tls import NOT_ANSWERED

log = logging.getLogger(__name__)

CONNECT_STAGGER_S = 0.05
"""How long a connection attempt runs alone before the next address is tried alongside
it (a quarter of the deadline of the call that started it, if that is less)."""

BACKOFF_S = 10.0
"""How long an address whose connection attempt failed, timed out or was overtaken by
another address's is tried after the others."""


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
        self._frames = FrameBuffer()
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


def _discard(task: asyncio.Task[_ClientConnection]) -> None:
    """Close what an abandoned connection attempt opened; retrieve its error."""
    if task.cancelled():
        return
    if task.exception() is None:
        task.result().drop(Unavailable("connection attempt abandoned"))


class RpcClient:
    """A client of one logical service reachable at several addresses (failover).

    Calls go to the current connection; while there is none, one connection attempt runs
    in the background, shared by the calls that wait for it and outliving them, racing
    the addresses in a staggered way (see the module's docstring) and remembering those
    that failed.  A call never hangs: it returns, or raises a typed :class:`PegaError`
    (``Unavailable`` when no address answers, ``DeadlineExceeded`` when the deadline
    passes; ``Unauthorized`` and ``ProtocolError`` from a hello at once).

    ``tls``: TCP addresses are dialled over TLS with this context
    (:func:`pegaflow.tls.client_context`); a handshake that fails (a certificate not
    signed by its CA, a name it does not carry) is an ``Unavailable`` naming the cause.
    """

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        token: str | None = None,
        timeout: float = 5.0,
        connect_timeout: float = 1.0,
        max_frame: int = DEFAULT_MAX_FRAME,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        if not addresses:
            raise ValueError("RpcClient needs at least one address")
        self.addresses = list(addresses)
        self._token = token
        self._tls = tls
        self.timeout = timeout
        self._connect_timeout = connect_timeout
        self._max_frame = max_frame
        self._ids = itertools.count(1)
        self._current = 0
        self._conn: _ClientConnection | None = None
        self._connecting: asyncio.Task[_ClientConnection] | None = None
        """the connection attempt under way (see :meth:`_race`), if any"""
        self._attempts: set[asyncio.Task[_ClientConnection]] = set()
        """the attempts of :meth:`_race` to open one address, until each is done"""
        self._backoff: dict[str, float] = {}
        """address -> loop time until which it is tried after the others"""

    @property
    def current_address(self) -> str:
        """The address calls go to now."""
        return self.addresses[self._current]

    async def close(self) -> None:
        """Close the connection and stop connecting; pending calls fail with
        ``Unavailable``.  Returns once no connection attempt is left running."""
        tasks = [t for t in (self._connecting, *self._attempts) if t is not None]
        self.close_now()
        if tasks:
            await asyncio.wait(tasks)

    def close_now(self) -> None:
        """:meth:`close`, callable outside a coroutine (on the loop's thread): attempts
        under way are cancelled (they end on the loop's next turns, closing anything they
        opened)."""
        race, self._connecting = self._connecting, None
        for task in (race, *self._attempts):
            if task is not None:
                task.cancel()
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.drop(Unavailable("client closed"))

    def _move_on_from(self, addr: str) -> None:
        """Make the next address current, unless a concurrent call already moved on."""
        if self.addresses[self._current] == addr:
            self._current = (self._current + 1) % len(self.addresses)

    def _back_off(self, addr: str) -> None:
        """Try ``addr`` after the others for :data:`BACKOFF_S`."""
        self._backoff[addr] = asyncio.get_running_loop().time() + BACKOFF_S

    def _order(self) -> list[int]:
        """The addresses' indexes in the order to try them: from the current one round,
        those backed off last."""
        n = len(self.addresses)
        now = asyncio.get_running_loop().time()
        ring = [(self._current + i) % n for i in range(n)]
        return sorted(ring, key=lambda i: self._backoff.get(self.addresses[i], 0.0) > now)

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
                await loop.create_connection(lambda: conn, host, port, ssl=self._tls)
            try:
                hello = {"op": "hello", "version": PROTOCOL_VERSION, "token": self._token}
                conn.send(encode_frame(hello))
                try:
                    reply = req_map(await conn.hello)
                except Unavailable:
                    if self._tls is not None:
                        raise
                    raise Unavailable(f"{addr} {NOT_ANSWERED}") from None
            except BaseException:
                if conn.transport is not None:
                    conn.transport.abort()
                raise
        if not reply.get("ok"):
            conn.drop(Unavailable("handshake refused"))
            raise error_from_wire(reply.get("error"))
        return conn

    async def _connection(self, deadline: Deadline) -> _ClientConnection:
        """The connection, waiting (within the caller's own timeout) for the attempt
        under way or starting one; the attempt goes on when the caller gives up."""
        if self._conn is not None:
            return self._conn
        race = self._connecting
        if race is None:
            stagger = min(CONNECT_STAGGER_S, deadline.remaining() / 4)
            race = self._connecting = asyncio.ensure_future(self._race(stagger))
            race.add_done_callback(self._raced)
        try:
            return await asyncio.shield(race)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if race.cancelled() and (task is None or not task.cancelling()):
                raise Unavailable("client closed") from None  # close(), not our caller
            raise

    def _raced(self, race: asyncio.Task[_ClientConnection]) -> None:
        if self._connecting is race:
            self._connecting = None
        if not race.cancelled():
            race.exception()  # retrieved: its callers may all have given up

    def _attempt(self, idx: int) -> asyncio.Task[_ClientConnection]:
        """Start opening address ``idx`` (bounded by the connect timeout)."""
        task = asyncio.ensure_future(self._open(self.addresses[idx], self._connect_timeout))
        self._attempts.add(task)
        task.add_done_callback(self._attempts.discard)
        return task

    async def _race(self, stagger: float) -> _ClientConnection:
        """Connect to the first address that answers the hello: one attempt at a time in
        :meth:`_order`, the next one started when the last failed or ran ``stagger``
        seconds; attempts still running when one wins are cancelled.  An address that
        failed or was overtaken is backed off.  Raises ``Unavailable`` when every address
        failed, ``Unauthorized`` or ``ProtocolError`` as soon as one answers so."""
        order = self._order()
        attempts: dict[asyncio.Task[_ClientConnection], int] = {}
        errors: list[str] = []
        started = 0
        try:
            while True:
                if started < len(order):
                    idx = order[started]
                    started += 1
                    attempts[self._attempt(idx)] = idx
                if not attempts:
                    raise Unavailable("no service address reachable: " + "; ".join(errors))
                wait = stagger if started < len(order) else None
                done, _ = await asyncio.wait(
                    attempts, timeout=wait, return_when=asyncio.FIRST_COMPLETED
                )
                won: tuple[int, _ClientConnection] | None = None
                for task in sorted(done, key=lambda t: order.index(attempts[t])):
                    addr = self.addresses[attempts[task]]
                    if task.cancelled():  # by close_now(), which cancels this race too
                        attempts.pop(task)
                        continue
                    exc = task.exception()
                    if isinstance(exc, Unauthorized | ProtocolError) and won is None:
                        raise exc
                    idx = attempts.pop(task)
                    if exc is None:
                        conn = task.result()
                        if won is None and not conn.lost:
                            won = (idx, conn)
                        else:
                            conn.drop(Unavailable(f"another address than {addr} answered"))
                        continue
                    if not isinstance(exc, OSError | TimeoutError | PegaError):
                        raise exc
                    errors.append(f"{addr}: {type(exc).__name__} {exc}")
                    self._back_off(addr)
                if won is not None:
                    idx, conn = won
                    for other in attempts.values():  # overtaken: slower than the winner
                        self._back_off(self.addresses[other])
                    self._backoff.pop(conn.address, None)
                    self._current = idx
                    self._conn = conn
                    return conn
        finally:
            for task in attempts:  # the losers: cancelled, closed if they connected
                task.cancel()
                task.add_done_callback(_discard)

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
                addr = conn.address
                if len(self.addresses) > 1 and conn.last_rx < sent_at and not conn.lost:
                    # not a byte back for a whole deadline: a hung server (a frozen
                    # process, a partition) keeps its connection open; later calls go on
                    # to the next address instead of waiting on it again
                    self._move_on_from(addr)
                    self._back_off(addr)
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
