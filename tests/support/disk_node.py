"""A storage node with a small pool and a disk tier: its fixtures, data and metrics."""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pegaflow.client import SyncPegaClient
from pegaflow.storage_node.disk_files import DiskIO
from prometheus_client.parser import text_string_to_metric_families

from pegaflow.config import ClientConfig
from pegaflow.tools.devcluster import Proc, _temp_shm_dir, start_server
from tests.support.waiting import wait_for


class HeldIO(DiskIO):
    """Holds back every write of the slab files until ``release()``."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.waiting = threading.Semaphore(0)
        self.slab_fds: set[int] = set()

    def pwritev(self, fd: int, bufs: Sequence[Any], offset: int) -> int:
        if fd in self.slab_fds:
            self.waiting.release()
            assert self.open.wait(30)
        return super().pwritev(fd, bufs, offset)


NS = "disk-tier"


BLOCK = 64 << 10


POOL_BLOCKS = 32  # 2 MiB of 64 KiB blocks


WORKING_SET = 128  # 4x the pool


BATCH = 16


NODE = "disk-node"


def blocks(n: int, seed: int = 0) -> tuple[list[bytes], np.ndarray]:
    rng = np.random.default_rng(seed)
    hashes = [bytes(rng.integers(0, 255, 16, dtype=np.uint8)) for _ in range(n)]
    return hashes, rng.integers(0, 255, (n, BLOCK), dtype=np.uint8)


def server(
    disk: Path | str,
    shm: str,
    *,
    disk_bytes: str = "16MiB",
    prefix: Sequence[str] = (),
    extra: Sequence[str] = (),
) -> Proc:
    """A ``pegaflow-server`` with a 2 MiB pool and a disk tier in ``disk`` (run behind
    the command line ``prefix``, if any; ``extra``: more options)."""
    argv = [
        "--node-id", NODE, "--node-shm-dir", shm,
        "--node-pool-bytes", "2MiB", "--node-slab-bytes", "1MiB",
        "--node-disk-path", str(disk), "--node-disk-bytes", disk_bytes,
        "--node-disk-block-bytes", "64KiB", *extra,
    ]  # fmt: skip
    return start_server(extra=argv, prefix=prefix)


def client(p: Proc) -> SyncPegaClient:
    cfg = ClientConfig(
        coordinators=[p.ready["coordinator"]], lookup_timeout_s=5, transfer_timeout_s=20
    )
    return SyncPegaClient(cfg)


def metrics(p: Proc) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{p.ready['http']}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        s.name: s.value
        for fam in text_string_to_metric_families(text)
        if fam.name.startswith("pegaflow_node_disk")
        for s in fam.samples
    }


def wait_spilled(p: Proc, n: int = WORKING_SET - POOL_BLOCKS, what: str = "") -> None:
    """Until node ``p`` has written ``n`` evicted blocks to its disk tier (by default
    what a working set of :data:`WORKING_SET` evicts from the pool)."""
    wait_for(lambda: metrics(p)["pegaflow_node_disk_spills_total"] >= n,
             what or "the evicted blocks written to disk")  # fmt: skip


def put_all(c: SyncPegaClient, hashes: Sequence[bytes], data: np.ndarray) -> None:
    for i in range(0, len(hashes), BATCH):
        items = [(hashes[j], 0, data[j]) for j in range(i, min(i + BATCH, len(hashes)))]
        assert c.put_blocks(NS, items).stored == len(items)


def get_all(c: SyncPegaClient, hashes: Sequence[bytes]) -> tuple[list[bool], np.ndarray]:
    out = np.zeros((len(hashes), BLOCK), dtype=np.uint8)
    ok: list[bool] = []
    for i in range(0, len(hashes), BATCH):
        idx = range(i, min(i + BATCH, len(hashes)))
        ok += c.get_blocks(NS, [(NODE, hashes[j], 0, out[j]) for j in idx])
    return ok, out


def present(c: SyncPegaClient, hashes: Sequence[bytes]) -> list[bool]:
    """Per block, whether the index says it is stored."""
    return [c.lookup(NS, [h]).hits == 1 for h in hashes]


@pytest.fixture
def shm() -> Iterator[str]:
    yield _temp_shm_dir()

