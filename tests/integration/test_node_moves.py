"""A node that comes back at another address is reached there (issue 36, defect 4).

A client kept the node record it first learned: a node restarted on another UCX port
(or a pod with a new IP) was never reached again, and each failed load made vLLM claim
the same hits again (a livelock).  Real processes: etcd, a coordinator and a node whose
UCX port is chosen at each start (port 0), restarted on its own pool file (its blocks
are re-attached and republished under the same id).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from pegaflow.client import SyncPegaClient

from pegaflow.config import ClientConfig, EtcdConfig
from pegaflow.errors import PegaError
from pegaflow.tools.devcluster import Proc, free_port, start_coordinator, start_node

pytestmark = [pytest.mark.etcd, pytest.mark.ucx]

NS = "moves"
BLOCK = 64 << 10


def test_a_client_follows_a_node_restarted_at_another_address(
    etcd_config: EtcdConfig, tmp_path: Path, procs: list[Proc]
) -> None:
    etcd = etcd_config.endpoints[0]
    coord = start_coordinator(etcd=etcd, prefix=etcd_config.prefix)
    procs.append(coord)
    shm = tmp_path / "shm"
    shm.mkdir()
    node = start_node("m1", etcd=etcd, prefix=etcd_config.prefix, shm_dir=str(shm))
    procs.append(node)
    first = node.ready["ucx"]
    c = SyncPegaClient(ClientConfig(coordinators=[coord.ready["address"]], transfer_timeout_s=5.0))
    try:
        blocks = [bytes([i]) * 32 for i in range(1, 5)]
        data = [np.full(BLOCK, i, np.uint8) for i in range(1, 5)]
        assert (
            c.put_blocks(
                NS, [(h, 0, d) for h, d in zip(blocks, data, strict=True)], node_id="m1"
            ).stored
            == 4
        )

        def get() -> list[bool]:
            bufs = [np.zeros(BLOCK, np.uint8) for _ in blocks]
            got = c.get_blocks(NS, [("m1", h, 0, b) for h, b in zip(blocks, bufs, strict=True)])
            ok = [g and bool((b == d).all()) for g, b, d in zip(got, bufs, data, strict=True)]
            return ok

        assert get() == [True] * 4  # the client now knows m1 at its first address
        node.terminate()  # SIGTERM: it keeps its pool file
        node = start_node("m1", etcd=etcd, prefix=etcd_config.prefix, shm_dir=str(shm))
        procs.append(node)
        assert node.ready["ucx"] != first, "the node should have come back on another port"
        # the old address refuses: misses (never an exception), then the client learns
        # the node's new record and reaches it there, within a bound on a hang
        deadline = time.monotonic() + 60
        while get() != [True] * 4:
            assert time.monotonic() < deadline, "the client never reached the node again"
            time.sleep(0.2)
        # and lookups name it again (its blocks republished, any suspicion over)
        while c.lookup(NS, blocks).hits != 4:
            assert time.monotonic() < deadline, "lookups never found the node's blocks again"
            time.sleep(0.2)
    finally:
        c.close()


def _puts_reach(c: SyncPegaClient, node_id: str, within_s: float) -> int:
    """Puts of a new block to ``node_id`` until one is stored; how many failed first (a
    client that only puts: it never learns anything from a lookup)."""
    failed = 0
    deadline = time.monotonic() + within_s
    while True:
        block = np.random.default_rng().integers(0, 255, BLOCK, np.uint8)
        try:
            if c.put_blocks(NS, [(block.tobytes()[:32], 0, block)], node_id=node_id).stored:
                return failed
        except PegaError:
            failed += 1
        assert time.monotonic() < deadline, f"{failed} puts failed, none reached {node_id}"
        time.sleep(0.05)


@pytest.mark.parametrize("same_port", [False, True], ids=["moved", "same-port"])
def test_puts_to_a_named_node_reach_it_after_a_restart(
    etcd_config: EtcdConfig, tmp_path: Path, procs: list[Proc], same_port: bool
) -> None:
    """A client that only puts to a named node (``put_blocks(node_id=...)``, ``[client]
    local_node``) reaches it again after it was killed and restarted, at another port
    (it dialled the old address for good: 178 failed puts in 20 s) or the same one (its
    dead connection answered every request with a connection reset: 947 in 20 s)."""
    etcd = etcd_config.endpoints[0]
    coord = start_coordinator(etcd=etcd, prefix=etcd_config.prefix)
    procs.append(coord)
    shm = tmp_path / "shm"
    shm.mkdir()
    port = ["--node-ucx-port", str(free_port())] if same_port else []

    def node() -> Proc:
        p = start_node("m1", etcd=etcd, prefix=etcd_config.prefix, shm_dir=str(shm), extra=port)
        procs.append(p)
        return p

    first = node()
    c = SyncPegaClient(ClientConfig(coordinators=[coord.ready["address"]], transfer_timeout_s=2.0))
    try:
        assert _puts_reach(c, "m1", 10) == 0
        first.kill()
        second = node()
        assert (second.ready["ucx"] == first.ready["ucx"]) is same_port
        _puts_reach(c, "m1", 20)
    finally:
        c.close()
