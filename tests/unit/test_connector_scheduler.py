"""Scheduler-side bookkeeping of PegaKVConnector, with fake requests and a fake cluster."""

from __future__ import annotations

import pickle
import threading
from typing import Any

import pytest
from pegaflow.connector.metadata import StepPlan, WorkerReport
from pegaflow.connector.metrics import Counters
from pegaflow.connector.policy import CircuitBreaker
from pegaflow.connector.scheduler.known import KnownBlocks
from pegaflow.connector.scheduler.side import SchedulerSide
from pegaflow.connector.settings import ConnectorSettings

from tests.support.connector_fakes import (
    BS,
    DEADLINE,
    DOWN,
    NS,
    Clock,
    FakeCluster,
    FakeRequest,
    costed,
    make,
    new_req,
    sched_output,
    store,
    toks,
)


def test_miss_then_save_plan_of_full_prompt_blocks() -> None:
    side, _cl, c = make()
    req = FakeRequest("r1", toks(10), BS)  # 2 full blocks + 2 tokens
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    side.update_state_after_alloc(req, ([1, 2, 3],), 0)
    plan = side.build_plan(sched_output(new=[new_req("r1", [1, 2, 3], 0)], scheduled={"r1": 10}))
    assert plan.loads == []
    assert [(s.req_id, s.block_ids, s.hashes) for s in plan.saves] == [
        ("r1", [1, 2], req.block_hashes[:2])
    ]
    assert plan.namespace == NS
    assert c.totals()["lookup_miss_blocks"] == 2
    # nothing more to save on the next (decode) step
    plan = side.build_plan(sched_output(cached=[("r1", None, 10)], scheduled={"r1": 1}))
    assert plan.saves == []


def test_chunked_prefill_saves_blocks_as_they_fill() -> None:
    side, _, _ = make()
    req = FakeRequest("r1", toks(16), BS)
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, ([5, 6],), 0)
    p1 = side.build_plan(sched_output(new=[new_req("r1", [5, 6], 0)], scheduled={"r1": 6}))
    assert [s.block_ids for s in p1.saves] == [[5]]
    p2 = side.build_plan(sched_output(cached=[("r1", [7, 8], 6)], scheduled={"r1": 10}))
    assert [s.block_ids for s in p2.saves] == [[6, 7, 8]]


def test_hit_plans_async_load_of_exactly_the_hit_blocks() -> None:
    side, cl, c = make()
    req = FakeRequest("r1", toks(18), BS)  # 4 full blocks
    store(cl, req, 3)
    assert side.get_num_new_matched_tokens(req, 0) == (12, True)
    # asked again before allocation: answered from the short-lived lookup cache
    assert side.get_num_new_matched_tokens(req, 0) == (12, True)
    assert cl.lookups == 1
    side.update_state_after_alloc(req, ([10, 11, 12, 13, 14],), 12)
    plan = side.build_plan(sched_output())
    (job,) = plan.loads
    assert job.req_id == "r1" and job.block_ids == [10, 11, 12]
    assert job.hashes == req.block_hashes[:3] and job.nodes == [["n1"]] * 3
    assert job.gens == [[0]] * 3  # the generations the lookup saw: the get is fenced
    # the hit blocks were pinned on their node right after the lookup, once
    assert cl.pins == [(NS, [("n1", hh, 0) for hh in req.block_hashes[:3]], 5.0)]
    assert side.request_finished(req) is False  # loading: vLLM holds the blocks itself
    # after the load the request is scheduled: only the missing 4th block is saved
    plan = side.build_plan(
        sched_output(new=[new_req("r1", [10, 11, 12, 13, 14], 12)], scheduled={"r1": 6})
    )
    assert [s.block_ids for s in plan.saves] == [[13]]
    assert c.totals()["hit_tokens"] == 12
    assert c.totals()["save_known_blocks"] == 3


