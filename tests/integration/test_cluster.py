"""Integration: real etcd, a real coordinator process, real storage-node processes and
real UCX transfers, driven through the client library."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator

import numpy as np
import pytest
from pegaflow.client import PegaClient

from pegaflow.config import ClientConfig, EtcdConfig
from pegaflow.errors import BadRequest, PegaError, TooLarge, Unauthorized
from pegaflow.protocol.codec import PROTOCOL_VERSION, pack
from pegaflow.tools.devcluster import Proc, start_node
from tests.support.cluster import BLOCK, NS, RawConn, blocks
from tests.support.etcd_fixture import CoordinatorFactory, CoordinatorProcess
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.etcd, pytest.mark.ucx]


class Cluster:
    def __init__(self, etcd: EtcdConfig, coordinator: CoordinatorProcess, nodes: dict[str, Proc]):
        self.etcd = etcd
        self.coordinator = coordinator
        self.nodes = nodes
        self.clients: list[PegaClient] = []

    def client(self, local_node: str = "", coordinators: list[str] | None = None) -> PegaClient:
        cfg = ClientConfig(
            coordinators=coordinators or [self.coordinator.address],
            local_node=local_node,
            lookup_timeout_s=2.0,
            transfer_timeout_s=10.0,
        )
        c = PegaClient(cfg)
        self.clients.append(c)
        return c


@pytest.fixture
async def cluster(
    etcd_config: EtcdConfig, coordinators: CoordinatorFactory
) -> AsyncIterator[Cluster]:
    coord = await coordinators.start(etcd_config)
    nodes = {}
    for nid in ("n1", "n2"):
        nodes[nid] = start_node(
            nid, etcd=etcd_config.endpoints[0], prefix=etcd_config.prefix, pool="64MiB", slab="4MiB"
        )
    c = Cluster(etcd_config, coord, nodes)
    probe = c.client()
    await wait_until(lambda: _has_nodes(probe, 2), "both nodes in the index", 60)
    yield c
    for cl in c.clients:
        await cl.close()
    for p in nodes.values():
        p.kill()


async def _has_nodes(client: PegaClient, n: int) -> bool:
    return len(await client.nodes()) >= n


@pytest.fixture
def node_factory() -> Iterator[list[Proc]]:
    procs: list[Proc] = []
    yield procs
    for p in procs:
        p.kill()


async def test_put_get_round_trip_across_two_nodes(cluster: Cluster) -> None:
    c1 = cluster.client(local_node="n1")
    c2 = cluster.client(local_node="n2")
    h1, d1 = blocks(8, 1)
    h2, d2 = blocks(8, 2)
    r1 = await c1.put_blocks(NS, [(h, 0, d1[i]) for i, h in enumerate(h1)])
    r2 = await c2.put_blocks(NS, [(h, 0, d2[i]) for i, h in enumerate(h2)])
    assert (r1.stored, r2.stored) == (8, 8)
    again = await c1.put_blocks(NS, [(h, 0, d1[i]) for i, h in enumerate(h1)])
    assert (again.stored, again.skipped) == (0, 8)

    reader = cluster.client()
    hashes = h1 + h2
    await wait_until(lambda: _hits(reader, hashes, 16), "all blocks visible in the index", 60)
    res = await reader.lookup(NS, hashes)
    assert [b[0] for b in res.blocks] == ["n1"] * 8 + ["n2"] * 8
    out = np.zeros((16, BLOCK), dtype=np.uint8)
    ok = await reader.get_blocks(
        NS, [(res.blocks[i][0], h, 0, out[i]) for i, h in enumerate(hashes)]
    )
    assert all(ok)
    assert np.array_equal(out[:8], d1) and np.array_equal(out[8:], d2)

    # a block asked from the wrong node is a miss, never wrong bytes
    wrong = np.zeros(BLOCK, dtype=np.uint8)
    assert await reader.get_blocks(NS, [("n2", h1[0], 0, wrong)]) == [False]
    assert not wrong.any()


async def _hits(
    client: PegaClient, hashes: list[bytes], want: int, shards: tuple[int, ...] = (0,)
) -> bool:
    return (await client.lookup(NS, hashes, shards)).hits == want


async def test_longest_prefix_needs_every_shard(cluster: Cluster) -> None:
    c = cluster.client(local_node="n1")
    hashes, data = blocks(6, 3)
    await c.put_blocks(NS, [(h, 0, data[i]) for i, h in enumerate(hashes)])
    await c.put_blocks(NS, [(h, 1, data[i]) for i, h in enumerate(hashes[:3])], node_id="n2")
    await wait_until(lambda: _hits(c, hashes, 6), "shard 0 visible", 60)
    await wait_until(lambda: _hits(c, hashes, 3, (0, 1)), "shard 1 visible", 60)
    res = await c.lookup(NS, hashes, (0, 1))
    assert res.hits == 3 and res.blocks[0] == ["n1", "n2"]
    # a gap stops the prefix even if later blocks are stored
    gap = [*hashes[:2], os.urandom(32), *hashes[3:]]
    assert (await c.lookup(NS, gap)).hits == 2


async def test_killed_node_entries_vanish_within_lease_ttl(cluster: Cluster) -> None:
    c = cluster.client(local_node="n2")
    hashes, data = blocks(4, 4)
    await c.put_blocks(NS, [(h, 0, data[i]) for i, h in enumerate(hashes)])
    await wait_until(lambda: _hits(c, hashes, 4), "blocks visible", 60)
    cluster.nodes["n2"].kill()
    ttl = cluster.etcd.lease_ttl_s
    # etcd expires the lease after TTL; allow its expiry sweep and the watch some slack
    await wait_until(lambda: _hits(c, hashes, 0), "entries of the killed node gone", ttl * 3 + 5)
    assert "n2" not in await c.nodes()
    # a get that still names the dead node fails cleanly, as misses
    out = np.zeros((1, BLOCK), dtype=np.uint8)
    assert await c.get_blocks(NS, [("n2", hashes[0], 0, out[0])], timeout=3) == [False]


async def test_restarted_and_second_coordinator_answer_for_old_blocks(
    cluster: Cluster, coordinators: CoordinatorFactory
) -> None:
    c = cluster.client(local_node="n1")
    hashes, data = blocks(5, 5)
    await c.put_blocks(NS, [(h, 0, data[i]) for i, h in enumerate(hashes)])
    await wait_until(lambda: _hits(c, hashes, 5), "blocks visible", 60)
    second = await coordinators.start(cluster.etcd)
    cluster.coordinator.kill()
    c2 = cluster.client(coordinators=[cluster.coordinator.address, second.address])
    res = await c2.lookup(NS, hashes)
    assert res.hits == 5
    out = np.zeros((5, BLOCK), dtype=np.uint8)
    assert all(
        await c2.get_blocks(NS, [(res.blocks[i][0], h, 0, out[i]) for i, h in enumerate(hashes)])
    )
    assert np.array_equal(out, data)


async def test_eviction_under_a_full_pool_unpublishes(cluster: Cluster) -> None:
    c = cluster.client(local_node="n1")
    first, d_first = blocks(16, 6)  # 4 MiB: one slab
    await c.put_blocks(NS, [(h, 0, d_first[i]) for i, h in enumerate(first)])
    await wait_until(lambda: _hits(c, first, 16), "first batch visible", 60)
    for seed in range(10, 30):  # 80 MiB through a 64 MiB pool
        hs, d = blocks(16, seed)
        r = await c.put_blocks(NS, [(h, 0, d[i]) for i, h in enumerate(hs)])
        assert r.stored == 16
    await wait_until(lambda: _hits(c, first, 0), "evicted blocks gone from the index", 60)
    nodes = await c.nodes()
    assert nodes["n1"].used_bytes <= nodes["n1"].capacity_bytes


async def test_concurrent_clients(cluster: Cluster) -> None:
    async def worker(i: int) -> None:
        c = cluster.client(local_node=f"n{1 + i % 2}")
        hashes, data = blocks(6, 100 + i)
        assert (await c.put_blocks(NS, [(h, 0, data[j]) for j, h in enumerate(hashes)])).stored == 6
        await wait_until(lambda: _hits(c, hashes, 6), "own blocks visible", 60)
        for _ in range(3):
            res = await c.lookup(NS, hashes)
            out = np.zeros_like(data)
            ok = await c.get_blocks(
                NS, [(res.blocks[j][0], h, 0, out[j]) for j, h in enumerate(hashes)]
            )
            assert all(ok) and np.array_equal(out, data)

    await asyncio.gather(*(worker(i) for i in range(4)))


# ---- malformed data-plane input ---------------------------------------------------------


def _error(reply: dict) -> str:
    assert reply["ok"] is False, reply
    return reply["error"]["code"]


async def test_malformed_requests_get_typed_errors_and_node_keeps_serving(
    node_factory: list[Proc],
) -> None:
    node = start_node(
        "bad", pool="32MiB", slab="4MiB", token="s3cret", extra=["--node-max-batch", "16"]
    )
    node_factory.append(node)
    addr = node.ready["ucx"]
    raw = await RawConn.open(addr)
    try:
        assert (
            _error(await raw.ask(pack({"op": "get", "id": 1, "ns": NS, "seq": 1, "blocks": []})))
            == Unauthorized.code
        )
        assert (
            _error(
                await raw.ask(pack({"op": "hello", "version": PROTOCOL_VERSION, "token": "nope"}))
            )
            == Unauthorized.code
        )
        hello = await raw.ask(
            pack({"op": "hello", "id": 2, "version": PROTOCOL_VERSION, "token": "s3cret"})
        )
        assert hello["ok"] and hello["node_id"] == "bad"
        bad_frames = [
            b"\xc1garbage",  # not msgpack
            pack([1, 2, 3]),  # not a map
            pack({"op": "explode", "id": 3}),
            pack({"op": "get", "id": 4, "ns": "bad/ns", "seq": 1, "blocks": []}),
            pack({"op": "get", "id": 5, "ns": NS, "seq": "x", "blocks": []}),
            pack({"op": "reserve", "id": 6, "ns": NS, "blocks": [[b"h", 0]]}),
            pack({"op": "reserve", "id": 7, "ns": NS, "blocks": [[b"h", 0, -5]]}),
            pack({"op": "reserve", "id": 8, "ns": NS, "blocks": [[b"h" * 100, 0, 10]]}),
            pack({"op": "reserve", "id": 9, "ns": NS, "blocks": [[b"h", 0, 10 << 20]]}),
            pack({"op": "commit", "id": 10, "seq": 12345, "xxh3": []}),
        ]
        for frame in bad_frames:
            assert _error(await raw.ask(frame)) in (BadRequest.code, TooLarge.code)
        too_many = pack({"op": "get", "id": 11, "ns": NS, "seq": 1, "blocks": [[b"h", 0]] * 17})
        assert _error(await raw.ask(too_many)) == TooLarge.code
    finally:
        raw.close()

    # the node still serves real clients, and what it stores is intact
    c = PegaClient(ClientConfig(coordinators=["127.0.0.1:1"]), token="s3cret")
    try:
        hashes, data = blocks(4, 7)
        res = await c._data.put(addr, NS, [(h, 0, data[i]) for i, h in enumerate(hashes)], 10)
        assert res.stored == 4
        out = np.zeros_like(data)
        assert all(await c._data.get(addr, NS, [(h, 0, out[i]) for i, h in enumerate(hashes)], 10))
        assert np.array_equal(out, data)
    finally:
        await c.close()
    with pytest.raises(PegaError):
        bad = PegaClient(ClientConfig(coordinators=["127.0.0.1:1"]), token="wrong")
        try:
            await bad._data.put(addr, NS, [(b"x" * 32, 0, np.zeros(16, np.uint8))], 5)
        finally:
            await bad.close()


async def test_writer_dying_mid_put_leaves_nothing_visible(node_factory: list[Proc]) -> None:
    node = start_node("w", pool="8MiB", slab="4MiB", extra=["--node-reserve-timeout-s", "1"])
    node_factory.append(node)
    addr = node.ready["ucx"]
    hashes, data = blocks(16, 8)  # 4 MiB: half the pool
    raw = await RawConn.open(addr)
    await raw.ask(pack({"op": "hello", "id": 1, "version": PROTOCOL_VERSION}))
    reply = await raw.ask(
        pack({"op": "reserve", "id": 2, "ns": NS, "blocks": [[h, 0, BLOCK] for h in hashes]})
    )
    assert reply["ok"] and all(reply["accept"])
    raw.close()  # the writer dies: no payload, no commit

    c = PegaClient(ClientConfig(coordinators=["127.0.0.1:1"]))
    try:
        out = np.zeros_like(data)
        assert (
            await c._data.get(addr, NS, [(h, 0, out[i]) for i, h in enumerate(hashes)], 5)
            == [False] * 16
        )

        async def stored_again() -> bool:
            try:
                return (
                    await c._data.put(addr, NS, [(h, 0, data[i]) for i, h in enumerate(hashes)], 5)
                ).stored == 16
            except PegaError:
                return False

        # once the reservation expires its slots are reclaimed and the same blocks can be stored
        await wait_until(stored_again, "reservation reclaimed", 60)
        assert all(await c._data.get(addr, NS, [(h, 0, out[i]) for i, h in enumerate(hashes)], 5))
        assert np.array_equal(out, data)
    finally:
        await c.close()


async def test_read_pins_keep_looked_up_blocks_through_eviction(cluster: Cluster) -> None:
    c = cluster.client(local_node="n1")
    first, d_first = blocks(8, 40)
    await c.put_blocks(NS, [(h, 0, d_first[i]) for i, h in enumerate(first)])
    await wait_until(lambda: _hits(c, first, 8), "blocks visible", 60)
    res = await c.lookup(NS, first)
    pins = await c.pin_blocks(NS, [(res.blocks[i][0], h, 0) for i, h in enumerate(first)], ttl_s=30)
    assert pins == [True] * 8
    for seed in range(50, 70):  # 80 MiB through the 64 MiB pool: everything unpinned goes
        hs, d = blocks(16, seed)
        await c.put_blocks(NS, [(h, 0, d[i]) for i, h in enumerate(hs)])
    out = np.zeros_like(d_first)
    ok = await c.get_blocks(NS, [(res.blocks[i][0], h, 0, out[i]) for i, h in enumerate(first)])
    assert all(ok) and np.array_equal(out, d_first)


async def test_tenants_cannot_touch_each_others_blocks(node_factory: list[Proc]) -> None:
    from pegaflow.tools.devcluster import start_server

    server = start_server(
        token="admin",
        tenants="acme=a-secret,globex=g-secret",
        extra=["--node-pool-bytes", "32MiB", "--node-slab-bytes", "4MiB"],
    )  # fmt: skip
    node_factory.append(server)
    addr = server.ready["coordinator"]

    def client(token: str) -> PegaClient:
        return PegaClient(ClientConfig(coordinators=[addr], lookup_timeout_s=2), token=token)

    acme, globex, admin = client("a-secret"), client("g-secret"), client("admin")
    try:
        hashes, data = blocks(4, 60)
        assert (
            await acme.put_blocks("acme@m", [(h, 0, data[i]) for i, h in enumerate(hashes)])
        ).stored == 4
        with pytest.raises(Unauthorized):
            await acme.put_blocks("globex@m", [(hashes[0], 0, data[0])])
        await wait_until(lambda: _ns_hits(acme, "acme@m", hashes, 4), "acme's blocks visible", 60)
        with pytest.raises(Unauthorized):
            await globex.lookup("acme@m", hashes)
        node = server.ready["node"]
        out = np.zeros_like(data)
        # the node refuses too, even when asked directly
        assert (
            await globex.get_blocks("acme@m", [(node, h, 0, out[i]) for i, h in enumerate(hashes)])
            == [False] * 4
        )
        assert not out.any()
        # the cluster token sees every tenant
        assert (await admin.lookup("acme@m", hashes)).hits == 4
        ok = await admin.get_blocks("acme@m", [(node, h, 0, out[i]) for i, h in enumerate(hashes)])
        assert all(ok) and np.array_equal(out, data)
    finally:
        for c in (acme, globex, admin):
            await c.close()


async def _ns_hits(c: PegaClient, ns: str, hashes: list[bytes], want: int) -> bool:
    return (await c.lookup(ns, hashes)).hits == want
