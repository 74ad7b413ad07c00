"""Every miss gets a cause (issue 40, "Why did it miss?"), with real processes.

A real ``pegaflow-server`` (or etcd, a coordinator and a node) stores blocks put by a
real client; a scheduler side (:class:`~pegaflow.connector.scheduler.side.SchedulerSide`)
looks requests up and counts each lookup's misses by the cause of its first missing
block: never stored, evicted (tier, seconds after its save), namespace mismatch (the
factor), node unreachable, declined by the cost model, its own save failed.  The
engine's counters, the ``PegaFlow cache:`` line and ``pegaflow status`` say it; the
engine reports its causes to the coordinator (``miss_report``), whose status says them
too.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator

import numpy as np
import pytest
import torch
from pegaflow.client import SyncPegaClient
from pegaflow.connector.metadata import SaveJob, StepPlan, WorkerReport
from pegaflow.connector.metrics import Counters
from pegaflow.connector.report import CacheReport
from pegaflow.connector.scheduler.side import SchedulerSide
from pegaflow.connector.settings import ConnectorSettings
from pegaflow.connector.worker.side import WorkerSide

from pegaflow.config import ClientConfig, EtcdConfig
from pegaflow.tools.cli import render_status
from pegaflow.tools.devcluster import Proc, start_node, start_server
from tests.support.connector_fakes import FakeRequest
from tests.support.etcd_fixture import CoordinatorFactory
from tests.support.waiting import wait_for

pytestmark = pytest.mark.ucx

BS = 4
BLOCK = 1 << 20  # 32 of them fill the test server's 32 MiB pool (16 a test node's)
FACTORS = {"model": "config:abc", "dtype": "bfloat16", "block_size": "4", "tp_size": "1"}


def _client(coordinator: str) -> SyncPegaClient:
    return SyncPegaClient(ClientConfig(coordinators=[coordinator], lookup_timeout_s=2.0))


def _side(
    coordinator: str, ns: str, factors: dict[str, str] | None = None, **settings: object
) -> SchedulerSide:
    # a lookup deadline that a loaded test machine meets (the default is 50 ms)
    settings = {"lookup_timeout_s": 2.0, **settings}
    s = ConnectorSettings.load({"coordinators": coordinator, **settings}, env={})
    return SchedulerSide(
        s, BS, 1, namespace=lambda: ns, counters=Counters(),
        client_factory=lambda: _client(coordinator), factors=lambda: factors or FACTORS,
    )  # fmt: skip


def _put(c: SyncPegaClient, ns: str, hashes: list[bytes]) -> None:
    data = np.full(BLOCK, 7, np.uint8)
    assert c.put_blocks(ns, [(h, 0, data) for h in hashes]).stored == len(hashes)


def _store_then_evict(c: SyncPegaClient, ns: str, req: FakeRequest) -> None:
    """Store ``req``'s 4 blocks, then 40 others through a pool of 32 at most: LRU evicts
    them."""
    _put(c, ns, req.block_hashes)
    wait_for(lambda: c.lookup(ns, req.block_hashes).hits == 4, "the prompt indexed")
    for _ in range(10):
        _put(c, ns, [os.urandom(32) for _ in range(4)])
    wait_for(lambda: c.lookup(ns, req.block_hashes).hits == 0, "the prompt evicted")


def _unsaved_report(w: WorkerSide, ns: str, req: FakeRequest) -> WorkerReport:
    """Save ``req``'s 4 blocks from ``w`` (KV blocks 1-4); the report of their failure."""
    w.submit_saves(StepPlan(ns, saves=[SaveJob(req.request_id, [1, 2, 3, 4], req.block_hashes)]))
    reports: list[WorkerReport | None] = []
    wait_for(lambda: reports.append(w.take_report()) or any(reports), "the failed save")
    report = next(r for r in reports if r is not None)
    assert sorted(report.save_failed) == sorted(req.block_hashes)
    return report


