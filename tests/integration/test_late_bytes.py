"""Late bytes through the public client API, against real node and coordinator processes.

UCX cannot cancel a receive that matched its sender, and closing the endpoint does not
stop its bytes: the payloads of a get that gave up may land long after it returned
(as soon as a hung node resumes; at once over shared memory).  A caller of
:meth:`PegaClient.get_blocks` (asyncio or blocking) that got its answer owns its
buffers again: each case below gives a get up (a deadline shorter than its transfer,
or its node hung by SIGSTOP and resumed after the get returned), then watches the
caller's buffer for :data:`WATCH_S`: no byte may change, and every block reported
fetched must be the stored one.  (The zero-copy contract that the connector keeps,
``settled()``, is in ``tests/integration/test_hung_peers.py``.)
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from pegaflow.client import PegaClient, SyncPegaClient
from pegaflow.client.landing import Fetched

from pegaflow.config import ClientConfig
from pegaflow.errors import Unavailable
from pegaflow.tools.devcluster import Proc, start_coordinator, start_node
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.etcd, pytest.mark.ucx]

NS = "late-bytes"
N_BLOCKS = 32
BLOCK = 8 << 20  # 256 MiB a get: it takes long enough to be caught mid-transfer
WATCH_S = 2.0
"""how long the caller's buffer is watched after the get returned"""


@pytest.fixture(scope="module", params=["tcp", "default"])
def cluster(request: pytest.FixtureRequest, etcd_server: Any) -> Iterator[tuple[Proc, Proc]]:
    """A coordinator and node ``n1`` (UCX over TCP only, or its default transports)."""
    env = {"UCX_TLS": "tcp"} if request.param == "tcp" else None
    shm = tempfile.mkdtemp(prefix="pegaflow-test-", dir="/dev/shm")
    prefix = f"/pegaflow/late-bytes-{os.getpid()}-{time.monotonic_ns()}"
    procs: list[Proc] = []
    try:
        procs.append(start_coordinator(etcd=etcd_server.endpoint, prefix=prefix))
        node = start_node(
            "n1", etcd=etcd_server.endpoint, prefix=prefix, pool="320MiB", slab="32MiB",
            env=env, shm_dir=shm, extra=["--node-reserve-timeout-s", "2"],
        )  # fmt: skip
        procs.append(node)
        yield procs[0], procs[1]
    finally:
        for p in procs:
            if p.alive():
                os.kill(p.pid, signal.SIGCONT)
            p.kill()
        shutil.rmtree(shm, ignore_errors=True)


def _config(coord: Proc) -> ClientConfig:
    return ClientConfig(coordinators=[coord.ready["address"]], lookup_timeout_s=2.0)


def _data() -> tuple[list[bytes], np.ndarray]:
    rng = np.random.default_rng(36)
    hashes = [bytes([36, i]) * 16 for i in range(N_BLOCKS)]
    return hashes, rng.integers(0, 255, size=(N_BLOCKS, BLOCK), dtype=np.uint8)


async def _stored(c: PegaClient) -> tuple[list[bytes], np.ndarray]:
    """The test's blocks, stored on n1 and found by a lookup."""
    hashes, data = _data()
    await wait_until(lambda: _has_node(c), "n1 in the cluster", 60)
    for i in range(0, N_BLOCKS, 8):  # within a connection's reservation quota
        items = [(h, 0, data[i + j]) for j, h in enumerate(hashes[i : i + 8])]
        out = await c.put_blocks(NS, items, node_id="n1", timeout=60)
        assert out.stored + out.skipped == 8
    await wait_until(lambda: _hits(c, hashes), "the blocks in the index", 60)
    return hashes, data


async def _has_node(c: PegaClient) -> bool:
    return "n1" in await c.nodes()


async def _hits(c: PegaClient, hashes: list[bytes]) -> bool:
    return (await c.lookup(NS, hashes)).hits == len(hashes)


def _late_bytes(out: np.ndarray, seen: np.ndarray) -> int:
    """Bytes of ``out`` that differ from ``seen`` (what it held when the get returned)."""
    return sum(int(np.count_nonzero(out[i] != seen[i])) for i in range(len(out)))


def _check(out: np.ndarray, seen: np.ndarray, ok: list[bool], data: np.ndarray) -> None:
    late = _late_bytes(out, seen)
    assert late == 0, f"{late} bytes ({late / (1 << 20):.1f} MiB) written after the get returned"
    for i, g in enumerate(ok):
        if g:
            assert np.array_equal(out[i], data[i]), f"block {i} reported fetched, other bytes"


