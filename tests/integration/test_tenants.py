"""A storage node shared by tenants that do not trust each other, against real node
processes over real UCX: what a peer says before it authenticates stays bounded,
handshakes that never authenticate are closed, reservations and pins belong to the
connection that made them, and quotas keep one client from taking the pool."""

from __future__ import annotations

import os
import secrets
from typing import Any

import numpy as np
import pytest
from pegaflow.client.data import DataClient
from pegaflow.client.session import NodeSession

from pegaflow.checksum import checksum
from pegaflow.errors import BadRequest, QuotaExceeded, TooLarge, Unauthorized
from pegaflow.protocol.codec import pack, unpack
from pegaflow.protocol.framing import UNIX_PREFIX
from pegaflow.tools.devcluster import Proc, start_server
from pegaflow.transport.rpc_client import RpcClient
from pegaflow.transport.ucx import UcxWorker, close_endpoint, make_tag
from tests.support.cluster import BLOCK, RawConn, blocks
from tests.support.tenant_node import (
    POOL,
    TENANTS,
    error_code,
    raw_conn,
    sample,
    scrape,
    tenant_node,
)
from tests.support.waiting import wait_until

pytestmark = pytest.mark.ucx


async def flood(raw: RawConn, frames: list[bytes]) -> list[dict[str, Any]]:
    """Send every frame (32 in flight at a time); the replies."""
    w = raw.w
    replies: list[dict[str, Any]] = []
    for i in range(0, len(frames), 32):
        chunk = frames[i : i + 32]
        recvs = [w.am_recv(raw.ep) for _ in chunk]
        await w.wait_all([w.am_send(raw.ep, f) for f in chunk] + recvs, 10)
        replies += [unpack(bytes(r.recv_buffer), 1 << 20) for r in recvs]
    return replies


# ---- 4: nothing a peer says becomes a metric label -------------------------------------


async def test_garbage_op_names_never_become_metric_labels(procs: list[Proc]) -> None:
    server = start_server(
        token="admin",
        tenants=TENANTS,
        extra=["--node-pool-bytes", "32MiB", "--node-slab-bytes", "4MiB"],
    )  # fmt: skip
    procs.append(server)
    addr, http = server.ready["ucx"], server.ready["http"]
    junk = [f"junk{secrets.token_hex(6)}" for _ in range(3400)]
    raw = await raw_conn(addr, None)
    try:  # before any hello: random ops, and requests far over the pre-hello bound
        frames = [pack({"op": op, "id": i, "pad": b"x" * 64}) for i, op in enumerate(junk[:3000])]
        frames += [pack({"op": "get", "id": 1, "pad": b"x" * (64 << 10)})] * 32
        codes = [error_code(r) for r in await flood(raw, frames)]
        assert set(codes[:3000]) == {Unauthorized.code}
        assert set(codes[3000:]) == {TooLarge.code}
    finally:
        raw.close()
    tenant = await raw_conn(addr, "a-secret")
    try:  # a tenant's random ops, inside and outside its namespaces
        frames = [pack({"op": op, "id": 1, "ns": "globex@m"}) for op in junk[3000:3100]]
        frames += [pack({"op": op, "id": 1, "ns": "acme@m"}) for op in junk[3100:3200]]
        codes = {error_code(r) for r in await flood(tenant, frames)}
        assert codes == {Unauthorized.code, BadRequest.code}
    finally:
        tenant.close()
    # the node's control socket (cluster token) and the coordinator (a tenant)
    admin = DataClient(token="admin")
    try:
        pool = await admin.pool_file(addr, 5)
        assert pool is not None and pool.control
    finally:
        await admin.close()
    control = RpcClient([UNIX_PREFIX + pool.control], token="admin")
    coordinator = RpcClient([server.ready["coordinator"]], token="a-secret")
    try:
        for op in junk[3200:3300]:
            with pytest.raises(BadRequest):
                await control.call(op, {"ns": "m"}, timeout=5)
        for op in junk[3300:3400]:
            with pytest.raises(Unauthorized):
                await coordinator.call(op, {"ns": "globex@m"}, timeout=5)
    finally:
        await control.close()
        await coordinator.close()

    text = scrape(http)
    assert not [op for op in junk if op in text], "a peer's op string became a metric label"
    assert len(text) < 200_000, f"/metrics grew to {len(text)} bytes"
    assert sample(text, "pegaflow_node_request_errors_total", op="unknown", code="unauthorized")
    # the node keeps serving
    c = DataClient(token="a-secret")
    try:
        hashes, data = blocks(2, 40)
        assert (await c.put(addr, "acme@m", [(h, 0, data[i]) for i, h in enumerate(hashes)],
                            10)).stored == 2  # fmt: skip
    finally:
        await c.close()


# ---- 5: handshakes that never say hello are closed ---------------------------------------