def test_hits_on_the_local_node_load_layer_wise_and_leave_a_token() -> None:
    side, cl, _ = make(local_node="n1")
    req = FakeRequest("r1", toks(16), BS)  # exactly 4 full blocks, all stored on n1
    store(cl, req, 4)
    # synchronous (layer-wise) load; vLLM must still compute one token: 3 blocks
    assert side.get_num_new_matched_tokens(req, 0) == (12, False)
    side.update_state_after_alloc(req, ([10, 11, 12, 13],), 12)
    (job,) = side.build_plan(sched_output()).loads
    assert job.sync and job.block_ids == [10, 11, 12]
    # a hit on another node, or layer-wise off: asynchronous as before
    other, cl2, _ = make(local_node="n2")
    store(cl2, req, 4)
    assert other.get_num_new_matched_tokens(req, 0) == (16, True)
    off, cl3, _ = make(local_node="n1", layerwise=False)
    store(cl3, req, 4)
    assert off.get_num_new_matched_tokens(req, 0) == (16, True)


def test_an_engines_first_steps_compute_a_few_tokens_of_each_hit() -> None:
    """Where vLLM's CPU attention runs AMX kernels, its first call crashes the engine when
    it computes 4 tokens or fewer of a request (``compat.first_steps_min_tokens``): until
    the engine has run a step of 5, a hit leaves at least 5 tokens, a whole block fewer
    where it would leave less; from then on it leaves one token, as before."""
    c = Counters()
    s = ConnectorSettings.load({"cost_model": False, "local_node": "n1"}, env={})
    side = SchedulerSide(
        s, BS, 1, namespace=lambda: NS, counters=c, client=FakeCluster(), clock=Clock(),
        first_steps_min_tokens=5,
    )  # fmt: skip
    req = FakeRequest("r1", toks(18), BS)  # 4 full blocks + 2 tokens
    store(side.cluster.get(), req, 4)
    assert side.get_num_new_matched_tokens(req, 0) == (12, False)  # 6 left, not 2
    roomy = FakeRequest("r2", toks(24, 100), BS)  # 6 full blocks, the first 4 stored
    store(side.cluster.get(), roomy, 4)
    assert side.get_num_new_matched_tokens(roomy, 0) == (16, False)  # leaves 8: whole
    side.update_state_after_alloc(req, ([1, 2, 3, 4, 5],), 12)
    side.build_plan(sched_output(new=[new_req("r1", [1, 2, 3, 4, 5], 12)], scheduled={"r1": 6}))
    again = FakeRequest("r3", toks(18), BS)
    assert side.get_num_new_matched_tokens(again, 0) == (16, False)  # past it: 2 left


def test_layer_wise_hits_are_located_before_the_coordinator_is_asked() -> None:
    side, cl, _ = make(local_node="n1")
    req = FakeRequest("r1", toks(24), BS)  # 6 full blocks
    store(cl, req, 5)
    cl.unlocatable.add(req.block_hashes[4])  # evicted between the lookup and locate
    # the node located 4 of the 5 hits: the hit shrinks to them
    assert side.get_num_new_matched_tokens(req, 0) == (16, False)
    assert len(cl.locates) == 1 and not cl.pins  # locate pinned them: no second pin
    assert cl.lookups == 1  # the node lacked blocks: the coordinator was asked after it
    side.update_state_after_alloc(req, ([10, 11, 12, 13, 14, 15],), 16)
    (job,) = side.build_plan(sched_output()).loads
    assert job.sync and job.block_ids == [10, 11, 12, 13]
    assert job.located[0].column("gen").tolist() == [0, 0, 0, 0] and job.pins == [1]
    assert len(job.located[0]) == 4 and job.located[0].found.all()
    assert job.located_at > 0
    # every block on the local node: the node's answer is the whole hit
    whole, cl3, c3 = make(local_node="n1")
    store(cl3, req, 6)
    assert whole.get_num_new_matched_tokens(req, 0) == (20, False)  # one token left
    assert c3.totals().get("lookups_local") == 1 and not c3.totals().get("lookups")
    assert cl3.lookups == 0  # nothing for the coordinator to add: not asked at all
    whole.update_state_after_alloc(req, ([20, 21, 22, 23, 24, 25],), 20)
    (job3,) = whole.build_plan(sched_output()).loads
    assert job3.sync and len(job3.located[0]) == 5 and job3.gens == [[0]] * 5
    # hits on another node: no locations, read pins as before
    other, cl2, _ = make(local_node="n1")
    for h in req.block_hashes[:3]:
        cl2.blocks[(NS, h, 0)] = ("n2", b"x")
    assert other.get_num_new_matched_tokens(req, 0) == (12, True)
    other.update_state_after_alloc(req, ([10, 11, 12],), 12)
    (job2,) = other.build_plan(sched_output()).loads
    assert not job2.sync and job2.located == [] and cl2.pins


