"""Hung peers and late bytes, against real node processes.

A hung peer (SIGSTOP: what a hung host, a partition or a power loss look like from the
other side, whose kernel keeps the TCP connection open) must never freeze the other
side's event loop, and the bytes of a get that gave up must never land in a buffer that
its caller was given back.  ``kill -9`` hides both: the kernel closes the sockets.
Each test runs over UCX's TCP transport and over its default same-host transports
(shared memory, CMA), where the node writes straight into the reader's memory.  The
gets here are zero-copy (UCX receives into the test's buffers), the contract the
connector keeps: reuse a buffer only once ``settled``; ``tests/integration/test_late_bytes.py``
covers the default gets of the public API, which never write a buffer once returned.
"""

from __future__ import annotations

import asyncio
import gc
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest
from pegaflow.client import PegaClient
from pegaflow.client.data import DataClient

from pegaflow.config import ClientConfig, EtcdConfig
from pegaflow.errors import PegaError
from pegaflow.tools.devcluster import REPO, Proc, start_node
from tests.support.cluster import NS
from tests.support.etcd_fixture import CoordinatorFactory
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.etcd, pytest.mark.ucx]

N_BLOCKS = 32
BLOCK = 8 << 20  # 256 MiB a get: it takes long enough to be caught mid-transfer