async def test_handshakes_without_hello_are_closed_and_bounded(procs: list[Proc]) -> None:
    node = tenant_node(
        procs, "h", "--node-hello-timeout-s", "1", "--node-max-unauthenticated", "64"
    )
    addr, http = node.ready["ucx"], node.ready["http"]
    host, port = addr.rsplit(":", 1)
    w = UcxWorker()
    eps: list[Any] = []
    c = DataClient(token="a-secret")
    try:
        for _ in range(200):  # UCX handshakes that never send hello
            eps.append(await w.connect(host, int(port), 5))
        hashes, data = blocks(4, 41)
        items = [(h, 0, data[i]) for i, h in enumerate(hashes)]
        assert (await c.put(addr, "acme@m", items, 10)).stored == 4  # served meanwhile
        text = scrape(http)
        assert sample(text, "pegaflow_node_connections") <= 64 + 1
        assert sample(text, "pegaflow_node_unauthenticated_closed_total", reason="limit") >= 130

        def only_the_client_left() -> bool:
            return sample(scrape(http), "pegaflow_node_connections") == 1

        await wait_until(only_the_client_left, "the silent handshakes to be closed", 60)
        text = scrape(http)
        closed = sample(text, "pegaflow_node_unauthenticated_closed_total", reason="limit")
        closed += sample(text, "pegaflow_node_unauthenticated_closed_total", reason="timeout")
        assert closed == 200
        out = np.zeros_like(data)  # the authenticated connection outlived the timeout
        assert await c.get(addr, "acme@m", [(h, 0, out[i]) for i, h in enumerate(hashes)], 10)
        assert np.array_equal(out, data)
    finally:
        await c.close()
        for ep in eps:
            close_endpoint(ep)
        w.close()


# ---- 6: reservations and pins belong to their connection ---------------------------------


async def test_tenants_cannot_abort_unpin_or_see_each_others_state(procs: list[Proc]) -> None:
    node = tenant_node(procs, "iso")
    addr = node.ready["ucx"]
    acme = await raw_conn(addr, "a-secret")
    globex = await raw_conn(addr, "g-secret")
    admin = await raw_conn(addr, "admin")
    ca, cg = DataClient(token="a-secret"), DataClient(token="g-secret")
    try:
        # acme's reservation survives globex aborting (and committing) every id near it
        hashes, data = blocks(4, 42)
        res = await acme.ask(pack({"op": "reserve", "id": 1, "ns": "acme@m",
                                   "blocks": [[h, 0, BLOCK] for h in hashes]}))  # fmt: skip
        assert res["ok"] and all(res["accept"]), res
        seq = res["seq"]
        for s in range(max(1, seq - 5), seq + 5):
            assert (await globex.ask(pack({"op": "abort", "id": 2, "seq": s})))["ok"]  # no-op
            reply = await globex.ask(pack({"op": "commit", "id": 3, "seq": s, "xxh3": [0] * 4}))
            assert error_code(reply) == BadRequest.code
        sends = [acme.w.tag_send(acme.ep, data[i], make_tag(seq, i)) for i in range(4)]
        await acme.w.wait_all(sends, 5)
        done = await acme.ask(pack({"op": "commit", "id": 4, "seq": seq,
                                    "xxh3": [checksum(d) for d in data]}))  # fmt: skip
        assert done["ok"] and done["stored"] == 4, done

        # acme's read pins survive globex unpinning every id: globex then fills the pool
        # and acme's pinned blocks are not evicted
        pin = await acme.ask(pack({"op": "pin", "id": 5, "ns": "acme@m", "ttl_ms": 30_000,
                                   "blocks": [[h, 0] for h in hashes]}))  # fmt: skip
        assert pin["ok"] and all(pin["pinned"]), pin
        for p in range(1, pin["pin"] + 5):
            assert (await globex.ask(pack({"op": "unpin", "id": 6, "pin": p})))["ok"]
        for batch in range(10):
            gh, gd = blocks(16, 100 + batch)
            items = [(h, 0, gd[i]) for i, h in enumerate(gh)]
            assert (await cg.put(addr, "globex@m", items, 10)).stored == 16
        out = np.zeros_like(data)
        assert await ca.get(addr, "acme@m", [(h, 0, out[i]) for i, h in enumerate(hashes)], 10)
        assert np.array_equal(out, data)

        # a tenant learns nothing node-wide and cannot locate; the cluster token can
        for op in ("stats", "locate"):
            msg = {"op": op, "id": 7, "ns": "globex@m", "ttl_ms": 100, "shard": 0,
                   "hash_len": 32, "hashes": hashes[0]}  # fmt: skip
            assert error_code(await globex.ask(pack(msg))) == Unauthorized.code
        stats = await admin.ask(pack({"op": "stats", "id": 8}))
        assert stats["ok"] and stats["capacity_bytes"] == POOL
    finally:
        for raw in (acme, globex, admin):
            raw.close()
        await ca.close()
        await cg.close()


