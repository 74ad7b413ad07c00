"""The pure decisions behind a miss's cause: which cause wins, the coordinator's record
of removals (bounded), the wire form, how the engine's line says it, and the engines'
reports of their misses (sent when new, kept bounded by the coordinator)."""

from __future__ import annotations

import threading

import pytest
from pegaflow.connector.metadata import WorkerReport
from pegaflow.connector.metrics import Counters
from pegaflow.connector.report import CacheReport, format_line, misses_clause
from pegaflow.connector.scheduler.misscause import MAX_UNSAVED, MissTally, decide
from pegaflow.connector.scheduler.missreport import MissReporter
from pegaflow.coordinator.enginemisses import EngineMisses
from pegaflow.coordinator.evictions import EvictionLog
from pegaflow.coordinator.index import BlockIndex
from pegaflow.coordinator.namespaces import NamespacePeers

from pegaflow.errors import BadRequest, QuotaExceeded
from pegaflow.keys import NodeRecord
from pegaflow.protocol.coordinator import MissReport
from pegaflow.protocol.misses import MissCause, MissInfo, unsaved_reason
from pegaflow.tools.cli import render_status
from tests.support.connector_fakes import BS, FakeRequest, make, store, toks

EVICTED = MissInfo(MissCause.EVICTED, tier="memory", saved_s=42.0)


def test_the_first_missing_block_decides() -> None:
    # asked 8, the cluster holds 6, 5 before a node known down, 3 claimed: declined
    assert decide(8, 6, 5, 3, EVICTED).cause is MissCause.DECLINED
    down = MissInfo(MissCause.NODE_UNREACHABLE, node="n2")
    assert decide(8, 6, 4, 4, EVICTED, down="n2") == down
    assert decide(8, 6, 6, 6, EVICTED) is EVICTED
    assert decide(8, 8, 8, 8, EVICTED) is None  # nothing missed
    assert decide(8, 0, 0, 0, None).cause is MissCause.UNKNOWN  # an older coordinator
    # a block this engine failed to save: its miss says so (not "never stored")
    never = MissInfo(MissCause.NEVER_STORED)
    got = decide(8, 0, 0, 0, never, "staging memory full")
    assert (got.cause, got.reason) == (MissCause.SAVE_DROPPED, "staging memory full")
    quota = unsaved_reason(QuotaExceeded("past its share"))
    assert decide(8, 0, 0, 0, never, quota).cause is MissCause.QUOTA
    assert decide(8, 0, 0, 0, EVICTED, quota) is EVICTED  # it was stored after all
    # while the model is known stored under another namespace and nothing hit yet
    elsewhere = MissInfo(MissCause.NAMESPACE_MISMATCH, ns="m.02")
    assert decide(8, 0, 0, 0, never, mismatch=elsewhere) is elsewhere
    assert decide(8, 0, 0, 0, EVICTED, mismatch=elsewhere) is EVICTED


def test_the_wire_form_round_trips_and_malformed_reads_unknown() -> None:
    for info in (
        EVICTED,
        MissInfo(MissCause.NAMESPACE_MISMATCH, ns="m.01", factors=["dtype (a here, b there)"]),
        MissInfo(MissCause.NODE_UNREACHABLE, node="n1"),
        MissInfo(MissCause.NEVER_STORED),
    ):
        assert MissInfo.from_wire(info.to_wire()) == info
    assert MissInfo.from_wire({"cause": "gremlins"}).cause is MissCause.UNKNOWN
    assert MissInfo.from_wire("evicted").cause is MissCause.UNKNOWN
    odd = MissInfo.from_wire({"cause": "evicted", "saved_s": -1, "tier": 7})
    assert (odd.saved_s, odd.tier) == (None, "")


def _index() -> BlockIndex:
    idx = BlockIndex()
    idx.set_node(NodeRecord("n1", "127.0.0.1", 1, capacity_bytes=1))
    return idx


