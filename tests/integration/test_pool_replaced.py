"""A node restarted on a new pool file under a running same-host engine (issue 36,
defect 1).

The node is stopped and its pool file removed (a cleaned ``/dev/shm``, a new
emptyDir), then started again at the same path, while an engine's connector keeps its
mapping of the old file.  Before, the engine went on writing through that mapping; the
node hashed what its new slots held (zeros), published them with valid checksums, and a
reader over UCX loaded all of them without an error.  Now a reservation names the file
its writer maps and the node refuses another (``PoolChanged``); a ``locate`` answer
names the node's file and a reader mapping another refuses it; either way the
connector maps the new file and goes on.  Real processes: etcd, a coordinator and a
node; the connector's own same-host path (:class:`LocalPath`) on a CPU KV cache.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
from pegaflow.client import SyncPegaClient
from pegaflow.connector.media.kvio import KVBlockIO
from pegaflow.connector.media.localpath import LocalPath

from pegaflow.config import ClientConfig, EtcdConfig
from pegaflow.errors import PoolChanged
from pegaflow.tools.devcluster import Proc, start_coordinator, start_node

pytestmark = [pytest.mark.etcd, pytest.mark.ucx]

NS = "replaced"
BLOCKS = 8


def _kv(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        f"model.layers.{i}.self_attn.attn": torch.randn(BLOCKS, 2, 16, 16, generator=g)
        for i in range(4)
    }


def _expected(io: KVBlockIO, ids: list[int]) -> list[np.ndarray]:
    """The bytes of KV blocks ``ids`` as a save stores them."""
    bb = io.block_bytes
    host = torch.zeros(len(ids) * bb, dtype=torch.uint8)
    io.copy_out(ids, host, [i * bb for i in range(len(ids))])
    return [host[i * bb : (i + 1) * bb].numpy().copy() for i in range(len(ids))]


def _read_over_ucx(c: SyncPegaClient, hashes: list[bytes], bb: int) -> list[np.ndarray | None]:
    """Each block as a UCX reader gets it (None: a miss)."""
    bufs = [np.zeros(bb, np.uint8) for _ in hashes]
    got = c.get_blocks(NS, [("m1", h, 0, b) for h, b in zip(hashes, bufs, strict=True)])
    return [b if ok else None for ok, b in zip(got, bufs, strict=True)]


def _save(path: LocalPath, c: SyncPegaClient, hashes: list[bytes], ids: list[int]) -> int:
    """Blocks stored by one save through the pool file (raises as the save does)."""
    assert path.attach(c)
    return path.save(c, NS, hashes, 0, ids).result(30).stored


def test_a_replaced_pool_file_is_never_written_or_read_through_the_old_mapping(
    etcd_config: EtcdConfig, tmp_path: Path, procs: list[Proc]
) -> None:
    etcd = etcd_config.endpoints[0]
    coord = start_coordinator(etcd=etcd, prefix=etcd_config.prefix)
    procs.append(coord)
    shm = tmp_path / "shm"
    shm.mkdir()

    def node() -> Proc:
        p = start_node(
            "m1", etcd=etcd, prefix=etcd_config.prefix, pool="64MiB", slab="4MiB", shm_dir=str(shm)
        )
        procs.append(p)
        return p

    first = node()
    c = SyncPegaClient(ClientConfig(coordinators=[coord.ready["address"]], transfer_timeout_s=5.0))
    writer_kv, reader_kv, other_kv = _kv(1), _kv(2), _kv(3)
    writer = LocalPath(KVBlockIO(writer_kv, BLOCKS), "m1", 5.0)
    reader = LocalPath(KVBlockIO(reader_kv, BLOCKS), "m1", 5.0)
    other = LocalPath(KVBlockIO(other_kv, BLOCKS), "m1", 5.0)
    bb = writer.io.block_bytes
    try:
        before = [bytes([1, i]) * 8 for i in range(4)]
        assert _save(writer, c, before, [0, 1, 2, 3]) == 4
        assert reader.attach(c)  # both map the first pool file
        old_pool = writer.pool
        assert old_pool is not None

        first.terminate()
        for f in shm.iterdir():  # a cleaned /dev/shm: the pool file and journal go
            f.unlink()
        node()
        deadline = time.monotonic() + 60
        while c.lookup(NS, before).hits:  # the old node's entries leave with its record
            assert time.monotonic() < deadline
            time.sleep(0.1)

        # the writer still maps the old file: its reservation is refused, nothing published
        after = [bytes([2, i]) * 8 for i in range(4)]
        with pytest.raises(PoolChanged):
            _save(writer, c, after, [4, 5, 6, 7])
        assert c.lookup(NS, after).hits == 0
        assert writer.pool is None  # retired; the next save maps the node's new file
        assert _save(writer, c, after, [4, 5, 6, 7]) == 4
        assert writer.pool is not None and writer.pool is not old_pool
        want = _expected(writer.io, [4, 5, 6, 7])
        got = _read_over_ucx(c, after, bb)
        assert all(g is not None for g in got), "the blocks saved after the change are stored"
        for g, w in zip(got, want, strict=True):
            assert g is not None and np.array_equal(g, w), "a UCX reader gets the engine's KV"
            assert g.any()  # not the zeros the old mapping's writes left in the new file

        # a reader still mapping the old file: its load is refused, then it maps the new one
        fresh = [bytes([3, i]) * 8 for i in range(3)]
        assert _save(other, c, fresh, [0, 1, 2]) == 3
        scratch = {k: v.clone() for k, v in reader_kv.items()}
        with pytest.raises(PoolChanged):
            reader.start_load(c, NS, fresh, 0, [5, 6, 7])
        for name in reader_kv:  # nothing copied from the old file
            assert torch.equal(reader_kv[name], scratch[name])
        assert reader.attach(c)
        assert reader.start_load(c, NS, fresh, 0, [5, 6, 7]).finish() == [True] * 3
        for name in reader_kv:
            assert torch.equal(reader_kv[name][5:8], other_kv[name][0:3])
    finally:
        for p in (writer, reader, other):
            p.close()
        c.close()
