"""A disk tier whose file system fills up after it opened: a real ``pegaflow-server``
whose disk tier lives on a real 8 MiB tmpfs, mounted in a user and mount namespace of
its own (``unshare -rm``: no privileges needed).

The tier preallocates its slab files, so a disk that fills up later only makes writes
fail on a file system that does not keep that reservation (copy-on-write, thin, or no
``fallocate``).  The test makes tmpfs such a one: once the tier is open it punches
holes over the slabs' payloads and fills the file system with another file, so that
every spill fails with a real ``ENOSPC`` from the kernel."""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from pegaflow.storage_node.disk_format import HEADER_BYTES

from pegaflow.tools.devcluster import Proc
from tests.support.disk_node import (
    BATCH,
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

FS_BYTES = 8 << 20
_PUNCH_HOLE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE


def _namespaces_work() -> bool:
    if shutil.which("unshare") is None:
        return False
    r = subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=10)
    return r.returncode == 0


pytestmark = [
    pytest.mark.ucx,
    pytest.mark.skipif(not _namespaces_work(), reason="no unprivileged namespaces"),
]


def on_tmpfs(mnt: Path) -> list[str]:
    """The command line prefix that runs a process with a fresh tmpfs at ``mnt``."""
    script = f'mount -t tmpfs -o size={FS_BYTES} tmpfs "$0" && exec "$@"'
    return ["unshare", "-rm", "sh", "-c", script, str(mnt)]


def fill_up(root: Path) -> Path:
    """Give back the slabs' reserved payload space, then fill the file system."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    for slab in (root / "disk").glob("pegaflow-disk.*.slab"):
        fd = os.open(slab, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size - HEADER_BYTES
            if libc.fallocate(fd, _PUNCH_HOLE, HEADER_BYTES, size) != 0:
                raise OSError(ctypes.get_errno(), f"punching holes in {slab}")
        finally:
            os.close(fd)
    filler = root / "filler"
    with open(filler, "wb", buffering=0) as f:
        chunk = bytes(64 << 10)
        try:
            while True:
                f.write(chunk)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    assert os.statvfs(root).f_bavail == 0
    return filler


def test_a_disk_that_fills_up_after_it_opened_leaves_the_memory_tier_serving(
    tmp_path: Path, shm: str, procs: list[Proc]
) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    p = server(mnt / "disk", shm, disk_bytes="4MiB", prefix=on_tmpfs(mnt))
    procs.append(p)
    root = Path(f"/proc/{p.pid}/root") / mnt.relative_to("/")  # the node's view of it
    filler = fill_up(root)
    c = client(p)
    try:
        hashes, data = blocks(WORKING_SET, seed=7)
        put_all(c, hashes, data)  # the memory tier takes every put; spills all fail
        evicted = WORKING_SET - POOL_BLOCKS
        wait_for(lambda: metrics(p)["pegaflow_node_disk_errors_total"] >= evicted,
                 "the failed spills counted")  # fmt: skip
        m = metrics(p)
        assert m["pegaflow_node_disk_spills_total"] == 0
        assert m["pegaflow_node_disk_blocks"] == 0
        assert p.alive()
        errs = [line for line in p.log if " ERROR " in line and "spill failed" in line]
        assert errs and "No space left on device" in errs[0], p.log[-20:]

        # what memory holds is served byte-exact; what could not be kept is a miss, and
        # is not listed in the index
        ok, out = get_all(c, hashes)
        assert ok == [i >= evicted for i in range(WORKING_SET)]
        assert np.array_equal(out[evicted:], data[evicted:])
        wait_for(lambda: not any(present(c, hashes[:evicted])), "the lost blocks unlisted")

        # room again: spills succeed and come back, no restart needed
        filler.unlink()
        more, more_data = blocks(POOL_BLOCKS + BATCH, seed=8)
        put_all(c, more, more_data)
        wait_spilled(p, BATCH, "spills written once there is room")
        ok, out = get_all(c, more[:BATCH])  # evicted from memory: on disk only
        assert all(ok) and np.array_equal(out, more_data[:BATCH])
    finally:
        c.close()