def test_the_coordinator_tells_evicted_from_never_stored() -> None:
    idx = _index()
    log = EvictionLog(idx)
    h, other = b"a" * 32, b"b" * 32
    idx.add("m.01", h, 0, "n1")
    log.saved(h, 100.0)
    log.removing("m.01", h, 0, 130.0)
    idx.remove("m.01", h, 0)
    assert log.cause("m.01", h, [0], 4) == MissInfo(MissCause.EVICTED, "memory", 30.0)
    assert log.cause("m.01", other, [0], 2).cause is MissCause.NEVER_STORED
    assert log.removals == {"memory": 1, "disk": 0}
    assert log.causes["evicted"] == 4 and log.causes["never_stored"] == 2
    # from disk
    idx.add("m.01", other, 0, "n1", disk=True)
    log.removing("m.01", other, 0, 131.0)
    idx.remove("m.01", other, 0)
    assert log.cause("m.01", other, [0], 1).tier == "disk"
    # a block of two shards keeps its save time through both removals
    two = b"d" * 32
    idx.add("m.01", two, 0, "n1")
    idx.add("m.01", two, 1, "n1")
    log.saved(two, 200.0)
    for shard in (0, 1):
        log.removing("m.01", two, shard, 210.0)
        idx.remove("m.01", two, shard)
    assert log.cause("m.01", two, [0, 1], 1).saved_s == 10.0
    # the node that removed it has left the cluster
    idx.remove_node("n1")
    assert log.cause("m.01", h, [0], 1) == MissInfo(MissCause.NODE_UNREACHABLE, node="n1")


def test_a_suspected_node_and_another_namespace() -> None:
    idx = _index()
    peers = NamespacePeers(idx)
    log = EvictionLog(idx, peers)
    h = b"c" * 32
    idx.add("m.01", h, 0, "n1")
    idx.set_suspects(frozenset({"n1"}))
    assert log.cause("m.01", h, [0], 1) == MissInfo(MissCause.NODE_UNREACHABLE, node="n1")
    idx.set_suspects(frozenset())
    # the same hash under another namespace of the same model: a mismatch
    assert log.cause("m.02", h, [0], 1) == MissInfo(MissCause.NAMESPACE_MISMATCH, ns="m.01")
    peers.remember("m.01", {"dtype": "bf16"})
    peers.remember("m.02", {"dtype": "fp16"})
    assert log.cause("m.02", h, [0], 1).factors == ["dtype (fp16 here, bf16 there)"]
    # another model's namespace is no peer (nor another tenant's)
    assert log.cause("x.02", h, [0], 1).cause is MissCause.NEVER_STORED


def test_the_record_is_bounded() -> None:
    idx = _index()
    log = EvictionLog(idx, bound=3)
    hashes = [bytes([i]) * 32 for i in range(5)]
    for i, h in enumerate(hashes):
        idx.add("m.01", h, 0, "n1")
        log.saved(h, float(i))
    assert log.status()["kept"]["saves"] == 3
    for h in hashes:
        log.removing("m.01", h, 0, 10.0)
        idx.remove("m.01", h, 0)
    assert log.status()["kept"]["removals"] == 3
    assert log.cause("m.01", hashes[0], [0], 1).cause is MissCause.NEVER_STORED  # forgotten
    evicted = log.cause("m.01", hashes[4], [0], 1)
    assert (evicted.cause, evicted.saved_s) == (MissCause.EVICTED, 6.0)
    # a block whose save fell out of the record: evicted, its age unknown
    small = EvictionLog(idx, bound=1)
    idx.add("m.01", hashes[0], 0, "n1")
    small.saved(hashes[0], 1.0)
    small.saved(hashes[1], 2.0)
    small.removing("m.01", hashes[0], 0, 3.0)
    assert small.cause("m.01", hashes[0], [0], 1) == MissInfo(MissCause.EVICTED, "memory")


def test_the_tally_counts_once_per_lookup_and_keeps_details() -> None:
    c = Counters()
    t = MissTally(c)
    t.count(EVICTED, 6)
    t.count(MissInfo(MissCause.NEVER_STORED), 2)
    t.count(None, 5)
    tot = c.totals()
    assert tot["miss_lookups.evicted"] == 1 and tot["miss_blocks.evicted"] == 6
    assert tot["miss_blocks.never_stored"] == 2
    assert t.details() == {"evicted": "memory, 42 s after save"}
    line = format_line({"lookups": 2, **tot}, 10, miss_details=t.details())
    assert line is not None and line.endswith(
        "misses: evicted 75% (memory, 42 s after save), never stored 25%"
    ), line
    assert misses_clause({"lookups": 1}, {}) == ""
    t.note_unsaved({"staging full": [i.to_bytes(4) for i in range(MAX_UNSAVED + 5)]})
    assert t.unsaved((0).to_bytes(4)) is None  # the oldest dropped
    assert t.unsaved((MAX_UNSAVED + 4).to_bytes(4)) == "staging full"


def test_a_hit_cut_at_a_node_the_workers_report_down_names_it() -> None:
    side, cluster, c = make()
    req = FakeRequest("r1", toks(4 * BS + 1), BS)
    store(cluster, req, 4, node="n2")
    store(cluster, req, 2, node="n1")  # the first two on n1, the last two on n2
    side.learn(WorkerReport(down_nodes=["n2"]))
    assert side.get_num_new_matched_tokens(req, 0)[0] == 2 * BS
    tot = c.totals()
    assert tot["miss_blocks.node_unreachable"] == 2 and tot["unreachable_declined_blocks"] == 2
    assert side.lookups.misses.details() == {"node_unreachable": "n2"}


