"""Pure logic of ``scripts/bench_serving.py``'s tail-latency figures (issue 38): the
bootstrap interval of a percentile, the closed loop's conversations (each turn on the
next replica), conversations over shared documents, the seeds of repeated runs, the
pooling of a point's runs and the comparison against the first setup.  No engine."""

from __future__ import annotations

import importlib.util
import random
from types import ModuleType

import pytest

from tests.support.script_module import load_script

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("aiohttp") is None, reason="aiohttp not installed"
)


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    """``scripts/bench_serving.py`` as a module (scripts/ is not a package)."""
    return load_script("bench_serving")


def ttfts(n: int, seed: int = 1) -> list[float]:
    """``n`` TTFTs (ms) with a long tail."""
    rng = random.Random(seed)
    return [rng.lognormvariate(4.0, 0.8) for _ in range(n)]


def test_bootstrap_ci_holds_the_estimate_narrows_and_repeats(bench: ModuleType) -> None:
    small, large = ttfts(288), ttfts(288 * 8)
    width = {}
    for xs in (small, large):
        for q in (50, 99):
            lo, hi = bench.bootstrap_ci(xs, q)
            assert lo <= bench.pct(xs, q) <= hi
            width[len(xs), q] = hi - lo
    for q in (50, 99):
        assert width[len(large), q] < width[len(small), q]
    assert bench.bootstrap_ci(small, 99) == bench.bootstrap_ci(small, 99)
    assert bench.bootstrap_ci([5.0] * 10, 99) == (5.0, 5.0)
    lo, hi = bench.bootstrap_ci([], 99)
    assert lo != lo and hi != hi  # NaN


def test_ttft_stats_pool_the_runs(bench: ModuleType) -> None:
    runs = [ttfts(100, 1), ttfts(100, 2)]
    got = bench.ttft_stats(runs)
    assert got["ttft_p99_ms"] == round(bench.pct(runs[0] + runs[1], 99), 1)
    assert got["ttft_p99_runs_ms"] == [round(bench.pct(r, 99), 1) for r in runs]
    lo, hi = got["ttft_p50_ci95_ms"]
    assert lo <= got["ttft_p50_ms"] <= hi


def test_closed_loop_sends_each_turn_to_the_next_replica(bench: ModuleType) -> None:
    spec = bench.WorkloadSpec(turns=3, first_tokens=8, turn_tokens=2, docs=0, vary_turns=False)
    worker = bench.conversation_turns(bench.Workload(spec), 4)
    seen: list[tuple[str, int, int]] = []
    last = ""
    for item, replica in (next(worker) for _ in range(9)):
        prompt = item.conv.history
        if item.turn:
            assert prompt.startswith(last + " answer ")  # sent after the last answer
        last = prompt
        item.finish("answer")
        seen.append((item.stream, item.turn, replica))
    # conversation c starts on replica c % 4, each turn one further
    assert seen == [
        ("c0", 0, 0), ("c0", 1, 1), ("c0", 2, 2),
        ("c1", 0, 1), ("c1", 1, 2), ("c1", 2, 3),
        ("c2", 0, 2), ("c2", 1, 3), ("c2", 2, 0),
    ]  # fmt: skip


def test_closed_loop_workers_share_one_workload(bench: ModuleType) -> None:
    """Workers of one point take new conversations from one workload: the first turns
    spread over the replicas, no conversation twice."""
    spec = bench.WorkloadSpec(turns=2, first_tokens=8, docs=0, vary_turns=False)
    workload = bench.Workload(spec)
    workers = [bench.conversation_turns(workload, 4) for _ in range(4)]
    firsts = [next(w) for w in workers]
    assert [(i.stream, r) for i, r in firsts] == [("c0", 0), ("c1", 1), ("c2", 2), ("c3", 3)]


def test_conversations_over_one_document_share_its_prefix(bench: ModuleType) -> None:
    spec = bench.WorkloadSpec(docs=2, doc_tokens=50, first_tokens=10, conv_docs=True, seed=7)
    w = bench.Workload(spec)
    convs = [w.conversation() for _ in range(4)]
    doc = [c.history.split()[:50] for c in convs]
    assert doc[0] == doc[2] and doc[1] == doc[3] and doc[0] != doc[1]  # round robin
    assert convs[0].history != convs[2].history  # each its own first message
    assert all(len(c.history.split()) == 60 for c in convs)
    plain = bench.Workload(bench.dataclasses.replace(spec, conv_docs=False)).conversation()
    assert len(plain.history.split()) == 10
    assert convs[0].history.endswith(plain.history)  # the same own words after the doc


