"""A node cut off or hung (issue 35, defects 2 and 7): no load waits much longer than
computing its tokens, and once a node failed nobody waits on it again until it answers.

* Each load from another host has a budget, about what computing its tokens takes
  (``LoadJob.budget_s``, the cost model's estimate); after it the blocks fail and vLLM
  computes them.
* A client remembers a node a get failed on (:mod:`pegaflow.client.nodehealth`): its
  gets to it are misses at once and the connector's scheduler declines its hits, until a
  hello answers again; it reports the node to the coordinator, which leaves the node's
  blocks out of every lookup for a while (:mod:`pegaflow.coordinator.suspects`) unless
  it reaches the node itself.
* A failed load is attempted once under the recompute policy, and never again into a
  staging buffer a failed get may still write.

The last test (``slow``) runs a real vLLM engine whose prompt is on a node of "another
host" that is then frozen (SIGSTOP: a hung host or a partition, as the reader sees it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import shutil
import signal
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from pegaflow.client import PegaClient
from pegaflow.client.nodehealth import NodeHealth
from pegaflow.connector import sameprocess
from pegaflow.connector.metadata import LoadJob, StepPlan
from pegaflow.connector.metrics import Counters
from pegaflow.connector.scheduler.costmodel import CostModel
from pegaflow.connector.scheduler.side import SchedulerSide
from pegaflow.connector.settings import ConnectorSettings
from pegaflow.connector.worker.side import WorkerSide
from pegaflow.coordinator.index import BlockIndex
from pegaflow.coordinator.suspects import Suspects

from pegaflow.config import ClientConfig
from pegaflow.deadline import Deadline
from pegaflow.keys import NodeRecord
from pegaflow.tools.devcluster import Proc, start_coordinator, start_node
from tests.support.connector_fakes import (
    NB,
    NS,
    FakeCluster,
    FakeRequest,
    finish_loads,
    h,
    kv,
    save,
    worker,
)
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.etcd, pytest.mark.ucx]

# ---- the budget -------------------------------------------------------------------


def test_a_loads_budget_is_what_computing_its_tokens_takes_within_bounds() -> None:
    cm = CostModel("cpu", 32, 1 << 20)
    # the CPU prior: 2,000 tokens/s and a 5 ms step
    assert cm.load_budget_s(2000, 1.0, 0.05, 10.0) == pytest.approx(1.005, rel=1e-3)
    assert cm.load_budget_s(20, 1.0, 0.05, 10.0) == 0.05  # the floor
    assert cm.load_budget_s(10**6, 1.0, 0.05, 10.0) == 10.0  # never past the deadline
    assert cm.load_budget_s(2000, 0.0, 0.05, 10.0) == 10.0  # factor 0: no budget
    for _ in range(20):  # this engine computes 100k tokens/s
        cm.observe_compute(1000, 0.01)
    assert cm.load_budget_s(2000, 1.0, 0.001, 10.0) < 0.05


class _Hangs(FakeCluster):
    """Gets to ``hung`` answer only when their deadline passes (a hung node); the
    real client's node memory (``health``) is kept as the real client does."""

    def __init__(self) -> None:
        super().__init__()
        self.hung: set[str] = set()
        self.health = NodeHealth()
        self.get_calls = 0

    def submit_get_blocks(
        self,
        ns: str,
        items: Any,
        timeout: Any = None,
        generations: Any = None,
        *,
        zero_copy: bool = False,
    ) -> concurrent.futures.Future[list[bool]]:
        self.get_calls += 1
        nodes = {it[0] for it in items}
        if not nodes & self.hung:
            for n in nodes:
                self.health.answered(n)
            return super().submit_get_blocks(ns, items, timeout, generations)
        f: concurrent.futures.Future[list[bool]] = concurrent.futures.Future()
        wait = Deadline.of(timeout, 10.0).remaining()

        def fail() -> None:
            for n in nodes & self.hung:
                self.health.failed(n, "", "its get timed out")
            f.set_result([False] * len(items))

        t = __import__("threading").Timer(wait, fail)
        t.daemon = True
        t.start()
        return f