def _prompt(rid: str, base: int, blocks: int = 4) -> FakeRequest:
    """A request of ``blocks`` full blocks and one token more."""
    return FakeRequest(rid, list(range(base, base + blocks * BS + 1)), BS)


def _missed(side: SchedulerSide) -> dict[str, float]:
    return {
        k.split(".", 1)[1]: v
        for k, v in side.counters.totals().items()
        if k.startswith("miss_blocks.")
    }


def _line(side: SchedulerSide) -> str:
    report = CacheReport(Counters(), 10, miss_details=side.lookups.misses.details)
    report._seen = {}  # everything the side counted is news to this line
    report._counters = side.counters
    return report.take() or ""


def test_a_fresh_prompt_was_never_stored(server: Proc) -> None:
    side = _side(server.ready["coordinator"], "fresh.00aa", cost_model=False)
    try:
        assert side.get_num_new_matched_tokens(_prompt("r1", 1000), 0) == (0, False)
        assert _missed(side) == {"never_stored": 4}
        assert side.counters.totals()["miss_lookups.never_stored"] == 1
        assert "misses: never stored 100%" in _line(side)
        # a partial hit: the first half stored, the rest counted from the first miss on
        longer = _prompt("r2", 1100, blocks=6)
        c = _client(server.ready["coordinator"])
        try:
            _put(c, "fresh.00aa", longer.block_hashes[:2])
        finally:
            c.close()
        assert side.get_num_new_matched_tokens(longer, 0)[0] == 2 * BS
        assert _missed(side) == {"never_stored": 8}
        assert side.counters.totals()["miss_lookups.never_stored"] == 2
    finally:
        side.close()


def test_an_evicted_prompt_says_its_tier_and_its_age(server: Proc) -> None:
    ns = "evict.00aa"
    coordinator = server.ready["coordinator"]
    first = _prompt("r1", 2000)
    c = _client(coordinator)
    try:
        _store_then_evict(c, ns, first)
        side = _side(coordinator, ns)
        try:
            assert side.get_num_new_matched_tokens(first, 0) == (0, False)
            assert _missed(side) == {"evicted": 4}
            line = _line(side)
            assert "misses: evicted 100% (memory, " in line and " s after save)" in line, line
        finally:
            side.close()
        st = c.status()
        assert st["misses"]["removals"]["memory"] >= 4
        assert st["misses"]["miss_blocks_by_cause"]["evicted"] >= 4
        shown = render_status(st)
        assert "misses: evicted" in shown and "evictions: " in shown, shown
    finally:
        c.close()


def test_the_same_prompt_under_another_namespace_names_the_factor(server: Proc) -> None:
    """TP size (like dtype or the model) keeps a prompt's hashes: the coordinator finds
    them under the other namespace and names the factor both engines sent."""
    coordinator, stored, asking = server.ready["coordinator"], "llama.00aa", "llama.00bb"
    mine = {**FACTORS, "tp_size": "2"}
    req = _prompt("r1", 3000)
    c = _client(coordinator)
    try:
        assert c.namespace_peers(stored, FACTORS) == []
        _put(c, stored, req.block_hashes)
        wait_for(
            lambda: [p["ns"] for p in c.namespace_peers(asking, mine)] == [stored],
            "the stored namespace indexed",
        )
    finally:
        c.close()
    side = _side(coordinator, asking, mine)
    try:
        assert side.get_num_new_matched_tokens(req, 0) == (0, False)
        assert _missed(side) == {"namespace_mismatch": 4}
        line = _line(side)
        assert (
            "misses: namespace mismatch 100% (stored under llama.00aa; differs in tp_size "
            "(2 here, 1 there))"
        ) in line, line
    finally:
        side.close()