async def test_a_control_socket_reservation_belongs_to_its_session(procs: list[Proc]) -> None:
    node = tenant_node(procs, "sock")
    addr = node.ready["ucx"]
    data = DataClient(token="admin")
    c = NodeSession.at(addr, data, token="admin")
    admin = await raw_conn(addr, "admin")
    try:
        pool = await c.pool_file(5)
        assert pool is not None and pool.control
        h = os.urandom(16)
        seq, offsets = await c.reserve_local("m", [(h, 0, 4096)], pool.file_id, 5)
        assert offsets[0] is not None
        other = RpcClient([UNIX_PREFIX + pool.control], token="admin")  # another session
        try:
            assert await other.call("abort", {"seq": seq}, timeout=5) == {}  # a no-op
            with pytest.raises(BadRequest):
                await other.call("commit", {"seq": seq, "xxh3": [None]}, timeout=5)
        finally:
            await other.close()
        assert (await admin.ask(pack({"op": "abort", "id": 1, "seq": seq})))["ok"]  # no-op
        assert (await c.commit_local(seq, [True], 5)).stored == 1
        assert c.over_socket
    finally:
        admin.close()
        c.close()
        await data.close()


# ---- 7: quotas -----------------------------------------------------------------------------


async def test_quotas_keep_one_client_from_reserving_the_pool(procs: list[Proc]) -> None:
    pool = 2 * POOL  # room for what the test holds besides the quotas' worth
    node = tenant_node(
        procs, "q", "--node-conn-quota-share", "0.125", "--node-tenant-quota-share", "0.25",
        pool=pool,
    )  # fmt: skip
    addr = node.ready["ucx"]
    share = pool // 8 // BLOCK  # blocks in a connection's share of the pool (8 MiB)

    def reserve(n: int, seed: int, ns: str = "acme@m") -> bytes:
        return pack({"op": "reserve", "id": seed, "ns": ns,
                     "blocks": [[os.urandom(32), 0, BLOCK] for _ in range(n)]})  # fmt: skip

    conns = [await raw_conn(addr, "a-secret") for _ in range(3)]
    cg = DataClient(token="g-secret")
    try:
        assert error_code(await conns[0].ask(reserve(8 * share, 1))) == QuotaExceeded.code
        first = await conns[0].ask(reserve(share, 2))
        assert first["ok"], first
        assert error_code(await conns[0].ask(reserve(1, 3))) == QuotaExceeded.code  # connection
        assert (await conns[1].ask(reserve(share, 4)))["ok"]
        assert error_code(await conns[2].ask(reserve(1, 5))) == QuotaExceeded.code  # tenant
        # everyone else keeps storing
        hashes, data = blocks(16, 43)
        items = [(h, 0, data[i]) for i, h in enumerate(hashes)]
        assert (await cg.put(addr, "globex@m", items, 10)).stored == 16
        # an abort gives the quota back (aborting receives still posted also closes the
        # connection, so no reply is awaited)
        w0 = conns[0].w
        await w0.wait(
            w0.am_send(conns[0].ep, pack({"op": "abort", "id": 6, "seq": first["seq"]})), 5
        )

        async def room_again() -> bool:
            return bool((await conns[2].ask(reserve(share, 7)))["ok"])

        await wait_until(room_again, "the aborted reservation's quota to come back", 60)

        # read pins: distinct pinned bytes per connection (a block pinned twice counts once)
        more, more_data = blocks(24, 44)
        items = [(h, 0, more_data[i]) for i, h in enumerate(more)]
        assert (await cg.put(addr, "globex@m", items, 10)).stored == 24
        stored = hashes + more  # 40 blocks, 10 MiB: more than a connection's share

        def pin(hs: list[bytes]) -> bytes:
            return pack({"op": "pin", "id": 9, "ns": "globex@m", "ttl_ms": 30_000,
                         "blocks": [[h, 0] for h in hs]})  # fmt: skip

        g = await raw_conn(addr, "g-secret")
        try:
            assert error_code(await g.ask(pin(stored))) == QuotaExceeded.code
            held = await g.ask(pin(stored[:20]))
            assert held["ok"] and all(held["pinned"])
            again = await g.ask(pin(stored[:20]))  # the same blocks: no more bytes held
            assert again["ok"]
            assert error_code(await g.ask(pin(stored[20:]))) == QuotaExceeded.code
            for p in (held, again):
                assert error_code(await g.ask(pin(stored[20:]))) == QuotaExceeded.code
                assert (await g.ask(pack({"op": "unpin", "id": 10, "pin": p["pin"]})))["ok"]
            assert (await g.ask(pin(stored[20:])))["ok"]  # both released: room again
        finally:
            g.close()
    finally:
        for raw in conns:
            raw.close()
        await cg.close()
