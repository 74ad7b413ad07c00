"""Storage-node defects of issue 36, each against a real node process and real UCX
clients: slots of writers that went away, quotas charged by slot, big puts into small
pools, a truncated pool file, disk-tier faults in /health, and slab calcification."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pegaflow.client.data import DataClient

from pegaflow.errors import PegaError, QuotaExceeded
from pegaflow.protocol.codec import pack
from pegaflow.tools.devcluster import Proc, start_node
from tests.support.tenant_node import error_code, raw_conn, sample, scrape, tenant_node
from tests.support.waiting import wait_until

pytestmark = pytest.mark.ucx

MIB = 1 << 20


@pytest.fixture
def shm_dir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="pegaflow-test-", dir="/dev/shm")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def health(http_port: str) -> tuple[int, dict[str, Any]]:
    """The status and body of the node's ``/health``."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def items(n: int, size: int, seed: int) -> list[tuple[bytes, int, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(os.urandom(32), 0, rng.integers(0, 255, size, dtype=np.uint8)) for _ in range(n)]


async def node_stats(addr: str) -> dict[str, Any]:
    raw = await raw_conn(addr, None)
    try:
        return await raw.ask(pack({"op": "stats", "id": 1}))
    finally:
        raw.close()


# ---- 2: slots of a writer that stalled past its expiry and went away ------------------

_WRITER = """
import asyncio, os, sys
import numpy as np
from pegaflow.transport.ucx import UcxWorker, make_tag
from pegaflow.protocol.codec import PROTOCOL_VERSION, pack, unpack

async def main(addr, blocks, sent, size, stall):
    w = UcxWorker()
    host, port = addr.rsplit(":", 1)
    ep = await w.connect(host, int(port), 5)
    async def ask(m):
        r = w.am_recv(ep)
        await w.wait_all([w.am_send(ep, pack(m)), r], 5)
        return unpack(bytes(r.recv_buffer), 1 << 20)
    assert (await ask({"op": "hello", "id": 0, "version": PROTOCOL_VERSION}))["ok"]
    rep = await ask({"op": "reserve", "id": 1, "ns": "defects",
                     "blocks": [[os.urandom(32), 0, size] for _ in range(blocks)]})
    assert rep["ok"], rep
    data = np.ones(size, dtype=np.uint8)
    await w.wait_all([w.tag_send(ep, data, make_tag(rep["seq"], i)) for i in range(sent)], 5)
    print("sent", flush=True)
    await asyncio.sleep(stall)  # past the reservation's expiry; then it goes away
    os._exit(0)

asyncio.run(main(sys.argv[1], *map(int, sys.argv[2:5]), float(sys.argv[5])))
"""


def _stalling_writers(addr: str, n: int) -> None:
    """Run ``n`` writers of :data:`_WRITER` (8 blocks of 1 MiB, 3 sent, a 3 s stall)
    at once, until they all went away."""
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, addr, "8", "3", str(MIB), "3"],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(n)
    ]
    try:
        for w in writers:
            assert w.stdout is not None and w.stdout.readline().strip() == "sent"
        for w in writers:
            assert w.wait(30) == 0
    finally:
        for w in writers:
            w.kill()
            if w.stdout is not None:
                w.stdout.close()


async def test_slots_of_writers_that_stalled_and_went_away_come_back(procs: list[Proc]) -> None:
    """Eight writers each reserve 8 MiB of a 64 MiB pool, send 3 of their 8 blocks,
    stall past their reservation's expiry, then exit: their slots must come back (they
    stayed quarantined until the node restarted, and every later put got NoSpace)."""
    node = start_node("d2", pool="64MiB", slab="4MiB", extra=["--node-reserve-timeout-s", "1"])
    procs.append(node)
    addr = node.ready["ucx"]
    await asyncio.to_thread(_stalling_writers, addr, 8)
    c = DataClient()
    try:

        async def released() -> bool:
            st = await node_stats(addr)
            return st["quarantined_bytes"] == 0 and st["used_bytes"] == 0

        await wait_until(released, "the slots of the writers that went away to come back", 60)
        put = items(32, MIB, 2)  # half the pool
        assert (await c.put(addr, "defects", put, 20)).stored == 32
    finally:
        await c.close()


# ---- 3: quotas charge the slot a block takes, not the bytes asked ---------------------


