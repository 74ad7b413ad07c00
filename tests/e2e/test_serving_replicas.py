"""Two ``vllm serve`` replicas share one ``pegaflow-server`` through their HTTP API.

Driven with ``scripts/bench_serving.py``'s own workload and client code (imported), so
the test also exercises the serving benchmark: a conversation whose turns alternate
between the two replicas is answered from the shared cache (the second replica never
saw the conversation, yet its first turn has ``cached_tokens`` > 0), and every answer
equals a third replica's with no cache at all (no connector, vLLM's prefix caching
off; greedy).  Then a short closed-loop run of the benchmark (documents and unique
prompts, round robin) over the pair has no failed request and the same outputs as the
replica without a cache.  No timing is asserted.

Slow (three servers start together): ``pytest -m slow tests/e2e/test_serving_replicas.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import itertools
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from pegaflow.tools.devcluster import start_server
from tests.support.script_module import load_script

pytestmark = [
    pytest.mark.ucx,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None or importlib.util.find_spec("aiohttp") is None,
        reason="vLLM or aiohttp not installed",
    ),
]

BS = 32  # the tiny preset's --block-size


def load_bench() -> ModuleType:
    """``scripts/bench_serving.py`` as a module (scripts/ is not a package)."""
    return load_script("bench_serving")


async def wait_node_blocks(bench: ModuleType, url: str, blocks: int, timeout: float = 60.0) -> None:
    """Until the node's pool holds ``blocks`` blocks (the replica's saves are
    asynchronous: the other replica's lookup must find them)."""
    import aiohttp

    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while True:
            m = await bench.scrape(s, url)
            if m.get("pegaflow_node_blocks", 0) >= blocks:
                return
            if time.monotonic() > deadline:
                pytest.fail(f"the pool never held {blocks} blocks: {m.get('pegaflow_node_blocks')}")
            await asyncio.sleep(0.2)


async def metrics(bench: ModuleType, url: str) -> dict[str, float]:
    import aiohttp

    async with aiohttp.ClientSession() as s:
        return dict(await bench.scrape(s, url))


