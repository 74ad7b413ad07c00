"""The same-host shortcut against a real ``pegaflow-server`` process: blocks copied
straight between a KV cache and the node's pool file, pinned while read, verified."""

from __future__ import annotations

import asyncio
import os
import stat
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from pegaflow.client import SyncPegaClient
from pegaflow.connector.media.hostpool import MappedPool
from pegaflow.connector.media.kvio import KVBlockIO
from pegaflow.connector.media.localpath import LocalPath

from pegaflow.deadline import Deadline
from pegaflow.errors import BadRequest, TooLarge, Unauthorized
from pegaflow.protocol.codec import LocatedBlock, LocatedBlocks
from pegaflow.protocol.framing import UNIX_PREFIX
from pegaflow.tools.devcluster import Proc
from pegaflow.transport.rpc_client import RpcClient
from tests.support.tenant_server import client_of, tenant_server

pytestmark = pytest.mark.ucx

NS = "test-local"


@pytest.fixture(scope="module")
def server() -> Iterator[Proc]:
    p = tenant_server("64MiB")
    try:
        yield p
    finally:
        p.terminate()


def _data_address(c: SyncPegaClient, node: str) -> str:
    """The UCX address of ``node``."""
    return c.nodes()[node].ucx_address


def _pool_id(c: SyncPegaClient, node: str) -> tuple[int, int]:
    """The (device, inode) of ``node``'s pool file, which a local reservation names."""
    pool = c.local_pool(node)
    assert pool is not None
    return pool.file_id


def _over_socket(c: SyncPegaClient, node: str) -> bool:
    """Whether ``c``'s session with ``node`` asks its same-host ops over the socket."""
    return c.node_session(node).over_socket


def _same_host(c: SyncPegaClient, node: str, msg: dict[str, Any]) -> Any:
    """``msg`` asked the way ``c``'s session with ``node`` asks its same-host ops."""
    session = c.node_session(node)._session
    return c._on_loop(lambda a: session._same_host(dict(msg), Deadline.after(5.0)), 5.0)


def _refused_on_both_transports(
    c: SyncPegaClient, node: str, addr: str, bad: list[dict[str, Any]]
) -> None:
    """Each malformed request gets a typed error over UCX and over the control socket."""
    for msg in bad:
        with pytest.raises((BadRequest, TooLarge)):
            c._on_loop(lambda a, msg=msg: a._data.call(addr, dict(msg), 5.0), 5.0)
        with pytest.raises((BadRequest, TooLarge)):
            _same_host(c, node, msg)


def _kv(num_blocks: int, seed: int) -> dict[str, torch.Tensor]:
    """Per-layer caches shaped like vLLM's FlashAttention layout: (blocks, H, N, 2*D)."""
    g = torch.Generator().manual_seed(seed)
    return {
        f"model.layers.{i}.self_attn.attn": torch.randn(num_blocks, 2, 16, 16, generator=g).to(
            torch.bfloat16
        )
        for i in range(4)
    }


def test_save_then_load_into_other_blocks_is_byte_identical(server: Proc) -> None:
    node = server.ready["node"]
    c = client_of(server)
    src_kv, dst_kv = _kv(32, 1), _kv(32, 2)
    src, dst = KVBlockIO(src_kv, 32), KVBlockIO(dst_kv, 32)
    writer, reader = LocalPath(src, node, 5.0), LocalPath(dst, node, 5.0)
    try:
        assert writer.attach(c) and reader.attach(c)
        hashes = [bytes([i]) * 16 for i in range(10)]
        out = writer.save(c, NS, hashes, 0, list(range(3, 13))).result(30)
        assert (out.stored, out.failed) == (10, 0)
        assert c.lookup(NS, hashes).hits == 10
        again = writer.save(c, NS, hashes[:4], 0, [3, 4, 5, 6]).result(30)
        assert again.skipped == 4  # already stored: nothing rewritten
        targets = list(range(20, 30))
        pending = reader.start_load(c, NS, hashes, 0, targets)
        assert pending.on_device  # the writer's digests came back with locate
        assert pending.finish() == [True] * 10
        for name in src_kv:
            assert torch.equal(dst_kv[name][20:30], src_kv[name][3:13])
        # a block the node does not have is a miss, the others still load
        ok = reader.start_load(c, NS, [hashes[0], b"\xee" * 16], 0, [0, 1]).finish()
        assert ok == [True, False]
    finally:
        writer.close()
        reader.close()
        c.close()


