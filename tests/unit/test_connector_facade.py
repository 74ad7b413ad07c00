"""PegaKVConnector's vLLM-facing facade, wired to fakes: hook plumbing, metadata, stats.

Runs against whichever vLLM is installed (no engine is started).  The same checks pass
with vLLM 0.26's sources on ``PYTHONPATH`` (the GPU wheel's pure-Python modules).
"""

from __future__ import annotations

import pickle
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest

pytest.importorskip("vllm")

from pegaflow.connector import PegaKVConnector, sameprocess
from pegaflow.connector.compat import (
    KVConnectorRole,
    PegaConnectorMetadata,
    PegaWorkerMetadata,
    defers_block_frees,
)
from pegaflow.connector.metadata import WorkerReport
from pegaflow.connector.stats import PegaConnectorStats

from tests.support.connector_fakes import (
    FakeCluster,
    FakeRequest,
    FullAttentionSpec,
    kv_cache_config,
    new_req,
    sched_output,
    vllm_config,
)

BS = 32


@pytest.fixture(autouse=True, scope="module")
def _hash_root() -> None:
    """What vLLM's engine core does before the first request."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(get_hash_fn_by_name("sha256"))


def scheduler(cluster: FakeCluster, **kw: Any) -> PegaKVConnector:
    # patched on the class: the connector starts connecting (warm_up) as it is built
    with mock.patch.object(PegaKVConnector, "_make_client", lambda self: cluster):
        c = PegaKVConnector(vllm_config(**kw), KVConnectorRole.SCHEDULER, kv_cache_config())
    c._make_client = lambda: cluster  # type: ignore[method-assign]
    c._scheduler._client_factory = lambda: cluster  # type: ignore[union-attr]
    return c


def test_scheduler_hooks_roundtrip() -> None:
    cluster = FakeCluster()
    conn = scheduler(cluster)
    req = FakeRequest("r", list(range(100)), BS)
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    blocks = SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4],))
    conn.update_state_after_alloc(req, blocks, 0)
    meta = conn.build_connector_meta(
        sched_output(new=[new_req("r", [1, 2, 3, 4], 0)], scheduled={"r": 100})
    )
    assert isinstance(meta, PegaConnectorMetadata)
    again = pickle.loads(pickle.dumps(meta))  # vLLM ships it to the workers
    assert [s.block_ids for s in again.plan.saves] == [[1, 2, 3]]
    ns = again.plan.namespace
    assert ns.startswith("tiny.")
    assert conn.request_finished(req, [1, 2, 3, 4]) == (True, None)
    out = SimpleNamespace(
        kv_connector_worker_meta=PegaWorkerMetadata(WorkerReport(save_failed=[b"x"]))
    )
    conn.update_connector_output(out)
    stats = conn.get_kv_connector_stats()
    assert isinstance(stats, PegaConnectorStats)
    assert stats.data["save_planned_blocks"] == 3
    assert conn.get_kv_connector_stats() is None  # deltas
    rebuilt = PegaKVConnector.build_kv_connector_stats(stats.data)
    assert isinstance(rebuilt, PegaConnectorStats) and not rebuilt.is_empty()
    assert "hit_rate" in rebuilt.reduce()
    conn.shutdown()


def test_transfer_results_carry_the_requests_whose_load_failed() -> None:
    """vLLM 0.32's ``get_transfer_results``: a hybrid model's failed loads by request."""
    from pegaflow.connector.compat import TransferResults

    if TransferResults is None:
        pytest.skip("vLLM 0.26 has no transfer results")
    conn = scheduler(FakeCluster())
    conn._worker = SimpleNamespace(
        get_finished=lambda done: ({"s"}, {"a"}), take_failed_requests=lambda: {"b"}
    )
    res = conn.get_transfer_results(set())
    assert (res.finished_sending, res.finished_recving, res.failed_recving) == (
        {"s"}, {"a", "b"}, {"b"}
    )
    conn._worker = None
    conn.shutdown()


def test_lookup_exceptions_never_escape() -> None:
    conn = scheduler(FakeCluster())

    class Broken:
        request_id = "x"

        @property
        def block_hashes(self) -> list[bytes]:
            raise RuntimeError("boom")

    assert conn.get_num_new_matched_tokens(Broken(), 0) == (0, False)


def test_models_of_unequal_group_block_sizes_turn_the_connector_off() -> None:
    """(Hybrid attention models: tests/unit/test_connector_hybrid.py.)"""
    cfg = kv_cache_config(groups=2)
    cfg.kv_cache_groups[1].kv_cache_spec = FullAttentionSpec(
        **{**vars(cfg.kv_cache_groups[0].kv_cache_spec), "block_size": 2 * BS}
    )
    conn = PegaKVConnector(vllm_config(), KVConnectorRole.SCHEDULER, cfg)
    assert conn.settings.mode == "off"
    req = FakeRequest("r", list(range(64)), BS)
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)


def test_bad_extra_config_is_refused() -> None:
    with pytest.raises(ValueError):
        PegaKVConnector(vllm_config({"mdoe": "x"}), KVConnectorRole.SCHEDULER, kv_cache_config())


def test_vllms_default_failure_policy_becomes_recompute() -> None:
    """With the three keys vLLM's policy is ``fail`` (a block that cannot be loaded ends
    its request with an error); the scheduler's connector sets ``recompute`` before
    vLLM's scheduler reads it, on vLLM's own config class too, unless told not to."""
    from vllm.config import KVTransferConfig

    cfg = vllm_config()
    cfg.kv_transfer_config = KVTransferConfig(
        kv_connector="PegaKVConnector", kv_role="kv_both", kv_connector_extra_config={}
    )
    assert cfg.kv_transfer_config.kv_load_failure_policy == "fail"
    kept = vllm_config({"recompute_failed_loads": False}, policy="fail")
    with mock.patch.object(PegaKVConnector, "_make_client", lambda self: FakeCluster()):
        conn = PegaKVConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config())
        PegaKVConnector(kept, KVConnectorRole.SCHEDULER, kv_cache_config()).shutdown()
    assert cfg.kv_transfer_config.kv_load_failure_policy == "recompute"
    assert conn.policy == "recompute"
    conn.shutdown()
    assert kept.kv_transfer_config.kv_load_failure_policy == "fail"


def test_worker_metadata_aggregates_across_ranks() -> None:
    a = PegaWorkerMetadata(WorkerReport(save_failed=[b"a"], load_failed={"r": 3}))
    b = PegaWorkerMetadata(WorkerReport(save_failed=[b"b", b"a"], load_failed={"r": 1, "s": 0}))
    m = a.aggregate(b)
    assert isinstance(m, PegaWorkerMetadata)
    assert sorted(m.report.save_failed) == [b"a", b"b"]
    assert m.report.load_failed == {"r": 1, "s": 0}


def test_stats_aggregate_sums() -> None:
    a = PegaConnectorStats(data={"load_blocks": 2, "load_seconds": 0.5})
    b = PegaConnectorStats(data={"load_blocks": 3, "load_bytes": 10})
    a.aggregate(b)
    assert a.data == {"load_blocks": 5, "load_seconds": 0.5, "load_bytes": 10}
    a.reset()
    assert a.is_empty()


def test_the_engine_log_says_what_the_cache_did(caplog: pytest.LogCaptureFixture) -> None:
    """One 'PegaFlow cache:' INFO line per interval, from the scheduler's own lookups and
    the workers' loads and saves (their stats, as vLLM hands them over), and only when
    something happened."""
    from pegaflow.connector.report import format_line

    cluster = FakeCluster()
    conn = scheduler(cluster, extra={"report_interval_s": 3600})
    report = conn._report
    assert report is not None
    assert report.take() is None  # nothing happened yet: no line
    req = FakeRequest("r", list(range(100)), BS)
    for h in req.block_hashes[:2]:
        cluster.blocks[(conn._scheduler.namespace, h, 0)] = ("n1", b"x")  # type: ignore[union-attr]
    assert conn.get_num_new_matched_tokens(req, 0) == (64, True)
    conn.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4],)), 64)
    worker_stats = PegaConnectorStats(
        data={"load_blocks": 2, "load_bytes": 2e9, "load_seconds": 0.5, "local_load_blocks": 1,
              "save_blocks": 1, "save_bytes": 1e6, "save_dropped_blocks": 3,
              "lookups": 99}  # a scheduler counter in the workers' stats is not counted
    )  # fmt: skip
    conn.update_connector_output(SimpleNamespace(kv_connector_stats=worker_stats))
    line = report.take()
    assert line is not None
    for part in ("1 lookups", "hit rate 66.7% (2 of 3 blocks)", "64 tokens from the cache",
                 "2.00 GB loaded at 4.0 GB/s, 50% same-host", "saved 1 blocks", "3 dropped",
                 "0 failures"):  # fmt: skip
        assert part in line, line
    assert report.take() is None  # reset: nothing since
    assert format_line({"lookup_errors": 2}, 10) is not None  # failures alone are news
    declined = format_line({"lookups": 1, "cost_declined": 1}, 10, "computing 9 tokens/s")
    assert "1 hits declined as slower than computing (estimates: computing 9 tokens/s)" in (
        declined or ""
    )
    assert "estimates" not in (format_line({"lookups": 1}, 10, "computing 9 tokens/s") or "")
    caplog.set_level("INFO", "pegaflow.connector")
    conn.update_connector_output(SimpleNamespace(kv_connector_stats=worker_stats))
    conn.shutdown()  # the last line is logged at shutdown
    assert "PegaFlow cache (last" in caplog.text


def test_the_line_says_what_happened_to_small_and_failed_loads() -> None:
    """Issue 35, defect 8: a small remote load read ``4.1 MB loaded at 0.0 GB/s``, and an
    interval whose loads failed read ``hit rate 0.0% (0 of 62 blocks) ... 62 failures``
    although the lookup that claimed them had hit."""
    from pegaflow.connector.report import format_line

    small = format_line({"lookups": 1, "lookup_hit_blocks": 2, "load_blocks": 2,
                         "load_bytes": 4.1e6, "load_seconds": 0.05}, 10)  # fmt: skip
    assert small is not None and "4.1 MB loaded at 82.0 MB/s" in small, small
    assert "0.0 GB/s" not in small
    slow = format_line({"load_blocks": 1, "load_bytes": 2000, "load_seconds": 1.0}, 10)
    assert slow is not None and "at 2.00 kB/s" in slow, slow
    # the loads of an earlier interval's hits failed; this interval's lookups missed
    failed = format_line({"lookups": 2, "lookup_miss_blocks": 62, "load_failed_blocks": 62}, 10)
    assert failed is not None
    assert "62 blocks failed to load (hits of earlier lookups, recomputed)" in failed, failed
    assert "0 failures" not in failed
    # failures by kind, each said as what it is
    kinds = format_line({"lookup_errors": 3, "save_failed_blocks": 4}, 10)
    assert kinds is not None
    assert "no lookups answered" in kinds and "3 lookups failed (answered as misses)" in kinds
    assert "4 blocks failed to save" in kinds
    this_interval = format_line(
        {"lookups": 1, "lookup_hit_blocks": 8, "load_failed_blocks": 8}, 10, load_failure_fate="x"
    )
    assert this_interval is not None and "8 blocks failed to load (x)" in this_interval


def test_the_line_reads_a_worker_in_the_schedulers_process_directly() -> None:
    """With one rank the worker shares the scheduler's process: its saves show in the
    next line even when they finish after the engine's last step (no stats follow)."""
    from pegaflow.connector.metrics import Counters

    conn = scheduler(FakeCluster(), extra={"report_interval_s": 3600})
    report = conn._report
    assert report is not None
    counters = Counters("worker")
    worker = SimpleNamespace(counters=counters)
    sameprocess.register(worker)  # type: ignore[arg-type]
    try:
        counters.add("save_blocks", 5)
        counters.add("save_bytes", 5e6)
        line = report.take()
        assert line is not None and "saved 5 blocks (5.0 MB)" in line, line
        assert report.take() is None  # counted once
        counters.add("save_blocks", 2)
        stats = PegaConnectorStats(data={"save_blocks": 2})  # the same saves, via vLLM
        conn.update_connector_output(SimpleNamespace(kv_connector_stats=stats))
        line = report.take()
        assert line is not None and "saved 2 blocks" in line, line
    finally:
        sameprocess.unregister(worker)  # type: ignore[arg-type]
    conn.shutdown()