def test_another_block_size_is_a_namespace_mismatch_until_a_hit(
    server: Proc, caplog: pytest.LogCaptureFixture
) -> None:
    """Block size changes every hash: once the engine learnt that its model is stored
    under another namespace (the WARNING), its misses count as a mismatch."""
    coordinator, stored, asking = server.ready["coordinator"], "qwen.00aa", "qwen.00bb"
    c = _client(coordinator)
    try:
        assert c.namespace_peers(stored, {**FACTORS, "block_size": "16"}) == []
        _put(c, stored, [os.urandom(32) for _ in range(2)])
    finally:
        c.close()
    caplog.set_level(logging.WARNING, "pegaflow.connector")
    side = _side(coordinator, asking)
    try:
        assert side.get_num_new_matched_tokens(_prompt("r1", 4000), 0) == (0, False)
        assert _missed(side) == {"never_stored": 4}  # not known yet: asked in the background
        wait_for(lambda: "namespace mismatch" in caplog.text, "the mismatch WARNING")
        assert side.get_num_new_matched_tokens(_prompt("r2", 5000), 0) == (0, False)
        assert _missed(side) == {"never_stored": 4, "namespace_mismatch": 4}
        assert "differs in block_size (4 here, 16 there)" in _line(side)
    finally:
        side.close()


def test_a_hit_the_cost_model_declines(server: Proc) -> None:
    coordinator, ns, req = server.ready["coordinator"], "declined.00aa", _prompt("r1", 6000)
    c = _client(coordinator)
    try:
        _put(c, ns, req.block_hashes)
        [node] = c.lookup(ns, req.block_hashes).blocks[0]
    finally:
        c.close()
    side = _side(coordinator, ns)
    try:
        for _ in range(5):  # loads from the node measured slow, prefill fast
            side.costs.observe_load(node, 100 * BLOCK, 100.0)
            side.costs.observe_compute(4096, 0.001)
        assert side.get_num_new_matched_tokens(req, 0) == (0, False)
        assert _missed(side) == {"declined": 4}
        assert side.counters.totals()["cost_declined"] == 1
        # the report timer's call: the engine's cause reaches the coordinator's status
        assert side.miss_report.send() and side.miss_report.pending() == {}
        c = _client(coordinator)
        try:
            st = c.status()
        finally:
            c.close()
        [me] = [e for e in st["misses"]["engines"] if e["ns"] == ns]
        assert me["miss_blocks_by_cause"] == {"declined": 4} and me["pid"] == os.getpid()
        assert st["misses"]["engine_miss_blocks_by_cause"]["declined"] >= 4
        assert "engines' misses: " in render_status(st)
        assert "declined" in render_status(st).split("engines' misses: ")[1]
    finally:
        side.close()


def test_a_lookup_that_fails_is_counted_as_such() -> None:
    side = _side("127.0.0.1:1", "nowhere.00aa", lookup_timeout_s=0.5)
    try:
        assert side.get_num_new_matched_tokens(_prompt("r1", 7000), 0) == (0, False)
        assert _missed(side) == {"lookup_failed": 4}
    finally:
        side.close()


@pytest.fixture
async def one_node(
    etcd_config: EtcdConfig, coordinators: CoordinatorFactory
) -> AsyncIterator[tuple[str, Proc, SyncPegaClient]]:
    """etcd, a coordinator and node ``e1`` (16 blocks of 1 MiB): the coordinator's
    address, the node and a client."""
    coord = await coordinators.start(etcd_config)
    node = start_node(
        "e1", etcd=etcd_config.endpoints[0], prefix=etcd_config.prefix, pool="16MiB", slab="4MiB"
    )
    c = _client(coord.address)
    try:
        wait_for(lambda: "e1" in c.nodes(), "node e1 registered")
        yield coord.address, node, c
    finally:
        c.close()
        node.terminate()


