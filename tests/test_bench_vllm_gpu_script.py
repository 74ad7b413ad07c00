"""Pure logic of ``scripts/bench_vllm_gpu.py``'s ``--tp N`` figures: the per-rank
pinned-memcpy ceilings measured on every GPU at once (with a fake copy, no GPU), each
rank's load rate from its own stats file against its own ceiling, the batch floor, the
engines' NVLink-multicast switches and the cross-TP verdict.  No engine is started (the
bench itself runs on the GPU machines, see docs/benchmarks.md "GPU (H200)")."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from tests.script_module import SCRIPTS, load_script


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    """``scripts/bench_vllm_gpu.py`` as a module (scripts/ is not a package)."""
    return load_script("bench_vllm_gpu")


def test_help_lists_tp() -> None:
    r = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_vllm_gpu.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert "--tp" in r.stdout
    assert "--pool-size" in r.stdout


def test_ceilings_are_measured_on_every_rank_at_once(bench: ModuleType) -> None:
    ranks = 3
    # each fake copy waits for the other ranks' copies: it passes only if all run at once
    together = threading.Barrier(ranks)
    made: list[int] = []

    def make_copy(rank: int) -> Callable[[], None]:
        made.append(rank)
        return lambda: together.wait(timeout=30)

    rates = bench.concurrent_copy_gbps(make_copy, 2_000_000_000, ranks, rounds=3)
    assert sorted(made) == [0, 1, 2]
    assert len(rates) == ranks
    assert all(r > 0 for r in rates)


def test_ceiling_errors_reach_the_caller(bench: ModuleType) -> None:
    def make_copy(rank: int) -> Callable[[], None]:
        if rank == 1:
            raise RuntimeError("no GPU 1")
        return lambda: None

    with pytest.raises(RuntimeError, match="no GPU 1"):
        bench.concurrent_copy_gbps(make_copy, 1000, 2, rounds=2)


def test_rank_stats_read_each_worker_file(bench: ModuleType, tmp_path: Path) -> None:
    prefix = str(tmp_path / "defaults")
    Path(f"{prefix}.worker0.json").write_text(json.dumps({"load_bytes": 10.0}))
    Path(f"{prefix}.worker1.json").write_text("{not json")  # being replaced: read as empty
    Path(f"{prefix}.scheduler0.json").write_text(json.dumps({"load_bytes": 99.0}))
    assert bench.rank_stats(prefix, 3) == [{"load_bytes": 10.0}, {}, {}]


def test_rank_load_rates_against_own_ceiling(bench: ModuleType) -> None:
    before = [{"load_bytes": 1e9, "load_seconds": 0.5}, {}]
    after = [
        {"load_bytes": 3e9, "load_seconds": 0.6, "load_blocks": 7},
        {"load_bytes": 1.5e9, "load_seconds": 0.05},
    ]
    # 2 GB and 1.5 GB loaded by each rank while the pass took 0.05 s of wall time
    rates = bench.rank_load_gbps(before, after, wall_s=0.05)
    assert rates == pytest.approx([40.0, 30.0])
    assert bench.rank_job_gbps(before, after) == pytest.approx([20.0, 30.0])
    assert bench.rank_job_gbps([{}], [{"load_bytes": 5.0}]) == [0.0]  # no load time: none
    assert bench.x_ceiling(rates, [50.0, 60.0]) == [0.8, 0.5]
    assert bench.x_ceiling([1.0], [0.0]) == [0.0]


def test_floor_is_the_slowest_rank_share(bench: ModuleType) -> None:
    # TP=1: the whole copy at the one ceiling, as before
    assert bench.floor_ms(10_000_000_000, [50.0]) == pytest.approx(200.0)
    # TP=2: each rank copies half; the slower one decides
    assert bench.floor_ms(10_000_000_000, [50.0, 25.0]) == pytest.approx(200.0)
    assert bench.floor_ms(10_000_000_000, [50.0, 50.0]) == pytest.approx(100.0)
    assert bench.rank_share(131_072 * 10_000, 2) == 655_360_000


def test_multicast_off_for_more_than_one_gpu(bench: ModuleType) -> None:
    assert bench.tp_env(1) == {}
    env = bench.tp_env(2)
    assert env["NCCL_NVLS_ENABLE"] == "0"
    assert env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert env["NVSHMEM_DISABLE_NVLS"] == "1"


def test_cross_tp_verdict(bench: ModuleType) -> None:
    good = {
        "tp1_on_tpN": [0, 0],  # a TP=1 engine on prompts only TP=N saved: no hit
        "tp1_own": [9984, 9984],  # then on its own saves: hits
        "tpN_on_tp1": [0, 0],
        "tpN_own": [9984, 9984],
    }
    assert bench.cross_tp_ok(good, outputs_match=True)
    assert not bench.cross_tp_ok(good, outputs_match=False)
    assert not bench.cross_tp_ok({**good, "tp1_on_tpN": [16, 0]}, outputs_match=True)
    assert not bench.cross_tp_ok({**good, "tpN_on_tp1": [0, 32]}, outputs_match=True)
    # no hit on its own blocks either: the connector was not working, the zeros say nothing
    assert not bench.cross_tp_ok({**good, "tpN_own": [0, 0]}, outputs_match=True)
    assert not bench.cross_tp_ok({**good, "tp1_own": [0, 9984]}, outputs_match=True)


class _FakeEngine:
    """Stands in for a vLLM engine in the cross-TP pass: a TP size and what it saved."""

    def __init__(self, tp: int, stats_prefix: str) -> None:
        self.tp = tp
        self.stopped = False
        # the saves a real engine's worker reports in its stats file
        Path(f"{stats_prefix}.worker0.json").write_text(json.dumps({"save_blocks": 1e9}))

    def generate(self, prompts: list[list[int]], max_tokens: int) -> dict[str, object]:
        return {}

    def stop(self) -> None:
        self.stopped = True


def test_cross_tp_pass_sends_each_engine_the_other_size_s_prompts(
    bench: ModuleType, tmp_path: Path
) -> None:
    import argparse

    args = argparse.Namespace(tp=2, tokens=64, pause=0.0)
    set_a = [[1] * 64, [2] * 64, [3] * 64]
    saved: dict[tuple[int, ...], set[int]] = {}  # prompt -> TP sizes that saved it
    for p in set_a:
        saved[tuple(p)] = {2}
    started: list[tuple[str, int, bool]] = []
    engines: list[_FakeEngine] = []

    def start(name: str, env: dict[str, str], **extra: object) -> _FakeEngine:
        tp = extra.get("tp", args.tp)
        assert isinstance(tp, int)
        started.append((name, tp, bool(extra.get("prefix_caching", True))))
        engines.append(_FakeEngine(tp, env["PEGAFLOW_CONNECTOR_STATS_PATH"]))
        return engines[-1]

    def timed(e: _FakeEngine, p: list[int], pause: float) -> tuple[float, int, list[int]]:
        hit = e.tp in saved.setdefault(tuple(p), set())
        saved[tuple(p)].add(e.tp)
        return 1.0, 48 if hit else 0, [sum(p) % 7 + e.tp]  # each TP size its own outputs

    cold_a = [(1.0, 0, [sum(p) % 7 + 2]) for p in set_a]
    out: dict[str, object] = {}
    bench.cross_tp_pass(start, timed, cold_a, set_a, [[5] * 16], args, tmp_path, out)
    assert [(n, tp) for n, tp, _ in started] == [("cross_tp1", 1), ("cross_tp2", 2)]
    assert started[0][2] is False  # the TP=1 engine's own prefix cache is off
    assert all(e.stopped for e in engines)
    assert out["cross_tp_cached_tokens"] == {
        "tp1_on_tpN": [0, 0],
        "tp1_own": [48, 48],
        "tpN_on_tp1": [0, 0],
        "tpN_own": [48, 48],
    }
    assert out["cross_tp_outputs_match"] is True
    assert out["cross_tp_ok"] is True


def test_each_ranks_pinned_line_counts_once(bench: ModuleType) -> None:
    """An engine is timed once every rank's connector pinned the pool: a line printed
    twice (vLLM's handler and the connector's) is one rank, not two."""
    log = [
        "(Worker_TP0 pid=11) INFO pegaflow.connector: node pool x pinned for DMA in 3.8 s",
        "(Worker_TP0 pid=11) INFO:pegaflow.connector:node pool x pinned for DMA in 3.8 s",
        "(Worker_TP1 pid=12) INFO pegaflow.connector: node pool x pinned for DMA in 3.9 s",
        "(EngineCore pid=10) INFO something else",
    ]
    assert bench.pinned_ranks(log[:2]) == {"11"}
    assert bench.pinned_ranks(log) == {"11", "12"}


def test_a_batch_splits_at_vllm_s_own_marks(bench: ModuleType) -> None:
    """``--batch-phases``: before the first request is queued, then to its scheduling,
    to the last first token, and after it; requests of one step share its mark."""
    phases = [[4.0, 30.0, 220.0], [5.0, 30.0, 231.5], [6.5, 30.0, 229.0]]
    got = bench.phases_of(phases, 250.0)
    assert got == {
        "to_queued": 4.0,
        "queued_to_scheduled": 26.0,
        "scheduled_to_last_token": 201.5,
        "after_last_token": 18.5,
        "steps_scheduled": 1,
    }
    assert bench.phases_of([[4.0, 30.0, 90.0], [5.0, 95.0, 180.0]], 200.0)["steps_scheduled"] == 2
