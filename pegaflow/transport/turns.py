"""Fair turns on the event loop for the connections of an RPC server.

Once some connection has more work than a slice, tenants take turns of that long,
round-robin, and each tenant's connections share its turns (:class:`Turns`,
:class:`Queue`; measured in :mod:`pegaflow.transport.rpc_server`'s docstring).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Protocol


class Waiter(Protocol):
    """A connection with requests waiting for a turn."""

    tenant: str | None
    """whose turns it shares (None: cluster-wide access)"""

    def take_turn(self, until: float) -> bool:
        """Serve what was received until ``until`` (``time.perf_counter``); whether the
        connection is still busy after it."""
        ...


class Queue:
    """One tenant's connections waiting for a turn: those that had nothing waiting
    (``fresh``: most often one small request) and those still busy after a turn (or as
    long, inline) take the tenant's turns alternately.  A fresh turn serves fresh
    connections in their order of arrival, as many as it has time for; a busy turn,
    one busy connection.  So a small request waits for at most one busy connection's
    turn, however many are busy, and busy ones get at least every other turn."""

    __slots__ = ("busy", "fresh", "fresh_next")

    def __init__(self) -> None:
        self.fresh: deque[Waiter] = deque()
        self.busy: deque[Waiter] = deque()
        self.fresh_next = True

    def __bool__(self) -> bool:
        return bool(self.fresh or self.busy)

    def turn(self, until: float) -> None:
        """The tenant's turn, until ``until`` (``time.perf_counter``); the queue must
        not be empty."""
        line = self.fresh if self.fresh and (self.fresh_next or not self.busy) else self.busy
        self.fresh_next = line is self.busy
        while True:
            conn = line.popleft()
            if conn.take_turn(until):
                self.busy.append(conn)
            if line is self.busy or not line or time.perf_counter() >= until:
                return


class Turns:
    """Event-loop time for connections with requests waiting, shared fairly: tenants take
    turns round-robin (the connections with cluster-wide access count as one tenant), and
    each tenant's connections share its turns (:class:`Queue`).

    A connection runs what it has received at once unless its tenant has connections
    waiting; when that runs past ``slice_s`` it waits for a turn too.  A turn is one
    loop callback of about ``slice_s``, and the loop reads sockets between two, so a
    request of a tenant with nothing waiting is served after at most the turn in
    progress, and one of a tenant with connections waiting after at most two turns of
    each tenant waiting.
    """

    def __init__(self, slice_s: float) -> None:
        self.slice_s = slice_s
        self.waiting: dict[str | None, Queue] = {}
        """tenant -> its connections waiting for a turn"""
        self._ring: deque[str | None] = deque()  # the tenants in waiting, in turn order
        self._handle: asyncio.Handle | None = None

    def wait(self, conn: Waiter, busy: bool) -> None:
        """Give ``conn`` a turn; ``busy``: it has just run for a turn's time."""
        queue = self.waiting.get(conn.tenant)
        if queue is None:
            queue = self.waiting[conn.tenant] = Queue()
            self._ring.append(conn.tenant)
        (queue.busy if busy else queue.fresh).append(conn)
        if self._handle is None:
            self._handle = asyncio.get_running_loop().call_soon(self._turn)

    def _turn(self) -> None:
        tenant = self._ring.popleft()
        queue = self.waiting[tenant]
        try:
            queue.turn(time.perf_counter() + self.slice_s)
        finally:
            if queue:
                self._ring.append(tenant)
            else:
                del self.waiting[tenant]
            self._handle = asyncio.get_running_loop().call_soon(self._turn) if self._ring else None

    def close(self) -> None:
        """Give no more turns."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
