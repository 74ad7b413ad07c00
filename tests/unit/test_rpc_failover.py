"""RpcClient failover past a blackholed coordinator address (issue 35, defect 5).

A blackhole here is a real one on loopback: a listening TCP socket whose accept queue
is full (``listen(0)`` and a connection that is never accepted), so Linux drops every
further SYN and a connect to it hangs, as to a dead host or across a partition.  It is
put first in the client's address list, ahead of a real in-process coordinator.
"""

from __future__ import annotations

import asyncio
import gc
import select
import socket
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import pytest
from pegaflow.coordinator.index import BlockIndex
from pegaflow.coordinator.service import Coordinator

from pegaflow.config import CoordinatorConfig
from pegaflow.errors import DeadlineExceeded, PegaError, Unavailable
from pegaflow.transport.rpc_client import RpcClient

NS = "failover:bf16:bs16"
LOOKUP = {"ns": NS, "hashes": [bytes(32)], "shards": [0]}
DEADLINE_S = 0.05
"""the lookup deadline of a scheduler asking for hits (tens of milliseconds)"""


class Blackhole:
    """A loopback TCP address that drops SYNs: connects to it hang."""

    def __init__(self) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(0)
        self.port = self.listener.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self.fillers: list[socket.socket] = []
        filler = socket.socket()  # fills the accept queue, never accepted
        filler.setblocking(False)
        filler.connect_ex(("127.0.0.1", self.port))
        self.fillers.append(filler)
        time.sleep(0.02)

    def holds(self, wait: float = 0.3) -> bool:
        """Whether a connect to it really hangs (the kernel drops its SYN)."""
        probe = socket.socket()
        probe.setblocking(False)
        try:
            probe.connect_ex(("127.0.0.1", self.port))
            poller = select.poll()  # not select(): the suite may hold over 1,024 fds
            poller.register(probe, select.POLLOUT)
            return not poller.poll(wait * 1000)
        finally:
            probe.close()

    def close(self) -> None:
        for s in self.fillers:
            s.close()
        self.listener.close()


@contextmanager
def blackhole() -> Iterator[Blackhole]:
    hole = Blackhole()
    try:
        if not hole.holds():
            pytest.skip("this kernel does not drop SYNs to a full accept queue")
        yield hole
    finally:
        hole.close()


@asynccontextmanager
async def coordinator(port: int = 0) -> AsyncIterator[Coordinator]:
    """A real coordinator (control protocol over TCP) with an in-process index, no etcd."""
    coord = Coordinator(
        CoordinatorConfig(host="127.0.0.1", port=port, http_port=-1), index=BlockIndex()
    )
    await coord.start()
    try:
        yield coord
    finally:
        await coord.close()


async def lookups(client: RpcClient, seconds: float) -> tuple[int, int, list[str]]:
    """Lookups one after another, each under :data:`DEADLINE_S`: (succeeded, made,
    errors)."""
    ok = made = 0
    errors: list[str] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        made += 1
        t0 = time.monotonic()
        try:
            assert (await client.call("lookup", LOOKUP, timeout=DEADLINE_S))["hits"] == 0
            ok += 1
        except PegaError as e:
            errors.append(f"{type(e).__name__}: {e}")
        # a call never outlives its deadline by more than a scheduling hiccup
        assert time.monotonic() - t0 < DEADLINE_S + 0.5
        await asyncio.sleep(0.005)  # paced like a scheduler's steps, not a busy loop
    return ok, made, errors


def syn_sent_to(port: int) -> int:
    """How many sockets on this host are connecting (SYN_SENT) to 127.0.0.1:``port``."""
    n = 0
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            if fields[2] == f"0100007F:{port:04X}" and fields[3] == "02":
                n += 1
    return n


@contextmanager
def loop_errors() -> Iterator[list[str]]:
    """What the running loop's exception handler is told (an exception never retrieved,
    a task destroyed while pending) while the block runs."""
    loop = asyncio.get_running_loop()
    seen: list[str] = []
    old = loop.get_exception_handler()
    loop.set_exception_handler(lambda _l, ctx: seen.append(str(ctx.get("message"))))
    try:
        yield seen
    finally:
        loop.set_exception_handler(old)


