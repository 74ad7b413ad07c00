"""A client's node session against a real ``pegaflow-server``: one node's ops, the
same-host ones straight over the node's control socket."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
from pegaflow.client import SyncPegaClient
from pegaflow.client.data import DataClient
from pegaflow.client.session import NodeSession

from pegaflow.config import ClientConfig
from pegaflow.deadline import Deadline
from pegaflow.errors import Unavailable
from pegaflow.tools.devcluster import Proc, start_server

pytestmark = pytest.mark.ucx

NS = "test-session"


@pytest.fixture(scope="module")
def server() -> Iterator[Proc]:
    p = start_server(
        token="admin", extra=["--node-pool-bytes", "32MiB", "--node-slab-bytes", "4MiB"]
    )
    try:
        yield p
    finally:
        p.terminate()


def _client(server: Proc) -> SyncPegaClient:
    return SyncPegaClient(ClientConfig(coordinators=[server.ready["coordinator"]]), token="admin")


def _pool_id(session: object) -> tuple[int, int]:
    """The (device, inode) of the session's node's pool file (a local reservation's)."""
    pool = session.pool_file(5.0)  # type: ignore[attr-defined]
    assert pool is not None
    return pool.file_id


async def _no_ucx(deadline: Deadline) -> str:
    raise AssertionError("the session asked for the node's UCX address")


async def test_a_session_given_the_pool_file_needs_no_ucx_hello(server: Proc) -> None:
    node = server.ready["node"]
    c = _client(server)
    try:
        pool = c.local_pool(node)  # what the search for this host's node learns
    finally:
        c.close()
    assert pool is not None and pool.control
    data = DataClient(token="admin")
    s = NodeSession(node, data, _no_ucx, token="admin", pool=pool)
    try:
        hashes = [os.urandom(16) for _ in range(3)]
        seq, offsets = await s.reserve_local(NS, [(h, 0, 4096) for h in hashes], pool.file_id, 5.0)
        assert None not in offsets
        taken: list[bool] = []
        out = await s.commit_local(seq, [True] * 3, 5.0, on_taken=lambda: taken.append(True))
        assert out.stored == 3 and taken == [True]
        pin, where = await s.locate(NS, hashes, 0, 5.0, 5.0)
        assert where.found.all() and (where.column("offset") == offsets).all()
        await s.unpin(pin, 5.0)
        await s.report_lookups(1, 3, 3, 5.0)
        assert await s.pool_file(5.0) is pool
        assert s.over_socket
        assert not data._conns  # no UCX connection, no hello
    finally:
        s.close()
        await data.close()


def test_the_socket_outlives_the_ucx_connection(server: Proc) -> None:
    node = server.ready["node"]
    c = _client(server)
    try:
        assert [n.record.node_id for n in c.local_nodes()] == [node]
        session = c.node_session(node)
        h = os.urandom(16)
        seq, _ = session.reserve_local(NS, [(h, 0, 4096)], _pool_id(session), 5.0)
        assert session.commit_local(seq, [True], 5.0).stored == 1
        assert session.over_socket  # the search told the session where the socket is

        async def cut(a: object) -> None:  # a get that failed mid-transfer, say
            for conn in list(a._data._conns.values()):  # type: ignore[attr-defined]
                a._data._drop(conn, Unavailable("cut by the test"))  # type: ignore[attr-defined]

        c._on_loop(cut, 5.0)
        pin, where = session.locate(NS, [h], 0, 5.0, 5.0)
        assert where.found.all() and session.over_socket
        session.submit_unpin(pin, 5.0).result(5.0)
        assert not c._on_loop(lambda a: _conns(a), 5.0)  # still no new UCX connection
    finally:
        c.close()


async def _conns(a: object) -> dict[str, object]:
    return dict(a._data._conns)  # type: ignore[attr-defined]


def test_locate_here_asks_from_the_calling_thread(server: Proc) -> None:
    """``locate_here`` answers as ``locate`` does, over a blocking socket of its own to
    the node's control socket, and goes through the loop when that socket fails."""
    node = server.ready["node"]
    c = _client(server)
    try:
        c.local_nodes()  # the search for this host's node gives the session its socket
        session = c.node_session(node)
        h = os.urandom(16)
        seq, _ = session.reserve_local(NS, [(h, 0, 4096)], _pool_id(session), 5.0)
        assert session.commit_local(seq, [True], 5.0).stored == 1
        pin, where = c.locate_here(NS, node, [h, os.urandom(16)], 0, 5.0, 5.0)
        assert where.found.tolist() == [True, False]
        here = session._here.client
        assert here is not None and here.address.startswith("unix:")
        session.submit_unpin(pin, 5.0).result(5.0)

        def gone(*_a: object) -> None:  # as if the socket went away
            raise Unavailable("connection refused")

        here.call = gone  # type: ignore[method-assign]
        pin, where = session.locate_here(NS, [h], 0, 5.0, 5.0)
        assert where.found.all() and session._here.client is None  # answered through the loop
        session.submit_unpin(pin, 5.0).result(5.0)
    finally:
        c.close()


def test_lookup_here_asks_the_coordinator_from_the_calling_thread(server: Proc) -> None:
    """``lookup_here`` answers as ``lookup`` does, over a blocking connection of its own
    to the coordinator, and goes through the loop when that connection fails."""
    node = server.ready["node"]
    c = _client(server)
    try:
        h = os.urandom(16)
        c.put_blocks(NS, [(h, 0, bytes(4096))], node)
        hashes = [h, os.urandom(16)]
        deadline = time.monotonic() + 60
        while c.lookup(NS, hashes, timeout=5.0).hits < 1:  # published asynchronously
            assert time.monotonic() < deadline
            time.sleep(0.05)
        got = c.lookup_here(NS, hashes, (0,), 5.0, generations=True)
        want = c.lookup(NS, hashes, (0,), 5.0, generations=True)
        assert (got.hits, got.blocks, got.generations) == (want.hits, want.blocks, want.generations)
        here = c._lookup_here.client
        assert here is not None and here.address == server.ready["coordinator"]

        def gone(*_a: object) -> None:  # as if that coordinator went away
            raise Unavailable("connection refused")

        here.call = gone  # type: ignore[method-assign]
        assert c.lookup_here(NS, hashes, (0,), 5.0).hits == 1  # answered through the loop
        assert c.lookup_here(NS, [], (0,), 5.0).hits == 0
    finally:
        c.close()
