"""Fault injection against real processes: node crash and restart, corrupted slots."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from pegaflow.client import PegaClient

from pegaflow.config import ClientConfig, EtcdConfig
from pegaflow.errors import PegaError
from pegaflow.tools.devcluster import Proc, start_coordinator, start_node
from tests.support.cluster import NS, blocks
from tests.support.etcd_fixture import CoordinatorFactory
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.etcd, pytest.mark.ucx]


@pytest.fixture
def shm_dir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="pegaflow-test-", dir="/dev/shm")
    yield d
    shutil.rmtree(d, ignore_errors=True)


async def _hits(c: PegaClient, hashes: list[bytes], want: int) -> bool:
    return (await c.lookup(NS, hashes)).hits == want


async def test_node_restart_serves_the_same_verified_blocks(
    etcd_config: EtcdConfig, coordinators: CoordinatorFactory, shm_dir: str
) -> None:
    coord = await coordinators.start(etcd_config)
    procs: list[Proc] = []

    def node() -> Proc:
        p = start_node(
            "r1",
            etcd=etcd_config.endpoints[0],
            prefix=etcd_config.prefix,
            pool="64MiB",
            slab="4MiB",
            shm_dir=shm_dir,
        )
        procs.append(p)
        return p

    node()
    c = PegaClient(ClientConfig(coordinators=[coord.address], local_node="r1", lookup_timeout_s=2))
    try:
        await wait_until(lambda: _node_known(c, "r1"), "node r1 registered", 60)
        hashes, data = blocks(12, 11)
        assert (
            await c.put_blocks(NS, [(h, 0, data[i]) for i, h in enumerate(hashes)])
        ).stored == 12
        await wait_until(lambda: _hits(c, hashes, 12), "blocks visible", 60)

        procs[-1].kill()  # kill -9: no clean shutdown, the pool file stays in shm
        # corrupt one stored block behind the node's back: it must never be served again
        _corrupt_first_block(Path(shm_dir) / "pegaflow-r1.pool")

        node()
        await wait_until(lambda: _hits(c, hashes[1:], 11), "re-attached blocks republished", 60)
        # the corrupted block (the first slot) is not republished: once the dead
        # process's lease expires, the prefix stops right at it
        await wait_until(
            lambda: _hits(c, hashes, 0), "old lease gone", etcd_config.lease_ttl_s * 3 + 5
        )
        res = await c.lookup(NS, hashes[1:])
        assert res.hits == 11
        out = np.zeros_like(data[1:])
        ok = await c.get_blocks(
            NS, [(res.blocks[i][0], h, 0, out[i]) for i, h in enumerate(hashes[1:])]
        )
        assert all(ok) and np.array_equal(out, data[1:])
        again = await c.put_blocks(NS, [(h, 0, data[i]) for i, h in enumerate(hashes)])
        assert (again.stored, again.skipped) == (1, 11)
    finally:
        await c.close()
        for p in procs:
            p.kill()


async def _node_known(c: PegaClient, node_id: str) -> bool:
    return node_id in await c.nodes()


def _corrupt_first_block(pool_file: Path) -> None:
    first = np.fromfile(pool_file, dtype=np.uint8, count=1 << 20)
    with open(pool_file, "r+b") as f:
        f.seek(int(np.flatnonzero(first)[0]) + 17)
        f.write(b"\x00\x01\x02")


async def test_node_killed_during_batched_get_gives_misses_not_garbage(shm_dir: str) -> None:
    node = start_node("k1", pool="512MiB", slab="64MiB", shm_dir=shm_dir)
    addr = node.ready["ucx"]
    c = PegaClient(ClientConfig(coordinators=["127.0.0.1:1"]))
    try:
        rng = np.random.default_rng(5)
        data = rng.integers(0, 255, size=(32, 8 << 20), dtype=np.uint8)
        hashes = [bytes([i]) * 32 for i in range(32)]
        assert (
            await c._data.put(addr, NS, [(h, 0, data[i]) for i, h in enumerate(hashes)], 30)
        ).stored == 32
        out = np.zeros_like(data)
        get = asyncio.ensure_future(
            c._data.get(addr, NS, [(h, 0, out[i]) for i, h in enumerate(hashes)], 5)
        )
        await asyncio.sleep(0.01)
        node.kill()
        ok = await get  # returns (no hang, no exception) within its deadline
        assert len(ok) == 32
        for i, good in enumerate(ok):
            if good:  # anything reported fetched is exactly right
                assert np.array_equal(out[i], data[i])
        # the client recovers: a dead node is a miss, promptly, every time
        assert await c._data.get(addr, NS, [(hashes[0], 0, out[0])], 2) == [False]
    finally:
        await c.close()
        node.kill()


async def test_reads_fenced_by_generation_miss_once_the_slot_was_rewritten(
    etcd_config: EtcdConfig, coordinators: CoordinatorFactory
) -> None:
    """A lookup returns each block's generation; a get that carries it is answered with
    a typed miss ("stale") once the block was evicted and stored again (a new
    generation), and succeeds with the new generation from a fresh lookup."""
    coord = await coordinators.start(etcd_config)
    node = start_node(
        "f1", etcd=etcd_config.endpoints[0], prefix=etcd_config.prefix, pool="16MiB", slab="4MiB"
    )
    c = PegaClient(ClientConfig(coordinators=[coord.address], local_node="f1", lookup_timeout_s=2))
    block = 1 << 20  # 16 slots in the pool
    try:
        await wait_until(lambda: _node_known(c, "f1"), "node f1 registered", 60)
        target = os.urandom(32)
        data = np.frombuffer(target * (block // 32), dtype=np.uint8)
        assert (await c.put_blocks(NS, [(target, 0, data)])).stored == 1
        await wait_until(lambda: _hits(c, [target], 1), "block indexed", 60)
        first = await c.lookup(NS, [target], generations=True)
        assert first.blocks == [["f1"]] and len(first.generations) == 1
        [[gen1]] = first.generations
        out = np.zeros(block, dtype=np.uint8)
        assert await c.get_blocks(NS, [("f1", target, 0, out)], generations=[gen1]) == [True]

        # 16 other blocks evict it (LRU); storing it again gives it a new generation
        fill = np.zeros(block, dtype=np.uint8)
        for _ in range(16):
            assert (await c.put_blocks(NS, [(os.urandom(32), 0, fill)])).stored == 1
        assert (await c.put_blocks(NS, [(target, 0, data)])).stored == 1

        async def regenerated() -> bool:
            res = await c.lookup(NS, [target], generations=True)
            return res.hits == 1 and res.generations[0][0] != gen1

        await wait_until(regenerated, "the new generation indexed", 60)
        stale_before = c._data.stale_misses
        out[:] = 0
        assert await c.get_blocks(NS, [("f1", target, 0, out)], generations=[gen1]) == [False]
        assert c._data.stale_misses == stale_before + 1  # the node's typed answer
        assert not out.any()  # nothing landed for a stale block
        [[gen2]] = (await c.lookup(NS, [target], generations=True)).generations
        assert await c.get_blocks(NS, [("f1", target, 0, out)], generations=[gen2]) == [True]
        assert np.array_equal(out, data)
        assert await c.get_blocks(NS, [("f1", target, 0, out)]) == [True]  # unfenced: any gen
        metrics = _http_text(int(node.ready["http"]), "/metrics")
        assert 'pegaflow_node_get_blocks_total{result="stale"} 1.0' in metrics
    finally:
        await c.close()
        node.kill()


def _http_text(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        return r.read().decode()


def _listening(pid: int) -> set[tuple[str, int]]:
    """``(address, port)`` of every TCP socket process ``pid`` listens on (/proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    out = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] != "0A" or f[9] not in inodes:  # 0A: LISTEN
                continue
            hexaddr, hexport = f[1].split(":")
            raw = bytes.fromhex(hexaddr)
            if table == "tcp":
                addr = socket.inet_ntop(socket.AF_INET, raw[::-1])
            else:  # four little-endian 32-bit words
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                addr = socket.inet_ntop(socket.AF_INET6, words)
            out.add((addr, int(hexport, 16)))
    return out