async def test_a_fresh_client_fails_over_past_a_blackholed_first_coordinator() -> None:
    """Each 50 ms lookup used to spend its deadline connecting to the blackholed first
    address, and the next one started there again: every lookup was lost."""
    with blackhole() as hole:
        async with coordinator() as coord:
            client = RpcClient([hole.address, coord.address])
            try:
                ok, made, errors = await lookups(client, 4.0)
                print(f"lookups succeeded: {ok} of {made} ({ok / made:.1%})")
                assert ok >= 0.9 * made, (ok, made, errors[:5])
                assert client.current_address == coord.address
            finally:
                await client.close()


async def test_fresh_clients_each_answer_their_first_lookup() -> None:
    """The first call of a fresh client races the addresses within its own deadline."""
    with blackhole() as hole:
        async with coordinator() as coord:
            ok = 0
            for _ in range(20):
                client = RpcClient([hole.address, coord.address])
                try:
                    await client.call("lookup", LOOKUP, timeout=0.5)
                    ok += 1
                except PegaError:
                    pass
                finally:
                    await client.close()
            assert ok >= 18, ok


async def test_the_blackholed_address_coming_back_breaks_nothing() -> None:
    """The dead address comes back as a coordinator: calls stay on the live one, and go
    to the returned one once the live one is gone."""
    hole = Blackhole()
    try:
        if not hole.holds():
            pytest.skip("this kernel does not drop SYNs to a full accept queue")
        async with coordinator() as second:
            client = RpcClient([hole.address, second.address])
            try:
                ok, made, _ = await lookups(client, 1.0)
                assert ok >= 0.9 * made, (ok, made)
                hole.close()  # the address comes back, now a real coordinator
                async with coordinator(hole.port) as first:
                    ok, made, _ = await lookups(client, 1.0)
                    assert ok >= 0.9 * made, (ok, made)
                    assert client.current_address == second.address
                    await second.close()  # the live one goes away: on to the first
                    ok, made, errors = await lookups(client, 1.0)
                    assert ok >= 0.9 * made, (ok, made, errors[:5])
                    assert client.current_address == first.address
            finally:
                await client.close()
    finally:
        hole.close()


async def test_close_during_a_background_connect_leaves_nothing_behind() -> None:
    """A connection attempt outlives the call that started it; close() ends it: no
    socket left connecting, no task left pending, no exception left unretrieved, and a
    call waiting on it gets a typed error."""
    with blackhole() as hole, loop_errors() as seen:
        before = syn_sent_to(hole.port)
        client = RpcClient([hole.address], connect_timeout=30)
        with pytest.raises(DeadlineExceeded):
            await client.call("lookup", LOOKUP, timeout=DEADLINE_S)
        assert syn_sent_to(hole.port) == before + 1  # still connecting, for the next call
        waiting = asyncio.ensure_future(client.call("lookup", LOOKUP, timeout=5))
        await asyncio.sleep(0.05)
        await client.close()
        with pytest.raises(Unavailable):
            await waiting
        assert syn_sent_to(hole.port) == before

        client = RpcClient([hole.address], connect_timeout=30)
        with pytest.raises(DeadlineExceeded):
            await client.call("lookup", LOOKUP, timeout=DEADLINE_S)
        client.close_now()  # outside a coroutine's wait: ends on the loop's next turns
        for _ in range(50):
            if syn_sent_to(hole.port) == before:
                break
            await asyncio.sleep(0.01)
        assert syn_sent_to(hole.port) == before
        del client, waiting
        gc.collect()
        await asyncio.sleep(0.05)
        assert not seen, seen


async def test_a_failed_race_is_unavailable_and_leaves_no_error_unretrieved() -> None:
    """Every address dead (one blackholed, one refusing): the background attempt fails
    after the connect timeout with no caller left waiting, and nobody is told of an
    exception never retrieved; a later call raises ``Unavailable``."""
    refused = socket.socket()
    refused.bind(("127.0.0.1", 0))
    dead = f"127.0.0.1:{refused.getsockname()[1]}"
    refused.close()  # nothing listens there: connects are refused
    with blackhole() as hole, loop_errors() as seen:
        client = RpcClient([hole.address, dead], connect_timeout=0.2)
        try:
            with pytest.raises(PegaError):
                await client.call("lookup", LOOKUP, timeout=DEADLINE_S)
            await asyncio.sleep(0.4)  # the attempt at the blackhole times out meanwhile
            gc.collect()
            await asyncio.sleep(0.01)
            assert not seen, seen
            t0 = time.monotonic()
            with pytest.raises(Unavailable):
                await client.call("lookup", LOOKUP, timeout=2)
            assert time.monotonic() - t0 < 2
        finally:
            await client.close()