def test_a_corrupted_slot_is_never_loaded(server: Proc) -> None:
    node = server.ready["node"]
    c = client_of(server)
    kv = _kv(8, 3)
    io = KVBlockIO(kv, 8)
    path = LocalPath(io, node, 5.0)
    try:
        assert path.attach(c)
        hashes = [b"c" * 15 + bytes([i]) for i in range(2)]
        assert path.save(c, NS, hashes, 0, [0, 1]).result(30).stored == 2
        pin, where = c.locate(NS, node, [hashes[1]], 0, 5.0)
        assert where[0] is not None and path.pool is not None
        path.pool.view(where[0].offset, 64)[:] ^= 0xFF  # flip bits in the stored slot
        c.unpin(node, pin)
        before = {k: v.clone() for k, v in kv.items()}
        ok = path.start_load(c, NS, hashes, 0, [5, 6]).finish()
        assert ok == [True, False]
        for name in kv:
            assert torch.equal(kv[name][5], before[name][0])
    finally:
        path.close()
        c.close()


def test_blocks_without_a_digest_are_checked_by_xxh3(server: Proc) -> None:
    node = server.ready["node"]
    c = client_of(server)
    src_kv, dst_kv = _kv(8, 4), _kv(8, 5)
    src, dst = KVBlockIO(src_kv, 8), KVBlockIO(dst_kv, 8)
    src.can_digest = False  # e.g. a block written before a node restart
    writer, reader = LocalPath(src, node, 5.0), LocalPath(dst, node, 5.0)
    try:
        assert writer.attach(c) and reader.attach(c)
        hashes = [b"x" * 15 + bytes([i]) for i in range(3)]
        assert writer.save(c, NS, hashes, 0, [0, 1, 2]).result(30).stored == 3
        pending = reader.start_load(c, NS, hashes, 0, [5, 6, 7])
        assert not pending.on_device
        assert pending.finish() == [True] * 3
        for name in src_kv:
            assert torch.equal(dst_kv[name][5:8], src_kv[name][0:3])
    finally:
        writer.close()
        reader.close()
        c.close()


def test_tenants_get_no_pool_access(server: Proc) -> None:
    node = server.ready["node"]
    acme = client_of(server, "a-secret")
    try:
        assert acme.local_pool(node) is None
        with pytest.raises(Unauthorized):
            acme.reserve_local("acme@m", node, [(b"x" * 16, 0, 4096)], (0, 0))
    finally:
        acme.close()


def test_mapped_pool_refuses_a_different_file(server: Proc, tmp_path: object) -> None:
    c = client_of(server)
    try:
        info = c.local_pool(server.ready["node"])
        assert info is not None
        with MappedPool(info) as pool:
            assert pool.size == info.size
            assert isinstance(pool.view(0, 16), np.ndarray)
        from dataclasses import replace

        with pytest.raises(OSError, match="not the node's pool file"):
            MappedPool(replace(info, ino=info.ino + 1))
    finally:
        c.close()


def test_malformed_locates_get_typed_errors_and_the_node_keeps_serving(server: Proc) -> None:
    node = server.ready["node"]
    c = client_of(server)
    try:
        addr = _data_address(c, node)
        base = {"op": "locate", "ns": NS, "ttl_ms": 1000, "shard": 0, "hash_len": 16}
        bad = [
            {**base, "hashes": b"x" * 17},  # not a multiple of hash_len
            {**base, "hashes": [b"x" * 16]},  # not bytes
            {**base, "hash_len": 0, "hashes": b""},
            {**base, "shard": -1, "hashes": b"x" * 16},
            {**base, "hashes": b"x" * 16 * 5000},  # more than max_batch
        ]
        _refused_on_both_transports(c, node, addr, bad)
        pin, where = c.locate(NS, node, [b"y" * 16], 0, 1.0)
        assert len(where) == 1 and where[0] is None and pin > 0
    finally:
        c.close()


