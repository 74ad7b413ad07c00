"""``pegaflow-server``'s default pool: sized for the host, printed at start, and PegaFlow's
own ``--pool-size`` spelling accepted."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from pegaflow.client.api import PegaClient

from pegaflow.config import ClientConfig
from pegaflow.server import AUTO_POOL_CAP, HostMemory, _aliases, auto_pool_bytes
from pegaflow.tools.devcluster import REPO, Proc, start_server
from tests.support.journal import tmpfs
from tests.support.waiting import wait_until

pytestmark = pytest.mark.ucx

GiB = 1 << 30
SLAB = 64 << 20
NS = "server-restart"


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    d = tempfile.mkdtemp(prefix="pegaflow-test-", dir="/dev/shm")
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def test_a_gpu_host_gets_the_cap() -> None:
    host = HostMemory(mem_total=2048 * GiB, mem_available=1900 * GiB, shm_total=1024 * GiB,
                      shm_free=1000 * GiB)  # fmt: skip
    size, why = auto_pool_bytes(host, SLAB)
    assert size == AUTO_POOL_CAP == 64 * GiB
    assert "25% of 2048.0 GiB memory" in why and "64.0 GiB" in why


def test_smaller_hosts_get_a_share_in_whole_slabs() -> None:
    host = HostMemory(mem_total=30 * GiB, mem_available=28 * GiB, shm_total=16 * GiB,
                      shm_free=16 * GiB)  # fmt: skip
    assert auto_pool_bytes(host, SLAB)[0] == 7 * GiB + 512 * (1 << 20)  # 25% of 30 GiB
    host = HostMemory(mem_total=64 * GiB, mem_available=60 * GiB, shm_total=8 * GiB,
                      shm_free=8 * GiB)  # fmt: skip
    assert auto_pool_bytes(host, SLAB)[0] == 4 * GiB  # half of shm_dir


def test_never_more_than_half_of_what_is_there_now() -> None:
    host = HostMemory(mem_total=64 * GiB, mem_available=6 * GiB, shm_total=32 * GiB,
                      shm_free=30 * GiB)  # fmt: skip
    size, why = auto_pool_bytes(host, SLAB)
    assert size == 3 * GiB and "cut to half of what is available now" in why
    docker = HostMemory(mem_total=64 * GiB, mem_available=60 * GiB, shm_total=64 << 20,
                        shm_free=64 << 20)  # fmt: skip
    assert auto_pool_bytes(docker, SLAB)[0] == 0  # not one slab: the server says so and exits
    assert auto_pool_bytes(docker, 16 << 20)[0] == 32 << 20


def test_pool_size_is_an_alias_of_the_pool_option() -> None:
    assert _aliases(["--pool-size", "40gb", "-x"]) == ["--node-pool-bytes", "40gb", "-x"]
    assert _aliases(["--pool-size=auto"]) == ["--node-pool-bytes", "0"]
    assert _aliases(["--node-pool-bytes", "AUTO"]) == ["--node-pool-bytes", "0"]
    assert _aliases(["--node-slab-bytes", "4MiB"]) == ["--node-slab-bytes", "4MiB"]
    assert _aliases(["--fresh-pool", "-x"]) == ["--node-fresh-pool", "true", "-x"]


def test_the_server_takes_pool_size_and_prints_its_capacity() -> None:
    p = start_server(extra=["--pool-size", "48MiB", "--node-slab-bytes", "4MiB"])
    try:
        assert p.ready["pool"] == str(48 << 20)
        assert any("pool of 48 MiB (given)" in line for line in p.log), p.log
    finally:
        p.terminate()


# ---- the server's pool across its restarts, and a pool that does not fit (#14) --------


def blocks(n: int, size: int = 12288) -> tuple[list[bytes], np.ndarray]:
    rng = np.random.default_rng(n)
    return [os.urandom(32) for _ in range(n)], rng.integers(0, 255, (n, size), dtype=np.uint8)


def server(shm: Path, *extra: str) -> Proc:
    return start_server(
        extra=["--node-id", "s1", "--node-shm-dir", str(shm), "--pool-size", "32MiB",
               "--node-slab-bytes", "4MiB", *extra]
    )  # fmt: skip


async def hits_and_bytes(p: Proc, hashes: list[bytes], size: int) -> tuple[int, np.ndarray]:
    c = PegaClient(ClientConfig(coordinators=[p.ready["coordinator"]], lookup_timeout_s=2))
    try:
        found = await c.lookup(NS, hashes)
        out = np.zeros((len(hashes), size), dtype=np.uint8)
        got = await c.get_blocks(
            NS, [(found.blocks[i][0], h, 0, out[i]) for i, h in enumerate(hashes[: found.hits])]
        )
        assert all(got)
        return found.hits, out[: found.hits]
    finally:
        await c.close()


async def put(p: Proc, hashes: list[bytes], data: np.ndarray) -> None:
    c = PegaClient(ClientConfig(coordinators=[p.ready["coordinator"]]))
    try:
        stored = await c.put_blocks(NS, [(h, 0, data[i]) for i, h in enumerate(hashes)])
        assert stored.stored == len(hashes)
    finally:
        await c.close()


async def test_the_server_keeps_its_pool_across_a_restart(shm_dir: Path) -> None:
    hashes, data = blocks(6)
    p = server(shm_dir)
    try:
        await put(p, hashes, data)
        await wait_until(lambda: _hits_are(p, hashes, 6), "the blocks visible", 60)
    finally:
        p.terminate()  # SIGTERM: a clean stop keeps the pool ([node] keep_pool)
    assert p.popen.returncode == 0 and (shm_dir / "pegaflow-s1.pool").exists()
    p = server(shm_dir)
    try:
        assert any("re-attached 6 verified blocks" in line for line in p.log), p.log
        hits, out = await hits_and_bytes(p, hashes, data.shape[1])
        assert hits == 6 and np.array_equal(out, data)
    finally:
        p.terminate()
    p = server(shm_dir, "--fresh-pool")  # asked to start empty: it does
    try:
        hits, _ = await hits_and_bytes(p, hashes, data.shape[1])
        assert hits == 0
    finally:
        p.terminate()
    p = server(shm_dir, "--node-keep-pool", "false")
    p.terminate()
    assert not os.listdir(shm_dir)  # told not to keep it: nothing left


async def _hits_are(p: Proc, hashes: list[bytes], n: int) -> bool:
    return await _hits(p, hashes) == n


async def _hits(p: Proc, hashes: list[bytes]) -> int:
    c = PegaClient(ClientConfig(coordinators=[p.ready["coordinator"]], lookup_timeout_s=2))
    try:
        return (await c.lookup(NS, hashes)).hits
    finally:
        await c.close()


def test_the_server_refuses_a_pool_larger_than_its_shm_dir() -> None:
    with tmpfs(16 << 20) as d:
        r = subprocess.run(
            [sys.executable, "-m", "pegaflow.server", "--coordinator-port", "0",
             "--coordinator-http-port", "0", "--node-ucx-port", "0", "--node-shm-dir", str(d),
             "--pool-size", "64MiB", "--node-slab-bytes", "4MiB"],
            capture_output=True, text=True, timeout=60, cwd=REPO, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        assert r.returncode == 2, r.stdout + r.stderr
        (line,) = [x for x in r.stderr.splitlines() if " ERROR " in x]
        assert "pool of 64 MiB does not fit" in line and f"16 MiB free in {d}" in line, line
        assert "--pool-size" in line and "Traceback" not in r.stderr
        assert not list(d.iterdir())
