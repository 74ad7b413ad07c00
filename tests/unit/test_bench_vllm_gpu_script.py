"""Pure logic of ``scripts/bench_vllm_gpu.py``: its ``--tp N`` figures (the per-rank
pinned-memcpy ceilings measured on every GPU at once, with a fake copy, no GPU; each
rank's load rate from its own stats file against its own ceiling, the batch floor, the
engines' NVLink-multicast switches and the cross-TP verdict); when the pool's pinning
ended, against the restart set's requests, and the restart figures; the KV oracle's
count, its pass with fake engines and the per-block digests it reads
(``tests/support/vllm_runner.py``'s, on CPU tensors).  No engine is started (the bench
itself runs on the GPU machines, see docs/benchmarks.md "GPU (H200)")."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from tests.support.script_module import SCRIPTS, load_script


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
    assert "--skip-kv-oracle" in r.stdout
    # vLLM's default mode is the default: eager is the opt-in
    assert "--eager" in r.stdout
    assert "--no-decline" in r.stdout
    assert "--cuda-graphs" not in r.stdout


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


PINNED = "(Worker_TP{r} pid=1{r}) INFO pegaflow.connector: node pool x pinned for DMA in 3.8 s"


def test_pin_watch_keeps_when_the_last_rank_s_line_came(bench: ModuleType) -> None:
    """The defaults engine is timed from its first request: whether the pinning still ran
    when its restart set and batch ended is read from when the line reached the script."""
    log = ["(EngineCore pid=10) INFO starting"]
    started = time.monotonic()
    watch = bench.PinWatch(log, 2, started)
    log.append(PINNED.format(r=0))
    restart_end = time.monotonic()
    time.sleep(5 * bench.PIN_POLL_S)  # one rank of two: not pinned yet
    assert watch.at is None
    log.append(PINNED.format(r=1))
    seconds = watch.wait(10.0)
    batch_end = time.monotonic()
    assert watch.at is not None and restart_end < watch.at <= batch_end
    assert seconds == round(watch.at - started, 1)
    assert watch.during(restart_end)  # the restart set ended while it still pinned
    assert not watch.during(batch_end)
    assert watch.after(started) == round(watch.at - started, 1)
    assert watch.after(batch_end) == 0.0


def test_pin_watch_gives_up_at_its_timeout(bench: ModuleType) -> None:
    watch = bench.PinWatch([], 1, time.monotonic())
    assert watch.wait(0.05) is None
    assert watch.during(time.monotonic())  # never pinned: still running at every time
    assert watch.after(time.monotonic()) is None
    # a line already there when the watch starts counts at once
    assert bench.PinWatch([PINNED.format(r=0)], 1, time.monotonic()).wait(10.0) is not None


def test_restart_figures_set_the_slowest_restart_request_against_the_steady_mean(
    bench: ModuleType,
) -> None:
    # the pattern right after a restart: every second request slower
    got = bench.restart_figures([62.0, 42.0, 58.0, 41.0], [40.0, 42.0, 41.0])
    assert got == {
        "restart_mean_ms": 50.8,
        "steady_mean_ms": 41.0,
        "restart_max_over_steady": 1.51,
    }


class _ResetEngine:
    """Answers ``reset_prefix_cache`` as vLLM does: false while blocks are in use."""

    name = "defaults"

    def __init__(self, refusals: int) -> None:
        self.refusals = refusals
        self.calls = 0

    def call(self, cmd: dict[str, object]) -> dict[str, object]:
        assert cmd == {"op": "reset_prefix_cache"}
        self.calls += 1
        return {"ok": self.calls > self.refusals}


def test_gpu_cache_emptied_once_vllm_agrees(bench: ModuleType) -> None:
    e = _ResetEngine(refusals=2)
    bench.empty_gpu_cache(e, timeout=10.0)
    assert e.calls == 3
    with pytest.raises(RuntimeError, match="did not empty"):
        bench.empty_gpu_cache(_ResetEngine(refusals=10**6), timeout=0.3)


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


def test_kv_oracle_compares_the_hit_blocks_only(bench: ModuleType) -> None:
    ref = [["a0", "a1", "a2"], ["b0", "b1", "b2"]]
    # prompt a: 2 blocks hit (the third computed by the hit engine, in other kernels: its
    # last bits may differ and are not compared); prompt b: no hit
    assert bench.kv_oracle(ref, [["a0", "a1", "zz"], ["x", "y", "z"]], [32, 0]) == (2, 0)
    assert bench.kv_oracle(ref, [["a0", "zz", "a2"], ref[1]], [47, 48]) == (5, 1)
    # a hit block the hit engine no longer holds, or the cold one never did, differs
    assert bench.kv_oracle(ref, [["a0", None, "a2"], ref[1]], [32, 0]) == (2, 1)
    assert bench.kv_oracle([[None, "a1"]], [[None, "a1"]], [32]) == (2, 1)
    assert bench.kv_oracle([["a0"]], [["a0"]], [32]) == (2, 1)  # past the digests
    assert bench.kv_oracle(ref, ref, [0, 0]) == (0, 0)


Node = dict[tuple[int, ...], str]


class _OracleEngine:
    """A vLLM engine in the KV oracle's pass: its own KV per block, computed (a value
    of its own) or loaded from ``node`` (the saved blocks, by their tokens from the
    prompt's start) through ``load``."""

    def __init__(
        self, name: str, stats_prefix: str, node: Node,
        load: Callable[[str], str],
    ) -> None:  # fmt: skip
        self.name = name
        self.node = node
        self.load = load
        self.kv: Node = {}
        self.calls: list[str] = []
        self.stopped = False
        # the saves a real engine's worker reports in its stats file
        Path(f"{stats_prefix}.worker0.json").write_text(json.dumps({"save_blocks": 1e9}))

    def generate(self, prompts: list[list[int]], max_tokens: int) -> dict[str, object]:
        self.calls.append("generate")
        cached = []
        for p in prompts:
            hit = 0
            for end in range(16, len(p) + 1, 16):
                key = tuple(p[:end])
                if key in self.node and end < len(p) and hit == end - 16:  # vLLM computes
                    self.kv[key] = self.load(self.node[key])  # one token at least
                    hit = end
                else:  # computed here: the same KV up to its last bits, not compared
                    self.kv[key] = self.node[key] = f"{self.name}:{sum(key)}:{end}"
            cached.append(hit)
        return {"cached": cached, "outputs": [[len(p)] for p in prompts]}

    def kv_digest(self, prompt: list[int]) -> list[str | None]:
        self.calls.append("kv_digest")
        return [self.kv.get(tuple(prompt[:end])) for end in range(16, len(prompt) + 1, 16)]

    def stop(self) -> None:
        self.stopped = True


def _oracle(
    bench: ModuleType, tmp_path: Path, load: Callable[[str], str], eager: bool = True,
    on_start: Callable[[str, Node], None] = lambda name, node: None,
) -> tuple[dict[str, object], list[tuple[str, dict[str, str], dict[str, object]]],
           list[_OracleEngine]]:  # fmt: skip
    """The KV oracle's pass with fake engines on a fake node; ``on_start(name, node)``
    before each engine starts."""
    args = argparse.Namespace(tokens=64, pause=0.0, eager=eager)
    node: Node = {}
    started: list[tuple[str, dict[str, str], dict[str, object]]] = []
    engines: list[_OracleEngine] = []

    def start(name: str, env: dict[str, str], **extra: object) -> _OracleEngine:
        on_start(name, node)
        started.append((name, env, extra))
        engines.append(_OracleEngine(name, env["PEGAFLOW_CONNECTOR_STATS_PATH"], node, load))
        return engines[-1]

    out: dict[str, object] = {}
    bench.kv_oracle_pass(start, args, [[5] * 16], tmp_path, out)
    return out, started, engines


def test_kv_oracle_pass_checks_a_new_engine_s_loaded_kv(bench: ModuleType, tmp_path: Path) -> None:
    out, started, engines = _oracle(bench, tmp_path, load=lambda kv: kv)
    assert [n for n, _, _ in started] == ["kv_oracle_cold", "kv_oracle"]
    for _, env, extra in started:
        # the engine core in the runner's process, vLLM's prefix cache on (kv_digest)
        assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
        assert extra == {"three_keys": True, "prefix_caching": True}
    for e in engines:  # the KV read once every request is done
        assert e.stopped
        assert e.calls == ["generate"] * 4 + ["kv_digest"] * 4
    assert out["kv_oracle_cold_cached_tokens"] == [0, 0, 0, 0]
    assert out["kv_oracle_cached_tokens"] == [48, 48, 48, 48]  # 2 paced, a batch of 2
    assert out["kv_oracle_blocks"] == 12
    assert out["kv_oracle_mismatches"] == 0
    assert out["kv_oracle_outputs_match"] is True
    assert out["kv_oracle_ok"] is True


def test_kv_oracle_pass_catches_wrong_kv(bench: ModuleType, tmp_path: Path) -> None:
    """All-zero KV loaded: the outputs (of dummy weights) still match, the oracle not."""
    out, _, _ = _oracle(bench, tmp_path, load=lambda kv: "zeros")
    assert out["kv_oracle_outputs_match"] is True
    assert out["kv_oracle_blocks"] == 12
    assert out["kv_oracle_mismatches"] == 12
    assert out["kv_oracle_ok"] is False


def test_kv_oracle_pass_with_cuda_graphs_has_one_token_hits(
    bench: ModuleType, tmp_path: Path
) -> None:
    out, _, engines = _oracle(bench, tmp_path, load=lambda kv: kv, eager=False)
    # the one-token batch: 65 tokens, its 4 full blocks hit, one token left to compute
    assert out["kv_oracle_cached_tokens"] == [48, 48, 48, 48, 64, 64]
    assert out["kv_oracle_blocks"] == 20  # 4 x 3 and 2 x 4
    assert out["kv_oracle_ok"] is True
    assert engines[1].calls == ["generate"] * 5 + ["kv_digest"] * 6


def test_kv_oracle_fails_with_nothing_to_compare(bench: ModuleType, tmp_path: Path) -> None:
    def lose_node(name: str, node: Node) -> None:
        if name == "kv_oracle":  # the node lost every block: the hit engine hits nothing
            node.clear()

    out, _, _ = _oracle(bench, tmp_path, load=lambda kv: kv, on_start=lose_node)
    assert out["kv_oracle_cached_tokens"] == [0, 0, 0, 0]
    assert (out["kv_oracle_blocks"], out["kv_oracle_mismatches"]) == (0, 0)
    assert out["kv_oracle_ok"] is False


def test_kv_oracle_fails_when_its_cold_engine_hits(bench: ModuleType, tmp_path: Path) -> None:
    """A cold engine that loaded the prompts' KV gives no reference computed from them."""

    def saved_before(name: str, node: Node) -> None:
        if name == "kv_oracle_cold":
            p = bench.oracle_sets(argparse.Namespace(tokens=64, eager=True))[0][0]
            node[tuple(p[:16])] = "someone else's"

    out, _, _ = _oracle(bench, tmp_path, load=lambda kv: kv, on_start=saved_before)
    assert out["kv_oracle_cold_cached_tokens"] == [16, 0, 0, 0]
    assert out["kv_oracle_mismatches"] == 0
    assert out["kv_oracle_ok"] is False


def test_block_digests_are_xxh3_of_each_block_over_the_layers() -> None:
    """``kv_digest``'s digests (``tests/support/vllm_runner.py``), gathered per layer where the KV
    lives: per block, the xxh3-64 of its bytes in every layer in layer order, for both
    layouts (block dimension first, or after K and V)."""
    torch = pytest.importorskip("torch")
    xxhash = pytest.importorskip("xxhash")
    from tests.support.vllm_runner import block_digests

    num_blocks = 7
    g = torch.Generator().manual_seed(0)
    layers = [
        torch.randn(2, num_blocks, 4, 2, 8, generator=g).to(torch.bfloat16),  # FlashAttention
        torch.randn(num_blocks, 2, 4, 2, 8, generator=g).to(torch.bfloat16),
        torch.randn(2, num_blocks, 4, 2, 8, generator=g).to(torch.bfloat16)[:, :, :, :, ::2],
    ]  # the last one a strided view
    ids = [5, 0, 3, 5]

    def naive(b: int) -> str:
        d = xxhash.xxh3_64()
        for t in layers:
            tile = t[b] if t.shape[0] == num_blocks else t[:, b]
            d.update(tile.contiguous().view(torch.uint8).numpy().tobytes())
        return d.hexdigest()

    got = block_digests(layers, ids, num_blocks)
    assert got == [naive(b) for b in ids]
    assert got[0] == got[3] != got[1]
    assert block_digests(layers, [], num_blocks) == []
    with pytest.raises(RuntimeError, match="no block dimension"):
        block_digests([torch.zeros(3, 3, 4)], [0], num_blocks)