def test_a_load_from_a_hung_node_gives_up_after_its_budget_and_the_next_one_at_once() -> None:
    cluster = _Hangs()
    src = kv(1)
    w1, _ = worker(cluster, src)
    save(w1, cluster, [1, 2], [h(1), h(2)])
    w2, c2 = worker(cluster, {k: torch.zeros_like(v) for k, v in src.items()},
                    transfer_timeout_s=30.0)  # fmt: skip
    # a first load: the node answers (its connection is set up), within the budget
    w2.start_step(StepPlan(NS, loads=[LoadJob("a", [3], [h(1)], [["n1"]], budget_s=0.3)]))
    assert finish_loads(w2, "a")[0] == set()
    cluster.hung.add("n1")
    t0 = time.monotonic()
    job = LoadJob("b", [4, 5], [h(1), h(2)], [["n1"], ["n1"]], budget_s=0.3)
    w2.start_step(StepPlan(NS, loads=[job]))
    errors, _ = finish_loads(w2, "b")
    took = time.monotonic() - t0
    assert errors == {4, 5}  # reported: vLLM computes them
    assert 0.25 < took < 3.0, took  # the budget, not transfer_timeout_s (30 s)
    assert cluster.health.is_down("n1")
    calls = cluster.get_calls
    t0 = time.monotonic()
    w2.start_step(StepPlan(NS, loads=[LoadJob("c", [6], [h(1)], [["n1"]], budget_s=0.3)]))
    assert finish_loads(w2, "c")[0] == {6}
    assert cluster.get_calls == calls  # not asked at all
    assert c2.totals()["load_unreachable_blocks"] == 1
    w1.shutdown()
    w2.shutdown()


def test_the_first_load_from_a_node_gets_a_connection_set_up_more() -> None:
    """A node this client never heard from also sets up its connection in that load:
    its budget gets ``FIRST_CONTACT_S`` more, never ``transfer_timeout_s`` (a node cut
    off before an engine's first load from it must not cost 10 s)."""
    from pegaflow.connector.media.remote import FIRST_CONTACT_S

    cluster = _Hangs()
    w, _ = worker(cluster, kv(2), transfer_timeout_s=7.0)
    assert w._remote is not None
    job = LoadJob("a", [1], [h(1)], [["n1"]], budget_s=0.2)
    first = w._remote.deadline(cluster, job).remaining()
    assert FIRST_CONTACT_S < first <= FIRST_CONTACT_S + 0.2
    cluster.health.answered("n1")
    assert w._remote.deadline(cluster, job).remaining() <= 0.2
    job.budget_s = 0.0  # no budget: the whole deadline
    assert w._remote.deadline(cluster, job).remaining() > 6.5
    w.shutdown()


# ---- defect 7: attempted once -------------------------------------------------------


def test_a_failed_load_is_attempted_once_under_recompute() -> None:
    """With vLLM's default policy (fail) turned to recompute by the connector, the
    worker (of its own process too) does not retry: its blocks are computed."""
    pytest.importorskip("vllm")
    from pegaflow.connector import PegaKVConnector
    from pegaflow.connector.compat import KVConnectorRole

    from tests.support.connector_fakes import kv_cache_config, vllm_config

    def worker_connector(extra: dict[str, Any] | None = None) -> Any:
        # a worker of its own process (TP > 1): no scheduler beside it decided anything
        with mock.patch("pegaflow.connector.connector.parallel_ranks", return_value=(1, 2, 0, 1)):
            return PegaKVConnector(
                vllm_config(extra, policy="fail"), KVConnectorRole.WORKER, kv_cache_config()
            )

    conn = worker_connector()
    try:
        assert conn.policy == "recompute"
        assert conn._worker._retry is False
    finally:
        conn.shutdown()
    kept = worker_connector({"recompute_failed_loads": False})
    try:
        assert kept._worker._retry is True  # vLLM fails such a request: one more try
    finally:
        kept.shutdown()

    cluster = FakeCluster()
    src = kv(3)
    w1, _ = worker(cluster, src)
    save(w1, cluster, [1], [h(1)])
    calls = {"n": 0}

    def failing(ns, items, timeout=None, generations=None):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        return [False] * len(items)

    cluster.get_blocks = failing  # type: ignore[method-assign]
    s = ConnectorSettings.load({}, env={})
    w2 = WorkerSide(s, 0, Counters(), lambda: cluster, retry_failed_loads=conn._worker._retry)
    w2.register_kv_caches({k: torch.zeros_like(v) for k, v in src.items()}, NB)
    w2.start_step(StepPlan(NS, loads=[LoadJob("r", [2], [h(1)], [["n1"]])]))
    assert finish_loads(w2, "r")[0] == {2}
    assert calls["n"] == 1
    w1.shutdown()
    w2.shutdown()