def test_lookups_during_the_engine_start_connections_wait_for_them() -> None:
    side, cl, c = make(local_node="n1")
    req = FakeRequest("r1", toks(24), BS)
    store(cl, req, 6)
    cl.connect_gate = threading.Event()  # the connections take their time
    side.start_warm_up()
    answer: list[Any] = []
    asking = threading.Thread(target=lambda: answer.append(side.get_num_new_matched_tokens(req, 0)))
    asking.start()
    asking.join(0.2)
    assert not answer and cl.lookups == 0  # waiting for the warm-up, not missing
    cl.connect_gate.set()
    asking.join(5)
    assert answer == [(20, False)]  # a whole local hit, as without the wait
    assert len(cl.locates) == 2 and cl.lookups == 1  # warm-up's locate and lookup, then ours
    assert c.totals().get("lookups_local") == 1


def test_a_failing_local_node_is_not_asked_for_a_while() -> None:
    clock = Clock()
    side, cl, c = make(local_node="n1", clock=clock, failures_to_backoff=2, backoff_s=5.0)
    store(cl, FakeRequest("r0", toks(24), BS), 6)  # every block of the requests below
    cl.locate_error = DOWN
    for i in range(3):  # the coordinator still answers: layer-wise, the worker locates
        req = FakeRequest(f"r{i}", toks(24), BS)
        assert side.get_num_new_matched_tokens(req, 0) == (20, False)
    assert len(cl.locates) == 2 and cl.lookups == 3  # two failures: no third locate
    assert not c.totals().get("lookup_errors")
    clock.t += 6  # the pause is over: a trial locate, which now succeeds
    cl.locate_error = None
    assert side.get_num_new_matched_tokens(FakeRequest("r9", toks(24), BS), 0) == (20, False)
    assert len(cl.locates) == 3 and cl.lookups == 3  # the node answered the whole hit


def test_lookup_starts_after_local_prefix_hit() -> None:
    side, cl, _ = make()
    req = FakeRequest("r1", toks(20), BS)
    store(cl, req, 4)
    # vLLM has the first 2 blocks locally: the connector offers blocks 2..3
    assert side.get_num_new_matched_tokens(req, 8) == (8, True)
    side.update_state_after_alloc(req, ([1, 2, 3, 4, 5],), 8)
    (job,) = side.build_plan(sched_output()).loads
    assert job.block_ids == [3, 4] and job.first_block == 2
    assert job.hashes == req.block_hashes[2:4]


def test_no_lookup_when_only_the_last_tokens_block_is_left() -> None:
    side, cl, _ = make()
    req = FakeRequest("r1", toks(16), BS)  # 4 full blocks; vLLM's own hit stops at 3
    store(cl, req, 4)
    assert side.get_num_new_matched_tokens(req, 12) == (0, False)
    assert cl.lookups == 0  # the last token is computed anyway: nothing worth a lookup
    assert side.get_num_new_matched_tokens(req, 8) == (8, True)
    assert cl.lookups == 1


def test_unaligned_local_hit_and_no_full_block_are_misses() -> None:
    side, cl, _ = make()
    req = FakeRequest("r1", toks(7), BS)
    store(cl, req, 1)
    assert side.get_num_new_matched_tokens(req, 2) == (0, False)
    assert side.get_num_new_matched_tokens(req, 4) == (0, False)  # no full block left


def test_hit_requires_every_shard() -> None:
    side, cl, _ = make(world=2)
    req = FakeRequest("r1", toks(12), BS)
    store(cl, req, 3, world=1)  # shard 1 missing everywhere
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    store(cl, req, 2, world=2)
    req2 = FakeRequest("r2", toks(12), BS)
    assert side.get_num_new_matched_tokens(req2, 0) == (8, True)