def test_repeats_get_their_own_content(bench: ModuleType) -> None:
    spec = bench.WorkloadSpec(seed=1000, docs=1, doc_tokens=20, conv_docs=True)
    assert bench.repeat_spec(spec, 0, 1).seed == 1000  # one run: the workload of before
    seeds = {bench.repeat_spec(bench.dataclasses.replace(spec, seed=s), k, 3).seed
             for s in (1000, 1001) for k in range(3)}  # fmt: skip
    assert len(seeds) == 6  # no two points or runs alike
    prompts = {bench.Workload(bench.repeat_spec(spec, k, 2)).conversation().history
               for k in range(2)}  # fmt: skip
    assert len(prompts) == 2


def test_a_points_runs_pool_and_keep_their_own_figures(bench: ModuleType) -> None:
    """Two runs of a point: p99 over both runs' requests, each run's own p99 and
    throughput, the warm-up left out of each run (not only of the first)."""
    R = bench.Result

    def run(repeat: int, t0: float, ms: list[float], wall: float) -> dict:
        rs = [R(i, "conv", f"c{i}", 0, 0, repeat, t_send=t0 + i, ttft=x / 1e3)
              for i, x in enumerate(ms)]  # fmt: skip
        return {"results": rs, "wall_s": wall, "connector": {"cost_declined_blocks": 2.0},
                "node": {}, "node_after": {}, "timeline": [], "router": {}}  # fmt: skip

    runs = [run(0, 100.0, [900.0, 10.0, 20.0, 30.0], 4.0),
            run(1, 500.0, [800.0, 40.0, 50.0, 60.0], 2.0)]  # fmt: skip
    s = bench.summarize(bench.pool_runs(runs), warmup_s=1.0)
    assert s["measured"] == 6  # each run's first request is its warm-up
    assert s["ttft_p99_ms"] == round(bench.pct([10, 20, 30, 40, 50, 60], 99), 1)
    assert s["ttft_p99_runs_ms"] == [round(bench.pct([10, 20, 30], 99), 1),
                                     round(bench.pct([40, 50, 60], 99), 1)]  # fmt: skip
    assert s["req_per_s_runs"] == [1.0, 2.0] and s["req_per_s_mean"] == 1.5
    assert s["req_per_s"] == round(8 / 6.0, 3)
    assert s["declined_blocks"]["cost_declined_blocks"] == 4.0
    lo, hi = s["ttft_p99_ci95_ms"]
    assert lo <= s["ttft_p99_ms"] <= hi
    one = bench.summarize(runs[0])  # one run: the figures of before, and an interval
    assert one["req_per_s_runs"] == [1.0] and len(one["ttft_p99_ci95_ms"]) == 2


def test_ratios_against_vllm_alone(bench: ModuleType) -> None:
    base = {"points": [{"offered": 16, "ttft_p99_ms": 1000.0, "ttft_p50_ms": 100.0,
                        "req_per_s": 2.0, "failed": 0}]}  # fmt: skip
    cache = {"points": [{"offered": 16, "ttft_p99_ms": 900.0, "ttft_p50_ms": 50.0,
                         "req_per_s": 3.2, "failed": 0, "ttft_p99_ci95_ms": [800.0, 990.0]}]}
    setups = {"vllm": base, "pegaflow": cache}
    bench.against_first(setups, 2000.0)
    (r,) = cache["ratios_vs_vllm"]
    assert (r["p99_ratio"], r["p50_ratio"], r["throughput_ratio"]) == (0.9, 0.5, 1.6)
    assert r["meets_targets"] is True
    assert bench.ratios(base["points"][0], {**cache["points"][0], "req_per_s": 2.5})[
        "meets_targets"] is False  # fmt: skip
    table = bench.comparison_table(setups)
    assert len(table) == 3 and "[800, 990]" in table[2] and "0.90" in table[2]


def test_merge_pools_repeats_split_over_runs(bench: ModuleType) -> None:
    """Two commands measured one point: merged into one, TTFTs pooled from their rows."""
    points = [{"offered": 4, "req_per_s": 1.0, "wall_s": 10.0, "requests": 3, "failed": 0},
              {"offered": 4, "req_per_s": 2.0, "wall_s": 10.0, "requests": 3, "failed": 0}]
    rows = [{"run": (f, 0), "t_send": float(i), "ttft": (f + 1) * i / 10, "error": ""}
            for f in (0, 1) for i in range(3)]  # fmt: skip
    m = bench.merge_repeats(points, rows, warmup_s=1.0)
    assert m["repeats"] == 2 and m["req_per_s"] == 1.5 and m["req_per_s_runs"] == [1.0, 2.0]
    assert m["ttft_p99_runs_ms"] == [round(bench.pct([100, 200], 99), 1),
                                     round(bench.pct([200, 400], 99), 1)]  # fmt: skip
