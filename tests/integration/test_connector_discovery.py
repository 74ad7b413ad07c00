"""Same-host discovery: the connector finds the storage node on its own host by itself.

Against real processes: a ``pegaflow-server``, and a cluster (etcd, a coordinator, one
node that offers its pool file and one that does not).  "On this host" means: a node the
coordinator knows whose pool file this process can open as the very file the node
described (path, device and inode), so it works the same for ``pegaflow-server`` and for
one ``pegaflow-node`` per host.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import replace
from typing import Any

import pytest
import torch
from pegaflow.client import SyncPegaClient
from pegaflow.client.samehost import PoolFile, on_this_host, open_pool_file
from pegaflow.connector.discovery import LocalNodeFinder
from pegaflow.connector.metadata import LoadJob, SaveJob, StepPlan
from pegaflow.connector.metrics import Counters
from pegaflow.connector.scheduler.side import SchedulerSide
from pegaflow.connector.settings import ConnectorSettings
from pegaflow.connector.worker.side import WorkerSide

from pegaflow.config import ClientConfig
from pegaflow.tools.devcluster import Proc, start_coordinator, start_node

pytestmark = [pytest.mark.etcd, pytest.mark.ucx]

NS = "test-discovery"
NB = 8


def _client(coordinator: str) -> SyncPegaClient:
    return SyncPegaClient(ClientConfig(coordinators=[coordinator], lookup_timeout_s=2.0))


def test_addresses_of_this_host() -> None:
    assert on_this_host("127.0.0.1") and on_this_host("127.0.0.7") and on_this_host("localhost")
    assert on_this_host(socket.gethostname())
    assert on_this_host("0.0.0.0")
    assert not on_this_host("198.18.0.77")  # not assigned here: bind() fails, nothing is sent
    assert not on_this_host("no-such-host.invalid")
    assert not on_this_host("")


def test_a_pool_file_is_only_opened_when_it_is_the_same_file(tmp_path: Any) -> None:
    f = tmp_path / "pool"
    f.write_bytes(b"\0" * 8192)
    st = os.stat(f)
    info = PoolFile(str(f), st.st_dev, st.st_ino, 8192)
    os.close(open_pool_file(info))
    bad_ones = [
        replace(info, ino=st.st_ino + 1),
        replace(info, dev=st.st_dev + 1),
        replace(info, size=1 << 20),
        replace(info, path=str(tmp_path / "absent")),
    ]
    for bad in bad_ones:
        with pytest.raises(OSError):
            open_pool_file(bad)


def test_the_server_node_is_found_with_no_configuration(server: Proc) -> None:
    c = _client(server.ready["coordinator"])
    try:
        found = c.local_nodes(timeout=5.0)
    finally:
        c.close()
    assert [n.record.node_id for n in found] == [server.ready["node"]]
    assert found[0].pool.path.endswith(".pool") and os.path.exists(found[0].pool.path)


def test_cluster_finds_the_node_whose_pool_it_can_open(etcd_server: Any, caplog: Any) -> None:
    prefix = f"/pegaflow/discovery-{os.getpid()}"
    coord = start_coordinator(etcd=etcd_server.endpoint, prefix=prefix)
    small = {"etcd": etcd_server.endpoint, "prefix": prefix, "pool": "32MiB", "slab": "4MiB"}
    nodes = [
        start_node("here", **small),
        start_node("closed", **small, extra=["--node-local-access", "false"]),
    ]
    c = _client(coord.ready["address"])
    try:
        deadline = time.monotonic() + 60
        while len(c.nodes()) < 2:
            assert time.monotonic() < deadline, "nodes did not join"
            time.sleep(0.1)
        assert [n.record.node_id for n in c.local_nodes(timeout=5.0)] == ["here"]
        caplog.set_level(logging.INFO, "pegaflow.connector")
        finder = LocalNodeFinder("", timeout=5.0, announce=True)
        assert finder.find(c) == "here"
        assert "same-host node here found: pool" in caplog.text
        # only the node that offers nothing left: none, and the log says what that costs
        nodes[0].kill()
        deadline = time.monotonic() + 60
        while "here" in c.nodes():
            assert time.monotonic() < deadline, "the killed node's lease did not expire"
            time.sleep(0.2)
        caplog.clear()
        finder = LocalNodeFinder("", timeout=5.0, announce=True)
        assert finder.find(c) == ""
        assert "no storage node on this host" in caplog.text and "closed" in caplog.text
    finally:
        c.close()
        for p in nodes:
            p.kill()
        coord.kill()


def test_an_override_is_used_as_given_and_nothing_is_asked() -> None:
    finder = LocalNodeFinder("n7", timeout=1.0)
    assert finder.node == "n7" and finder.wait(0) == "n7"
    assert finder.find(object()) == "n7"  # no client call at all


def test_scheduler_and_worker_find_the_node_at_engine_start(server: Proc, caplog: Any) -> None:
    """The three keys alone (no local_node): the scheduler's warm-up finds the node and
    answers whole same-host hits layer-wise; the worker saves through the pool file and
    loads from it, with no UCX hop."""
    caplog.set_level(logging.INFO, "pegaflow.connector")
    coordinator, node = server.ready["coordinator"], server.ready["node"]
    settings = ConnectorSettings.load({"coordinators": coordinator}, env={})
    assert settings.local_node == ""
    caches = {f"layers.{i}.attn": torch.randn(NB, 2, 4, 8).to(torch.bfloat16) for i in range(2)}
    wc = Counters()
    w = WorkerSide(settings, 0, wc, lambda: _client(coordinator))
    side = SchedulerSide(
        settings, 4, 1, namespace=lambda: NS, counters=Counters(),
        client_factory=lambda: _client(coordinator),
    )  # fmt: skip
    try:
        w.register_kv_caches(caches, NB)
        # the UCX worker was opened before register_kv_caches returned (see
        # WorkerSide._start_up: UCX reads the environment, which an engine's start changes)
        assert w.client is not None and w.client._client._data._worker is not None
        side.start_warm_up()
        assert side.finder.wait(10.0) == node
        assert w.finder.wait(10.0) == node
        assert f"same-host node {node} found: pool" in caplog.text
        hashes = [bytes([i]) * 32 for i in range(1, 4)]
        w.submit_saves(StepPlan(NS, saves=[SaveJob("r", [1, 2, 3], hashes)]))
        deadline = time.monotonic() + 60
        while wc.totals().get("save_blocks", 0) < 3:
            assert time.monotonic() < deadline, wc.totals()
            time.sleep(0.02)
        assert w._local is not None and w._local.pool is not None  # saved through the file
        want = [caches["layers.0.attn"][i].clone() for i in (1, 2, 3)]
        for t in caches.values():
            t.zero_()
        w.start_step(StepPlan(NS, loads=[LoadJob("r", [1, 2, 3], hashes, [[node]] * 3)]))
        deadline = time.monotonic() + 60
        while not (w.get_finished(set())[1] or set()):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert wc.totals().get("local_load_blocks", 0) == 3
        got = [caches["layers.0.attn"][i] for i in (1, 2, 3)]
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    finally:
        w.shutdown()
        side.close()