def test_malformed_lookup_answer_is_trimmed() -> None:
    side, cl, _ = make(world=2)
    req = FakeRequest("r1", toks(12), BS)

    class Bad:
        hits = 3
        blocks = [["n1", "n2"], ["n1"], ["n1", "n2"]]

    cl.lookup = lambda *a, **k: Bad()  # type: ignore[method-assign]
    assert side.get_num_new_matched_tokens(req, 0) == (4, True)


@pytest.mark.parametrize("err", [DEADLINE, DOWN, RuntimeError("boom")])
def test_lookup_failure_is_a_miss_and_counted(err: Exception) -> None:
    side, cl, c = make()
    req = FakeRequest("r1", toks(12), BS)
    store(cl, req, 3)
    cl.lookup_error = err
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert c.totals()["lookup_errors"] == 1


def test_circuit_breaker_stops_and_resumes_lookups() -> None:
    clock = Clock()
    side, cl, c = make(clock=clock, failures_to_backoff=2, backoff_s=5.0)
    cl.lookup_error = DOWN
    for i in range(2):
        side.get_num_new_matched_tokens(FakeRequest(f"a{i}", toks(8), BS), 0)
    assert cl.lookups == 2
    for i in range(5):
        assert side.get_num_new_matched_tokens(FakeRequest(f"b{i}", toks(8), BS), 0) == (0, False)
    assert cl.lookups == 2 and c.totals()["lookup_skipped"] == 5
    clock.t += 5.1
    cl.lookup_error = None
    req = FakeRequest("c", toks(8), BS)
    store(cl, req, 2)
    assert side.get_num_new_matched_tokens(req, 0) == (8, True)
    assert cl.lookups == 3


def test_breaker_backoff_doubles_on_failed_trial() -> None:
    clock = Clock()
    b = CircuitBreaker(1, 1.0, 4.0, clock)
    assert b.failure() and not b.allow()
    clock.t += 1.01
    assert b.allow()
    assert b.failure()  # trial failed: open for 2 s now
    clock.t += 1.5
    assert not b.allow()
    clock.t += 0.6
    assert b.allow()
    b.success()  # closed: the backoff is back to its base
    assert b.failure()
    clock.t += 1.01
    assert b.allow()


def test_request_finished_delays_free_only_after_saves() -> None:
    side, _, _ = make()
    a = FakeRequest("a", toks(8), BS)
    b = FakeRequest("b", toks(3), BS)  # no full block: never saves
    for r in (a, b):
        side.get_num_new_matched_tokens(r, 0)
    side.build_plan(
        sched_output(
            new=[new_req("a", [1, 2], 0), new_req("b", [3], 0)], scheduled={"a": 8, "b": 3}
        )
    )
    assert side.request_finished(a) is True
    assert side.request_finished(b) is False
    plan = side.build_plan(sched_output(finished={"a", "b"}))
    assert plan.delay_free == ["a"]
    assert not side.has_state("a") and not side.has_state("b")
    assert side.build_plan(sched_output()).delay_free == []


def test_modes() -> None:
    side, cl, _ = make(mode="save_only")
    req = FakeRequest("r1", toks(8), BS)
    store(cl, req, 2)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert cl.lookups == 0
    plan = side.build_plan(sched_output(new=[new_req("r1", [1, 2], 0)], scheduled={"r1": 8}))
    assert plan.saves  # cluster has them, but save_only did not look: the node dedupes

    side, cl, _ = make(mode="load_only")
    req = FakeRequest("r2", toks(8), BS)
    side.get_num_new_matched_tokens(req, 0)
    plan = side.build_plan(sched_output(new=[new_req("r2", [1, 2], 0)], scheduled={"r2": 8}))
    assert plan.saves == []
    assert side.request_finished(req) is False


