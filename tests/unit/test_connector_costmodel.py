"""The connector's cost model: claim a hit only when loading it beats computing it."""

from __future__ import annotations

import random

import pytest
from pegaflow.connector.metadata import LOCAL
from pegaflow.connector.scheduler.costmodel import (
    LOCAL_PROBE_INTERVAL_S,
    PROBE_INTERVAL_S,
    SPIKE,
    CostModel,
    LinearCost,
)

BS = 16  # tokens per block
BB = 2 << 20  # bytes per block (one shard): 128 KiB per token, a Llama-8B-like KV


def gpu(**kw: object) -> CostModel:
    return CostModel("cuda", block_size=BS, block_bytes=BB, **kw)  # type: ignore[arg-type]


def test_a_linear_cost_learns_fixed_cost_and_rate_and_forgets_the_prior() -> None:
    c = LinearCost(fixed_s=0.001, rate=1e9)
    assert c.estimate(1e9) == pytest.approx(1.001)
    for size in (1e6, 1e8, 5e8, 1e9) * 5:  # truly 2 ms + 10 GB/s
        c.observe(size, 0.002 + size / 10e9)
    assert c.rate == pytest.approx(10e9, rel=0.1)
    assert c.fixed_s == pytest.approx(0.002, abs=0.0005)
    # one stall moves the estimate by SPIKE at most (the first load after an engine
    # start paid 2.2 s of pool pinning on the H200, and declined every hit after it)
    before = c.estimate(5e8)
    c.observe(5e8, 100.0)
    assert c.estimate(5e8) <= SPIKE * before * 1.01
    # a source that becomes slow is seen as slow within some loads
    for _ in range(20):
        c.observe(5e8, 5e8 / 0.2e9)
    assert c.estimate(5e8) > 1.0


def test_samples_of_one_size_keep_the_fixed_cost_of_the_prior() -> None:
    c = LinearCost(fixed_s=0.001, rate=1e9)
    for _ in range(20):
        c.observe(1e8, 0.051)  # 50 ms for 100 MB, always: 2 GB/s plus the prior's 1 ms
    assert c.estimate(1e8) == pytest.approx(0.051, rel=0.05)
    assert c.fixed_s >= 0 and c.rate > 0


def test_this_hosts_pool_declined_is_tried_again_sooner_than_a_remote_node() -> None:
    now = [100.0]
    m = CostModel("cuda", block_size=BS, block_bytes=BB, clock=lambda: now[0])
    for src in (LOCAL, "n2"):
        for _ in range(5):
            m.observe_load(src, 100 * BB, 100 * BB / 0.2e9)  # both measured slow
    assert m.choose([LOCAL] * 200, layerwise=True).blocks == 0
    now[0] += LOCAL_PROBE_INTERVAL_S - 1
    assert not m.wants_probe(LOCAL)
    now[0] += 2
    assert m.wants_probe(LOCAL) and not m.wants_probe(LOCAL)  # once, then marked
    assert not m.wants_probe("n2")
    now[0] += PROBE_INTERVAL_S
    assert m.wants_probe("n2")


def test_a_busy_device_does_not_make_computing_look_free() -> None:
    """Four engines sharing one GPU: each step waits 50-350 ms for the others' kernels
    whatever its own size.  The time per token stays near what the engine does alone
    (40k tokens/s here), so a 4,000-token hit in this host's pool is still claimed."""
    rng = random.Random(1)
    m = gpu()
    for tokens in (500, 2000, 4000, 8000) * 3:  # alone first
        m.observe_compute(tokens, 0.01 + tokens / 40_000)
    rates = []
    for _ in range(400):
        tokens = rng.randint(300, 8000)
        m.observe_compute(tokens, rng.uniform(0.05, 0.35) + tokens / 40_000)
        rates.append(m.compute.rate)
    assert max(rates) < 100_000, max(rates)
    assert m.choose([LOCAL] * 250, layerwise=True).blocks == 250


def test_garbage_samples_are_ignored() -> None:
    c = LinearCost(fixed_s=0.001, rate=1e9)
    before = c.estimate(1e9)
    for size, secs in ((-1, 1.0), (1e6, -1.0), (float("nan"), 1.0), (1e6, float("inf"))):
        c.observe(size, secs)
    assert c.estimate(1e9) == before


def test_before_anything_is_measured_same_host_is_claimed_and_remote_tcp_is_not() -> None:
    m = gpu()
    n = 10_000 // BS  # a 10k-token prompt: 1.3 GB
    local = m.choose([LOCAL] * n, layerwise=True)
    assert local.blocks == n and local.sync
    remote = m.choose(["n2"] * n, layerwise=True)
    assert remote.blocks == 0 and remote.est_load_s > remote.est_compute_s
    # on a CPU engine prefill is slow: loading over TCP still wins
    cpu = CostModel("cpu", block_size=BS, block_bytes=BB)
    assert cpu.choose(["n2"] * n, layerwise=True).blocks == n