def _stored(server: Proc, c: SyncPegaClient, seed: int) -> list[bytes]:
    """Four blocks saved through the pool file; their hashes."""
    kv = _kv(8, seed)
    writer = LocalPath(KVBlockIO(kv, 8), server.ready["node"], 5.0)
    try:
        assert writer.attach(c)
        hashes = [bytes([seed, i]) * 8 for i in range(4)]
        assert writer.save(c, NS, hashes, 0, [0, 1, 2, 3]).result(30).failed == 0
        return hashes
    finally:
        writer.close()


def test_locate_goes_over_the_control_socket_and_falls_back_to_ucx(server: Proc) -> None:
    node = server.ready["node"]
    c = client_of(server)
    try:
        hashes = _stored(server, c, 7)  # saved through the socket (reserve, commit)
        pool = c.local_pool(node)
        assert pool is not None and pool.control and os.path.exists(pool.control)
        assert stat.S_IMODE(os.stat(pool.control).st_mode) & 0o077 == 0  # the node's user only
        assert _over_socket(c, node)
        pin, where = c.locate(NS, node, hashes, 0, 5.0)
        assert where.found.all()
        c.unpin(node, pin)
    finally:
        c.close()
    # a client that cannot reach the socket (another host, say) is answered over UCX,
    # and keeps to UCX on that connection: its saves work too
    c2 = client_of(server)
    moved = pool.control + ".away"
    try:
        assert c2.local_pool(node).control == pool.control
        os.rename(pool.control, moved)
        try:
            pin2, where2 = c2.locate(NS, node, hashes, 0, 5.0)
        finally:
            os.rename(moved, pool.control)
        assert not _over_socket(c2, node)
        assert where2.to_wire() == where.to_wire()
        c2.unpin(node, pin2)
        _stored(server, c2, 8)
    finally:
        c2.close()


def test_packed_reservations_and_their_malformed_forms(server: Proc) -> None:
    node = server.ready["node"]
    c = client_of(server)
    try:
        stored = _stored(server, c, 9)
        addr = _data_address(c, node)
        fresh = [b"\xf1\xf2" * 8, b"\xf1\xf3" * 8]
        blocks = [(h, 0, 4096) for h in [*stored[:2], *fresh]]  # one shard, one size: packed
        pool = _pool_id(c, node)
        seq, offsets = c.reserve_local(NS, node, blocks, pool, 5.0)
        assert offsets[:2] == [None, None] and None not in offsets[2:]  # stored: no slot
        c.abort_local(node, seq)
        base = {"op": "reserve", "ns": NS, "local": True, "shard": 0, "size": 4096,
                "pool": list(pool)}  # fmt: skip
        bad = [
            {**base, "hash_len": 16, "hashes": b"x" * 17},  # not a multiple of hash_len
            {**base, "hash_len": 0, "hashes": b""},
            {**base, "hash_len": 16, "size": 0, "hashes": b"x" * 16},
            {**base, "hash_len": 16, "local": False, "hashes": b"x" * 16},  # UCX puts list
            {**base, "hash_len": 16, "hashes": b"x" * 16 * 70000},  # more than max_batch
        ]
        _refused_on_both_transports(c, node, addr, bad)
        assert c.locate(NS, node, stored, 0, 1.0)[1].found.all()
    finally:
        c.close()


def test_a_socket_reservation_is_committed_on_the_socket_only(server: Proc) -> None:
    node = server.ready["node"]
    c = client_of(server)
    try:
        addr = _data_address(c, node)
        seq, offsets = c.reserve_local(NS, node, [(b"\x31" * 16, 0, 4096)], _pool_id(c, node), 5.0)
        assert offsets[0] is not None
        commit = {"op": "commit", "seq": seq, "xxh3": [None]}
        with pytest.raises(BadRequest):  # over UCX: not that connection's reservation
            c._on_loop(lambda a: a._data.call(addr, dict(commit), 5.0), 5.0)
        c.abort_local(node, seq)
        with pytest.raises(BadRequest):  # aborted: gone
            _same_host(c, node, commit)
    finally:
        c.close()