async def test_quotas_charge_the_slot_not_the_size_asked(procs: list[Proc]) -> None:
    """1-byte blocks take 4 KiB slots: a tenant reserving them is refused at its share of
    the pool's slots, and another tenant keeps storing (before, 4,096 reservations of 1
    byte took the whole 16 MiB pool with no refusal and the others got NoSpace)."""
    node = tenant_node(procs, "d3", pool=16 * MIB)
    addr = node.ready["ucx"]
    acme = await raw_conn(addr, "a-secret")
    globex = DataClient(token="g-secret")
    try:
        refused = 0
        for batch in range(8):  # 8 x 512 slots of 4 KiB = the whole pool
            reply = await acme.ask(
                pack({"op": "reserve", "id": batch, "ns": "acme@m",
                      "blocks": [[os.urandom(32), 0, 1] for _ in range(512)]})
            )  # fmt: skip
            if not reply["ok"]:
                assert error_code(reply) == QuotaExceeded.code
                refused += 1
        assert refused >= 4  # a connection holds at most half the pool's slots
        put = items(8, 256 << 10, 3)
        assert (await globex.put(addr, "globex@m", put, 10)).stored == 8
    finally:
        acme.close()
        await globex.close()


# ---- 6: a put bigger than a connection's share of a small pool ------------------------


async def test_a_put_over_half_a_small_pool_is_stored(procs: list[Proc]) -> None:
    """3 MiB puts into a 4 MiB pool (cluster token): each is stored, evicting the one
    before (every one was refused by the connection quota)."""
    node = start_node("d6", pool="4MiB", slab="4MiB")
    procs.append(node)
    addr = node.ready["ucx"]
    c = DataClient()
    try:
        for seed in range(4):
            assert (await c.put(addr, "defects", items(1, 3 * MIB, seed), 10)).stored == 1
        assert (await node_stats(addr))["evictions"] >= 3
    finally:
        await c.close()


# ---- 5: a truncated pool file ---------------------------------------------------------


async def test_a_truncated_pool_file_gives_misses_and_an_unhealthy_node(
    procs: list[Proc], shm_dir: str
) -> None:
    """Someone truncates the pool file: the next get used to kill the node with SIGBUS.
    Now gets are misses, puts are refused, the node lives and /health says why."""
    node = start_node("d5", pool="16MiB", slab="4MiB", shm_dir=shm_dir)
    procs.append(node)
    addr, http = node.ready["ucx"], node.ready["http"]
    c = DataClient()
    try:
        put = items(8, 256 << 10, 5)
        assert (await c.put(addr, "defects", put, 10)).stored == 8
        assert health(http)[0] == 200
        os.truncate(Path(shm_dir) / "pegaflow-d5.pool", 0)
        out = np.zeros((8, 256 << 10), dtype=np.uint8)
        got = await c.get(addr, "defects", [(h, 0, out[i]) for i, (h, _, _) in enumerate(put)], 5)
        assert got == [False] * 8
        with pytest.raises(PegaError):
            await c.put(addr, "defects", items(1, 256 << 10, 6), 5)
        await asyncio.sleep(0.2)
        assert node.alive(), "the node died"
        status, body = health(http)
        assert status == 503 and "truncated" in body["reason"]
    finally:
        await c.close()


# ---- 10: disk-tier faults in /health; a stop while the pool is prepared ---------------


async def test_disk_tier_faults_show_in_health_and_metrics(
    procs: list[Proc], tmp_path: Path
) -> None:
    """The disk tier's directory deleted under the node: /health stays 200 (the node
    serves from memory) but says the tier is degraded and why; so does the metric."""
    disk = tmp_path / "tier"
    node = start_node(
        "d10", pool="8MiB", slab="1MiB",
        extra=["--node-disk-path", str(disk), "--node-disk-bytes", "8MiB",
               "--node-disk-block-bytes", "256KiB"],
    )  # fmt: skip
    procs.append(node)
    http = node.ready["http"]
    status, body = health(http)
    assert status == 200 and body["disk_degraded"] is False
    shutil.rmtree(disk)
    status, body = health(http)
    assert status == 200 and body["disk_degraded"] is True and "gone" in body["disk_reason"]
    assert sample(scrape(http), "pegaflow_node_disk_degraded") == 1


def test_a_stop_while_the_pool_is_prepared_leaves_no_control_socket(shm_dir: str) -> None:
    """SIGTERM while the node prepares its pool (touching every page): the node exits
    and removes what its start made, the control socket too (it was left behind)."""
    argv = [
        sys.executable, "-m", "pegaflow.storage_node.main", "--node-id", "d10s",
        "--node-ucx-port", "0", "--node-http-port", "0", "--node-pool-bytes", "1GiB",
        "--node-slab-bytes", "16MiB", "--node-shm-dir", shm_dir,
    ]  # fmt: skip
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        pool = Path(shm_dir) / "pegaflow-d10s.pool"
        deadline = time.monotonic() + 60
        while not any(Path(shm_dir).iterdir()) and time.monotonic() < deadline:
            time.sleep(0.002)
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) != 0
    finally:
        p.kill()
    assert not Path(str(pool) + ".sock").exists()
    assert not pool.exists()