def test_known_blocks_dedupe_concurrent_requests_and_forget_failures() -> None:
    side, _, _ = make()
    a = FakeRequest("a", toks(8), BS)
    b = FakeRequest("b", toks(8), BS)  # same prompt
    for r in (a, b):
        side.get_num_new_matched_tokens(r, 0)
    plan = side.build_plan(
        sched_output(
            new=[new_req("a", [1, 2], 0), new_req("b", [3, 4], 0)], scheduled={"a": 8, "b": 8}
        )
    )
    assert [(s.req_id, s.block_ids) for s in plan.saves] == [("a", [1, 2])]
    side.update_connector_output(WorkerReport(save_failed=a.block_hashes[:1]))
    assert a.block_hashes[0] not in side.known and a.block_hashes[1] in side.known
    c = FakeRequest("c", toks(8), BS)
    side.get_num_new_matched_tokens(c, 0)  # a miss: nothing of it is assumed stored
    plan = side.build_plan(sched_output(new=[new_req("c", [5, 6], 0)], scheduled={"c": 8}))
    assert [s.block_ids for s in plan.saves] == [[5, 6]]


def test_lookup_miss_forgets_evicted_blocks() -> None:
    side, _cl, _ = make()
    a = FakeRequest("a", toks(8), BS)
    side.get_num_new_matched_tokens(a, 0)
    side.build_plan(sched_output(new=[new_req("a", [1, 2], 0)], scheduled={"a": 8}))
    # the cluster never got (or evicted) them; the next lookup says so
    b = FakeRequest("b", toks(8), BS)
    assert side.get_num_new_matched_tokens(b, 0) == (0, False)
    plan = side.build_plan(sched_output(new=[new_req("b", [3, 4], 0)], scheduled={"b": 8}))
    assert [s.block_ids for s in plan.saves] == [[3, 4]]


def test_failed_load_report_makes_blocks_saveable_again() -> None:
    side, cl, _ = make()
    req = FakeRequest("r", toks(12), BS)
    store(cl, req, 3)
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, ([1, 2, 3, 4],), 12)
    side.build_plan(sched_output())
    side.update_connector_output(WorkerReport(load_failed={"r": 1}))
    plan = side.build_plan(sched_output(new=[new_req("r", [1, 2, 3, 4], 4)], scheduled={"r": 8}))
    assert [s.block_ids for s in plan.saves] == [[2, 3]]


def test_preemption_and_resume_track_new_blocks() -> None:
    side, _, _ = make()
    req = FakeRequest("r", toks(16), BS)
    side.get_num_new_matched_tokens(req, 0)
    p = side.build_plan(sched_output(new=[new_req("r", [1, 2], 0)], scheduled={"r": 8}))
    assert [s.block_ids for s in p.saves] == [[1, 2]]
    p = side.build_plan(sched_output(preempted={"r"}))
    assert p.preempted == ["r"]
    # resumed with all-new blocks; blocks 0-1 were saved already, 2-3 now
    p = side.build_plan(
        sched_output(cached=[("r", [9, 8, 7, 6], 0)], resumed={"r"}, scheduled={"r": 16})
    )
    assert [s.block_ids for s in p.saves] == [[7, 6]]


def test_decode_blocks_saved_only_when_enabled() -> None:
    for enabled, expect in ((False, []), (True, [[3]])):
        side, _, _ = make(save_decode_blocks=enabled)
        req = FakeRequest("r", toks(8), BS)
        side.get_num_new_matched_tokens(req, 0)
        side.build_plan(sched_output(new=[new_req("r", [1, 2], 0)], scheduled={"r": 8}))
        req.append(4)  # 4 generated tokens: block 2 full once their KV is computed
        p = side.build_plan(sched_output(cached=[("r", [3], 11)], scheduled={"r": 1}))
        assert [s.block_ids for s in p.saves] == expect


def test_unexpected_load_is_answered_with_failures() -> None:
    side, _, _ = make()
    req = FakeRequest("r", toks(8), BS)
    side.update_state_after_alloc(req, ([1, 2],), 8)  # no lookup offered this
    (job,) = side.build_plan(sched_output()).loads
    assert len(job.block_ids) == 2 and job.nodes == [[], []]