@pytest.mark.etcd
async def test_evictions_reach_the_coordinator_through_etcd(
    one_node: tuple[str, Proc, SyncPegaClient],
) -> None:
    """With etcd between them, the node's removals reach the coordinator as deletes of
    its keys, which the mirror records."""
    coordinator, _node, c = one_node
    first = _prompt("r1", 11000)
    _store_then_evict(c, "evict.00bb", first)
    side = _side(coordinator, "evict.00bb")
    try:
        assert side.get_num_new_matched_tokens(first, 0) == (0, False)
        assert _missed(side) == {"evicted": 4}
        assert "misses: evicted 100% (memory, " in _line(side)
    finally:
        side.close()


@pytest.mark.etcd
async def test_a_block_on_a_node_nobody_reaches(one_node: tuple[str, Proc, SyncPegaClient]) -> None:
    """Saved on a node that then dies: once a client reported it unreachable (and the
    coordinator could not reach it either), a lookup's miss names the node."""
    coordinator, node, c = one_node
    req = _prompt("r1", 8000)
    _put(c, "gone.00aa", req.block_hashes)
    wait_for(lambda: c.lookup("gone.00aa", req.block_hashes).hits == 4, "the prompt indexed")
    node.kill()
    wait_for(lambda: c.report_unreachable("e1"), "e1 suspected", timeout=30)
    side = _side(coordinator, "gone.00aa")
    try:
        assert side.get_num_new_matched_tokens(req, 0) == (0, False)
        assert _missed(side) == {"node_unreachable": 4}
        assert "misses: node unreachable 100% (e1)" in _line(side)
    finally:
        side.close()


def test_a_block_whose_save_failed_says_why(server: Proc) -> None:
    """A worker's save fails (its cluster is unreachable: a real put to a dead address);
    its report reaches the scheduler, whose later miss of that prompt (against a real
    server that never saw it) counts as ``save_dropped``, with the reason."""
    nb = 8
    kv = {
        f"model.layers.{i}.self_attn.attn": torch.zeros(nb, 2, BS, 8, dtype=torch.bfloat16)
        for i in range(2)
    }
    dead = "127.0.0.1:1"
    s = ConnectorSettings.load(
        {"coordinators": dead, "rpc_timeout_s": 0.5, "transfer_timeout_s": 1.0}, env={}
    )
    w = WorkerSide(s, 0, Counters(), lambda: _client(dead))
    w.register_kv_caches(kv, nb)
    ns, req = "dropped.00aa", _prompt("r1", 9000)
    side = _side(server.ready["coordinator"], ns)
    try:
        report = _unsaved_report(w, ns, req)
        side.update_connector_output(report)
        assert side.get_num_new_matched_tokens(req, 0) == (0, False)
        assert _missed(side) == {"save_dropped": 4}
        [why] = report.unsaved
        assert f"misses: save dropped 100% ({why})" in _line(side)
    finally:
        side.close()
        w.shutdown()


def test_a_save_a_quota_refused() -> None:
    """A node whose per-connection quota is under two blocks refuses a worker's batch
    of four (``quota``): the scheduler's later miss of that prompt says so."""
    p = start_server(
        extra=["--node-pool-bytes", "16MiB", "--node-slab-bytes", "4MiB",
               "--node-conn-quota-share", "0.0001"]
    )  # fmt: skip
    coordinator = p.ready["coordinator"]
    kv = {"model.layers.0.self_attn.attn": torch.zeros(8, 2, BS, 8, dtype=torch.bfloat16)}
    s = ConnectorSettings.load({"coordinators": coordinator, "same_host_shortcut": False}, env={})
    w = WorkerSide(s, 0, Counters(), lambda: _client(coordinator))
    w.register_kv_caches(kv, 8)
    ns, req = "quota.00aa", _prompt("r1", 10000)
    side = _side(coordinator, ns)
    try:
        report = _unsaved_report(w, ns, req)
        side.update_connector_output(report)
        assert side.get_num_new_matched_tokens(req, 0) == (0, False)
        assert _missed(side) == {"quota": 4}, report.unsaved
        assert "misses: quota 100% (quota: " in _line(side)
    finally:
        side.close()
        w.shutdown()
        p.terminate()