def _report(pid: int, **blocks: int) -> MissReport:
    return MissReport("m.00aa", "h1", pid, blocks)


def test_the_coordinator_keeps_the_engines_tallies_bounded() -> None:
    now = [0.0]
    t = EngineMisses(max_engines=2, forget_s=60.0, clock=lambda: now[0])
    assert t.report(_report(1, declined=6, never_stored=3)) == {"engines": 1}
    assert t.report(_report(1, declined=4))["engines"] == 1  # the same engine adds up
    t.report(MissReport("m.00aa", "h1", 2, {"save_dropped": 2}, {"save_dropped": "pool full"}))
    st = t.status()
    assert [(e["pid"], e["miss_blocks_by_cause"]) for e in st["engines"]] == [
        (1, {"declined": 10, "never_stored": 3}), (2, {"save_dropped": 2}),
    ]  # fmt: skip
    assert st["engine_miss_details"] == {"save_dropped": "pool full"}
    # one engine more than the bound: the least recently reporting one is forgotten
    now[0] = 10.0
    t.report(_report(2, quota=1))
    t.report(_report(3, lookup_failed=1))
    assert [e["pid"] for e in t.status()["engines"]] == [2, 3]
    # a minute without a report: forgotten, but the total since start keeps its blocks
    now[0] = 70.0
    t.report(_report(3, lookup_failed=1))
    assert [e["pid"] for e in t.status()["engines"]] == [3]
    now[0] = 131.0
    assert t.status()["engines"] == []
    assert t.total == {
        "declined": 10, "never_stored": 3, "save_dropped": 2, "quota": 1, "lookup_failed": 2
    }  # fmt: skip
    # a tenant's engine is its own, even with the cluster's host and pid
    t.report(_report(3, declined=1), tenant="beta")
    assert [(e["tenant"], e["pid"]) for e in t.status()["engines"]] == [("beta", 3)]


def test_a_bad_miss_report_is_refused_field_by_field() -> None:
    good = _report(1, declined=1).to_wire()
    assert MissReport.from_wire(good) == _report(1, declined=1)
    for bad, field in (
        ({"blocks": {"bored": 1}}, "blocks"), ({"blocks": {"declined": -1}}, "declined"),
        ({"blocks": [1]}, "blocks"), ({"pid": "x"}, "pid"), ({"ns": ""}, "namespace"),
        ({"details": {"nope": "x"}}, "details"),
    ):  # fmt: skip
        with pytest.raises(BadRequest, match=field):
            MissReport.from_wire({**good, **bad})


def test_an_engine_reports_what_is_new_and_retries_what_failed() -> None:
    counters, sent, fail = Counters(), [], [False]

    def send(rep: MissReport, timeout: float) -> None:
        if fail[0]:
            raise ConnectionError("coordinator down")
        sent.append((rep.blocks, rep.details, timeout))

    r = MissReporter(counters, lambda: send, lambda: "m.00aa", lambda: {"declined": "x"}, 1.5)
    assert r.send() and sent == []  # nothing new: nothing sent
    counters.add("miss_blocks.declined", 6)
    counters.add("miss_lookups.declined")
    fail[0] = True
    assert not r.send()
    counters.add("miss_blocks.never_stored", 3)
    fail[0] = False
    assert r.send()
    assert sent == [({"declined": 6, "never_stored": 3}, {"declined": "x"}, 1.5)]
    assert r.send() and len(sent) == 1 and r.pending() == {}


def test_pegaflow_status_says_the_engines_misses_in_one_line() -> None:
    t = EngineMisses()
    t.report(MissReport("m.00aa", "h1", 1, {"declined": 6, "never_stored": 3}))
    t.report(MissReport("m.00aa", "h2", 2, {"save_dropped": 1}, {"save_dropped": "pool full"}))
    st = {"nodes": [], "coordinator": {"mode": "local"}, "misses": t.status()}
    assert (
        "engines' misses: declined 60%, never stored 30%, save dropped 10% (pool full) "
        "(2 engines reporting)"
    ) in render_status(st)


def test_the_report_timer_also_sends_the_misses() -> None:
    ticked = threading.Event()
    report = CacheReport(Counters(), 0.01, on_tick=ticked.set)
    report.start()
    try:
        assert ticked.wait(30)
    finally:
        report.close()