@pytest.fixture(params=["tcp", "default"])
def tls(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _ucx(tls: str) -> dict[str, str] | None:
    return {"TLS": "tcp"} if tls == "tcp" else None


def _node(node_id: str, tls: str, shm_dir: str) -> Proc:
    env = {"UCX_TLS": "tcp"} if tls == "tcp" else None
    # its transfers time out within the tests: what a node does then is under test
    return start_node(
        node_id,
        pool="320MiB",
        slab="32MiB",
        env=env,
        shm_dir=shm_dir,
        extra=["--node-reserve-timeout-s", "2"],
    )


def _data(seed: int) -> tuple[list[bytes], np.ndarray]:
    rng = np.random.default_rng(seed)
    hashes = [bytes([seed, i]) * 16 for i in range(N_BLOCKS)]
    return hashes, rng.integers(0, 255, size=(N_BLOCKS, BLOCK), dtype=np.uint8)


class _Ticker:
    """A task on the test's loop that counts its ticks: a loop that froze runs none."""

    def __init__(self) -> None:
        self.ticks = 0
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(0.01)
            self.ticks += 1

    def stop(self) -> int:
        self._task.cancel()
        return self.ticks


@pytest.fixture
def nodes(tls: str) -> Iterator[list[Proc]]:
    shm = tempfile.mkdtemp(prefix="pegaflow-test-", dir="/dev/shm")
    procs: list[Proc] = []
    try:
        procs += [_node("hung", tls, shm), _node("well", tls, shm)]
        yield procs
    finally:
        for p in procs:
            if p.alive():
                os.kill(p.pid, signal.SIGCONT)
            p.kill()
        shutil.rmtree(shm, ignore_errors=True)


async def _store(c: DataClient, node: Proc, hashes: list[bytes], data: np.ndarray) -> None:
    items = [(h, 0, data[i]) for i, h in enumerate(hashes)]
    for i in range(0, len(items), 8):  # within a connection's reservation quota
        assert (await c.put(node.ready["ucx"], NS, items[i : i + 8], 60)).stored == 8


async def _settled_then_reusable(
    c: DataClient,
    well: Proc,
    items: list[tuple[bytes, int, np.ndarray]],
    out: np.ndarray,
    data: np.ndarray,
) -> None:
    """Once ``out`` is settled nothing writes it any more, and a get into it works."""
    await wait_until(lambda: c.settled(out), "the failed get's receives finished", 60)
    out[:] = 0
    await asyncio.sleep(0.5)
    assert not out.any(), "bytes landed in a buffer after it was settled"
    assert all(await c.get(well.ready["ucx"], NS, items, 10.0))
    assert np.array_equal(out, data)


async def test_a_hung_node_neither_freezes_the_reader_nor_writes_a_returned_buffer(
    nodes: list[Proc], tls: str
) -> None:
    hung, well = nodes
    c = DataClient(ucx_config=_ucx(tls))
    hashes, data = _data(1)
    try:
        await _store(c, hung, hashes, data)
        await _store(c, well, hashes, data)
        out = np.zeros_like(data)
        items = [(h, 0, out[i]) for i, h in enumerate(hashes)]
        get = asyncio.ensure_future(c.get(hung.ready["ucx"], NS, items, 1.0, zero_copy=True))
        await asyncio.sleep(0.02)
        os.kill(hung.pid, signal.SIGSTOP)
        ticker = _Ticker()
        # the get returns while the node is still stopped, and the loop ran other tasks
        # meanwhile (it used to freeze until the node was resumed: 20 s and more)
        ok = await asyncio.wait_for(get, 10)
        assert ticker.stop() > 0, "nothing else ran on the client's loop during the get"
        if all(ok):
            pytest.skip("the get finished before the node was stopped")
        assert not c.settled(out)
        # while the hung node may still write them, a get into the same buffers is
        # refused, even from a healthy node (it used to verify 32 of 32 blocks, which the
        # hung node then overwrote once it resumed)
        assert not any(await c.get(well.ready["ucx"], NS, items, 5.0, zero_copy=True))
        assert not any(await c.get(well.ready["ucx"], NS, items, 5.0))  # nor a copying get

        os.kill(hung.pid, signal.SIGCONT)
        await _settled_then_reusable(c, well, items, out, data)
        assert c.unsettled_bytes == 0
    finally:
        await c.close()


async def test_a_get_past_its_deadline_leaves_no_late_bytes(nodes: list[Proc], tls: str) -> None:
    """No fault at all: a deadline shorter than the transfer."""
    _, well = nodes
    c = DataClient(ucx_config=_ucx(tls))
    hashes, data = _data(2)
    try:
        await _store(c, well, hashes, data)
        out = np.zeros_like(data)
        items = [(h, 0, out[i]) for i, h in enumerate(hashes)]
        await c.get(well.ready["ucx"], NS, items[:1], 5.0)  # connected: the next one streams
        ok = await c.get(well.ready["ucx"], NS, items, 0.005, zero_copy=True)
        if all(ok):
            pytest.skip("256 MiB arrived within 5 ms")
        await _settled_then_reusable(c, well, items, out, data)
    finally:
        await c.close()


async def test_reconnecting_to_a_hung_node_keeps_a_short_deadline(
    nodes: list[Proc], tls: str
) -> None:
    hung, _ = nodes
    c = DataClient(ucx_config=_ucx(tls))  # its connect timeout is 2 s
    try:
        os.kill(hung.pid, signal.SIGSTOP)
        out = np.zeros((1, 4096), dtype=np.uint8)
        # within its own deadline (it used to take the 2 s connect timeout), and a miss
        get = c.get(hung.ready["ucx"], NS, [(b"x" * 32, 0, out[0])], 0.3)
        assert await asyncio.wait_for(get, 1.5) == [False]
    finally:
        await c.close()


_HUNG_READER = """
import asyncio, sys
import numpy as np
from pegaflow.client.data import DataClient

async def main() -> None:
    addr, tls = sys.argv[1], sys.argv[2]
    c = DataClient(ucx_config={{"TLS": "tcp"}} if tls == "tcp" else None)
    out = np.zeros(({n}, {size}), dtype=np.uint8)
    items = [(bytes([1, i]) * 16, 0, out[i]) for i in range({n})]
    print("reading", flush=True)
    while True:
        await c.get(addr, "{ns}", items, 30.0)

asyncio.run(main())
"""


async def test_a_hung_reader_does_not_stop_the_node_serving_others(
    nodes: list[Proc], tls: str
) -> None:
    _, well = nodes
    c = DataClient(ucx_config=_ucx(tls))
    hashes, data = _data(1)
    reader: subprocess.Popen[str] | None = None
    try:
        await _store(c, well, hashes, data)
        reader = _start_reader(well.ready["ucx"], tls)
        await asyncio.sleep(1.0)
        os.kill(reader.pid, signal.SIGSTOP)  # hung in the middle of its gets
        out = np.zeros((4, BLOCK), dtype=np.uint8)
        items = [(h, 0, out[i]) for i, h in enumerate(hashes[:4])]
        health = f"http://127.0.0.1:{well.ready['http']}/health"
        # the node used to stop answering everyone about 2 s after its reader hung
        for _ in range(12):
            assert all(await c.get(well.ready["ucx"], NS, items, 5.0))
            assert np.array_equal(out, data[:4])
            out[:] = 0
            status = await asyncio.to_thread(_http_status, health)
            assert status == 200
            await asyncio.sleep(0.5)
    finally:
        if reader is not None:
            reader.kill()
            reader.wait()
        await c.close()


def _start_reader(addr: str, tls: str) -> subprocess.Popen[str]:
    """A process reading the node's blocks over and over (to be hung by SIGSTOP)."""
    code = _HUNG_READER.format(n=N_BLOCKS, size=BLOCK, ns=NS)
    env = {**os.environ, "UCX_TLS": "tcp"} if tls == "tcp" else None
    reader = subprocess.Popen(
        [sys.executable, "-c", code, addr, tls],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert reader.stdout is not None and reader.stdout.readline().strip() == "reading"
    return reader


def _http_status(url: str) -> int:
    with urllib.request.urlopen(url, timeout=5) as r:
        return int(r.status)


async def test_a_failed_put_leaves_no_unretrieved_exception(nodes: list[Proc], tls: str) -> None:
    hung, _ = nodes
    c = DataClient(ucx_config=_ucx(tls))
    loop = asyncio.get_running_loop()
    seen: list[str] = []
    old = loop.get_exception_handler()
    loop.set_exception_handler(lambda _l, ctx: seen.append(str(ctx.get("message"))))
    hashes, data = _data(3)
    try:
        await c.put(hung.ready["ucx"], NS, [(hashes[0], 0, data[0])], 10)  # connected
        items = [(h + b"p", 0, data[i]) for i, h in enumerate(hashes[:8])]
        put = asyncio.ensure_future(c.put(hung.ready["ucx"], NS, items, 1.0))
        await asyncio.sleep(0.01)
        os.kill(hung.pid, signal.SIGSTOP)  # the node hangs mid-put: the put fails
        with pytest.raises(PegaError):  # a typed failure, not a bare TimeoutError
            await put
        os.kill(hung.pid, signal.SIGCONT)
        await asyncio.sleep(1.0)
        gc.collect()
        await asyncio.sleep(0.1)
        assert not [m for m in seen if "never retrieved" in m], seen
    finally:
        loop.set_exception_handler(old)
        await c.close()


async def test_a_hung_coordinator_is_failed_over(
    etcd_config: EtcdConfig, coordinators: CoordinatorFactory
) -> None:
    """A frozen coordinator keeps its TCP connection open: a call past its deadline with
    nothing heard from it moves the client on to the next one (it used to wait on the
    frozen one call after call, for as long as it stayed frozen)."""
    first = await coordinators.start(etcd_config)
    second = await coordinators.start(etcd_config)
    c = PegaClient(ClientConfig(coordinators=[first.address, second.address], lookup_timeout_s=0.5))
    try:
        assert (await c.lookup(NS, [b"h" * 32])).hits == 0  # connected to the first
        os.kill(first.pid, signal.SIGSTOP)
        with pytest.raises(PegaError):
            await c.lookup(NS, [b"h" * 32])  # the one call that finds it frozen
        for _ in range(5):
            assert (await c.lookup(NS, [b"h" * 32])).hits == 0
    finally:
        os.kill(first.pid, signal.SIGCONT)
        await c.close()