def test_namespace_not_ready_is_asked_again() -> None:
    calls = []

    def ns() -> str | None:
        calls.append(1)
        return None if len(calls) == 1 else NS

    side = SchedulerSide(
        ConnectorSettings.load({}, env={}),
        BS,
        1,
        namespace=ns,
        counters=Counters(),
        client=FakeCluster(),
    )
    req = FakeRequest("r", toks(8), BS)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert side.namespace == NS


def test_plan_is_picklable() -> None:
    side, cl, _ = make()
    req = FakeRequest("r", toks(12), BS)
    store(cl, req, 2)
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, ([1, 2, 3],), 8)
    plan = side.build_plan(sched_output())
    again = pickle.loads(pickle.dumps(plan))
    assert isinstance(again, StepPlan) and again == plan


def test_known_blocks_lru_bound() -> None:
    k = KnownBlocks(0)  # floor of 1024
    for i in range(2000):
        k.add(i.to_bytes(4, "big"))
    assert len(k) == 1024
    assert (0).to_bytes(4, "big") not in k
    assert (1999).to_bytes(4, "big") in k


def test_a_slow_source_is_declined_counted_and_probed() -> None:
    cl = FakeCluster()
    side, c = costed(cl)
    req = FakeRequest("r1", toks(404), BS)  # 101 full blocks, 100 of them stored on n2
    store(cl, req, 100, node="n2")
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # computing is faster
    t = c.totals()
    assert t["cost_declined"] == 1 and t["cost_declined_blocks"] == 100 and t["probes"] == 1
    assert t["lookup_hit_blocks"] == 100  # the blocks were found; only the load was declined
    assert not cl.pins  # nothing claimed: nothing pinned
    # the probe of n2 (64 MiB of its blocks) goes to the workers with the next plan
    (probe,) = side.build_plan(sched_output()).loads
    assert probe.probe and probe.block_ids == [] and probe.nodes == [["n2"]] * 32
    assert probe.hashes == req.block_hashes[:32]
    assert side.build_plan(sched_output()).loads == []  # once, not at every lookup
    # the workers measured n2: it is fast after all, and hits from it are claimed
    samples = [("n2", 10 << 21, 0.001), ("n2", 100 << 21, 0.006)] * 10
    side.update_connector_output(WorkerReport(samples=samples, block_bytes=2 << 20))
    req2 = FakeRequest("r2", toks(404), BS)
    assert side.get_num_new_matched_tokens(req2, 0) == (400, True)
    assert c.totals()["cost_whole"] == 1


def test_only_the_leading_part_that_pays_is_claimed() -> None:
    cl = FakeCluster()
    side, c = costed(cl, local_node="n1")
    req = FakeRequest("r1", toks(44), BS)
    store(cl, req, 6, node="n1")  # 6 blocks on this host's node, then 4 behind a slow link
    for hsh in req.block_hashes[6:10]:
        cl.blocks[(NS, hsh, 0)] = ("slow", b"x")
    side.update_connector_output(WorkerReport(samples=[("slow", 8 << 20, 1.0)] * 5))
    assert side.get_num_new_matched_tokens(req, 0) == (24, False)  # layer-wise, local part
    assert c.totals()["cost_part"] == 1 and c.totals()["cost_declined_blocks"] == 4
    side.update_state_after_alloc(req, ([20 + i for i in range(11)],), 24)
    loads = [j for j in side.build_plan(sched_output()).loads if not j.probe]
    (job,) = loads
    assert job.sync and job.block_ids == [20, 21, 22, 23, 24, 25] and job.nodes == [["n1"]] * 6


def test_forward_passes_teach_the_prefill_cost() -> None:
    cl = FakeCluster()
    side, _ = costed(cl)
    before = side.costs.compute_s(1000)
    side.update_connector_output(
        WorkerReport(samples=[("compute", 16, 0.01), ("compute", 4096, 20.0)] * 10)
    )
    assert side.costs.compute_s(1000) > 10 * before  # a slow engine: loads pay sooner
    req = FakeRequest("r1", toks(44), BS)
    store(cl, req, 10, node="n2")
    assert side.get_num_new_matched_tokens(req, 0) == (40, True)
