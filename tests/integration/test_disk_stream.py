"""A batched get of blocks held only on the disk tier streams: a real ``pegaflow-server``
with a 2 MiB pool and a disk tier in a real directory, real UCX gets.

A get sends its first blocks while its later blocks are still being read (the node
counts the blocks it sent ahead of the get's last disk read in
``pegaflow_node_disk_streamed_blocks``), every block is verified before it is sent, a
block whose read fails is a miss for that block only, and what was promoted stays in the
pool."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pegaflow.tools.devcluster import Proc
from tests.support.disk_node import (
    BLOCK,
    NODE,
    NS,
    WORKING_SET,
    blocks,
    client,
    metrics,
    put_all,
    server,
    wait_spilled,
)
from tests.support.disk_node import shm as shm  # a fixture
from tests.support.waiting import wait_for

pytestmark = pytest.mark.ucx

GET = 32  # one batched get, all of its blocks only on disk (the pool holds 32 blocks)


def get_batch(c: object, hashes: list[bytes]) -> tuple[list[bool], np.ndarray]:
    out = np.zeros((len(hashes), BLOCK), dtype=np.uint8)
    ok = c.get_blocks(NS, [(NODE, h, 0, out[i]) for i, h in enumerate(hashes)])  # type: ignore[attr-defined]
    return ok, out


def corrupt_on_disk(disk: Path, block: np.ndarray) -> None:
    """Flip a byte of ``block``'s payload in the slab file holding it."""
    slab = disk / "pegaflow-disk.0.slab"
    raw = slab.read_bytes()
    at = raw.find(block[:256].tobytes())
    assert at >= 0, "block not found on disk"
    with open(slab, "r+b") as f:
        f.seek(at + 1000)
        b = f.read(1)
        f.seek(at + 1000)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.fixture
def node(
    tmp_path: Path, shm: str, procs: list[Proc]
) -> Iterator[tuple[Proc, list[bytes], np.ndarray]]:
    p = server(tmp_path / "disk", shm)
    procs.append(p)
    hashes, data = blocks(WORKING_SET, seed=11)
    c = client(p)
    try:
        put_all(c, hashes, data)
    finally:
        c.close()
    wait_spilled(p)
    yield p, hashes, data


def test_a_batched_get_from_disk_sends_its_first_blocks_before_its_last_read(
    node: tuple[Proc, list[bytes], np.ndarray],
) -> None:
    p, hashes, data = node
    c = client(p)
    try:
        before = metrics(p)
        ok, out = get_batch(c, hashes[:GET])  # the oldest blocks: only on disk
        assert all(ok), [i for i, x in enumerate(ok) if not x]
        assert np.array_equal(out, data[:GET])
        m = metrics(p)
        assert m["pegaflow_node_disk_hits_total"] - before["pegaflow_node_disk_hits_total"] == GET
        # sends went out while later blocks of the same get were still being read
        assert m["pegaflow_node_disk_streamed_blocks_total"] > 0, m
        assert m["pegaflow_node_disk_errors_total"] == 0

        # the promoted blocks were committed in the pool: a second get reads no disk
        ok, out = get_batch(c, hashes[:GET])
        assert all(ok), [i for i, x in enumerate(ok) if not x]
        assert np.array_equal(out, data[:GET])
        assert metrics(p)["pegaflow_node_disk_hits_total"] == m["pegaflow_node_disk_hits_total"]
    finally:
        c.close()


def test_a_failed_disk_read_in_a_streamed_get_is_a_miss_for_that_block_only(
    tmp_path: Path, node: tuple[Proc, list[bytes], np.ndarray]
) -> None:
    p, hashes, data = node
    bad = 5
    corrupt_on_disk(tmp_path / "disk", data[bad])
    c = client(p)
    try:
        ok, out = get_batch(c, hashes[:GET])
        assert ok == [i != bad for i in range(GET)]
        for i in range(GET):
            if i != bad:
                assert np.array_equal(out[i], data[i]), i
        assert metrics(p)["pegaflow_node_disk_errors_total"] == 1
        wait_for(lambda: c.lookup(NS, [hashes[bad]]).hits == 0, "the refused block unpublished")
    finally:
        c.close()
