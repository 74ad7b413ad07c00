"""Pure logic of ``scripts/bench_serving.py``'s router setups (``pd``, ``rr-hosts``,
``cache-hosts``): the router's replica flags, the namespace read from an engine's log,
the share of hits served from the same host, the router's counters, how often a
conversation's turns stay on one replica, and the summary's P/D and host figures.
No process is started (the setups themselves run in the benchmark, see docs/router.md
"Measuring")."""

from __future__ import annotations

import importlib.util
import json
import math
from types import ModuleType
from typing import Any

import pytest

from tests.support.script_module import load_script

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("aiohttp") is None, reason="aiohttp not installed"
)


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    """``scripts/bench_serving.py`` as a module (scripts/ is not a package)."""
    return load_script("bench_serving")


def test_router_replica_spec(bench: ModuleType) -> None:
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert bench.router_replicas(urls) == "http://127.0.0.1:1,http://127.0.0.1:2"
    assert (
        bench.router_replicas(urls, nodes=["host0", "host1"])
        == "http://127.0.0.1:1;node=host0,http://127.0.0.1:2;node=host1"
    )
    assert (
        bench.router_replicas(urls, roles=["prefill", "decode"])
        == "http://127.0.0.1:1;role=prefill,http://127.0.0.1:2;role=decode"
    )
    with pytest.raises(ValueError):
        bench.router_replicas(urls, nodes=["host0"])


def test_namespace_and_block_size(bench: ModuleType) -> None:
    log = ["INFO starting", "INFO PegaFlow namespace tiny.0123abcd for NamespaceFactors(...)"]
    assert bench.namespace_in(log) == "tiny.0123abcd"
    assert bench.namespace_in(["nothing here"]) == ""
    assert bench.block_size_of(["--seed", "0", "--block-size", "32"]) == 32
    assert bench.block_size_of(["--block-size=64"]) == 64
    assert bench.block_size_of(["--seed", "0"]) == 16  # vLLM's default


def test_same_host_share(bench: ModuleType) -> None:
    # 1000 cached tokens, of which 10 blocks of 32 were loaded over UCX from another host
    assert bench.same_host_share(1000, 15, 5, 32) == pytest.approx(0.68)
    assert bench.same_host_share(1000, 0, 0, 32) == 1.0  # all from vLLM's own cache
    assert bench.same_host_share(320, 10, 0, 32) == 0.0
    assert bench.same_host_share(100, 50, 0, 32) == 0.0  # never below 0
    assert math.isnan(bench.same_host_share(0, 0, 0, 32))


def test_router_counters(bench: ModuleType) -> None:
    samples = [
        ("pegaflow_router_prefix_blocks_total", {"where": "local"}, 90.0),
        ("pegaflow_router_prefix_blocks_total", {"where": "elsewhere"}, 10.0),
        ("pegaflow_router_routes_total", {"mode": "cache", "decision": "affinity"}, 7.0),
        ("pegaflow_router_routes_total", {"mode": "cache", "decision": "miss"}, 3.0),
        ("pegaflow_router_routes_created", {"mode": "cache", "decision": "miss"}, 1e9),
        ("pegaflow_router_inflight", {"replica": "x"}, 2.0),
    ]
    got = bench.router_counters(samples)
    assert got == {"prefix_local": 90.0, "prefix_elsewhere": 10.0, "affinity": 7.0, "miss": 3.0}
    assert bench.router_local_share({"prefix_local": 90.0, "prefix_elsewhere": 10.0}) == 0.9
    assert bench.router_local_share({}) is None


def test_save_publish_mean(bench: ModuleType) -> None:
    """The mean time from a save's step to the node's answer, from the connector's
    counter and its histogram's count as ``/metrics`` shows them on two replicas."""
    scraped = [
        {
            "vllm:pegaflow_save_publish_seconds_total": 1.5,
            "vllm:pegaflow_save_publish_latency_seconds_count": 3.0,
            "vllm:pegaflow_save_publish_latency_seconds_sum": 1.5,
            "vllm:pegaflow_save_publish_latency_seconds_bucket": 3.0,
            "vllm:pegaflow_save_blocks_total": 30.0,
        },
        {
            "vllm:pegaflow_save_publish_seconds_total": 0.5,
            "vllm:pegaflow_save_publish_latency_seconds_count": 1.0,
        },
    ]
    now = bench.summed([bench.connector_counters(m) for m in scraped])
    assert now["save_blocks"] == 30.0 and "save_publish_latency_seconds_sum" not in now
    assert bench.latency_ms({}, now) == 500.0
    earlier = {"save_publish_seconds": 1.9, "save_publish_latency_seconds_count": 3.0}
    assert bench.latency_ms(earlier, now) == 100.0
    assert bench.latency_ms(now, now) is None  # no put answered in between
    held = {"save_hold_seconds": 0.6, "save_hold_latency_seconds_count": 4.0}
    assert bench.latency_ms({}, held, "save_hold") == 150.0
    assert bench.latency_ms({}, held, "save_wait") is None


