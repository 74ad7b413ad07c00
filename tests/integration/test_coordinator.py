"""Integration tests of the index path: EtcdPublisher -> real etcd -> coordinator
processes (mirror + lookups over the control protocol), and the in-process coordinator
fed by an InProcessSink."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import urllib.request
from collections.abc import AsyncIterator, Awaitable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from pegaflow.coordinator.index import BlockIndex
from pegaflow.coordinator.inprocess_sink import InProcessSink
from pegaflow.coordinator.mirror import EtcdMirror
from pegaflow.coordinator.service import Coordinator

from pegaflow import huge_pages
from pegaflow.config import CoordinatorConfig, EtcdConfig, SecurityConfig
from pegaflow.errors import BadRequest, NoSpace, TooLarge, Unauthorized, Unavailable
from pegaflow.etcd import EtcdClient
from pegaflow.keys import BlockLocation, Keyspace, NodeRecord
from pegaflow.protocol.codec import PROTOCOL_VERSION
from pegaflow.protocol.framing import encode_frame, parse_address, read_frame
from pegaflow.transport.rpc_client import RpcClient
from tests.support.coordinator_fakes import NS, FakeNode, eventually, h
from tests.support.etcd_fixture import EtcdServer, make_test_certs

pytestmark = [pytest.mark.etcd, pytest.mark.ucx]


async def lookup(client: RpcClient, n: int, shards: list[int], ns: str = NS) -> dict[str, Any]:
    return await client.call(
        "lookup", {"ns": ns, "hashes": [h(i) for i in range(n)], "shards": shards}
    )


async def hits(client: RpcClient, n: int, shards: list[int]) -> int:
    return (await lookup(client, n, shards))["hits"]


def http_get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


async def test_lookup_longest_prefix_with_partial_shards(
    etcd_config: EtcdConfig, coordinators: Any
) -> None:
    a = await FakeNode(etcd_config, "node-a").start()
    b = await FakeNode(etcd_config, "node-b").start()
    try:
        a.put(range(6), shard=0)
        b.put([0, 1, 2, 4], shard=1)
        await a.flush()
        await b.flush()

        coord = await coordinators.start(etcd_config)
        client = RpcClient([coord.address], timeout=5)
        try:
            r = await lookup(client, 6, [0, 1])
            assert r["hits"] == 3
            assert r["blocks"] == [["node-a", "node-b"]] * 3
            assert set(r["nodes"]) == {"node-a", "node-b"}
            assert r["nodes"]["node-b"]["ucx_port"] == 9000
            assert await hits(client, 6, [0]) == 6
            assert await hits(client, 6, [1]) == 3
            assert await hits(client, 6, [2]) == 0
            miss = await client.call("lookup", {"ns": "other", "hashes": [h(0)], "shards": [0]})
            # a miss says why its first block is missing (absent from older coordinators)
            assert miss == {"hits": 0, "nodes": {}, "blocks": [], "miss": {"cause": "never_stored"}}

            # Changes after the initial load arrive through the watch.
            b.put([3], shard=1)
            await b.flush()
            await eventually(lambda: _eq(hits(client, 6, [0, 1]), 5), what="watch put")
            a.evict([1])
            await a.flush()
            await eventually(lambda: _eq(hits(client, 6, [0]), 1), what="watch delete")
            gone = await client.call("lookup", {"ns": NS, "hashes": [h(1)], "shards": [0]})
            assert gone["miss"]["cause"] == "evicted" and gone["miss"]["tier"] == "memory"

            st = await client.call("status", {})
            assert st["blocks"] == 6 and st["namespaces"] == 1
            assert {n["node_id"] for n in st["nodes"]} == {"node-a", "node-b"}
            assert st["coordinator"]["etcd_connected"] is True
            assert st["coordinator"]["lookups"] >= 7
            assert {n["node_id"] for n in (await client.call("nodes", {}))["nodes"]} == {
                "node-a",
                "node-b",
            }

            code, body = await asyncio.to_thread(http_get, coord.http_port, "/health")
            assert code == 200 and json.loads(body)["ok"] is True
            code, body = await asyncio.to_thread(http_get, coord.http_port, "/metrics")
            assert code == 200
            text = body.decode()
            for name in (
                "pegaflow_coordinator_lookups_total",
                "pegaflow_coordinator_lookup_seconds_bucket",
                "pegaflow_coordinator_lookup_hit_blocks_total",
                "pegaflow_index_blocks 6.0",
                "pegaflow_etcd_connected 1.0",
            ):
                assert name in text, name
            code, body = await asyncio.to_thread(http_get, coord.http_port, "/v1/status")
            assert code == 200 and json.loads(body)["blocks"] == 6
        finally:
            await client.close()
    finally:
        await a.publisher.close()
        await b.publisher.close()


async def _eq(aw: Awaitable[Any], want: Any) -> bool:
    return (await aw) == want


async def test_entries_vanish_when_the_lease_expires_or_is_revoked(
    etcd_config: EtcdConfig, coordinators: Any
) -> None:
    cfg = replace(etcd_config, lease_ttl_s=2)
    crashed = await FakeNode(cfg, "crashed").start()
    leaving = await FakeNode(cfg, "leaving").start()
    crashed.put(range(4))
    leaving.put(range(4), shard=1)
    await crashed.flush()
    await leaving.flush()
    coord = await coordinators.start(cfg)
    client = RpcClient([coord.address])
    try:
        assert await hits(client, 4, [0, 1]) == 4
        # A graceful stop revokes the lease: entries go at once.
        await leaving.publisher.close()
        await eventually(lambda: _eq(hits(client, 4, [1]), 0), timeout=5, what="revoke")
        # A crash stops the keepalives: entries go within the TTL.
        await crashed.publisher.close(revoke=False)
        assert await hits(client, 4, [0]) == 4
        await eventually(lambda: _eq(hits(client, 4, [0]), 0), timeout=10, what="expiry")
        assert (await client.call("nodes", {}))["nodes"] == []
    finally:
        await client.close()


async def test_lost_lease_is_regranted_and_inventory_republished(
    etcd_config: EtcdConfig, coordinators: Any
) -> None:
    node = await FakeNode(etcd_config, "n1").start()
    coord = await coordinators.start(etcd_config)
    client = RpcClient([coord.address])
    etcd = EtcdClient(etcd_config)
    try:
        node.put(range(10))
        await node.flush()
        await eventually(lambda: _eq(hits(client, 10, [0]), 10), what="published")
        old = node.publisher.lease_id
        await etcd.revoke(old)  # what an expiry during a partition looks like
        await eventually(
            lambda: _true(node.publisher.lease_id not in (0, old)), timeout=60, what="regrant"
        )
        await node.flush()
        await eventually(lambda: _eq(hits(client, 10, [0]), 10), what="republished")
        assert node.publisher.lease_losses == 1
        assert (await client.call("nodes", {}))["nodes"][0]["node_id"] == "n1"
    finally:
        await client.close()
        await etcd.close()
        await node.publisher.close()


async def _true(v: bool) -> bool:
    return v


async def test_queue_overflow_drops_then_republishes_everything(etcd_config: EtcdConfig) -> None:
    node = await FakeNode(etcd_config, "small-queue", max_pending=16).start()
    etcd = EtcdClient(etcd_config)
    blocks_prefix = Keyspace(etcd_config.prefix).blocks.encode()
    try:
        node.put(range(200))
        assert node.publisher.dropped > 0
        await node.flush()

        async def all_there() -> bool:
            return (await etcd.count_prefix(blocks_prefix))[0] == 200

        await eventually(all_there, what="republish after drops")
        assert node.publisher.rotations >= 2
        # The rotation revoked the old lease: every key is on the current one.
        old_keys = 0
        async for _, kvs in etcd.range_pages(blocks_prefix):
            old_keys += sum(1 for kv in kvs if kv.lease != node.publisher.lease_id)
        assert old_keys == 0
    finally:
        await etcd.close()
        await node.publisher.close()


async def test_restart_and_failover_between_coordinators(
    etcd_config: EtcdConfig, coordinators: Any
) -> None:
    node = await FakeNode(etcd_config, "n1").start()
    try:
        node.put(range(32))
        await node.flush()
        c1, c2 = await asyncio.gather(
            coordinators.start(etcd_config), coordinators.start(etcd_config)
        )
        client = RpcClient([c1.address, c2.address], timeout=5)
        try:
            assert await hits(client, 32, [0]) == 32
            first = client.current_address
            (c1 if first == c1.address else c2).kill()
            assert await hits(client, 32, [0]) == 32  # failed over
            assert client.current_address != first

            # A coordinator started now loads everything stored before.
            c3 = await coordinators.start(etcd_config)
            fresh = RpcClient([c3.address])
            try:
                assert await hits(fresh, 32, [0]) == 32
                # by default it re-executed itself (same process) with huge pages asked for
                st = (await fresh.call("status", {}))["coordinator"]
                if huge_pages.available():
                    assert st["huge_pages"] == "on", st
                    environ_file = Path(f"/proc/{c3.popen.pid}/environ")
                    environ = await asyncio.to_thread(environ_file.read_bytes)
                    assert b"GLIBC_TUNABLES=" + huge_pages.TUNABLE.encode() in environ
            finally:
                await fresh.close()
            c3.terminate()
            assert c3.popen.returncode == 0  # graceful SIGTERM stop
        finally:
            await client.close()
    finally:
        await node.publisher.close()


async def test_malformed_requests_get_typed_errors(
    etcd_config: EtcdConfig, coordinators: Any
) -> None:
    coord = await coordinators.start(etcd_config, token="s3cret")
    for token in (None, "wrong"):
        bad = RpcClient([coord.address], token=token, timeout=3)
        with pytest.raises(Unauthorized):
            await bad.call("status", {})
        await bad.close()

    client = RpcClient([coord.address], token="s3cret", timeout=3)
    try:
        good = {"ns": NS, "hashes": [h(0)], "shards": [0]}
        cases: list[tuple[str, dict[str, Any], type[Exception]]] = [
            ("no_such_op", {}, BadRequest),
            ("lookup", {**good, "ns": 7}, BadRequest),
            ("lookup", {**good, "ns": "has space"}, BadRequest),
            ("lookup", {**good, "hashes": "abc"}, BadRequest),
            ("lookup", {**good, "hashes": ["text"]}, BadRequest),
            ("lookup", {**good, "hashes": [b"x" * 65]}, BadRequest),
            ("lookup", {**good, "shards": []}, BadRequest),
            ("lookup", {**good, "shards": [0, 0]}, BadRequest),
            ("lookup", {**good, "shards": [True]}, BadRequest),
            ("lookup", {"ns": NS}, BadRequest),
            ("place", {"ns": NS, "count": 0, "block_bytes": 1}, BadRequest),
            ("place", {"ns": NS, "count": 1, "block_bytes": 1}, Unavailable),
        ]
        for op, args, exc in cases:
            with pytest.raises(exc):
                await client.call(op, args)

        # Raw frames: a non-map request, undecodable msgpack, an oversized frame.
        host, port = parse_address(coord.address)
        for payload, code in (
            (encode_frame([1, 2, 3]), "bad_request"),
            (b"\x00\x00\x00\x02\xc1\xc1", "bad_request"),
            ((64 << 20).to_bytes(4, "big"), TooLarge.code),
        ):
            reader, writer = await asyncio.open_connection(host, port)
            hello = {"op": "hello", "version": PROTOCOL_VERSION, "token": "s3cret"}
            writer.write(encode_frame(hello))
            assert (await read_frame(reader, 1 << 16))["ok"] is True
            writer.write(payload)
            reply = await asyncio.wait_for(read_frame(reader, 1 << 16), 5)
            assert reply["ok"] is False and reply["error"]["code"] == code, reply
            writer.close()

        # A peer that does not speak the protocol at all.
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(encode_frame({"op": "hello", "version": 999, "token": "s3cret"}))
        reply = await asyncio.wait_for(read_frame(reader, 1 << 16), 5)
        assert reply["error"]["code"] == "protocol"
        writer.close()

        assert (await client.call("lookup", good))["hits"] == 0
        assert coord.alive()
    finally:
        await client.close()


async def test_etcd_outage_keeps_serving_and_recovers(
    etcd_server: Any, etcd_config: EtcdConfig, coordinators: Any
) -> None:
    node = await FakeNode(etcd_config, "n1").start()
    coord = await coordinators.start(etcd_config)
    client = RpcClient([coord.address])
    try:
        node.put(range(8))
        await node.flush()
        await eventually(lambda: _eq(hits(client, 16, [0]), 8), what="before outage")

        await asyncio.to_thread(etcd_server.stop)

        async def disconnected() -> bool:
            st = await client.call("status", {})
            return st["coordinator"]["etcd_connected"] is False

        await eventually(disconnected, what="coordinator notices the outage")
        assert await hits(client, 16, [0]) == 8  # last state still served
        node.put(range(8, 16))  # queued while etcd is down
        await asyncio.sleep(0.5)
        assert node.publisher.pending > 0 or node.publisher.write_errors > 0

        await asyncio.to_thread(etcd_server.start)
        await node.flush()
        await eventually(lambda: _eq(hits(client, 16, [0]), 16), timeout=60, what="recovery")
        st = await client.call("status", {})
        assert st["coordinator"]["etcd_connected"] is True
    finally:
        etcd_server.start()
        await client.close()
        await node.publisher.close()


async def test_in_process_coordinator_with_local_sink() -> None:
    index = BlockIndex()
    coord = Coordinator(
        CoordinatorConfig(port=0, http_port=0),
        index=index,
        security=SecurityConfig(token="t"),
    )
    await coord.start()
    near = InProcessSink(index)
    far = InProcessSink(index)
    client = RpcClient([coord.address], token="t")
    try:
        await near.start(NodeRecord("near", "hostA", 1, capacity_bytes=1000, used_bytes=900))
        await far.start(NodeRecord("far", "hostB", 1, capacity_bytes=4000, used_bytes=0))
        near.publish(NS, h(0), 0, BlockLocation("near", 0, 1, 16, 0))
        far.publish(NS, h(1), 0, BlockLocation("far", 0, 1, 16, 0))
        r = await lookup(client, 3, [0])
        assert r["hits"] == 2 and r["blocks"] == [["near"], ["far"]]
        assert set(r["nodes"]) == {"near", "far"}

        def place(host: str, count: int = 1) -> Awaitable[Any]:
            args = {"ns": NS, "count": count, "block_bytes": 100, "client_host": host}
            return client.call("place", args)

        assert (await place("hostA"))["node"]["node_id"] == "near"  # local first
        assert (await place("hostC"))["node"]["node_id"] == "far"  # most free
        assert (await place("hostA", 20))["node"]["node_id"] == "far"  # local too small
        with pytest.raises(NoSpace):
            await place("hostA", 100)
        st = await client.call("status", {})
        assert st["coordinator"]["etcd_connected"] is False and st["blocks"] == 2
        ok, _ = await coord.health()
        assert ok
        await near.close()
        assert (await lookup(client, 3, [0]))["hits"] == 0
    finally:
        await client.close()
        await coord.close()


@contextlib.asynccontextmanager
async def _mirrored(
    etcd_config: EtcdConfig, **kw: Any
) -> AsyncIterator[tuple[FakeNode, EtcdClient, BlockIndex, EtcdMirror]]:
    """A fake node publishing into etcd and a mirror (pages of 4 keys) of it."""
    node = await FakeNode(etcd_config, "n1").start()
    etcd = EtcdClient(etcd_config)
    index = BlockIndex()
    mirror = EtcdMirror(etcd, Keyspace(etcd_config.prefix), index, page_size=4, **kw)
    try:
        yield node, etcd, index, mirror
    finally:
        await mirror.close()
        await node.publisher.close()
        await etcd.close()


async def test_mirror_reads_big_ranges_in_slices_and_resyncs_after_compaction(
    etcd_config: EtcdConfig,
) -> None:
    async with _mirrored(etcd_config) as (node, etcd, index, mirror):
        node.put(range(100), ns="ns-a")
        node.put(range(30), ns="ns-b")
        node.put(range(10), shard=1, ns="ns-b")
        await node.flush()
        assert await mirror.start(wait_s=10)
        assert (index.num_blocks, index.num_entries) == (130, 140)
        assert index.lookup("ns-b", [h(i) for i in range(30)], [0, 1]).hits == 10

        # Miss a stretch of history, and let etcd compact it away meanwhile.
        await mirror.close()
        node.evict(range(50), ns="ns-a")
        node.put(range(100, 120), ns="ns-a")
        await node.flush()
        _, rev = await etcd.count_prefix(b"/")
        await etcd.compact(rev)
        syncs = mirror.full_syncs
        await mirror.start()
        await eventually(lambda: _true(mirror.full_syncs > syncs and mirror.connected))
        assert index.num_blocks == 100
        assert index.lookup("ns-a", [h(i) for i in range(50, 120)], [0]).hits == 70
        node.put([0], ns="ns-a")  # and the watch goes on from the new revision
        await node.flush()
        await eventually(lambda: _true(index.num_blocks == 101), what="watch after resync")


async def test_mirror_serves_a_big_first_load_while_it_runs(etcd_config: EtcdConfig) -> None:
    # 200 keys, more than it waits for: start() returns once the load is under way
    async with _mirrored(etcd_config, wait_load_keys=50) as (node, _, index, mirror):
        node.put(range(200), ns="ns-a")
        await node.flush()
        assert await mirror.start(wait_s=10)
        st = mirror.status()
        assert not mirror.synced and st["state"] == "loading"
        assert st["load_keys_total"] == 200 and st["load_keys_read"] < 200
        while mirror.loading:  # lookups answer from what has been read so far
            assert index.lookup("ns-a", [h(i) for i in range(200)], [0]).hits <= index.num_blocks
            await asyncio.sleep(0)
        await eventually(lambda: _true(mirror.synced and mirror.connected))
        assert index.num_blocks == 200 and mirror.status()["state"] == "watching"
        assert mirror.status()["load_keys_read"] == 200
        assert index.lookup("ns-a", [h(i) for i in range(200)], [0]).hits == 200
        node.put([500], ns="ns-a")
        await node.flush()
        await eventually(lambda: _true(index.num_blocks == 201), what="watch after the load")


@pytest.mark.skipif(shutil.which("etcdctl") is None, reason="needs etcdctl to enable etcd auth")
async def test_etcd_user_auth(tmp_path: Path) -> None:
    server = EtcdServer(tmp_path / "etcd")
    await asyncio.to_thread(server.start)
    try:
        env = {**os.environ, "ETCDCTL_API": "3"}
        for cmd in (["user", "add", "root:pw"], ["auth", "enable"]):
            argv = ["etcdctl", "--endpoints", server.endpoint, *cmd]
            await asyncio.to_thread(
                subprocess.run, argv, env=env, check=True, capture_output=True, timeout=30
            )
        good = EtcdClient(EtcdConfig(endpoints=[server.endpoint], username="root", password="pw"))
        await good.put(b"/k", b"v")
        kv = await good.get(b"/k")
        assert kv is not None and kv.value == b"v"
        await good.close()
        for user, password in (("root", "wrong"), ("", "")):
            bad = EtcdClient(
                EtcdConfig(endpoints=[server.endpoint], username=user, password=password)
            )
            with pytest.raises(Unauthorized):
                await bad.put(b"/k", b"x")
            await bad.close()
    finally:
        server.kill()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl for test certs")
async def test_etcd_tls_with_client_certs(tmp_path: Path, coordinators: Any) -> None:
    certs = await asyncio.to_thread(make_test_certs, tmp_path / "certs")
    server = EtcdServer(tmp_path / "etcd", tls_dir=certs)
    await asyncio.to_thread(server.start)
    try:
        cfg = EtcdConfig(
            endpoints=[f"https://{server.endpoint}"],
            prefix="/tls",
            ca_cert=str(certs / "ca.crt"),
            cert_cert=str(certs / "client.crt"),
            cert_key=str(certs / "client.key"),
            lease_ttl_s=3,
            timeout_s=2.0,
        )
        node = await FakeNode(cfg, "tls-node").start()
        node.put(range(5))
        await node.flush()
        coord = await coordinators.start(
            cfg,
            extra_args=[
                "--etcd-ca-cert", cfg.ca_cert,
                "--etcd-cert-cert", cfg.cert_cert,
                "--etcd-cert-key", cfg.cert_key,
            ],
        )  # fmt: skip
        client = RpcClient([coord.address])
        try:
            assert await hits(client, 5, [0]) == 5
        finally:
            await client.close()
            await node.publisher.close()
        no_cert = EtcdClient(replace(cfg, cert_cert="", cert_key=""))
        with pytest.raises(Unavailable):
            await no_cert.put(b"/tls/x", b"1")
        await no_cert.close()
    finally:
        server.kill()


async def _is_leader(address: str) -> bool:
    client = RpcClient([address], timeout=5)
    try:
        return bool((await client.call("status", {}))["coordinator"]["leader"])
    finally:
        await client.close()


async def _coordinator_status(address: str) -> dict[str, Any]:
    client = RpcClient([address], timeout=5)
    try:
        return (await client.call("status", {}))["coordinator"]
    finally:
        await client.close()


async def test_one_elected_coordinator_runs_the_index_gc_and_a_survivor_takes_over(
    etcd_config: EtcdConfig, coordinators: Any
) -> None:
    """Two coordinators, exactly one leader (etcd election); the leader's GC deletes an
    index entry that points at a live node but a block the node does not have, and
    keeps the real ones; kill -9 the leader and the other takes over, GC included."""
    import numpy as np
    from pegaflow.client import PegaClient

    from pegaflow.config import ClientConfig
    from pegaflow.tools.devcluster import start_node

    ttl = 2
    duty_args = ["--coordinator-election-ttl-s", str(ttl), "--coordinator-gc-interval-s", "0.2"]
    c1, c2 = await asyncio.gather(
        coordinators.start(etcd_config, extra_args=duty_args),
        coordinators.start(etcd_config, extra_args=duty_args),
    )
    node = start_node(
        "g1", etcd=etcd_config.endpoints[0], prefix=etcd_config.prefix, pool="16MiB", slab="4MiB"
    )
    etcd = EtcdClient(etcd_config)
    keys = Keyspace(etcd_config.prefix)
    client = PegaClient(
        ClientConfig(coordinators=[c1.address, c2.address], local_node="g1", lookup_timeout_s=2)
    )
    by_address = {c1.address: c1, c2.address: c2}

    async def leaders() -> list[str]:
        return [a for a, p in by_address.items() if p.alive() and await _is_leader(a)]

    async def stale_entry_is_collected(i: int) -> None:
        key = keys.block_key(NS, h(i), 0)
        # a live node, a block it never had: only the GC can remove this (no lease)
        await etcd.put(key, BlockLocation("g1", slot=0, gen=12345, size=4096, xxh3=0).encode())
        await eventually(
            lambda: _none(etcd.get(key)), 60, f"stale entry {i} deleted by the leader's GC"
        )

    try:
        await eventually(lambda: _count_is(leaders(), 1), 60, "exactly one leader")
        await eventually(lambda: _node_known(client, "g1"), 60, "node g1 registered")
        data = np.arange(4096, dtype=np.uint8)
        assert (await client.put_blocks(NS, [(h(0), 0, data)])).stored == 1
        await eventually(lambda: _hits_of(client, [h(0)], 1), 60, "the real block indexed")

        [leader] = await leaders()
        await stale_entry_is_collected(1)
        assert await etcd.get(keys.block_key(NS, h(0), 0)) is not None  # real entry kept
        assert (await client.lookup(NS, [h(0)])).hits == 1
        st = await _coordinator_status(leader)
        assert st["gc"]["deleted"] >= 1 and st["election"]["leader_id"] == st["id"]
        other = c2.address if leader == c1.address else c1.address
        follower = await _coordinator_status(other)
        assert (follower["leader"], follower["gc"]["passes"], follower["gc"]["deleted"]) == (
            False,
            0,
            0,
        )
        assert follower["election"]["leader_id"] == st["id"]

        by_address[leader].kill()  # kill -9: its lease expires within the TTL
        await eventually(lambda: _count_is(leaders(), 1), ttl * 3 + 10, "the survivor leads")
        assert await leaders() == [other]
        await stale_entry_is_collected(2)
        assert (await client.lookup(NS, [h(0)])).hits == 1
        status, body = http_get(by_address[other].http_port, "/metrics")
        assert status == 200
        text = body.decode()
        assert "pegaflow_coordinator_leader 1.0" in text
        deleted = [
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith("pegaflow_coordinator_gc_deleted_entries_total ")
        ]
        assert deleted and deleted[0] >= 1
    finally:
        await client.close()
        await etcd.close()
        node.kill()


async def _count_is(values: Awaitable[list[str]], n: int) -> bool:
    return len(await values) == n


async def _none(value: Awaitable[Any]) -> bool:
    return await value is None


async def _node_known(client: Any, node_id: str) -> bool:
    return node_id in await client.nodes()


async def _hits_of(client: Any, hashes: list[bytes], want: int) -> bool:
    return (await client.lookup(NS, hashes)).hits == want
