"""The node's protocol table and its codecs (pure logic: no processes)."""

from __future__ import annotations

import pytest
from pegaflow.coordinator import index
from pegaflow.storage_node import journal

from pegaflow.errors import BadRequest, PoolChanged, ProtocolError, TooLarge, Unavailable
from pegaflow.protocol import node as proto
from pegaflow.protocol.codec import GEN_MAX, INDEX_SHARDS, NO_SLOT, PROTOCOL_VERSION, SHARD_LIMIT
from pegaflow.protocol.node import OPS, Loop, Op, Site


def test_the_table_names_every_op_once_with_its_transports() -> None:
    assert set(OPS) == set(Op)
    socket = {op for op, spec in OPS.items() if Site.SOCKET in spec.sites}
    assert socket == {Op.RESERVE, Op.COMMIT, Op.ABORT, Op.TAKEN, Op.LOCATE, Op.UNPIN, Op.REPORT}
    assert all(Site.UCX in spec.sites for spec in OPS.values())
    on_thread = {op for op, spec in OPS.items() if spec.loop is Loop.CONTROL}
    assert on_thread == {Op.LOCATE, Op.UNPIN}
    assert {op for op, spec in OPS.items() if spec.cluster_only} == {
        Op.LOCATE, Op.STATS, Op.REPORT, Op.DROP,
    }  # fmt: skip
    assert proto.op_label("get") == "get" and proto.op_label("nope") == proto.UNKNOWN_OP


def test_bounds_are_defined_once() -> None:
    assert index.MAX_SHARDS == INDEX_SHARDS == 4096
    assert index.MAX_GEN == GEN_MAX == (1 << 64) - 1
    assert journal._MAX_SHARD == SHARD_LIMIT - 1 == 65535


def test_get_request_and_reply_round_trip() -> None:
    msg = proto.encode_get("ns", 7, [(b"a", 0), (b"b", 65535)], [None, GEN_MAX])
    assert msg == {"op": "get", "ns": "ns", "seq": 7, "blocks": [[b"a", 0], [b"b", 65535, GEN_MAX]]}
    ns, seq, keys, gens = proto.decode_get(msg, 16)
    assert (ns, seq, keys, gens) == (
        "ns",
        7,
        [("ns", b"a", 0), ("ns", b"b", 65535)],
        [None, GEN_MAX],
    )
    reply = {"blocks": [proto.get_hit(4, 1, 9), None, proto.STALE, [1, 2]]}
    assert proto.get_reply(reply, 4) == [(4, 1, 9), None, proto.STALE, None]
    with pytest.raises(Unavailable):
        proto.get_reply(reply, 3)


@pytest.mark.parametrize(
    "block",
    [[b"a", SHARD_LIMIT], [b"a", -1], [b"a", True], [b"a", 0, GEN_MAX + 1], [b"a", 0, -1], [b""]],
)
def test_out_of_bounds_blocks_are_bad_requests(block: list[object]) -> None:
    with pytest.raises(BadRequest):
        proto.decode_check({"ns": "ns", "blocks": [block]}, 16)


def test_hello_checks_the_version() -> None:
    assert proto.decode_hello(proto.encode_hello("t")) == "t"
    with pytest.raises(ProtocolError):
        proto.decode_hello({"version": PROTOCOL_VERSION + 1})


@pytest.mark.parametrize("same", [True, False])
def test_local_reserve_round_trip(same: bool) -> None:
    blocks = [(b"h1", 3, 64), (b"h2", 3, 64 if same else 128)]
    msg = proto.encode_reserve_local("ns", blocks, (1, 2))
    assert proto.reserve_is_packed(msg) is same and proto.reserve_is_local(msg)
    proto.check_reserve_pool(msg, (1, 2), "/p")
    with pytest.raises(PoolChanged):  # the writer maps another file than the node's
        proto.check_reserve_pool(msg, (1, 3), "/p")
    with pytest.raises(BadRequest):  # a local reservation names the file it writes
        proto.check_reserve_pool({k: v for k, v in msg.items() if k != "pool"}, (1, 2), "/p")
    parsed = proto.decode_reserve_blocks("ns", msg, 16)
    assert parsed == [(("ns", h, s), z) for h, s, z in blocks]
    reply = proto.encode_reserve_reply(msg, 5, [0, None])
    if same:
        assert reply["offsets"] == (0).to_bytes(8, "little") + NO_SLOT.to_bytes(8, "little")
    assert proto.reserve_local_reply(msg, reply, 2) == (5, [0, None])
    with pytest.raises(TooLarge):
        proto.decode_reserve_blocks("ns", msg, 1)


def test_ucx_reserve_and_commit_round_trip() -> None:
    msg = proto.encode_reserve("ns", [(b"h", 1, 8)])
    assert not proto.reserve_is_local(msg)
    reply = proto.encode_reserve_reply(msg, 9, [None])
    assert reply == {"seq": 9, "accept": [False]}
    assert proto.reserve_reply(reply, 1) == (9, [False])
    commit = proto.encode_commit(9, [None], [-(2**63)])
    assert proto.decode_commit(commit, 4) == (9, [None], [-(2**63)])
    assert proto.digest_of(-(2**63)) == -(2**63) and proto.digest_of(2**63) is None
    assert proto.digest_of(True) is None


def test_locate_round_trip() -> None:
    with pytest.raises(BadRequest):
        proto.encode_locate("ns", [b"a", b"bb"], 0, 1.0)
    msg = proto.encode_locate("ns", [b"aa", b"bb"], 2, 0.0001)
    assert proto.decode_locate(msg, 8) == ("ns", 1, 2, [b"aa", b"bb"])
    from pegaflow.protocol.codec import LocatedBlocks

    rows = [LocatedBlocks.wire_row(0, 8, 1, 2, None), None]
    reply = proto.encode_locate_reply(4, rows, (7, 9))
    pin, where = proto.locate_reply(reply, 2)
    assert pin == 4 and where[1] is None and where[0] is not None and where[0].size == 8
    assert where.pool == (7, 9) and where[:1].pool == (7, 9)  # the file the offsets are in
    with pytest.raises(Unavailable):
        proto.locate_reply(reply, 3)


def test_report_bounds_hits_by_asked() -> None:
    assert proto.decode_report(proto.encode_report(1, 5, 5)) == (1, 5, 5)
    with pytest.raises(BadRequest):
        proto.decode_report(proto.encode_report(1, 5, 6))