def test_no_retry_into_a_buffer_a_failed_get_may_still_write() -> None:
    cluster = FakeCluster()
    src = kv(4)
    w1, _ = worker(cluster, src)
    save(w1, cluster, [1], [h(1)])
    calls = {"n": 0}

    def failing(ns, items, timeout=None, generations=None):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        return [False] * len(items)

    cluster.get_blocks = failing  # type: ignore[method-assign]
    unsettled = {"on": True}
    cluster.settled = lambda buf: not unsettled["on"]  # type: ignore[method-assign]
    s = ConnectorSettings.load({}, env={})
    w2 = WorkerSide(s, 0, Counters(), lambda: cluster, retry_failed_loads=True)
    w2.register_kv_caches({k: torch.zeros_like(v) for k, v in src.items()}, NB)
    w2.start_step(StepPlan(NS, loads=[LoadJob("r", [2], [h(1)], [["n1"]])]))
    assert finish_loads(w2, "r")[0] == {2}
    assert calls["n"] == 1  # the retry would have been refused (or worse): not made
    unsettled["on"] = False
    w1.shutdown()
    w2.shutdown()


# ---- the client's memory -------------------------------------------------------------


def test_node_health_bookkeeping(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    nh = NodeHealth(clock=lambda: now[0])
    assert not nh.is_down("n1") and not nh.has_answered("n1")
    with caplog.at_level("WARNING", "pegaflow"):
        assert nh.failed("n1", "10.0.0.1:7800", "its get timed out")
        assert not nh.failed("n1", "10.0.0.1:7800", "again")
    assert nh.is_down("n1") and nh.down() == {"n1"}
    assert "loads from node n1 are skipped" in caplog.text
    assert nh.due_reports() == ["n1"]
    assert nh.due_reports() == []  # rate-limited
    now[0] += 1.0
    assert nh.due_reports() == ["n1"]
    assert not nh.moved("n1", "10.0.0.1:7800")
    assert nh.moved("n1", "10.0.0.2:7800")  # restarted elsewhere: tried again
    assert not nh.is_down("n1") and nh.has_answered("n1")
    nh.failed("n1", "10.0.0.2:7800", "its connection failed")
    caplog.clear()
    with caplog.at_level("WARNING", "pegaflow"):
        assert nh.answered("n1")
    assert caplog.text == ""  # a flapping node: one line per 10 s and direction
    now[0] += 10.0
    nh.failed("n1", "10.0.0.2:7800", "its connection failed")
    with caplog.at_level("WARNING", "pegaflow"):
        assert nh.answered("n1")
    assert "answers again" in caplog.text
    assert not nh.answered("n1")


def test_the_scheduler_declines_hits_on_a_node_that_failed_its_loads() -> None:
    cluster = FakeCluster()
    cluster.health = NodeHealth()  # type: ignore[attr-defined]
    tokens = list(range(200))
    req = FakeRequest("r", tokens, 32)
    for b in req.block_hashes:
        cluster.blocks[("ns", b, 0)] = ("n9", b"x")
    s = ConnectorSettings.load({"cost_model": False}, env={})
    c = Counters()
    sched = SchedulerSide(s, 32, 1, lambda: "ns", c, client=cluster)
    assert sched.get_num_new_matched_tokens(req, 0)[0] == 192
    cluster.health.failed("n9", "", "its get timed out")  # type: ignore[attr-defined]
    req2 = FakeRequest("r2", tokens, 32)
    assert sched.get_num_new_matched_tokens(req2, 0) == (0, False)
    assert c.totals()["unreachable_declined_blocks"] == 6
    sched.close()


def test_the_scheduler_reads_the_workers_memory_in_its_process() -> None:
    """With one rank the worker shares the scheduler's process: its client's memory
    declines the hit at once (the scheduler's own client does no gets)."""
    health = NodeHealth()
    health.failed("n9", "", "its get timed out")
    w = type("W", (), {"client": type("C", (), {"health": health})()})()
    sameprocess.register(w)  # type: ignore[arg-type]
    try:
        cluster = FakeCluster()
        req = FakeRequest("r", list(range(100)), 32)
        for b in req.block_hashes:
            cluster.blocks[("ns", b, 0)] = ("n9", b"x")
        s = ConnectorSettings.load({"cost_model": False}, env={})
        sched = SchedulerSide(s, 32, 1, lambda: "ns", Counters(), client=cluster)
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        sched.close()
    finally:
        sameprocess.unregister(w)  # type: ignore[arg-type]


# ---- the coordinator's part ----------------------------------------------------------


def _index(*nodes: str) -> BlockIndex:
    idx = BlockIndex()
    for n in nodes:
        idx.set_node(NodeRecord(n, "10.0.0.1", 7800, http="10.0.0.1:7880"))
    return idx


async def test_the_coordinator_leaves_a_reported_node_out_until_ttl_or_it_answers() -> None:
    idx = _index("n1", "n2")
    for i in range(4):
        idx.add("ns", bytes([i]) * 32, 0, "n1" if i >= 2 else "n2", 1)
    hashes = [bytes([i]) * 32 for i in range(4)]
    assert idx.lookup("ns", hashes, [0]).hits == 4
    alive = {"n1": False, "n2": True}
    now = [0.0]

    async def check(rec: NodeRecord) -> bool:
        return alive[rec.node_id]

    counts: dict[str, int] = {}
    sus = Suspects(idx, 5.0, counts, alive=check, clock=lambda: now[0])
    assert not await sus.report("n2")  # the coordinator reaches it: nothing changes
    assert not await sus.report("nx")
    assert await sus.report("n1")
    assert idx.lookup("ns", hashes, [0]).hits == 2  # the hit ends before n1's blocks
    assert counts == {"alive": 1, "unknown": 1, "suspected": 1}
    now[0] = 4.0
    assert await sus.report("n1")  # renewed
    now[0] = 8.0
    await asyncio.sleep(1.2)  # a check: still down, not expired
    assert sus.nodes == {"n1"}
    now[0] = 9.5
    await wait_until(lambda: sus.nodes == frozenset(), "the last report's TTL to run out", 60)
    assert idx.lookup("ns", hashes, [0]).hits == 4
    assert await sus.report("n1")
    alive["n1"] = True
    await asyncio.sleep(1.2)
    assert idx.lookup("ns", hashes, [0]).hits == 4  # it answered the coordinator
    await sus.close()


# ---- real processes: a node frozen under a client --------------------------------------


@pytest.fixture
def frozen_cluster(etcd_server: Any) -> Iterator[tuple[Proc, Proc]]:
    shm = tempfile.mkdtemp(prefix="pegaflow-test-", dir="/dev/shm")
    prefix = f"/pegaflow/partition-{os.getpid()}-{time.monotonic_ns()}"
    procs: list[Proc] = []
    try:
        procs.append(start_coordinator(etcd=etcd_server.endpoint, prefix=prefix))
        procs.append(start_node("n1", etcd=etcd_server.endpoint, prefix=prefix, shm_dir=shm))
        yield procs[0], procs[1]
    finally:
        for p in procs:
            if p.alive():
                os.kill(p.pid, signal.SIGCONT)
            p.kill()
        shutil.rmtree(shm, ignore_errors=True)


def _reports(coord: Proc, result: str) -> float:
    port = coord.ready["http"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    key = f'pegaflow_coordinator_unreachable_reports_total{{result="{result}"}} '
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(key))


async def test_a_client_stops_waiting_on_a_frozen_node_and_so_do_lookups(
    frozen_cluster: tuple[Proc, Proc],
) -> None:
    coord, node = frozen_cluster
    c = PegaClient(ClientConfig(coordinators=[coord.ready["address"]], lookup_timeout_s=2.0))
    try:
        for _ in range(100):
            if "n1" in await c.nodes():
                break
            await asyncio.sleep(0.1)
        hashes = [bytes([7, i]) * 16 for i in range(4)]
        data = np.arange(4 * 4096, dtype=np.uint32).view(np.uint8).reshape(4, -1)[:, :4096]
        data = np.ascontiguousarray(data)
        assert (await c.put_blocks(NS_R, [(x, 0, data[i]) for i, x in enumerate(hashes)],
                                   node_id="n1")).stored == 4  # fmt: skip
        for _ in range(100):
            if (await c.lookup(NS_R, hashes)).hits == 4:
                break
            await asyncio.sleep(0.1)
        out = np.zeros_like(data)
        items = [("n1", x, 0, out[i]) for i, x in enumerate(hashes)]
        assert all(await c.get_blocks(NS_R, items, timeout=5.0))
        assert c.health.has_answered("n1")

        os.kill(node.pid, signal.SIGSTOP)
        out2 = np.zeros_like(data)
        items2 = [("n1", x, 0, out2[i]) for i, x in enumerate(hashes)]
        t0 = time.monotonic()
        assert await c.get_blocks(NS_R, items2, timeout=0.3) == [False] * 4
        assert time.monotonic() - t0 < 1.5
        assert c.health.is_down("n1")
        t0 = time.monotonic()
        assert await c.get_blocks(NS_R, items2, timeout=5.0) == [False] * 4
        assert time.monotonic() - t0 < 0.05  # not asked: a miss at once
        assert c.health.skipped_blocks == 4
        # cluster-wide: the coordinator cannot reach n1 either, lookups leave it out
        for _ in range(600):
            if (await c.lookup(NS_R, hashes)).hits == 0:
                break
            await asyncio.sleep(0.1)
        assert (await c.lookup(NS_R, hashes)).hits == 0
        assert _reports(coord, "suspected") >= 1

        os.kill(node.pid, signal.SIGCONT)
        t0 = time.monotonic()
        while c.health.is_down("n1") or (await c.lookup(NS_R, hashes)).hits < 4:
            assert time.monotonic() - t0 < 5.0, "n1 was not taken back within 5 s"
            await asyncio.sleep(0.1)
        out3 = np.zeros_like(data)
        items3 = [("n1", x, 0, out3[i]) for i, x in enumerate(hashes)]
        assert all(await c.get_blocks(NS_R, items3, timeout=5.0))
        assert np.array_equal(out3, data)
        assert not out2.any() or c._data.settled(out2)
    finally:
        await c.close()


NS_R = "partition-model"


# ---- a real engine, its prompt on a frozen node of "another host" ----------------------


@pytest.mark.slow
@pytest.mark.vllm
def test_an_engine_does_not_wait_on_a_frozen_remote_node(etcd_server: Any, tmp_path: Any) -> None:
    """The prompt's blocks are on n1, loaded over UCX (not this host's pool: the
    same-host shortcut is off, as on another host); n1 is then frozen.  The request
    that meets the frozen node waits its budget (about a recompute), not
    ``transfer_timeout_s`` (30 s here); the next ones do not wait on it at all; outputs
    stay those of the cold runs; hits come back once n1 runs again."""
    from tests.support.vllm_engine import VllmEngine, prompts
    from tests.support.vllm_engine import connector_stats as stats

    shm = tempfile.mkdtemp(prefix="pegaflow-test-", dir="/dev/shm")
    prefix = f"/pegaflow/partition-e2e-{os.getpid()}"
    coord = start_coordinator(etcd=etcd_server.endpoint, prefix=prefix)
    node = start_node("n1", etcd=etcd_server.endpoint, prefix=prefix, shm_dir=shm)
    s = str(tmp_path / "eng")
    eng = None
    try:
        eng = VllmEngine(
            {
                "connector": {
                    "coordinators": coord.ready["address"],
                    "local_node": "n1",
                    "same_host_shortcut": False,  # n1's blocks come over UCX
                    "cost_model": False,  # every hit claimed: the loads must happen
                    "stats_path": s,
                    "lookup_timeout_s": 0.5,
                    "transfer_timeout_s": 30.0,
                    "shutdown_wait_s": 1.0,
                    "log_level": os.environ.get("PARTITION_DEBUG", ""),
                }
            },
            name="partition",
        )
        ps = prompts(4, 500, seed=35)
        ref, cold = [], []
        for p in ps:  # computed (nothing stored yet) and saved to n1
            r = eng.generate([p], 8)
            ref.append(r["outputs"][0])
            cold.append(r["elapsed_s"])
        deadline = time.monotonic() + 60
        while stats(s).get("save_blocks", 0) < 4 * 15:
            assert time.monotonic() < deadline, stats(s)
            time.sleep(0.2)

        def run(i: int) -> tuple[float, int]:
            eng.call({"op": "reset_prefix_cache"})  # else vLLM's own cache serves it
            r = eng.generate([ps[i]], 8)
            assert r["outputs"][0] == ref[i]
            return r["elapsed_s"], r["cached"][0]

        _, cached = run(0)  # a load from n1: its connection is set up, it answered
        assert cached >= 15 * 32
        deadline = time.monotonic() + 60
        while stats(s).get("load_blocks", 0) < 15:  # the counters are written every 0.3 s
            assert time.monotonic() < deadline, stats(s)
            time.sleep(0.2)

        os.kill(node.pid, signal.SIGSTOP)
        took, cached = run(1)  # its load meets the frozen node
        print(f"cold {cold[1] * 1e3:.0f} ms, with n1 frozen {took * 1e3:.0f} ms")
        if os.environ.get("PARTITION_DEBUG"):
            print("\n".join(ln for ln in eng.log[-80:] if "egaflow" in ln or "PegaFlow" in ln))
        assert took < 10.0  # a bound on a hang: transfer_timeout_s is 30 s
        took2, cached = run(2)  # nobody waits on n1 now
        print(f"next request: cold {cold[2] * 1e3:.0f} ms, with n1 frozen {took2 * 1e3:.0f} ms")
        assert took2 < 3.0 and cached == 0
        time.sleep(1.0)  # the counters' file
        after = stats(s)
        skipped = after.get("unreachable_declined_blocks", 0) + after.get(
            "load_unreachable_blocks", 0
        )
        assert skipped > 0 or _reports(coord, "suspected") >= 1

        os.kill(node.pid, signal.SIGCONT)
        t0 = time.monotonic()
        while True:
            _, cached = run(3)
            if cached:
                break
            assert time.monotonic() - t0 < 15.0, "no hits after n1 ran again"
            time.sleep(0.5)
        print(f"hits again {time.monotonic() - t0:.1f} s after SIGCONT")
    finally:
        if node.alive():
            os.kill(node.pid, signal.SIGCONT)
        if eng is not None:
            eng.stop()
        node.kill()
        coord.kill()
        shutil.rmtree(shm, ignore_errors=True)
