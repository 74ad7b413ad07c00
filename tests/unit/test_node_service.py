"""The node service alone (a real pool, no transport): who owns a reservation.

A reservation belongs to the session that made it: another session can neither commit
nor abort it, and the end of its session drops it, unless its commit was taken.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from pegaflow.storage_node.metrics import NodeMetrics
from pegaflow.storage_node.node import NullSink
from pegaflow.storage_node.node_service import NodeService
from pegaflow.storage_node.pool import BlockPool
from pegaflow.storage_node.sessions import Session
from prometheus_client import CollectorRegistry

from pegaflow.config import NodeConfig
from pegaflow.errors import BadRequest, QuotaExceeded, Unauthorized
from pegaflow.protocol import node as proto
from pegaflow.protocol.node import Op

NS = "svc"
SIZE = 4096


@pytest.fixture
async def service(tmp_path: Path) -> AsyncIterator[NodeService]:
    pool = BlockPool(tmp_path / "svc.pool", 4 << 20, 1 << 20, node_id="svc", persist=False)
    svc = NodeService(pool, NodeConfig(), NullSink(), NodeMetrics(CollectorRegistry()))
    await svc.start()
    try:
        yield svc
    finally:
        await svc.close()
        pool.close(unlink=True)


def _reserve(svc: NodeService, s: Session, *hashes: bytes) -> tuple[int, list[int | None]]:
    blocks = [(h, 0, SIZE) for h in hashes]
    msg = proto.encode_reserve_local(NS, blocks, svc.pool.file_id)
    return proto.reserve_local_reply(msg, svc.call(Op.RESERVE, msg, s), len(blocks))


async def _commit(svc: NodeService, s: Session, seq: int, n: int) -> int:
    return proto.commit_reply(await svc.call(Op.COMMIT, proto.encode_commit(seq, [None] * n), s))


def _stored(svc: NodeService, h: bytes) -> bool:
    return svc.find(NS, [h], 0)[0] is not None


async def test_a_reservation_is_its_sessions(service: NodeService) -> None:
    a, b = Session(service.pin_table()), Session(service.pin_table())
    seq, offsets = _reserve(service, a, b"\x01" * 32)
    assert offsets[0] is not None
    with pytest.raises(BadRequest):
        service.call(Op.COMMIT, proto.encode_commit(seq, [None]), b)
    assert service.call(Op.TAKEN, proto.encode_taken(seq), b) == {"taken": False}
    assert service.call(Op.ABORT, proto.encode_abort(seq), b) == {}  # a no-op: a's still
    assert await _commit(service, a, seq, 1) == 1
    assert _stored(service, b"\x01" * 32)
    assert service.pool.stats().reserved == 0


async def test_the_end_of_a_session_drops_its_reservations_only(service: NodeService) -> None:
    a, b = Session(service.pin_table()), Session(service.pin_table())
    seq_a, _ = _reserve(service, a, b"\x02" * 32)
    seq_b, _ = _reserve(service, b, b"\x03" * 32)
    service.end_session(a)
    with pytest.raises(BadRequest):
        service.call(Op.COMMIT, proto.encode_commit(seq_a, [None]), a)
    assert await _commit(service, b, seq_b, 1) == 1
    assert not _stored(service, b"\x02" * 32) and _stored(service, b"\x03" * 32)
    # the key is free again for another writer
    seq, offsets = _reserve(service, b, b"\x02" * 32)
    assert offsets[0] is not None
    assert await _commit(service, b, seq, 1) == 1


async def test_a_commit_taken_outlives_its_session(service: NodeService) -> None:
    a = Session(service.pin_table())
    seq, _ = _reserve(service, a, b"\x04" * 32)
    done = service.call(Op.COMMIT, proto.encode_commit(seq, [None]), a)
    assert service.call(Op.TAKEN, proto.encode_taken(seq), a) == {"taken": True}
    service.end_session(a)
    assert proto.commit_reply(await done) == 1
    assert _stored(service, b"\x04" * 32)


async def test_a_session_without_a_transport_takes_local_reservations_only(
    service: NodeService,
) -> None:
    s = Session(service.pin_table())
    with pytest.raises(BadRequest):
        service.call(Op.RESERVE, proto.encode_reserve(NS, [(b"\x05" * 32, 0, SIZE)]), s)
    tenant = Session(service.pin_table())
    service.admit(tenant, "t1")
    with pytest.raises(Unauthorized):
        _reserve(service, tenant, b"\x05" * 32)
    with pytest.raises(Unauthorized):
        service.call(Op.LOCATE, proto.encode_locate(NS, [b"\x05" * 32], 0, 1.0), tenant)
    assert service.pool.stats().reserved == 0


async def test_reserved_bytes_are_bounded_per_session(tmp_path: Path) -> None:
    pool = BlockPool(tmp_path / "q.pool", 4 << 20, 1 << 20, node_id="q", persist=False)
    cfg = NodeConfig(conn_quota_share=0.01)  # about 41 KiB of 4 MiB
    svc = NodeService(pool, cfg, NullSink(), NodeMetrics(CollectorRegistry()))
    await svc.start()
    try:
        a, b = Session(svc.pin_table()), Session(svc.pin_table())
        hashes = [bytes([i]) * 32 for i in range(8)]
        seq, _ = _reserve(svc, a, *hashes)  # 32 KiB
        with pytest.raises(QuotaExceeded):
            _reserve(svc, a, *(bytes([i]) * 32 for i in range(8, 16)))
        seq_b, _ = _reserve(svc, b, *(bytes([i]) * 32 for i in range(8, 16)))  # b's own
        assert await _commit(svc, a, seq, 8) == 8
        assert await _commit(svc, b, seq_b, 8) == 8
    finally:
        await svc.close()
        pool.close(unlink=True)


def test_the_service_imports_no_transport() -> None:
    import ast

    import pegaflow.storage_node.drop as drop
    import pegaflow.storage_node.node_service as svc
    import pegaflow.storage_node.promotion as promotion
    import pegaflow.storage_node.puts as puts
    import pegaflow.storage_node.reads as reads
    import pegaflow.storage_node.sessions as sessions

    for mod in (svc, sessions, puts, reads, promotion, drop):  # the service and its rooms
        tree = ast.parse(Path(mod.__file__).read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        transports = ("ucx", "socket", "rpc", "local_control", "ucx_site", "loopthread")
        assert not [m for m in names if m.split(".")[-1] in transports or "ucxx" in m], names
