"""The disk tier inside a real node: a real ``pegaflow-server`` process with a 2 MiB
memory pool and a disk tier in a real directory, a working set several times the pool,
real UCX gets through ``pegaflow.client`` and the same-host locate path."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import pytest
from pegaflow.storage_node.disk_format import HEADER_BYTES

from pegaflow.tools.devcluster import Proc, start_server
from tests.support.disk_node import (
    BATCH,
    BLOCK,
    NODE,
    NS,
    POOL_BLOCKS,
    WORKING_SET,
    blocks,
    client,
    get_all,
    metrics,
    present,
    put_all,
    server,
    wait_spilled,
)
from tests.support.disk_node import shm as shm  # a fixture
from tests.support.waiting import wait_for

pytestmark = pytest.mark.ucx

RESERVE_BLOCKS = 4
"""kept free by spill-ahead (disk_spill_ahead_bytes: by default at most 1/8 of the pool)"""
IN_MEMORY = POOL_BLOCKS - RESERVE_BLOCKS
"""blocks left in the pool once the spill-ahead is done"""


def test_a_working_set_larger_than_memory_spills_and_comes_back_byte_exact(
    tmp_path: Path, shm: str, procs: list[Proc]
) -> None:
    p = server(tmp_path / "disk", shm)
    procs.append(p)
    c = client(p)
    try:
        hashes, data = blocks(WORKING_SET)
        put_all(c, hashes, data)
        wait_spilled(p)
        assert all(present(c, hashes))  # the index still has every block (most on disk)
        ok, out = get_all(c, hashes)
        assert all(ok) and np.array_equal(out, data)
        m = metrics(p)
        assert m["pegaflow_node_disk_promotions_total"] >= WORKING_SET - POOL_BLOCKS
        assert m["pegaflow_node_disk_hits_total"] >= WORKING_SET - POOL_BLOCKS
        assert m["pegaflow_node_disk_errors_total"] == 0

        # the same-host path: locate promotes the blocks only on disk, then they are
        # read straight out of the pool file
        node = p.ready["node"]
        first = hashes[:BATCH]  # evicted again by the gets behind them: on disk only
        pin, where = c.locate(NS, node, first, 0, 5.0)
        assert where.found.all()
        pool = c.local_pool(node)
        assert pool is not None
        with open(pool.path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
            for i, (off, size) in enumerate(
                zip(where.column("offset"), where.column("size"), strict=True)
            ):
                assert mm[int(off) : int(off) + int(size)] == data[i].tobytes()
        c.unpin(node, pin)
    finally:
        c.close()


def test_kill_9_mid_spill_then_restart_serves_only_verified_blocks(
    tmp_path: Path, shm: str, procs: list[Proc]
) -> None:
    disk = tmp_path / "disk"
    p = server(disk, shm)
    procs.append(p)
    hashes, data = blocks(WORKING_SET, seed=1)
    c = client(p)
    try:
        put_all(c, hashes, data)  # the last batches' evictions are still being written
    finally:
        c.close()
    p.kill()

    p = server(disk, shm)
    procs.append(p)
    c = client(p)
    try:
        on_disk = int(metrics(p)["pegaflow_node_disk_blocks"])
        # the spills written before the kill (those queued then are lost with the process)
        assert 0 < on_disk <= WORKING_SET - IN_MEMORY
        listed = present(c, hashes)
        # re-attached pool + disk, republished (a block written ahead whose slot was not
        # freed yet is in both)
        assert on_disk + IN_MEMORY - RESERVE_BLOCKS <= sum(listed) <= POOL_BLOCKS + on_disk
        ok, out = get_all(c, hashes)
        assert ok == listed  # what is listed is served, and nothing else
        for i in np.flatnonzero(ok):
            assert np.array_equal(out[i], data[i]), i
        assert metrics(p)["pegaflow_node_disk_errors_total"] == 0
    finally:
        c.close()


def test_a_corrupted_disk_block_is_refused_and_counted(
    tmp_path: Path, shm: str, procs: list[Proc]
) -> None:
    disk = tmp_path / "disk"
    p = server(disk, shm)
    procs.append(p)
    hashes, data = blocks(WORKING_SET, seed=2)
    c = client(p)
    try:
        put_all(c, hashes, data)
        wait_spilled(p, WORKING_SET - IN_MEMORY)  # evicted or written ahead
    finally:
        c.close()
    p.terminate()
    on_disk = WORKING_SET - IN_MEMORY  # the oldest blocks: only on disk
    slab = disk / "pegaflow-disk.0.slab"
    with open(slab, "r+b") as f:  # flip a byte in every slot's payload
        for slot in range((os.path.getsize(slab) - HEADER_BYTES) // BLOCK):
            f.seek(HEADER_BYTES + slot * BLOCK + 100)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0xFF]))

    p = server(disk, shm)
    procs.append(p)
    c = client(p)
    try:
        # the background check at start drops every corrupted block and unpublishes it
        wait_for(lambda: metrics(p)["pegaflow_node_disk_errors_total"] >= on_disk,
                 "the corrupted blocks refused")  # fmt: skip
        assert metrics(p)["pegaflow_node_disk_blocks"] == 0
        listed = present(c, hashes)
        ok, out = get_all(c, hashes)
        assert sum(listed) == sum(ok) == IN_MEMORY  # the pool's blocks, re-attached
        for i in range(WORKING_SET):
            if ok[i]:
                assert np.array_equal(out[i], data[i])
        assert not any(ok[:on_disk])  # the oldest: only on disk, all corrupted
    finally:
        c.close()


@pytest.mark.parametrize("why", ["no room", "not a directory"])
def test_a_disk_tier_that_cannot_be_used_leaves_the_memory_tier_serving(
    tmp_path: Path, shm: str, procs: list[Proc], why: str
) -> None:
    if why == "no room":
        disk, size = tmp_path / "disk", "1024TiB"
    else:
        (tmp_path / "file").write_bytes(b"x")
        disk, size = tmp_path / "file" / "disk", "16MiB"
    p = server(disk, shm, disk_bytes=size)
    procs.append(p)
    assert any(" ERROR " in line and "memory only" in line for line in p.log), p.log[-20:]
    c = client(p)
    try:
        hashes, data = blocks(POOL_BLOCKS, seed=3)
        put_all(c, hashes, data)
        ok, out = get_all(c, hashes)
        assert all(ok) and np.array_equal(out, data)
        m = metrics(p)
        assert m["pegaflow_node_disk_enabled"] == 0
    finally:
        c.close()


# ---- vLLM end to end (slow: two engine starts) ----------------------------------------

E2E_MAX_TOKENS = 8


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_prompts_larger_than_the_pool_are_served_from_disk_after_an_engine_restart(
    tmp_path: Path, shm: str, procs: list[Proc]
) -> None:
    """An engine computes and saves a prompt set about twice the memory pool (so most of
    its blocks end up only on disk); a new engine process asks for the same prompts and
    loads them, the oldest promoted from disk, with outputs equal to a run without any
    cache."""
    import shutil

    from tests.support.vllm_engine import VllmEngine, connector_stats, prompts, wait_saved

    if shutil.which("etcd") is None:
        pytest.skip("no etcd binary")
    # tiny Llama: 2 layers x K,V x 2 heads x 32 dims x 32 tokens x bf16 = 16 KiB a block
    prompt_set = prompts(12, 600, seed=17)  # 12 x 18 full blocks: 216 blocks, 3.4 MiB
    ref = VllmEngine({"connector": None}, name="reference")
    try:
        want = [ref.generate([p], E2E_MAX_TOKENS)["outputs"][0] for p in prompt_set]
    finally:
        ref.stop()
    argv = [
        "--node-id", NODE, "--node-shm-dir", shm,
        "--node-pool-bytes", "2MiB", "--node-slab-bytes", "1MiB",
        "--node-disk-path", str(tmp_path / "disk"), "--node-disk-bytes", "64MiB",
        "--node-disk-block-bytes", "64KiB",
    ]  # fmt: skip
    p = start_server(extra=argv)
    procs.append(p)

    def connector(stats: str) -> dict[str, object]:
        return {
            "coordinators": p.ready["coordinator"],
            "local_node": NODE,
            "stats_path": stats,
            "lookup_timeout_s": 2.0,
            "transfer_timeout_s": 10.0,
        }

    s1, s2 = str(tmp_path / "e1"), str(tmp_path / "e2")
    e1 = VllmEngine({"connector": connector(s1)}, name="e1")
    try:
        got = [e1.generate([q], E2E_MAX_TOKENS)["outputs"][0] for q in prompt_set]
        assert got == want
        st = wait_saved(s1, 12 * 18)
        assert st.get("save_blocks", 0) >= 12 * 18, st
    finally:
        e1.stop()
    spilled = metrics(p)["pegaflow_node_disk_spills_total"]
    assert spilled > 0  # most of the prompt set is only on disk now

    e2 = VllmEngine({"connector": connector(s2)}, name="e2")
    try:
        cached = []
        for q, w in zip(prompt_set, want, strict=True):
            r = e2.generate([q], E2E_MAX_TOKENS)
            assert r["outputs"][0] == w
            cached.append(r["cached"][0])
        assert all(c >= 512 for c in cached), cached  # every prompt loaded its prefix
        st = connector_stats(s2)
        assert st.get("load_failed_blocks", 0) == 0, st
    finally:
        e2.stop()
    m = metrics(p)
    assert m["pegaflow_node_disk_promotions_total"] > 0, m
    assert m["pegaflow_node_disk_errors_total"] == 0


def test_pegaflow_status_shows_the_disk_tier_of_the_nodes_that_have_one() -> None:
    from pegaflow.tools.cli import render_status

    nodes = [
        {"node_id": "a", "host": "h", "ucx_port": 1, "capacity_bytes": 1 << 30,
         "used_bytes": 1 << 29, "blocks": 3, "disk_capacity_bytes": 64 << 30,
         "disk_used_bytes": 16 << 30, "disk_blocks": 7},
        {"node_id": "b", "host": "h", "ucx_port": 2, "capacity_bytes": 1 << 30},
    ]  # fmt: skip
    lines = render_status({"nodes": nodes}).splitlines()
    assert "DISK" in lines[0].split()
    col = lines[0].index("DISK")
    assert lines[1][col:].startswith("16.0 GiB/64.0 GiB")
    assert lines[2][col:].startswith("-")
    assert "DISK" not in render_status({"nodes": nodes[1:]}).splitlines()[0]


def test_an_index_record_of_a_disk_block_keeps_the_five_fields_old_readers_read() -> None:
    import msgpack

    from pegaflow.keys import DISK_SLOT, BlockLocation

    disk = BlockLocation("n1", DISK_SLOT, 7, BLOCK, 99)
    raw = disk.encode()
    assert len(msgpack.unpackb(raw)) == 5  # what the coordinator's mirror checks
    assert BlockLocation.decode(raw) == disk and disk.tier == "disk"
    assert BlockLocation("n1", 0, 7, BLOCK, 99).tier == "memory"


def test_a_dropped_namespace_leaves_the_disk_tier_too(
    tmp_path: Path, shm: str, procs: list[Proc]
) -> None:
    """``drop`` removes the namespace's copies on disk as well as in memory: none is
    found after it, and a restart (which republishes what the disk holds) brings none
    back."""
    disk = tmp_path / "disk"
    p = server(disk, shm)
    procs.append(p)
    c = client(p)
    hashes, data = blocks(WORKING_SET, seed=5)
    try:
        put_all(c, hashes, data)
        wait_spilled(p)
        got = c.drop(NODE, NS)
        assert got.dropped + got.pinned <= WORKING_SET
        wait_for(lambda: not any(present(c, hashes)), "the namespace gone from the index")
        wait_for(lambda: metrics(p)["pegaflow_node_disk_blocks"] == 0, "the disk copies gone")
    finally:
        c.close()
    p.terminate()
    p2 = server(disk, shm)
    procs.append(p2)
    c2 = client(p2)
    try:
        assert not any(present(c2, hashes))
        ok, _ = get_all(c2, hashes[:BATCH])
        assert not any(ok)
    finally:
        c2.close()