def test_the_control_socket_admits_the_cluster_token_only(server: Proc) -> None:
    node = server.ready["node"]
    c = client_of(server)
    try:
        path = c.local_pool(node).control
    finally:
        c.close()

    async def locate(token: str | None) -> Any:
        rpc = RpcClient([UNIX_PREFIX + path], token=token)
        try:
            args = {"ns": NS, "ttl_ms": 100, "shard": 0, "hash_len": 16, "hashes": b"z" * 16}
            return await rpc.call("locate", args, timeout=5.0)
        finally:
            await rpc.close()

    for token in ("a-secret", None, "wrong"):  # a tenant's, none, a wrong one
        with pytest.raises(Unauthorized):
            asyncio.run(locate(token))
    assert asyncio.run(locate("admin"))["flags"] == b"\x00"


def test_located_blocks_round_trip_the_wire() -> None:
    rows = [(4096, 2048, 7, (1 << 64) - 5, -3), None, (0, 2048, 1, 9, None)]
    where = LocatedBlocks.build(rows)
    # what a node sends, from rows packed once per block, is the same
    packed = [None if r is None else LocatedBlocks.wire_row(*r) for r in rows]
    assert LocatedBlocks.wire_rows(packed) == where.to_wire()
    back = LocatedBlocks.from_wire(where.to_wire(), 3)
    assert back[0] == LocatedBlock(4096, 2048, 7, (1 << 64) - 5, -3)
    assert back[1] is None and back[2] == LocatedBlock(0, 2048, 1, 9, None)
    assert back.found.tolist() == [True, False, True]
    assert back[1:].column("offset").tolist() == [0, 0]
    with pytest.raises(BadRequest):
        LocatedBlocks.from_wire(where.to_wire(), 4)


def test_runs_of_consecutive_blocks_for_2d_copies() -> None:
    mib = 1 << 20
    offsets = [0, 2 * mib, 4 * mib, 6 * mib, 40 * mib, 42 * mib, 44 * mib]
    ids = [10, 11, 12, 20, 21, 22, 23]
    # a break where the cache ids jump, where the host step changes, never across a piece
    assert KVBlockIO._runs(offsets, ids) == [(0, 3, 2 * mib), (3, 1, 0), (4, 3, 2 * mib)]
    assert KVBlockIO._runs(offsets, ids, piece=4 * mib) == [
        (0, 2, 2 * mib), (2, 1, 0), (3, 1, 0), (4, 2, 2 * mib), (6, 1, 0),
    ]  # fmt: skip
    far = [0, 1 << 30]  # a step too large for a 2-D copy's pitch
    assert KVBlockIO._runs(far, [1, 2]) == [(0, 1, 0), (1, 1, 0)]
    assert KVBlockIO._runs([], []) == []


def _served_bytes(server: Proc) -> float:
    """The server's ``pegaflow_node_get_bytes_total``, from its ``/metrics``."""
    import urllib.request

    url = f"http://127.0.0.1:{server.ready['http']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    line = next(x for x in text.splitlines() if x.startswith("pegaflow_node_get_bytes_total"))
    return float(line.split()[-1])


def test_located_bytes_count_as_served(server: Proc) -> None:
    """A same-host hit serves its bytes as a get does (the dashboard read 0 B served)."""
    node = server.ready["node"]
    c = client_of(server)
    try:
        hashes = _stored(server, c, 9)
        before = _served_bytes(server)
        pin, where = c.locate(NS, node, hashes, 0, 5.0)
        c.unpin(node, pin)
    finally:
        c.close()
    located = int(where.cols[:, 1].sum())
    assert located > 0
    for _ in range(50):  # counted on the node's data loop, a moment later
        if _served_bytes(server) - before == located:
            return
        time.sleep(0.1)
    assert _served_bytes(server) - before == located
