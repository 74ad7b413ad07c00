"""The index says which tier holds a block, and the connector's cost model prices a disk
read apart from a memory read: the index's disk marks, the lookup reply's ``disk``
column (and that a reply without it still parses), the mirror's reading of a block
record's slot, the pricing, and a real ``pegaflow-server`` with a tiny pool and a disk
tier whose lookups report the blocks it spilled."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aetcd import rpc
from pegaflow.connector.metadata import LOCAL, LoadJob, WorkerReport, disk_source
from pegaflow.connector.scheduler.costmodel import CostModel
from pegaflow.coordinator.index import BlockIndex
from pegaflow.coordinator.inprocess_sink import InProcessSink
from pegaflow.coordinator.mirror import EtcdMirror
from pegaflow.coordinator.service import Coordinator

from pegaflow.config import CoordinatorConfig
from pegaflow.errors import BadRequest
from pegaflow.keys import DISK_SLOT, BlockLocation, Keyspace, NodeRecord
from pegaflow.protocol.codec import pack_bits, unpack, unpack_bits
from pegaflow.tools.devcluster import Proc
from tests.support.connector_fakes import BS, NS, FakeCluster, FakeLookup, FakeRequest, costed, toks
from tests.support.disk_node import (
    BATCH,
    NODE,
    POOL_BLOCKS,
    blocks,
    client,
    metrics,
    put_all,
    server,
)
from tests.support.disk_node import NS as DISK_NS  # a fixture
from tests.support.disk_node import shm as shm  # a fixture
from tests.support.waiting import wait_for

pytestmark = pytest.mark.ucx

H = [bytes([i]) * 16 for i in range(8)]


def hashes_on(idx: BlockIndex, ns: str = "ns") -> list[int]:
    return idx.on_disk(ns, H, [0])


# ---- the index --------------------------------------------------------------------------


def test_the_index_marks_disk_only_shards_and_forgets_them_when_they_go() -> None:
    idx = BlockIndex()
    idx.set_node(NodeRecord("a", "127.0.0.1", 1))
    for i, h in enumerate(H):
        idx.add("ns", h, 0, "a", i + 1, disk=i in (2, 5))
    assert hashes_on(idx) == [2, 5]
    idx.add("ns", H[2], 0, "a", 3)  # promoted back into memory (same generation)
    assert hashes_on(idx) == [5]
    idx.remove("ns", H[5], 0)
    assert hashes_on(idx) == [] and idx.on_disk("ns", H, [0]) == []
    # a block of two shards: on disk for a lookup of the shards that are
    idx.add("ns", H[0], 1, "a", 9, disk=True)
    assert idx.on_disk("ns", H[:1], [0, 1]) == [0] and idx.on_disk("ns", H[:1], [0]) == []
    assert idx.disk_shards("ns", H[0]) == {1}
    idx.remove_node("a")
    assert idx.disk_shards("ns", H[0]) == set() and idx.on_disk("ns", H, [0, 1]) == []


def test_the_in_process_sink_and_the_mirror_read_the_disk_slot() -> None:
    idx = BlockIndex()
    idx.set_node(NodeRecord("a", "127.0.0.1", 1))
    sink = InProcessSink(idx)
    sink.publish("ns", H[0], 0, BlockLocation("a", DISK_SLOT, 4, 64, 1))
    sink.publish("ns", H[1], 0, BlockLocation("a", 7, 5, 64, 1))
    assert hashes_on(idx) == [0]
    mirror = EtcdMirror(None, Keyspace("/p"), BlockIndex())  # type: ignore[arg-type]
    kv = rpc.KeyValue(key=b"k", value=BlockLocation("a", DISK_SLOT, 4, 64, 1).encode())
    assert mirror._location({}, kv) == ("a", 4, True)
    kv = rpc.KeyValue(key=b"k", value=BlockLocation("a", 0, 4, 64, 1).encode())
    assert mirror._location({}, kv) == ("a", 4, False)


# ---- the lookup reply -------------------------------------------------------------------


def test_the_bit_column_round_trips_and_refuses_bad_input() -> None:
    for n, on in ((1, [0]), (8, [0, 7]), (9, [8]), (1000, [3, 500, 999])):
        assert unpack_bits(pack_bits(on, n), n, "disk") == [i in on for i in range(n)]
    with pytest.raises(BadRequest, match="bytes"):
        unpack_bits(b"\x01\x00", 8, "disk")  # one byte too many
    with pytest.raises(BadRequest, match="past"):
        unpack_bits(b"\x10", 4, "disk")  # a bit beyond the last block
    with pytest.raises(BadRequest):
        unpack_bits([1], 1, "disk")


def coordinator_with(disk: set[int]) -> Coordinator:
    idx = BlockIndex()
    idx.set_node(NodeRecord("a", "127.0.0.1", 1))
    for i, h in enumerate(H[:4]):
        idx.add("ns", h, 0, "a", i + 1, disk=i in disk)
    return Coordinator(CoordinatorConfig(), index=idx)


@pytest.mark.parametrize("gens", [False, True])
def test_the_lookup_reply_carries_a_disk_column_only_when_a_hit_is_on_disk(gens: bool) -> None:
    args: dict[str, Any] = {"ns": "ns", "hashes": H[:6], "shards": [0], "gens": gens}
    memory = unpack(coordinator_with(set()).op_lookup(args), 1 << 20)
    assert memory["hits"] == 4 and "disk" not in memory  # as before: old clients see no change
    assert ("gens" in memory) == gens
    c = coordinator_with({1, 3})
    reply = unpack(c.op_lookup(args), 1 << 20)
    assert reply["hits"] == 4 and reply["blocks"] == [["a"]] * 4
    assert unpack_bits(reply["disk"], 4, "disk") == [False, True, False, True]
    assert ("gens" in reply) == gens
    assert c.lookup("ns", H[:6], [0])["disk"] == reply["disk"]  # the in-process form


# ---- pricing ----------------------------------------------------------------------------


def test_a_hit_on_a_slow_disk_is_declined_where_the_same_hit_in_memory_is_taken() -> None:
    m = CostModel("cuda", block_size=16, block_bytes=2 << 20)
    mem = m.choose([LOCAL] * 100, layerwise=True)
    assert mem.reason == "whole" and mem.blocks == 100 and mem.sync
    mostly_disk = [LOCAL] * 10 + [disk_source(LOCAL)] * 90
    d = m.choose(mostly_disk, layerwise=True)
    assert d.blocks == 10 and d.reason == "part"  # the memory part only
    assert m.choose([disk_source(LOCAL)] * 100, layerwise=True).reason == "declined"
    # the disk turns out fast: measured loads of disk blocks teach its own estimate
    for _ in range(10):
        m.observe_load(disk_source(LOCAL), 200 << 20, 0.01)  # 20 GB/s
    assert m.choose(mostly_disk, layerwise=True).blocks == 100
    assert m.source(LOCAL).samples == 0  # the memory estimate learned nothing


def test_a_remote_disk_never_starts_faster_than_its_node() -> None:
    m = CostModel("cpu", block_size=16, block_bytes=1 << 20)
    assert m.source(disk_source("n2")).rate <= m.source("n2").rate
    assert m.source(disk_source(LOCAL)).rate < m.source(LOCAL).rate
    assert m.source(disk_source("n2")).fixed_s > m.source("n2").fixed_s


def test_a_load_mostly_from_disk_is_filed_under_the_disk() -> None:
    job = LoadJob("r", [1, 2, 3], [b"a", b"b", b"c"], [["n"]] * 3, disk=[True, True, False])
    assert job.mostly_on_disk(range(3)) and not job.mostly_on_disk([2])
    assert not LoadJob("r", [1], [b"a"], [["n"]]).mostly_on_disk([0])  # no column: memory


class DiskCluster(FakeCluster):
    """A fake cluster whose lookups say which hit blocks are on disk."""

    def __init__(self) -> None:
        super().__init__()
        self.disk: set[bytes] = set()

    def lookup(self, ns: str, hashes: Any, *args: Any, **kwargs: Any) -> FakeLookup:
        res = super().lookup(ns, hashes, *args, **kwargs)
        res.on_disk = [h in self.disk for h in hashes[: res.hits]]  # type: ignore[attr-defined]
        return res


def test_the_scheduler_declines_a_hit_on_a_slow_remote_disk_and_probes_it() -> None:
    cl = DiskCluster()
    side, c = costed(cl)
    # n2 was measured fast (so its memory hits are taken) ...
    fast = [("n2", 10 << 21, 0.001), ("n2", 100 << 21, 0.006)] * 10
    side.update_connector_output(WorkerReport(samples=fast, block_bytes=2 << 20))
    req = FakeRequest("r1", toks(404), BS)
    for h in req.block_hashes[:100]:
        cl.blocks[(NS, h, 0)] = ("n2", b"x")
    assert side.get_num_new_matched_tokens(req, 0) == (400, True)
    # ... the same hit on n2's disk is declined, and n2's disk is probed
    cl.disk = set(req.block_hashes[:100])
    req2 = FakeRequest("r2", toks(404), BS)
    assert side.get_num_new_matched_tokens(req2, 0) == (0, False)
    assert c.totals()["cost_declined"] == 1
    (probe,) = [j for j in side.lookups.take_probes()]
    assert probe.probe and all(probe.disk) and probe.nodes[0] == ["n2"]
    # the probe measured the disk fast: the disk hit is taken
    disk = [(disk_source("n2"), 10 << 21, 0.001), (disk_source("n2"), 100 << 21, 0.006)] * 10
    side.update_connector_output(WorkerReport(samples=disk, block_bytes=2 << 20))
    req3 = FakeRequest("r3", toks(404), BS)
    assert side.get_num_new_matched_tokens(req3, 0) == (400, True)


# ---- a real server ----------------------------------------------------------------------


def test_a_real_lookup_reports_the_blocks_the_node_spilled_to_disk(
    tmp_path: Path, shm: str, procs: list[Proc]
) -> None:
    p = server(tmp_path / "disk", shm)
    procs.append(p)
    c = client(p)
    try:
        n = 3 * POOL_BLOCKS
        hashes, data = blocks(n, seed=7)
        put_all(c, hashes, data)
        wait_for(
            lambda: metrics(p)["pegaflow_node_disk_spills_total"] >= n - POOL_BLOCKS,
            "the evicted blocks written to disk",
        )
        # the node publishes a spilled block's disk location once its write is done
        wait_for(
            lambda: sum(c.lookup(DISK_NS, hashes).on_disk) >= n - POOL_BLOCKS,
            "the spilled blocks published on disk",
        )
        res = c.lookup(DISK_NS, hashes)
        assert res.hits == n and len(res.on_disk) == n
        # the oldest blocks were evicted to disk, the newest are in memory
        assert res.on_disk[0] and not res.on_disk[-1]
        assert sum(res.on_disk) == metrics(p)["pegaflow_node_disk_blocks"]
        # a get promotes a disk block into memory: the index says so
        first = hashes[:BATCH]
        out = np.zeros((BATCH, data.shape[1]), dtype=np.uint8)
        assert all(c.get_blocks(DISK_NS, [(NODE, h, 0, out[i]) for i, h in enumerate(first)]))
        wait_for(
            lambda: not any(c.lookup(DISK_NS, first).on_disk),
            "the promoted blocks published in memory",
        )
    finally:
        c.close()