def test_vllm_gauges(bench: ModuleType) -> None:
    """Queued and running requests add up over the replicas; KV cache use is the fullest
    replica's, by either of vLLM's names for it."""
    scraped = [
        {"vllm:num_requests_waiting": 3.0, "vllm:num_requests_running": 5.0,
         "vllm:kv_cache_usage_perc": 0.97},
        {"vllm:num_requests_waiting": 1.0, "vllm:num_requests_running": 2.0,
         "vllm:gpu_cache_usage_perc": 0.5},
        {},
    ]  # fmt: skip
    assert bench.vllm_gauges(scraped) == {"waiting": 4.0, "running": 7.0, "kv_usage_max": 0.97}
    assert bench.vllm_gauges([])["kv_usage_max"] == 0.0


def test_turn_misses(bench: ModuleType) -> None:
    R = bench.Result

    def turn(stream: str, n: int, t: float, cached: int, e2e: float = 1.0) -> object:
        r = R(0, "conv", stream, n, 0, t_send=t, e2e=e2e)
        r.prompt_tokens, r.cached_tokens = 1000 * (n + 1), cached
        return r

    rs = [
        turn("a", 0, 0.0, 0), turn("a", 1, 1.2, 990), turn("a", 2, 2.5, 0),  # sent 0.3 s after
        turn("b", 0, 0.0, 0), turn("b", 1, 5.0, 100),  # 4 s after: missed, not soon
        turn("c", 1, 0.0, 0),  # its turn 0 is not in the run: not counted
    ]  # fmt: skip
    assert bench.turn_misses(rs, rs) == {
        "later_turns": 3, "missed": 2, "missed_sent_within_1s": 1,
    }  # fmt: skip
    assert bench.turn_misses(rs, rs[2:3])["missed"] == 1  # only the counted ones


def test_stickiness(bench: ModuleType) -> None:
    R = bench.Result
    rs = [
        R(0, "conv", "c0", 0, 0, served_by="a"),
        R(1, "conv", "c1", 0, 0, served_by="b"),
        R(2, "conv", "c0", 1, 0, served_by="a"),  # stays
        R(3, "conv", "c1", 1, 0, served_by="a"),  # moves
        R(4, "doc", "d0", 0, 0, served_by="b"),  # not a conversation
        R(5, "conv", "c0", 2, 0, served_by="a"),  # stays
        R(6, "conv", "c0", 3, 0, served_by="b", error="boom"),  # failed: not counted
    ]
    assert bench.stickiness(rs) == pytest.approx(2 / 3)
    assert bench.stickiness(rs[:2]) is None
    # without the router's header, the replica index stands for the server
    plain = [R(0, "conv", "c0", 0, 1), R(1, "conv", "c0", 1, 0)]
    assert bench.stickiness(plain) == 0.0


def test_handoff_summary(bench: ModuleType) -> None:
    single = [100.0, 110.0, 120.0, 130.0]
    pd = [150.0, 160.0, 170.0, 180.0]
    s = bench.handoff_summary(single, pd)
    assert s["single_ttft_p50_ms"] == 115.0 and s["pd_ttft_p50_ms"] == 165.0
    assert s["handoff_p50_ms"] == 50.0
    assert s["pd_over_single_p50"] == pytest.approx(165 / 115, abs=1e-3)
    assert s["requests"] == 4


def test_hosts_comparison(bench: ModuleType) -> None:
    rr = {"points": [{"hit_rate": 0.5, "ttft_p99_ms": 400.0, "same_host_share": 0.5}]}
    cache = {"points": [{"hit_rate": 0.6, "ttft_p99_ms": 200.0, "same_host_share": 0.95}]}
    c = bench.hosts_comparison(rr, cache, target=0.9)
    assert c["hit_rate"] == [(0.5, 0.6)]
    assert c["ttft_p99_ratio"] == [2.0]
    assert c["same_host_share"] == [(0.5, 0.95)]
    assert c["meets_target"] is True
    low = {"points": [{"hit_rate": 0.6, "ttft_p99_ms": 200.0, "same_host_share": 0.8}]}
    assert bench.hosts_comparison(rr, low, target=0.9)["meets_target"] is False


