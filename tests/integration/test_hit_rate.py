"""The cluster-wide hit rate counts same-host hits and not warm-ups, against a real
``pegaflow-server``: a connector's scheduler (:class:`SchedulerSide`) answers a lookup
from its host's node alone (never seen by the coordinator) and reports it to that node;
``pegaflow status`` (the real CLI) adds the node's reported lookups to the
coordinator's, counting a lookup that the node answered only partly (and the
coordinator then answered) once; the engine-start warm-up lookup is not counted."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pegaflow.client import PegaClient, SyncPegaClient
from pegaflow.connector.metrics import Counters
from pegaflow.connector.report import SameHostReport
from pegaflow.connector.scheduler.side import SchedulerSide
from pegaflow.connector.settings import ConnectorSettings

from pegaflow.config import ClientConfig, EtcdConfig
from pegaflow.errors import BadRequest
from pegaflow.tools.devcluster import Proc, start_coordinator, start_node
from pegaflow.transport.rpc_client import RpcClient
from tests.support.connector_fakes import FakeRequest

pytestmark = [pytest.mark.etcd, pytest.mark.ucx]

BLOCK = 16 << 10
BS = 16
BIN = Path(sys.executable).parent


def _client(server: Proc) -> SyncPegaClient:
    return SyncPegaClient(ClientConfig(coordinators=[server.ready["coordinator"]]))


def _status(client: SyncPegaClient) -> dict[str, Any]:
    return client.status(timeout=5.0)


def _counts(st: dict[str, Any]) -> tuple[int, int, int]:
    """(lookups, hit blocks, miss blocks) the coordinator itself served."""
    c = st["coordinator"]
    return c["lookups"], c["hit_blocks"], c["miss_blocks"]


def _store(client: SyncPegaClient, ns: str, node: str, hashes: list[bytes]) -> None:
    """Put ``hashes`` on ``node`` and wait until the index has them (that lookup is
    counted: an ordinary one)."""
    data = np.random.default_rng(1).integers(0, 255, (len(hashes), BLOCK), dtype=np.uint8)
    out = client.put_blocks(ns, [(h, 0, data[i]) for i, h in enumerate(hashes)], node)
    assert out.stored == len(hashes)
    deadline = time.monotonic() + 60
    while client.lookup(ns, hashes, timeout=5.0).hits < len(hashes):
        assert time.monotonic() < deadline, "blocks never reached the index"
        time.sleep(0.05)


def _scheduler(server: Proc, ns: str) -> SchedulerSide:
    coord, node = server.ready["coordinator"], server.ready["node"]
    settings = ConnectorSettings.load(
        {"coordinators": coord, "local_node": node, "lookup_timeout_s": 5.0}, env={}
    )
    return SchedulerSide(settings, BS, 1, namespace=lambda: ns, counters=Counters(),
                         client=_client(server))  # fmt: skip


def _scrape(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not served")


def _cli_status(server: Proc, *extra: str) -> str:
    p = subprocess.run(
        [str(BIN / "pegaflow"), "status", "--coordinators", server.ready["coordinator"],
         "--no-health", *extra],
        capture_output=True, text=True, timeout=30, cwd="/",
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_same_host_hits_count_in_the_cluster_hit_rate(server: Proc) -> None:
    ns, node = "hit-rate-same-host", server.ready["node"]
    client = _client(server)
    whole = FakeRequest("whole", list(range(4 * BS + 1)), BS)  # 4 blocks, all stored
    part = FakeRequest("part", list(range(6 * BS + 1)), BS)  # the same 4, then 2 more
    assert part.block_hashes[:4] == whole.block_hashes
    sched = _scheduler(server, ns)
    try:
        _store(client, ns, node, whole.block_hashes)
        base = _counts(_status(client))

        sched.warm_up()  # engine start: connects by a locate and a lookup of nothing
        assert _counts(_status(client)) == base, "the warm-up lookup was counted"

        # answered by the node alone: the coordinator never hears of it
        assert sched.get_num_new_matched_tokens(whole, 0) == (4 * BS, False)
        assert sched.counters.totals().get("lookups_local") == 1
        assert _counts(_status(client)) == base
        # the node has 4 of 6: the coordinator answers (and counts) it, the node not
        assert sched.get_num_new_matched_tokens(part, 0)[0] == 4 * BS
        assert sched.counters.totals().get("lookups") == 1
        after = _counts(_status(client))
        assert after == (base[0] + 1, base[1] + 4, base[2] + 2)
    finally:
        sched.close()  # reports what the node answered (at shutdown at the latest)

    # the node's record carries the reported lookups into the coordinator's status
    deadline = time.monotonic() + 60
    while True:
        st = _status(client)
        cluster = st["cluster_lookups"]
        if cluster["same_host_lookups"] >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    client.close()
    assert (cluster["same_host_lookups"], cluster["same_host_hit_blocks"],
            cluster["same_host_miss_blocks"]) == (1, 4, 0)  # fmt: skip
    lookups, hits, misses = after[0] + 1, after[1] + 4, after[2]
    assert (cluster["lookups"], cluster["hit_blocks"], cluster["miss_blocks"]) == (
        lookups,
        hits,
        misses,
    )
    (rec,) = st["nodes"]
    assert (rec["same_host_lookups"], rec["same_host_hit_blocks"]) == (1, 4)
    assert _scrape(int(server.ready["http"]), "pegaflow_node_same_host_lookups_total") == 1
    assert _scrape(int(server.ready["http"]), "pegaflow_node_same_host_hit_blocks_total") == 4

    text = _cli_status(server)
    rate = f"{100 * hits / (hits + misses):.1f}%"
    want = f"lookup hit rate {rate} ({hits} of {hits + misses} blocks in {lookups} lookups"
    assert want in text, text
    assert "1 lookup(s) answered by a same-host node" in text, text
    doc = json.loads(_cli_status(server, "--json"))
    assert doc["cluster_lookups"]["lookups"] == lookups


async def test_report_and_warm_up_on_the_wire(server: Proc) -> None:
    """A warm-up lookup is flagged and not counted, an unflagged one (an older client)
    is; a malformed report gets a typed error and the node keeps counting good ones."""
    rpc = RpcClient([server.ready["coordinator"]], timeout=5)
    try:
        before = _counts(await rpc.call("status", {}))
        args = {"ns": "hit-rate-wire", "hashes": [bytes(32)], "shards": [0]}
        await rpc.call("lookup", {**args, "warm_up": True})
        assert _counts(await rpc.call("status", {})) == before
        await rpc.call("lookup", args)
        assert _counts(await rpc.call("status", {})) == (before[0] + 1, before[1], before[2] + 1)
    finally:
        await rpc.close()

    client = PegaClient(ClientConfig(coordinators=[server.ready["coordinator"]]))
    node = server.ready["node"]
    port = int(server.ready["http"])
    try:
        n0 = _scrape(port, "pegaflow_node_same_host_lookups_total")
        for bad in ((1, 2, 3), (-1, 0, 0), (1, 1 << 62, 0)):
            with pytest.raises(BadRequest):
                await client.report_lookups(node, *bad, timeout=5.0)
        await client.report_lookups(node, 2, 10, 7, timeout=5.0)
        assert _scrape(port, "pegaflow_node_same_host_lookups_total") == n0 + 2
    finally:
        await client.close()


async def test_reports_reach_the_coordinators_through_etcd(etcd_config: EtcdConfig) -> None:
    """In a cluster the node's record carries the reported lookups through etcd to a
    coordinator of another process, and two nodes' reports add up."""
    etcd, prefix = etcd_config.endpoints[0], etcd_config.prefix
    coord = start_coordinator(etcd=etcd, prefix=prefix)
    nodes = [start_node(n, etcd=etcd, prefix=prefix, pool="16MiB", slab="4MiB")
             for n in ("hr1", "hr2")]  # fmt: skip
    client = PegaClient(ClientConfig(coordinators=[coord.ready["address"]]))
    try:
        deadline = time.monotonic() + 60
        while len(await client.nodes()) < 2:
            assert time.monotonic() < deadline, "nodes never registered"
            await asyncio.sleep(0.1)
        await client.report_lookups("hr1", 3, 30, 24, timeout=5.0)
        await client.report_lookups("hr2", 1, 8, 8, timeout=5.0)
        await client.report_lookups("hr1", 1, 2, 2, timeout=5.0)
        want = {"same_host_lookups": 5, "same_host_hit_blocks": 34, "same_host_miss_blocks": 6}
        deadline = time.monotonic() + 60
        while True:
            cluster = (await client.status(timeout=5.0))["cluster_lookups"]
            got = {k: cluster[k] for k in want}
            if got == want or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        assert got == want
        assert cluster["hit_blocks"] == 34 and cluster["miss_blocks"] == 6
        assert cluster["lookups"] == 5  # the coordinator answered none itself
    finally:
        await client.close()
        for p in [*nodes, coord]:
            p.terminate()


def test_same_host_report_batches_and_keeps_what_failed() -> None:
    """Unit test of the tally: per node, batched; a failed report is sent with the next;
    close sends what is left and later lookups are not counted."""
    sent: list[tuple[str, int, int, int]] = []
    fail = [True]

    def send(node: str, lookups: int, asked: int, hits: int, timeout: float) -> None:
        assert timeout == 1.0
        if fail[0]:
            raise ConnectionError("node down")
        sent.append((node, lookups, asked, hits))

    rep = SameHostReport(send, interval_s=3600.0, timeout_s=1.0)
    rep.add("a", 4, 4)
    rep.add("a", 2, 1)
    rep.add("b", 3, 3)
    assert not sent  # never on the request path
    assert not rep.flush() and rep.pending() == {"a": (2, 6, 5), "b": (1, 3, 3)}
    rep.add("a", 1, 1)
    fail[0] = False
    rep.close()
    assert sorted(sent) == [("a", 3, 7, 6), ("b", 1, 3, 3)]
    rep.add("a", 1, 1)
    assert rep.pending() == {}