async def conversation(
    bench: ModuleType, pair: list[Any], base: Any, model: str, node_metrics: str
) -> list[dict[str, Any]]:
    """Four turns of one conversation, turn k on replica k % 2, each turn's blocks in the
    pool before the next; each prompt also answered by ``base``."""
    import aiohttp

    spec = bench.WorkloadSpec(
        conversations=1, turns=4, first_tokens=200, turn_tokens=40, docs=0,
        mix=(1.0, 0.0, 0.0), output_tokens=8,
    )  # fmt: skip
    items = bench.Workload(spec).items()
    turns: list[dict[str, Any]] = []
    async with aiohttp.ClientSession() as s:
        for k in range(4):
            item = next(items)
            assert (item.kind, item.turn) == ("conv", k)
            prompt = await item.ready_prompt()
            r = await bench.complete(s, pair[k % 2].url, model, prompt, spec.output_tokens)
            assert r.ok, f"turn {k}: {r.error}\n{pair[k % 2].tail()}"
            item.finish(r.text)
            plain = await bench.complete(s, base.url, model, prompt, spec.output_tokens)
            assert plain.ok, f"turn {k} without cache: {plain.error}\n{base.tail()}"
            turns.append({"prompt": prompt, "r": r, "plain": plain})
            await wait_node_blocks(bench, node_metrics, r.prompt_tokens // BS)
    return turns


def test_workload_chains_turns_and_is_deterministic() -> None:
    """Pure logic of the benchmark's workload: a turn's prompt is the previous prompt,
    its answer and a new message, known only once the previous turn is answered; the
    same seed gives the same requests; the mix's kinds all occur."""
    bench = load_bench()
    spec = bench.WorkloadSpec(conversations=2, turns=3, first_tokens=20, turn_tokens=5,
                              docs=2, doc_tokens=30, unique_tokens=10, seed=3)  # fmt: skip

    async def drive() -> list[tuple[str, str, int, str]]:
        out = []
        for item in itertools.islice(bench.Workload(spec).items(), 40):
            prompt = await item.ready_prompt()
            if item.conv is not None and item.turn > 0:
                assert prompt.startswith(last[item.stream] + " answer words ")
            last[item.stream] = prompt
            item.finish("answer words")
            out.append((item.kind, item.stream, item.turn, prompt))
        return out

    async def waits() -> None:
        one = bench.WorkloadSpec(conversations=1, turns=2, first_tokens=8, docs=0,
                                 mix=(1.0, 0.0, 0.0))  # fmt: skip
        items = bench.Workload(one).items()
        t0, t1 = next(items), next(items)
        pending = asyncio.create_task(t1.ready_prompt())
        for _ in range(5):
            await asyncio.sleep(0)
        assert not pending.done()  # turn 1 waits for turn 0's answer
        p0 = await t0.ready_prompt()
        t0.finish("the answer")
        assert (await pending).startswith(p0 + " the answer ")

    asyncio.run(waits())
    last: dict[str, str] = {}
    first = asyncio.run(drive())
    last.clear()
    assert asyncio.run(drive()) == first
    assert {k for k, *_ in first} == {"conv", "doc", "unique"}
    assert max(t for _, _, t, _ in first) == spec.turns - 1
    assert bench.pct([1.0, 2.0, 3.0, 4.0], 50) == 2.5


def test_conversations_of_varied_length_start_out_of_step() -> None:
    """With ``vary_turns`` conversations last 1 .. 2 x turns - 1 turns (mean about
    ``turns``), so their first turns, cold for any cache, come spread out rather than
    all the slots' at once every ``turns`` rounds."""
    bench = load_bench()
    spec = bench.WorkloadSpec(conversations=8, turns=4, first_tokens=4, turn_tokens=2, docs=0,
                              mix=(1.0, 0.0, 0.0), vary_turns=True)  # fmt: skip
    items = list(itertools.islice(bench.Workload(spec).items(), 8 * 40))
    lengths: dict[str, int] = {}
    for it in items:
        lengths[it.stream] = max(lengths.get(it.stream, 0), it.turn + 1)
    done = list(lengths.values())[:-8]  # the last of each slot may be cut short
    assert min(done) >= 1 and max(done) <= 7 and 3.0 <= sum(done) / len(done) <= 5.0
    firsts_per_round = [sum(it.turn == 0 for it in items[r : r + 8]) for r in range(8, 320, 8)]
    assert max(firsts_per_round) < 8  # never every slot at once, as with fixed turns
    fixed = bench.Workload(dataclasses.replace(spec, vary_turns=False))
    fixed_items = list(itertools.islice(fixed.items(), 8 * 8))
    assert [sum(it.turn == 0 for it in fixed_items[r : r + 8]) for r in (0, 32)] == [8, 8]


@pytest.mark.slow
@pytest.mark.vllm
def test_two_replicas_share_the_cache_over_http(tmp_path: Path) -> None:
    bench = load_bench()
    server = start_server(extra=["--pool-size", "256MiB", "--node-slab-bytes", "16MiB"])
    replicas: list[Any] = []
    try:
        node_metrics = f"http://127.0.0.1:{server.ready['http']}/metrics"
        model = bench.preset_model("tiny", tmp_path / "model")
        args = ["--seed", "0", *bench.TINY_ARGS]
        env = {"PEGAFLOW_CLIENT_COORDINATORS": server.ready["coordinator"]}
        # all three start together (the start dominates the test's time)
        pair = [bench.Replica(model, args, bench.THREE_KEYS, env, name=f"r{i}") for i in (0, 1)]
        replicas += pair
        base = bench.Replica(model, [*args, "--no-enable-prefix-caching"], None, name="plain")
        replicas.append(base)
        for r in replicas:
            r.wait_ready(600)

        turns = asyncio.run(conversation(bench, pair, base, model, node_metrics))
        for k, t in enumerate(turns):
            assert t["r"].text == t["plain"].text, f"turn {k}: cache changed the answer"
            assert t["r"].prompt_tokens == t["plain"].prompt_tokens
            assert t["plain"].cached_tokens == 0
        assert turns[0]["r"].cached_tokens == 0
        # r1's first turn: its own vLLM cache is empty, the hit is r0's blocks from PegaFlow
        assert turns[1]["r"].cached_tokens > 0, pair[1].tail()
        assert all(t["r"].cached_tokens > 0 for t in turns[1:])
        m = bench.connector_counters(asyncio.run(metrics(bench, pair[1].url + "/metrics")))
        assert m.get("lookup_hit_blocks", 0) > 0, m
        assert m.get("load_failed_blocks", 0) == 0, m

        spec = bench.WorkloadSpec(
            conversations=0, docs=1, doc_tokens=160, question_tokens=16, unique_tokens=64,
            mix=(0.0, 1.0, 0.5), output_tokens=4, seed=7,
        )  # fmt: skip
        run = asyncio.run(
            bench.run_point([r.url for r in pair], model, spec, concurrency=2, requests=8)
        )
        summary = bench.summarize(run)
        assert summary["failed"] == 0, summary["errors"]
        ref = asyncio.run(bench.run_point([base.url], model, spec, concurrency=2, requests=8))
        same = bench.compare_outputs(ref["results"], run["results"], 8)
        assert same == {"compared": 8, "equal": 8, "differ": 0, "differ_idx": []}
    finally:
        for r in replicas:
            r.kill()
        server.terminate()