def test_a_slow_source_is_declined_once_measured() -> None:
    m = gpu()
    n = 200
    for _ in range(5):  # the same-host pool turns out slow (say, not pinned): 0.5 GB/s
        m.observe_load(LOCAL, 100 * BB, 100 * BB / 0.5e9)
        m.observe_compute(4096, 0.1)  # and prefill runs at 41k tokens/s
    d = m.choose([LOCAL] * n, layerwise=True)
    assert d.blocks == 0 and d.reason == "declined"
    # the engine log's cache line says why
    why = m.explain()
    assert "loading from this host 0.6 GB/s + 1.3 ms" in why and "tokens/s" in why, why
    # a remote node measured fast is claimed
    for _ in range(5):
        m.observe_load("n2", 100 * BB, 0.002 + 100 * BB / 40e9)
    assert m.choose(["n2"] * n, layerwise=True).blocks == n


def test_a_leading_part_is_claimed_when_only_it_pays() -> None:
    m = gpu()
    for _ in range(5):
        m.observe_compute(4096, 0.1)
        m.observe_load("slow", 100 * BB, 100 * BB / 0.2e9)
    d = m.choose([LOCAL] * 300 + ["slow"] * 300, layerwise=True)
    assert d.blocks == 300 and d.sync and d.reason == "part"
    # whole when every part pays
    for _ in range(30):  # it got fast: forgiven within a few dozen loads
        m.observe_load("slow", 100 * BB, 100 * BB / 50e9)
    d = m.choose([LOCAL] * 300 + ["slow"] * 300, layerwise=True)
    assert d.blocks == 600 and not d.sync and d.reason == "whole"


def test_async_loads_pay_an_extra_engine_step() -> None:
    m = gpu()
    for _ in range(10):  # steps of 30 ms fixed cost; a load just as fast as the compute
        m.observe_compute(16, 0.030)
        for tokens in (2048, 4096):
            m.observe_compute(tokens, 0.030 + tokens / 50_000)
        for blocks in (10, 100):
            m.observe_load("n2", blocks * BB, blocks * BB / (50_000 * BB / BS))
    assert m.step_s == pytest.approx(0.030, rel=0.2)
    # 10 blocks: 3.2 ms to load or to compute; the extra step makes the async load lose
    assert m.choose(["n2"] * 10, layerwise=True).blocks == 0
    assert m.choose(["n2"] * 1000, layerwise=True).blocks == 0  # equal rates: never a gain
    for _ in range(10):
        for blocks in (10, 100):  # 10x faster
            m.observe_load("n2", blocks * BB, blocks * BB / (500_000 * BB / BS))
    assert m.choose(["n2"] * 1000, layerwise=True).blocks == 1000


def test_small_steps_do_not_teach_the_prefill_cost() -> None:
    m = CostModel("cpu", block_size=32, block_bytes=16 << 10)
    before = m.compute_s(288)
    for tokens in (3, 8, 70, 140) * 5:  # decodes and short prefills: mostly fixed cost
        m.observe_compute(tokens, 0.012 + tokens * 0.0001)
    assert m.compute_s(288) == before  # the prior (2000 tokens/s) still decides
    assert m.step_s == pytest.approx(0.012 + 55 * 0.0001, rel=0.3)
    m.observe_load("n1", 6 * (16 << 10), 0.003)
    assert m.choose(["n1"] * 9, layerwise=True).blocks == 9


def test_off_claims_everything() -> None:
    m = gpu(enabled=False)
    assert m.choose(["n2"] * 10, layerwise=True).blocks == 10


def test_empty_and_snapshot() -> None:
    m = gpu()
    assert m.choose([], layerwise=True).blocks == 0
    snap = m.snapshot()
    assert set(snap) >= {"compute_tokens_per_s", "step_s", "sources"}


def test_a_declined_hit_is_one_the_model_predicts_slower() -> None:
    """Whatever the measurements, a hit (or its tail) is declined only where the model
    predicts loading it slower than computing it, and a claimed part is predicted
    faster: every decline was right by the model's own figures (issue 38)."""
    rng = random.Random(38)
    sources = [LOCAL, "n2", "n3"]
    for _ in range(200):
        m = gpu()
        for _ in range(rng.randint(0, 6)):
            m.observe_compute(rng.choice((512, 4096, 16384)), rng.uniform(0.005, 0.5))
            src = rng.choice(sources)
            nb = rng.randint(1, 400)
            m.observe_load(src, nb * BB, nb * BB / rng.uniform(0.1e9, 50e9))
        hit = [rng.choice(sources) for _ in range(rng.randint(1, 60))]
        hit.sort(key=lambda s: rng.random() if s != LOCAL else -1.0)
        d = m.choose(hit, layerwise=True)
        for k in range(1, len(hit) + 1):
            counts: dict[str, int] = {}
            for s in hit[:k]:
                counts[s] = counts.get(s, 0) + 1
            sync = len(counts) == 1 and LOCAL in counts
            faster = m.load_s(counts, sync) < m.compute_s(k * BS)
            if d.blocks == 0:
                assert not faster, (hit[:k], m.explain())
        if d.blocks:
            counts = {}
            for s in hit[: d.blocks]:
                counts[s] = counts.get(s, 0) + 1
            assert m.load_s(counts, d.sync) < m.compute_s(d.blocks * BS)