@pytest.mark.parametrize("fault", ["deadline", "hung"])
async def test_a_get_given_up_never_writes_its_callers_buffer_afterwards(
    cluster: tuple[Proc, Proc], fault: str
) -> None:
    coord, node = cluster
    c = PegaClient(_config(coord))
    try:
        hashes, data = await _stored(c)
        out = np.zeros_like(data)
        items = [("n1", h, 0, out[i]) for i, h in enumerate(hashes)]
        assert await c.get_blocks(NS, items[:1], timeout=10.0) == [True]  # connected
        out[0] = 0
        if fault == "deadline":
            ok = await c.get_blocks(NS, items, timeout=0.005)
        else:
            get = asyncio.ensure_future(c.get_blocks(NS, items, timeout=1.0))
            await asyncio.sleep(0.02)
            os.kill(node.pid, signal.SIGSTOP)
            ok = await asyncio.wait_for(get, 10)
        seen = out.copy()
        os.kill(node.pid, signal.SIGCONT)
        if all(ok):
            pytest.skip("the get finished before it was given up")
        await asyncio.sleep(WATCH_S)  # the client's loop runs: UCX progresses meanwhile
        _check(out, seen, ok, data)
        # what the given-up receives held is reused once they finished: bytes stay exact
        await wait_until(lambda: c._data.unsettled_bytes == 0, "the receives finished", 60)
        await wait_until(lambda: not c.health.is_down("n1"), "n1 answering again", 60)
        out[:] = 0
        assert all(await c.get_blocks(NS, items, timeout=30.0))
        assert np.array_equal(out, data)
    finally:
        os.kill(node.pid, signal.SIGCONT)
        await c.close()


@pytest.mark.parametrize(
    ("via", "fault"), [("client", "deadline"), ("client", "hung"), ("session", "deadline")]
)
def test_a_blocking_get_given_up_never_writes_its_callers_buffer_afterwards(
    cluster: tuple[Proc, Proc], via: str, fault: str
) -> None:
    coord, node = cluster
    c = SyncPegaClient(_config(coord))
    try:
        hashes, data = c._on_loop(_stored, 120)
        out = np.zeros_like(data)
        items = [("n1", h, 0, out[i]) for i, h in enumerate(hashes)]
        assert c.get_blocks(NS, items[:1], timeout=10.0) == [True]  # connected
        out[0] = 0
        if via == "session":  # the blocking NodeSession.get
            ok = c.node_session("n1").get(NS, [it[1:] for it in items], timeout=0.005)
        elif fault == "deadline":
            ok = c.get_blocks(NS, items, timeout=0.005)
        else:
            fut = c.submit_get_blocks(NS, items, timeout=1.0)
            time.sleep(0.02)
            os.kill(node.pid, signal.SIGSTOP)
            ok = fut.result(10)
        seen = out.copy()
        os.kill(node.pid, signal.SIGCONT)
        if all(ok):
            pytest.skip("the get finished before it was given up")
        time.sleep(WATCH_S)  # the client's loop thread progresses UCX meanwhile
        _check(out, seen, ok, data)
    finally:
        os.kill(node.pid, signal.SIGCONT)
        c.close()


# ---- a blocking caller's buffers are written on its side, or never ---------------------


@pytest.fixture
def held_fetch() -> Iterator[tuple[SyncPegaClient, threading.Event]]:
    """A blocking client whose gets verify their one block only once the event is set (a
    wedged loop, a slow node), in a landing buffer of 7s; no network."""
    c = SyncPegaClient(ClientConfig(coordinators=["127.0.0.1:9"]))
    go = threading.Event()

    async def fetch(ns: str, items: Any, *args: Any, **kwargs: Any) -> Fetched:
        await asyncio.to_thread(go.wait, 10)
        return Fetched([True], [(np.frombuffer(items[0][3], np.uint8), np.full(64, 7, np.uint8))])

    c._client._fetch_blocks = fetch  # type: ignore[method-assign]
    try:
        yield c, go
    finally:
        go.set()
        c.close()


def test_a_blocking_get_given_up_is_never_delivered(
    held_fetch: tuple[SyncPegaClient, threading.Event],
) -> None:
    c, go = held_fetch
    out = np.zeros(64, np.uint8)
    with pytest.raises(Unavailable):  # its loop did not answer in time
        c.get_blocks(NS, [("n1", b"h" * 32, 0, out)], timeout=0.01)
    cancelled = np.zeros(64, np.uint8)
    fut = c.submit_get_blocks(NS, [("n1", b"h" * 32, 0, cancelled)], timeout=5.0)
    assert fut.cancel()
    go.set()
    time.sleep(0.3)
    assert not out.any() and not cancelled.any()


def test_a_blocking_get_delivers_on_the_callers_side(
    held_fetch: tuple[SyncPegaClient, threading.Event],
) -> None:
    c, go = held_fetch
    out = np.zeros(64, np.uint8)
    fut = c.submit_get_blocks(NS, [("n1", b"h" * 32, 0, out)], timeout=5.0)
    go.set()
    assert fut.result(5) == [True] and (out == 7).all()
    assert not fut.cancel()  # delivered: too late to give it up
    out[:] = 0
    assert c.get_blocks(NS, [("n1", b"h" * 32, 0, out)], timeout=5.0) == [True]
    assert (out == 7).all()
