"""Worker side of PegaKVConnector on real torch KV tensors and an in-memory cluster."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
import torch
from pegaflow.connector.media.kvio import KVBlockIO
from pegaflow.connector.media.staging import Staging
from pegaflow.connector.metadata import LoadJob, SaveJob, StepPlan, merge_saves
from pegaflow.connector.metrics import Counters
from pegaflow.connector.settings import ConnectorSettings
from pegaflow.connector.worker.books import WorkerBooks
from pegaflow.connector.worker.side import WorkerSide

from tests.support.connector_fakes import (
    DOWN,
    NB,
    NS,
    FakeCluster,
    finish_loads,
    h,
    kv,
    save,
    worker,
)
from tests.support.waiting import wait_for


def test_block_bytes_are_whole_tiles_of_every_layer_in_order() -> None:
    caches = kv(0)
    io = KVBlockIO(caches, NB)
    assert io.block_bytes == 3 * 2 * 8 * 16 * 2
    buf, _ = io.new_staging(1)
    io.gather([5], buf)
    want = b"".join(
        caches[f"model.layers.{i}.self_attn.attn"][5]
        .contiguous()
        .view(torch.uint8)
        .numpy()
        .tobytes()
        for i in range(3)
    )
    assert buf[0].numpy().tobytes() == want


def test_save_then_load_into_another_engine_is_bit_exact() -> None:
    cluster = FakeCluster()
    src = kv(1)
    w1, c1 = worker(cluster, src)
    save(w1, cluster, [3, 4, 5, 6, 7], [h(i) for i in range(5)])
    wait_for(lambda: c1.totals().get("save_blocks", 0) == 5)
    assert c1.totals()["save_bytes"] == 5 * w1.io.block_bytes  # type: ignore[union-attr]

    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    w2, c2 = worker(cluster, dst)
    job = LoadJob("r", [9, 10, 11, 12, 13], [h(i) for i in range(5)], [["n1"]] * 5)
    w2.start_step(StepPlan(NS, loads=[job]))
    errors, _ = finish_loads(w2, "r")
    assert errors == set()
    for name in src:
        assert torch.equal(dst[name][9:14], src[name][3:8])
        assert not dst[name][:9].any() and not dst[name][14:].any()
    assert c2.totals()["load_blocks"] == 5 and "load_failed_blocks" not in c2.totals()
    w1.shutdown()
    w2.shutdown()


@pytest.mark.parametrize("failure", ["dead_node", "corrupt", "missing", "no_node", "regenerated"])
def test_failed_blocks_are_reported_with_the_request_and_never_written(failure: str) -> None:
    cluster = FakeCluster()
    src = kv(2)
    w1, _ = worker(cluster, src)
    save(w1, cluster, [1, 2, 3, 4], [h(i) for i in range(4)])
    nodes = [["n1"]] * 4
    if failure == "dead_node":
        cluster.dead_nodes.add("n1")
    elif failure == "corrupt":
        cluster.corrupt.add(h(2))
    elif failure == "missing":
        del cluster.blocks[(NS, h(3), 0)]
    elif failure == "no_node":
        nodes = [["n1"], [], ["n1"], ["n1"]]
    # the generations the lookup saw; "regenerated": block 1 was evicted and stored again
    # between lookup and get, so its slot holds another generation: fenced, a miss
    gens = [[0]] * 4
    if failure == "regenerated":
        cluster.restore(NS, h(1))
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    w2, c2 = worker(cluster, dst)
    job = LoadJob("r", [5, 6, 7, 8], [h(i) for i in range(4)], nodes, 0, gens=gens)
    w2.start_step(StepPlan(NS, loads=[job]))
    errors, _ = finish_loads(w2, "r")
    bad = {
        "dead_node": {5, 6, 7, 8},
        "corrupt": {7},
        "missing": {8},
        "no_node": {6},
        "regenerated": {6},
    }[failure]
    assert errors == bad
    for name in src:
        for b in range(5, 9):
            if b in bad:
                assert not dst[name][b].any()  # nothing half-written
            else:
                assert torch.equal(dst[name][b], src[name][b - 4])
    assert c2.totals()["load_failed_blocks"] == len(bad)
    rep = w2.take_report()
    assert rep is not None and rep.load_failed == {"r": min(bad) - 5}
    w1.shutdown()
    w2.shutdown()


def test_client_failure_fails_all_blocks_of_the_job() -> None:
    def broken() -> FakeCluster:
        raise DOWN

    s = ConnectorSettings.load({}, env={})
    w = WorkerSide(s, 0, Counters(), broken)
    w.register_kv_caches(kv(3), NB)
    w.start_step(StepPlan(NS, loads=[LoadJob("r", [1, 2], [h(1), h(2)], [["n1"], ["n1"]])]))
    errors, _ = finish_loads(w, "r")
    assert errors == {1, 2}
    w.shutdown()


def test_with_several_kv_cache_groups_a_failed_load_is_reported_by_its_request() -> None:
    """vLLM cannot map block ids of a hybrid model's groups back to requests: the
    request is reported failed (vLLM 0.32's ``failed_recving``) and recomputed whole."""

    def broken() -> FakeCluster:
        raise DOWN

    s = ConnectorSettings.load({}, env={})
    w = WorkerSide(s, 0, Counters(), broken, failed_as_requests=True)
    w.register_kv_caches(kv(3), NB)
    w.start_step(StepPlan(NS, loads=[LoadJob("r", [1, 2], [h(1), h(2)], [["n1"], ["n1"]])]))
    errors, _ = finish_loads(w, "r")
    assert errors == set()
    assert w.take_failed_requests() == {"r"}
    assert w.take_failed_requests() == set()  # once
    w.shutdown()


def test_retry_once_under_fail_policy() -> None:
    cluster = FakeCluster()
    src = kv(4)
    w1, _ = worker(cluster, src)
    save(w1, cluster, [1], [h(1)])
    calls = {"n": 0}
    real = cluster.get_blocks

    def flaky(ns, items, timeout=None, generations=None):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        return [False] * len(items) if calls["n"] == 1 else real(ns, items, timeout, generations)

    cluster.get_blocks = flaky  # type: ignore[method-assign]
    s = ConnectorSettings.load({}, env={})
    w2 = WorkerSide(s, 0, Counters(), lambda: cluster, retry_failed_loads=True)
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    w2.register_kv_caches(dst, NB)
    w2.start_step(StepPlan(NS, loads=[LoadJob("r", [2], [h(1)], [["n1"]])]))
    errors, _ = finish_loads(w2, "r")
    assert errors == set() and calls["n"] == 2
    w1.shutdown()
    w2.shutdown()


def test_delayed_free_reported_after_copy_out_only() -> None:
    cluster = FakeCluster()
    w, _ = worker(cluster, kv(5))
    cluster.put_gate = None
    w.submit_saves(StepPlan(NS, saves=[SaveJob("a", [1, 2, 3], [h(1), h(2), h(3)])]))
    w.start_step(StepPlan(NS, delay_free=["a"]))
    wait_for(lambda: (w.get_finished({"a"})[0] or set()) == {"a"} or False)
    # reported exactly once
    assert w.get_finished(set())[0] is None
    w.shutdown()


def test_preemption_waits_for_pending_copies() -> None:
    cluster = FakeCluster()
    w, _ = worker(cluster, kv(6))
    io = w.io
    assert io is not None
    real = io.gather

    copied: list[bool] = []

    def slow(*a, **k):  # type: ignore[no-untyped-def]
        time.sleep(0.3)
        out = real(*a, **k)
        copied.append(True)
        return out

    io.gather = slow  # type: ignore[method-assign]
    w.submit_saves(StepPlan(NS, saves=[SaveJob("p", [1], [h(1)])]))
    w.wait_for_copies(["p"])
    assert copied  # it returned only after the (slow) copy-out finished
    assert not w._pending_gathers
    w.shutdown()


def test_staging_full_drops_saves_instead_of_waiting() -> None:
    cluster = FakeCluster()
    gate = __import__("threading").Event()
    cluster.put_gate = gate  # puts hang until released: staging stays in use
    w, c = worker(cluster, kv(7), max_staging_bytes=2 * 2 * 3 * 512)  # 1 save chunk
    w.submit_saves(StepPlan(NS, saves=[SaveJob("a", [1, 2, 3, 4], [h(i) for i in range(4)])]))
    wait_for(lambda: c.totals().get("save_dropped_blocks", 0) == 2)
    gate.set()
    wait_for(lambda: c.totals().get("save_blocks", 0) == 2)
    rep = w.take_report()
    assert rep is not None and sorted(rep.save_failed) == sorted([h(2), h(3)])
    w.shutdown()


def test_failing_puts_open_the_breaker_and_later_saves_are_dropped() -> None:
    cluster = FakeCluster()
    cluster.put_error = DOWN
    w, c = worker(cluster, kv(8), failures_to_backoff=1, backoff_s=60)
    w.submit_saves(StepPlan(NS, saves=[SaveJob("a", [1], [h(1)])]))
    wait_for(lambda: c.totals().get("save_failed_blocks", 0) == 1)
    w.submit_saves(StepPlan(NS, saves=[SaveJob("b", [2], [h(2)])]))
    assert c.totals().get("save_dropped_blocks") == 1
    assert "copy_seconds" in c.totals()  # only the first save was copied
    w.shutdown()


def test_unsupported_layout_makes_worker_inert() -> None:
    w = WorkerSide(ConnectorSettings.load({}, env={}), 0, Counters(), FakeCluster)
    w.register_kv_caches({"l": torch.zeros(5, 7)}, NB)  # no dimension matches 16 blocks
    assert w.io is None
    w.start_step(StepPlan(NS, loads=[LoadJob("r", [1], [h(1)], [["n1"]])]))
    errors, _ = finish_loads(w, "r")
    assert errors == {1}
    w.submit_saves(StepPlan(NS, saves=[SaveJob("a", [1], [h(1)])]))
    w.shutdown()


def test_gather_is_a_snapshot_of_the_block_at_copy_time() -> None:
    caches = kv(9)
    io = KVBlockIO(caches, NB)
    buf, arr = io.new_staging(2)
    io.gather([3, 4], buf)
    before = arr.copy()
    for t in caches.values():
        t[3:5].zero_()
    assert np.array_equal(arr, before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("layout", ["contiguous", "nhd_view", "kv_outer"])
def test_cuda_save_then_load_is_bit_exact(layout: str) -> None:
    """The CUDA path (side stream, pinned staging) on vLLM's GPU layouts."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)

    def caches() -> dict[str, torch.Tensor]:
        out = {}
        for i in range(3):
            if layout == "contiguous":  # (B, H, N, 2D)
                t = torch.randn(NB, 2, 8, 32, device=dev, generator=g)
            elif layout == "nhd_view":  # physical (B, N, H, 2D), logical (B, H, N, 2D)
                t = torch.randn(NB, 8, 2, 32, device=dev, generator=g).permute(0, 2, 1, 3)
            else:  # (2, B, N, H, D): K and V apart
                t = torch.randn(2, NB, 8, 2, 16, device=dev, generator=g)
            out[f"model.layers.{i}.self_attn.attn"] = t.to(torch.bfloat16)
        return out

    cluster = FakeCluster()
    src = caches()
    w1, _ = worker(cluster, src)
    assert w1.io is not None and not w1.io.is_cpu
    save(w1, cluster, [3, 4, 5], [h(i) for i in range(3)])
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    w2, _ = worker(cluster, dst)
    w2.start_step(
        StepPlan(NS, loads=[LoadJob("r", [9, 10, 11], [h(i) for i in range(3)], [["n1"]] * 3)])
    )
    errors, _ = finish_loads(w2, "r")
    assert errors == set()
    bdim = 1 if layout == "kv_outer" else 0
    for name in src:
        got = dst[name].narrow(bdim, 9, 3)
        want = src[name].narrow(bdim, 3, 3)
        assert torch.equal(got, want)
        assert not dst[name].narrow(bdim, 0, 9).any()
    w1.shutdown()
    w2.shutdown()


def test_staging_full_drops_are_logged_with_the_reason(caplog: pytest.LogCaptureFixture) -> None:
    cluster = FakeCluster()
    gate = __import__("threading").Event()
    cluster.put_gate = gate
    w, c = worker(cluster, kv(7), max_staging_bytes=2 * 2 * 3 * 512)  # 1 save chunk
    w.submit_saves(StepPlan(NS, saves=[SaveJob("a", [1, 2, 3, 4], [h(i) for i in range(4)])]))
    wait_for(lambda: c.totals().get("save_dropped_blocks", 0) == 2)
    gate.set()
    w.shutdown()
    assert "2 blocks not saved: the save staging memory is full" in caplog.text
    assert "max_staging_bytes" in caplog.text


def test_shutdown_lets_pending_saves_finish_within_its_bound() -> None:
    import threading

    cluster = FakeCluster()
    gate = threading.Event()
    cluster.put_gate = gate
    w, c = worker(cluster, kv(11))
    w.submit_saves(StepPlan(NS, saves=[SaveJob("a", [1, 2, 3], [h(1), h(2), h(3)])]))
    threading.Timer(0.3, gate.set).start()  # the node answers a moment later
    w.shutdown()
    assert c.totals().get("save_blocks", 0) == 3
    assert not c.totals().get("save_dropped_blocks")
    assert c.totals().get("save_shutdown_seconds", 0) > 0


def test_saves_still_pending_after_the_bound_are_counted_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cluster = FakeCluster()
    gate = __import__("threading").Event()
    cluster.put_gate = gate  # the node never answers in time
    w, c = worker(cluster, kv(12), shutdown_wait_s=0.3)
    w.submit_saves(StepPlan(NS, saves=[SaveJob("a", [1, 2, 3], [h(1), h(2), h(3)])]))
    t0 = time.monotonic()
    w.shutdown()
    assert time.monotonic() - t0 < 5  # bounded: it did not wait for the node
    gate.set()
    assert c.totals().get("save_dropped_blocks", 0) == 3
    assert not c.totals().get("save_failed_blocks")  # lost once, not counted twice
    assert "3 blocks of saves did not finish within shutdown_wait_s" in caplog.text


def test_loads_and_forward_passes_are_measured_for_the_cost_model() -> None:
    cluster = FakeCluster()
    src, _ = worker(cluster, kv(13))
    save(src, cluster, [1, 2, 3], [h(1), h(2), h(3)])
    src.shutdown()
    w, _ = worker(cluster, kv(14))
    for req in ("first", "r"):  # the first of each source paid set-up: not reported
        plan = StepPlan(NS, loads=[LoadJob(req, [4, 5, 6], [h(1), h(2), h(3)], [["n1"]] * 3)])
        plan.tokens = 100
        w.begin_forward(plan)
        w.start_step(plan)
        w.end_forward()
        finish_loads(w, req)
    rep = w.take_report()
    assert rep is not None and rep.block_bytes == w.io.block_bytes  # type: ignore[union-attr]
    kinds = {s for s, _n, _t in rep.samples}
    assert kinds == {"compute", "n1"}
    assert ("n1", 3 * w.io.block_bytes) in {(s, n) for s, n, _t in rep.samples}  # type: ignore[union-attr]
    assert ("compute", 100) in {(s, n) for s, n, _t in rep.samples}
    # a probe fetches into staging only: nothing is reported to vLLM as loaded
    probe = LoadJob("pegaflow.probe:n1", [], [h(1), h(2)], [["n1"]] * 2, probe=True)
    w.start_step(StepPlan(NS, loads=[probe]))
    wait_for(lambda: any(s == "n1" for s, _n, _t in (w._report.samples or [])))
    assert w.get_finished(set()) == (None, None)
    w.shutdown()


def test_a_staging_buffer_that_a_failed_get_may_still_write_is_not_handed_out() -> None:
    """A get that gave up may still have receives under way into its staging buffer
    (UCX cannot cancel them): the buffer goes back only once the client says it settled."""
    io = KVBlockIO(kv(1), NB)
    staging = Staging(io, 2, 2 * 2 * io.block_bytes, min_chunks=1)  # two buffers at most
    a, b = staging.acquire(wait=False), staging.acquire(wait=False)
    assert a is not None and b is not None
    settled = False
    staging.release(a, lambda: settled)
    staging.release(b)
    assert staging.acquire(wait=False) is b
    assert staging.acquire(wait=False) is None  # a is held, and no third may be made
    settled = True
    assert staging.acquire(wait=False) is a


@pytest.mark.parametrize("graph_tokens", [512, 0])
def test_with_cuda_graphs_the_start_up_work_is_done_before_the_capture(
    monkeypatch: pytest.MonkeyPatch, graph_tokens: int
) -> None:
    # vLLM captures CUDA graphs right after register_kv_caches: a CUDA call of our
    # threads beside the capture would invalidate it, and compiles beside the first
    # requests would hold the GIL their lookups need.  So where it captures graphs,
    # register_kv_caches itself finds and maps the node's pool (the pinning then goes on
    # in its own thread, in CUDA's relaxed capture mode) and warms the kernel up; in an
    # eager engine that work runs in the background
    ran: list[str] = []
    monkeypatch.setattr(WorkerSide, "_warm_up", lambda self: ran.append("warm-up"))
    monkeypatch.setattr(WorkerSide, "_discover", lambda self: ran.append("discover"))
    s = ConnectorSettings.load({}, env={})
    gate = threading.Event()
    w = WorkerSide(s, 0, Counters(), FakeCluster, graph_tokens=graph_tokens)
    w._load_pool.submit(gate.wait)  # the background thread is busy
    w.register_kv_caches(kv(1), NB)
    assert ran == (["discover", "warm-up"] if graph_tokens else [])
    gate.set()
    w._load_pool.submit(lambda: None).result()
    w.start_step(StepPlan(NS))  # nothing more
    w._load_pool.submit(lambda: None).result()
    assert ran == ["discover", "warm-up"]
    w.shutdown()


@pytest.mark.parametrize("graph_tokens", [512, 0])
def test_the_ucx_worker_is_opened_while_vllms_thread_waits(graph_tokens: int) -> None:
    # UCX reads the process environment as it opens a worker; an engine's start changes
    # it on other threads, so the worker is opened before register_kv_caches returns,
    # in an eager engine too, where the rest of the start-up work is in the background
    s = ConnectorSettings.load({}, env={})
    made: list[FakeCluster] = []
    w = WorkerSide(s, 0, Counters(), lambda: made.append(FakeCluster()) or made[-1],
                   graph_tokens=graph_tokens)  # fmt: skip
    gate = threading.Event()
    w._load_pool.submit(gate.wait)  # the background thread is busy
    w.register_kv_caches(kv(1), NB)
    assert len(made) == 1 and made[0].transfers_opened
    gate.set()
    w.shutdown()


def test_steps_that_replay_a_cuda_graph_queue_every_layer_at_once() -> None:
    # a new step size may load new kernels (which wait for the copies in flight), but
    # not a size vLLM captured a graph for: its loads are not held back
    s = ConnectorSettings.load({"mode": "off"}, env={})
    eager = WorkerSide(s, 0, Counters(), FakeCluster)
    graphs = WorkerSide(s, 0, Counters(), FakeCluster, graph_tokens=512)
    ahead = s.load_lookahead_layers
    assert ahead > 0
    assert eager.layerwise._ahead(StepPlan(NS, tokens=128)) == ahead
    assert graphs.layerwise._ahead(StepPlan(NS, tokens=128)) == 0
    assert graphs.layerwise._ahead(StepPlan(NS, tokens=4096)) == ahead  # past the graphs
    eager.shutdown()
    graphs.shutdown()


def test_a_saves_wait_and_hold_are_counted() -> None:
    """A save job's wait behind earlier saves is one ``save_wait_seconds`` sample; a
    same-host hold is one ``save_hold_seconds`` sample from the step that filled the
    blocks, at its first release only, and it ends the hold on the request."""
    cluster = FakeCluster()
    w, c = worker(cluster, kv(1))
    save(w, cluster, [1, 2], [h(1), h(2)])
    wait_for(lambda: "save_wait_latency_seconds" in c.take_delta())
    assert c.totals()["save_wait_seconds"] >= 0

    books = WorkerBooks(ConnectorSettings.load({}, env={}), Counters())
    release = books.hold_until_taken(["r"], time.monotonic() - 0.5)
    assert books.pending_gathers == {"r": 1}
    release()
    release()
    assert books.pending_gathers == {}
    assert books.counters.totals()["save_hold_seconds"] >= 0.5
    assert len(books.counters.take_delta()["save_hold_latency_seconds"]) == 1  # type: ignore[arg-type]
    w.shutdown(0.5)


def test_merged_save_jobs_store_each_hash_once_and_hold_every_request() -> None:
    jobs = [
        SaveJob("a", [1, 2], [h(1), h(2)], 5.0),
        SaveJob("b", [3, 4], [h(3), h(1)], 4.0),  # h(1): the same block as a's
        SaveJob("a", [5], [h(5)], 0.0),
    ]
    m = merge_saves(jobs)
    assert (m.block_ids, m.hashes) == ([1, 2, 3, 5], [h(1), h(2), h(3), h(5)])
    assert m.holders == ["a", "b", "a"] and m.filled_at == 4.0
    assert merge_saves(jobs[:1]) is jobs[0] and jobs[0].holders == ["a"]


def test_saves_queued_behind_a_busy_save_thread_go_out_together() -> None:
    """Jobs that queue up while the save thread is busy are copied out and sent as one
    (fewer puts; a hash in two of them stored once); every block is stored as it was
    in the KV cache, the books end at zero and no request stays held."""
    cluster = FakeCluster()
    src = kv(12)
    w, c = worker(cluster, src, chunk_bytes=8 * 3 * 512)  # 8 blocks a put
    gate = threading.Event()
    w._save_pool.submit(gate.wait, 10)  # the save thread is busy
    w.submit_saves(StepPlan(NS, saves=[SaveJob("a", [1, 2], [h(1), h(2)])]))
    w.submit_saves(StepPlan(NS, saves=[SaveJob("b", [3, 4], [h(3), h(1)])]))
    w.submit_saves(StepPlan(NS, saves=[SaveJob("c", [5], [h(5)])]))
    gate.set()
    wait_for(lambda: w.pending_saves() == 0 and c.totals().get("save_blocks", 0) == 4)
    assert cluster.puts == 1
    assert "save_present_blocks" not in c.totals()
    assert w.books.pending_gathers == {}
    assert len(c.take_delta()["save_wait_latency_seconds"]) == 3  # type: ignore[arg-type]

    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    w2, _ = worker(cluster, dst)
    w2.start_step(
        StepPlan(NS, loads=[LoadJob("r", [1, 2, 3, 5], [h(1), h(2), h(3), h(5)], [["n1"]] * 4)])
    )
    errors, _ = finish_loads(w2, "r")
    assert errors == set()
    for name in src:
        assert torch.equal(dst[name][[1, 2, 3, 5]], src[name][[1, 2, 3, 5]])
    w.shutdown()
    w2.shutdown()


def test_a_save_stuck_on_the_node_delays_no_load_and_no_step() -> None:
    """A save whose put hangs (a slow node, a full link) holds only the save thread: a
    step started meanwhile returns, and a load in it lands and checks out while the
    save is still stuck (issue 38: no save delays a load or a step)."""
    cluster = FakeCluster()
    src = kv(3)
    w, _ = worker(cluster, src)
    save(w, cluster, [1, 2, 3], [h(i) for i in range(3)])
    stuck = threading.Event()
    put = cluster.put_blocks

    def stuck_put(*args: Any, **kw: Any) -> Any:
        stuck.set()
        return put(*args, **kw)

    cluster.put_blocks = stuck_put  # type: ignore[method-assign]
    cluster.put_gate = threading.Event()
    try:
        w.submit_saves(StepPlan(NS, saves=[SaveJob("s2", [4, 5], [h(10), h(11)])]))
        assert stuck.wait(10)
        job = LoadJob("r", [7, 8, 9], [h(i) for i in range(3)], [["n1"]] * 3)
        w.start_step(StepPlan(NS, loads=[job]))
        errors, _ = finish_loads(w, "r")
        assert errors == set()
        assert (NS, h(10), 0) not in cluster.blocks  # the save is still stuck
        for name in src:
            assert torch.equal(src[name][7:10], src[name][1:4])
    finally:
        cluster.put_gate.set()
    wait_for(lambda: (NS, h(10), 0) in cluster.blocks)
    w.shutdown()
