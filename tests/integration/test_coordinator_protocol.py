"""The coordinator's op table (pegaflow.protocol.coordinator): every op is served, its
access rule holds on a real connection, and each request and reply type reads what it
writes."""

from __future__ import annotations

import pytest
from pegaflow.coordinator.index import BlockIndex
from pegaflow.coordinator.service import Coordinator

from pegaflow.config import CoordinatorConfig, SecurityConfig
from pegaflow.errors import BadRequest, TooLarge, Unauthorized
from pegaflow.keys import NodeRecord
from pegaflow.protocol import coordinator as proto
from pegaflow.protocol.codec import unpack
from pegaflow.transport.rpc_client import RpcClient

NS = "acme@model.0123"


def test_the_coordinator_serves_every_op_of_the_table() -> None:
    assert set(Coordinator(CoordinatorConfig()).handlers) == set(proto.OPS) == set(proto.Op)


async def test_a_cluster_only_op_refuses_a_tenants_connection() -> None:
    security = SecurityConfig(token="admin", tenant_tokens=["acme=a-secret"])
    c = Coordinator(CoordinatorConfig(port=0, http_port=-1), security=security)
    await c.start()
    tenant = RpcClient([c.address], token="a-secret", timeout=5)
    cluster = RpcClient([c.address], token="admin", timeout=5)
    try:
        report, args = proto.Op.REPORT_UNREACHABLE, proto.encode_report_unreachable("n1")
        assert proto.OPS[report].cluster_only
        with pytest.raises(Unauthorized):
            await tenant.call(report, args)
        got = await cluster.call(report, args)
        assert got == {"suspected": False}  # not a known node
        assert (await tenant.call(proto.Op.STATUS, {}))["blocks"] == 0
    finally:
        await tenant.close()
        await cluster.close()
        await c.close()


def test_a_lookup_reply_reads_back_what_the_encoder_wrote() -> None:
    idx = BlockIndex()
    for n in ("a", "b"):
        idx.set_node(NodeRecord(n, "127.0.0.1", 1))
    hashes = [bytes([i]) * 32 for i in range(40)]
    for i, h in enumerate(hashes[:30]):
        idx.add(NS, h, 0, "a", i + 1, disk=i == 3)
        idx.add(NS, h, 1, "b" if i % 2 else "a", i + 2)
    c = Coordinator(CoordinatorConfig(), index=idx)
    req = proto.LookupRequest(NS, hashes, [0, 1], gens=True)
    assert proto.LookupRequest.from_wire(req.to_wire()) == req
    reply = unpack(c.op_lookup(req.to_wire()), 1 << 20)  # type: ignore[arg-type]
    got = proto.LookupResult.from_wire(reply, 2, True)
    assert got.hits == 30 and set(got.nodes) == {"a", "b"}
    assert got.blocks[1] == ["a", "b"] and got.generations[1] == [2, 3]
    assert got.on_disk == [i == 3 for i in range(30)]
    empty = proto.LookupEncoder.reply(0, [], b"", None, [])
    assert proto.LookupResult.from_wire(unpack(empty, 1 << 10), 1, False) == proto.LookupResult(0)


def test_requests_are_checked_against_their_bounds() -> None:
    with pytest.raises(TooLarge):
        too_many = [b"h"] * (proto.MAX_LOOKUP_HASHES + 1)
        proto.LookupRequest.from_wire({"ns": NS, "hashes": too_many, "shards": [0]})
    with pytest.raises(BadRequest):
        proto.LookupRequest.from_wire({"ns": "bad ns", "hashes": [b"h"], "shards": [0]})
    place = proto.PlaceRequest(NS, 4, 1024, "host-1")
    assert proto.PlaceRequest.from_wire(place.to_wire()) == place
    with pytest.raises(BadRequest):
        proto.PlaceRequest.from_wire({**place.to_wire(), "count": 0})
    assert proto.place_reply({"node": NodeRecord("n", "h", 1).to_wire()}).node_id == "n"
    peers = proto.NamespacePeersRequest(NS, {"dtype": "x" * 600})
    assert proto.NamespacePeersRequest.from_wire(peers.to_wire()).factors == {"dtype": "x" * 512}
    with pytest.raises(BadRequest):
        too_many = {str(i): "" for i in range(proto.MAX_FACTORS + 1)}
        proto.NamespacePeersRequest.from_wire({"ns": NS, "factors": too_many})