async def test_services_listen_on_the_configured_interface_only(
    etcd_config: EtcdConfig,
) -> None:
    """With default settings (loopback), every listening socket of the coordinator and
    the node is bound to 127.0.0.1: control protocol, HTTP, the node's UCX handshake
    socket ([node] ucx_port) and UCX's own transport sockets; a connection attempt
    through another interface of the host is refused."""
    from pegaflow.storage_node.netdev import ipv4_addresses

    etcd, prefix = etcd_config.endpoints[0], etcd_config.prefix
    coord = start_coordinator(etcd=etcd, prefix=prefix)  # default hosts
    node = start_node("b1", etcd=etcd, prefix=prefix, pool="16MiB", slab="4MiB")
    try:
        coord_port = int(coord.ready["address"].rsplit(":", 1)[1])
        assert _listening(coord.pid) == {
            ("127.0.0.1", coord_port),
            ("127.0.0.1", int(coord.ready["http"])),
        }
        ucx_port = int(node.ready["ucx"].rsplit(":", 1)[1])
        node_sockets = _listening(node.pid)
        assert ("127.0.0.1", int(node.ready["http"])) in node_sockets
        assert ("127.0.0.1", ucx_port) in node_sockets
        assert {a for a, _p in node_sockets} == {"127.0.0.1"}, node_sockets

        c = PegaClient(ClientConfig(coordinators=["127.0.0.1:1"]))
        try:
            assert await c._data.node_id(f"127.0.0.1:{ucx_port}", 5) == "b1"
            outside = [a for a in ipv4_addresses().values() if not a.startswith("127.")]
            if outside:  # through another interface of this host: nothing listens there
                with pytest.raises(PegaError):
                    await c._data.node_id(f"{outside[0]}:{ucx_port}", 5)
        finally:
            await c.close()
    finally:
        node.kill()
        coord.kill()


def test_ucx_net_devices_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from pegaflow.storage_node import netdev

    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    monkeypatch.setattr(netdev, "rdma_devices", lambda: ["mlx5_0:1"])
    assert netdev.ucx_net_devices("all", "127.0.0.1") is None
    assert netdev.ucx_net_devices("eth1,mlx5_1:1", "127.0.0.1") == "eth1,mlx5_1:1"
    loopback = netdev.interface_of("127.0.0.1")
    assert loopback and netdev.ucx_net_devices("auto", "localhost") == f"{loopback},mlx5_0:1"
    for name, addr in netdev.ipv4_addresses().items():
        assert netdev.interface_of(addr) == name or addr.startswith("127.")
    assert netdev.ucx_net_devices("auto", "203.0.113.254") is None  # not ours: UCX default
    monkeypatch.setenv("UCX_NET_DEVICES", "eth0")
    assert netdev.ucx_net_devices("auto", "127.0.0.1") is None  # the environment wins