def test_the_steady_state_leaves_out_a_points_cold_start(bench: ModuleType) -> None:
    """With ``warmup_s``, latencies and the hit rate count only requests sent that long
    after the point's first; the throughput still counts every request."""
    rs = []
    for i in range(10):
        r = bench.Result(i, "conv", "c0", i, 0, t_send=100.0 + i, ttft=5.0 if i < 3 else 0.1)
        r.prompt_tokens, r.cached_tokens = 100, 0 if i < 3 else 90
        rs.append(r)
    point = {"results": rs, "wall_s": 10.0, "connector": {}, "node": {}, "timeline": []}
    whole, steady = bench.summarize(point), bench.summarize(point, warmup_s=3.0)
    assert whole["ttft_p99_ms"] > 4000 and steady["ttft_p99_ms"] == pytest.approx(100.0)
    assert steady["measured"] == 7 and steady["hit_rate"] == pytest.approx(0.9)
    assert whole["req_per_s"] == steady["req_per_s"] == 1.0


def test_by_kind(bench: ModuleType) -> None:
    R = bench.Result
    rs = [R(0, "conv", "c0", 0, 0, ttft=0.2), R(1, "doc", "d0", 0, 0, ttft=0.1)]
    for r in rs:
        r.prompt_tokens, r.cached_tokens = 100, 50
    got = bench.by_kind(rs)
    assert set(got) == {"conv", "doc"}
    assert got["conv"]["ttft_p99_ms"] == pytest.approx(200.0)
    assert got["doc"]["requests"] == 1 and got["doc"]["hit_rate"] == 0.5


def _point(offered: float, served: float, p99: float, failed: int = 0) -> dict[str, Any]:
    return {"offered": offered, "req_per_s": served, "ttft_p99_ms": p99, "failed": failed}


def test_against_first_matches_points_by_offered_load(bench: ModuleType) -> None:
    """Setups measured at different loads: the objective's throughput is each one's
    best passing point; the p99 ratio is taken where both measured the same load."""
    setups = {
        "vllm": {"points": [_point(12, 12.0, 1600), _point(16, 13.0, 8000)]},
        "pegaflow": {
            "points": [_point(16, 16.0, 800), _point(20, 19.5, 1900), _point(24, 20, 3500)]
        },
    }
    bench.against_first(setups, 2000)
    assert setups["vllm"]["throughput_at_slo"] == 12.0
    assert setups["pegaflow"]["throughput_at_slo"] == 19.5
    assert setups["pegaflow"]["throughput_at_slo_ratio"] == pytest.approx(1.625)
    assert setups["pegaflow"]["ttft_p99_ratio"] == [10.0, None, None]


def test_merge_reports_separate_runs_as_one(
    bench: ModuleType, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = [  # vllm's rates in two runs, the later one first
        ("vllm", [_point(16, 13.0, 8000)]),
        ("vllm", [_point(12, 12.0, 1600)]),
        ("pegaflow", [_point(16, 16.0, 800)]),
    ]
    files, reqs = [], []
    for i, (name, points) in enumerate(runs):
        f = tmp_path / f"{name}{i}.txt"
        f.write_text("progress line\n" + json.dumps({"setups": {name: {"points": points}}}) + "\n")
        files.append(str(f))
        r = tmp_path / f"{name}{i}.jsonl"
        rows = [{"setup": name, "prompt_sha": "a", "text": "x", "error": ""}]
        rows.append({"setup": name, "prompt_sha": "b", "text": "y" if name == "vllm" else "z"})
        r.write_text("\n".join(json.dumps(x) for x in rows) + "\n")
        reqs.append(str(r))
    argv = ["--merge", ",".join(files), "--merge-requests", ",".join(reqs), "--slo-ms", "2000"]
    assert bench.main(argv) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [p["offered"] for p in got["setups"]["vllm"]["points"]] == [12, 16]
    peg = got["setups"]["pegaflow"]
    assert peg["throughput_at_slo_ratio"] == pytest.approx(16 / 12, abs=1e-3)
    assert peg["ttft_p99_ratio"] == [10.0]
    assert peg["outputs_vs_vllm"] == {"compared": 2, "equal": 1}


def test_the_kv_cache_size_an_engine_logged(bench: ModuleType) -> None:
    """What the first of several replicas sharing a GPU logged as its KV cache: the
    size the others start with (``--kv-cache-memory-bytes``, no racing memory check)."""
    log = [
        "(EngineCore pid=7) INFO 12-07 18:20:01 [gpu_worker.py:760] Available KV cache "
        "memory: 9.12 GiB",
        "(EngineCore pid=7) INFO 12-07 18:20:02 [kv_cache_utils.py:1] GPU KV cache size: 74,7",
    ]
    assert bench.kv_cache_bytes(log) == int(9.12 * (1 << 30))
    assert bench.kv_cache_bytes(["no such line"]) == 0