def test_full_cuda_graphs_are_refused_while_loads_wait_layer_by_layer() -> None:
    # a full graph's replay skips wait_for_layer_load: vLLM must capture piecewise ones
    assert PegaKVConnector.requires_piecewise_for_cudagraph({}) is True
    assert PegaKVConnector.requires_piecewise_for_cudagraph({"layerwise": False}) is False
    assert PegaKVConnector.requires_piecewise_for_cudagraph({"no_such_key": 1}) is True


def test_a_worker_in_the_schedulers_process_gets_each_load_as_vllm_allocates_it() -> None:
    """With one rank the worker shares the scheduler's process: each layer-wise load
    goes to it the moment vLLM allocates the request's blocks (it starts the copies
    there where vLLM replays CUDA graphs), and the step's plan once it is built."""
    cluster = FakeCluster()
    conn = scheduler(cluster, extra={"local_node": "n1", "cost_model": False})
    assert conn._scheduler is not None
    ns = conn._scheduler.namespace
    req = FakeRequest("r", list(range(100)), BS)  # 3 full blocks, all on this host's node
    for h in req.block_hashes:
        cluster.blocks[(ns, h, 0)] = ("n1", b"x")
    calls: list[tuple[Any, ...]] = []
    worker = SimpleNamespace(
        prestart_job=lambda job, ns: calls.append(("job", job.req_id, job.sync, ns)),
        prestart=lambda plan: calls.append(("plan", [j.req_id for j in plan.loads])),
    )
    sameprocess.register(worker)  # type: ignore[arg-type]
    try:
        assert conn.get_num_new_matched_tokens(req, 0) == (96, False)  # layer-wise
        assert calls == []
        blocks = SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4],))
        conn.update_state_after_alloc(req, blocks, 96)
        assert calls == [("job", "r", True, ns)]
        conn.build_connector_meta(
            sched_output(new=[new_req("r", [1, 2, 3, 4], 96)], scheduled={"r": 4})
        )
        assert calls[-1] == ("plan", ["r"])
    finally:
        sameprocess.unregister(worker)  # type: ignore[arg-type]
        conn.shutdown()


def test_this_vllm_holds_freed_blocks_back_while_a_step_in_flight_may_touch_them() -> None:
    # else the connector's copies into a new request's blocks follow the GPU work queued
    assert defers_block_frees() is True
