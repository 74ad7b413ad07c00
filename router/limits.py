"""The router's own resource bounds: request bodies held at once, client connections
served at once, and the 503 a connection past them gets (see :mod:`pegaflow.router.server`)."""

from __future__ import annotations

import asyncio
import resource
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import cast

FD_RESERVE = 64
"""file descriptors kept out of ``max_connections``' default (log, replicas' probes,
the coordinator, the tokenizer's files)"""
BUSY_LINGER_S = 0.5
"""how long a refused connection waits for its request head (see :class:`Busy`)"""
BUSY_LINGERING = FD_RESERVE // 2
"""refused connections waiting for their head at most"""


class ByteBudget:
    """At most ``capacity`` bytes held at once; :meth:`hold` waits its turn (FIFO).  A
    request over the whole capacity holds all of it (it runs alone)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.used = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    @asynccontextmanager
    async def hold(self, n: int) -> AsyncIterator[None]:
        """Hold ``n`` bytes for the body of the ``async with``."""
        n = min(max(0, n), self.capacity)
        if not self._waiters and self.used + n <= self.capacity:
            self.used += n
        else:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            entry = (n, fut)
            self._waiters.append(entry)
            try:
                await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():
                    self._release(n)  # granted, then cancelled
                else:
                    self._waiters.remove(entry)
                    self._release(0)
                raise
        try:
            yield
        finally:
            self._release(n)

    def _release(self, n: int) -> None:
        self.used -= n
        while self._waiters and self.used + self._waiters[0][0] <= self.capacity:
            m, fut = self._waiters.popleft()
            if not fut.done():
                self.used += m
                fut.set_result(None)


def connection_limit(configured: int) -> int:
    """Client connections served at once: ``configured``, or (0) from the file
    descriptor limit, raised to its hard limit first: half of it less ``FD_RESERVE``
    (each proxied request holds a client and an upstream descriptor)."""
    if configured > 0:
        return configured
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(8, (soft - FD_RESERVE) // 2)


class Busy(asyncio.Protocol):
    """A connection past ``max_connections``: once its request head is in (or after
    ``BUSY_LINGER_S``), a 503 with ``Connection: close`` and the end of our side; what
    the client sends is read and dropped (so it reads the 503 rather than a reset), and
    the connection closed when it closes or ``BUSY_LINGER_S`` later.  Past
    ``BUSY_LINGERING`` of them at once, the 503 goes out and the connection closes at
    once (their descriptors come out of ``FD_RESERVE``)."""

    def __init__(self, answer: bytes, lingering: list[int]) -> None:
        self._answer = answer
        self._lingering = lingering  # [count], shared by every Busy of one router
        self._transport: asyncio.Transport | None = None
        self._tail = b""
        self._answered = False
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, base: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, base)  # uvloop's is not a subclass
        if self._lingering[0] >= BUSY_LINGERING:
            transport.write(self._answer)
            transport.close()
            return
        self._lingering[0] += 1
        self._transport = transport
        self._timer = asyncio.get_running_loop().call_later(BUSY_LINGER_S, self._step)

    def data_received(self, data: bytes) -> None:
        if not self._answered:
            self._tail = (self._tail + data)[-(len(data) + 4) :]
            if b"\r\n\r\n" in self._tail:
                self._step()

    def eof_received(self) -> bool:
        self._step()
        return False  # closes the transport

    def _step(self) -> None:
        """Answer (head in, or the wait over); the second time, close."""
        t = self._transport
        if t is None or t.is_closing():
            return
        if self._answered:
            t.close()
            return
        self._answered = True
        t.write(self._answer)
        if t.can_write_eof():
            t.write_eof()
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(BUSY_LINGER_S, self._step)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._transport is not None:
            self._lingering[0] -= 1
            self._transport = None
        if self._timer is not None:
            self._timer.cancel()
