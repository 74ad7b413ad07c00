#!/usr/bin/env python3
"""Routing benchmark: round robin against routing on vLLM's KV events (issue 41).

Starts ``--replicas-n`` real ``vllm serve`` CPU replicas (dummy weights, a word-level
tokenizer, vLLM's own prefix caching, no connector: every cached token is a hit in the
replica's own cache), each publishing its KV events, and ``pegaflow-router``s in
front of them: ``rr`` (round robin), ``events`` (cache mode on the KV events, no pool,
each replica's queued prefill priced) and ``affinity`` (the same, its queue not priced:
``--router-queue-weight 0``).  The same workload, on fresh content, goes through each in
turn (``--repeats`` times, the order alternating; the figures pool the runs):
``--conversations`` multi-turn conversations, each opening with one of ``--docs`` shared
documents plus a question, ``--turns`` turns each (a turn's prompt: the whole history
plus a new message), ``--concurrency`` conversations in flight (closed loop: a
conversation's next turn is sent when its last is answered), so both routers see the
same load.

Reported per router: TTFT p50 / p99, the share of prompt tokens served from a replica's
cache (``cached_tokens``), the share of later turns (2 on) whose whole earlier history
(its full blocks) came from the answering replica's own cache, and how often a turn
stayed on its conversation's last replica; then the events router's TTFT p99 over round
robin's (target at most 0.5) and its later-turn share (target at least 0.9).  The
machine's ceiling in the same run: one prompt's TTFT cold and as a hit in the replica's
own cache, and the load average at start and end.  The last line is one JSON object.

Example (CPU, about 5 minutes)::

    python scripts/bench_router.py --conversations 12 --turns 4 --concurrency 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import scripts.bench_serving as serving  # noqa: E402
from pegaflow.tools.devcluster import Proc, free_port  # noqa: E402
from scripts.bench_serving import Replica, Result, complete, words  # noqa: E402

BLOCK = 32
SMALL = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
    "intermediate_size": 1536, "num_hidden_layers": 4, "num_attention_heads": 8,
    "num_key_value_heads": 4, "head_dim": 64, "hidden_act": "silu",
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
    "vocab_size": 1024, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
    "torch_dtype": "float32",
}  # fmt: skip
"""a Llama shape whose prefill of 1k tokens takes a few hundred ms on two CPU cores"""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--replicas-n", type=int, default=2)
    ap.add_argument("--shape", choices=("small", "tiny"), default="small",
                    help="small: SMALL above; tiny: the tests' tiny Llama")  # fmt: skip
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4, help="conversations in flight")
    ap.add_argument("--docs", type=int, default=2)
    ap.add_argument("--doc-tokens", type=int, default=768)
    ap.add_argument("--question-tokens", type=int, default=64)
    ap.add_argument("--message-tokens", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=16, help="answer length")
    ap.add_argument("--routers", default="rr,events,affinity",
                    help="in this order; affinity: events with --router-queue-weight 0")
    ap.add_argument("--max-inflight", type=int, default=64,
                    help="the events router's --router-max-inflight")
    ap.add_argument("--load-blocks", type=float, default=0.0,
                    help="the events router's --router-load-blocks")
    ap.add_argument("--queue-weight", type=float, default=1.0,
                    help="the events router's --router-queue-weight")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs per router, fresh content each, the routers' order alternating")
    ap.add_argument("--bind-cores", action="store_true",
                    help="each replica's threads on a core of its own (VLLM_CPU_OMP_THREADS_BIND)")
    return ap.parse_args(argv)


def start_replicas(
    model: str, n: int, bind: bool
) -> tuple[list[Replica], list[tuple[int, int]]]:
    """``n`` replicas publishing their KV events; each one's publisher and replay port."""
    ports = [(free_port(), free_port()) for _ in range(n)]
    more = [
        ["--kv-events-config", json.dumps({
            "enable_kv_cache_events": True, "publisher": "zmq",
            "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}"})]
        for pub, replay in ports
    ]  # fmt: skip
    envs = [{"VLLM_CPU_OMP_THREADS_BIND": str(i % (os.cpu_count() or 1))} if bind else {}
            for i in range(n)]  # fmt: skip
    replicas = serving.start_replicas(
        n, model, [*serving.TINY_ARGS, "--seed", "0"], None, serving.replica_env(),
        timeout=900, name="replica-", envs=envs, more_args=more,
    )  # fmt: skip
    return replicas, ports


class Conversation:
    """One conversation's prompts, built turn by turn from its answers."""

    def __init__(self, doc: str, rng: random.Random, a: argparse.Namespace) -> None:
        self.rng, self.a = rng, a
        self.prompt = f"{doc} {words(rng, a.question_tokens)}"
        self.turn = 1
        self.last_replica = ""
        self.last_prompt_tokens = 0

    def advance(self, answer: str) -> None:
        self.prompt = f"{self.prompt} {answer} {words(self.rng, self.a.message_tokens)}"
        self.turn += 1


async def run_router(
    url: str, model: str, a: argparse.Namespace, seed: int
) -> tuple[list[Result], list[dict[str, Any]]]:
    """The workload through the router at ``url``; each result and per result its
    conversation's context (turn, the last turn's prompt tokens and replica)."""
    rng = random.Random(seed)
    docs = [words(rng, a.doc_tokens) for _ in range(a.docs)]
    convs = [Conversation(docs[i % a.docs], random.Random(seed * 1000 + i), a)
             for i in range(a.conversations)]  # fmt: skip
    results: list[Result] = []
    context: list[dict[str, Any]] = []
    todo = list(convs)

    async def worker(session: aiohttp.ClientSession) -> None:
        while todo:
            c = todo.pop(0)
            for _ in range(a.turns):
                r = await complete(session, url, model, c.prompt, a.max_tokens)
                if not r.ok:
                    raise RuntimeError(f"request failed: {r.error}")
                results.append(r)
                context.append({"turn": c.turn, "prev_tokens": c.last_prompt_tokens,
                                "stayed": r.served_by == c.last_replica})  # fmt: skip
                c.last_replica, c.last_prompt_tokens = r.served_by, r.prompt_tokens
                c.advance(r.text)

    async with aiohttp.ClientSession() as session:
        warm = await complete(session, url, model, words(rng, 2 * BLOCK), a.max_tokens)
        if not warm.ok:  # the router's and the engines' first request, not measured
            raise RuntimeError(f"warm-up request failed: {warm.error}")
        await asyncio.gather(*(worker(session) for _ in range(a.concurrency)))
    return results, context


def summarize(results: list[Result], context: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of one router's run (module docstring); ``later_*``: turns 2 on only
    (the first turns of the first conversations are cold for every router)."""
    ttft = [r.ttft * 1000 for r in results]
    later = [(r, c) for r, c in zip(results, context, strict=True) if c["turn"] > 1]
    later_ttft = [r.ttft * 1000 for r, _ in later]
    own = sum(1 for r, c in later if r.cached_tokens >= c["prev_tokens"] // BLOCK * BLOCK)
    return {
        "requests": len(results),
        "ttft_p50_ms": round(serving.pct(ttft, 50), 1),
        "ttft_p99_ms": round(serving.pct(ttft, 99), 1),
        "ttft_mean_ms": round(sum(ttft) / len(ttft), 1),
        "later_ttft_p50_ms": round(serving.pct(later_ttft, 50), 1),
        "later_ttft_p99_ms": round(serving.pct(later_ttft, 99), 1),
        "cached_share": round(
            sum(r.cached_tokens for r in results) / max(1, sum(r.prompt_tokens for r in results)), 3
        ),
        "later_turns_from_own_cache": round(own / max(1, len(later)), 3),
        "later_turns_stayed": round(sum(c["stayed"] for _, c in later) / max(1, len(later)), 3),
        "prompt_tokens_mean": round(sum(r.prompt_tokens for r in results) / len(results)),
        "slowest": [
            {"ttft_ms": round(r.ttft * 1000, 1), "turn": c["turn"], "replica": r.served_by,
             "cached": r.cached_tokens, "prompt": r.prompt_tokens}
            for r, c in sorted(zip(results, context, strict=True), key=lambda x: -x[0].ttft)[:3]
        ],
    }


async def ceiling(url: str, model: str, a: argparse.Namespace) -> dict[str, float]:
    """TTFT of one fresh prompt as long as a last turn, cold then as a hit (ms)."""
    n = a.doc_tokens + a.question_tokens + (a.turns - 1) * (a.message_tokens + a.max_tokens)
    prompt = words(random.Random(-1), n)
    async with aiohttp.ClientSession() as s:
        cold = await complete(s, url, model, prompt, a.max_tokens)
        hit = await complete(s, url, model, prompt, a.max_tokens)
    return {"prompt_tokens": cold.prompt_tokens, "cold_ttft_ms": round(cold.ttft * 1000, 1),
            "own_hit_ttft_ms": round(hit.ttft * 1000, 1)}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    from tests.support.vllm_engine import tiny_model_with_tokenizer

    a = parse_args(argv)
    serving.trap_signals()  # killed by timeout or a signal: the replicas stop too
    out: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "args": vars(a),
    }
    workdir = Path(tempfile.mkdtemp(prefix="bench-router-"))
    model = tiny_model_with_tokenizer(workdir / "model", SMALL if a.shape == "small" else None)
    replicas: list[Replica] = []
    procs: list[Proc] = []
    try:
        replicas, ports = start_replicas(model, a.replicas_n, a.bind_cores)
        out["ceiling"] = asyncio.run(ceiling(replicas[0].url, model, a))
        print(f"ceiling: {out['ceiling']}", file=sys.stderr)
        spec_rr = ",".join(r.url for r in replicas)
        spec_ev = ",".join(
            f"{r.url};events=tcp://127.0.0.1:{p};replay=tcp://127.0.0.1:{q}"
            for r, (p, q) in zip(replicas, ports, strict=True)
        )
        urls = {}
        for name in a.routers.split(","):
            if name == "rr":
                proc, urls[name] = serving.start_router("rr", spec_rr)
            else:
                weight = 0.0 if name == "affinity" else a.queue_weight
                extra = ["--router-tokenizer", model, "--router-block-size", str(BLOCK),
                         "--router-max-inflight", str(a.max_inflight),
                         "--router-load-blocks", str(a.load_blocks),
                         "--router-queue-weight", str(weight)]  # fmt: skip
                proc, urls[name] = serving.start_router("cache", spec_ev, extra)
            procs.append(proc)
        for url in urls.values():
            wait_hashing(url)
        runs: dict[str, list[tuple[list[Result], list[dict[str, Any]]]]] = {n: [] for n in urls}
        routers: dict[str, Any] = {n: {"runs": []} for n in urls}
        names = list(urls)
        for rep in range(a.repeats):  # alternating order: the machine's drift hits both
            for i, name in enumerate(names if rep % 2 == 0 else names[::-1]):
                t0 = time.monotonic()
                seed = a.seed + 100 * (rep * len(names) + i + 1)
                res, ctx = asyncio.run(run_router(urls[name], model, a, seed))
                runs[name].append((res, ctx))
                one = {**summarize(res, ctx), "seconds": round(time.monotonic() - t0, 1),
                       "loadavg_1m": round(os.getloadavg()[0], 2)}  # fmt: skip
                print(f"{name} run {rep}: {one}", file=sys.stderr)
                routers[name]["runs"].append(
                    {k: one[k] for k in ("ttft_p50_ms", "ttft_p99_ms", "later_ttft_p99_ms",
                                         "later_turns_from_own_cache", "loadavg_1m")}
                )  # fmt: skip
        for name, url in urls.items():
            res = [r for rs, _ in runs[name] for r in rs]
            ctx = [c for _, cs in runs[name] for c in cs]
            routers[name].update(summarize(res, ctx))
            with urllib_open(url + "/v1/status") as st:
                doc = json.loads(st.read())
            routers[name]["counters"] = doc["counters"]
            routers[name]["per_replica"] = [r["requests"] for r in doc["replicas"]]
        out["routers"] = routers
        for other in ("events", "affinity"):
            if "rr" in routers and other in routers:
                rr, ev = routers["rr"], routers[other]
                out[f"{other}_over_rr"] = {
                    k: round(ev[f"{k}_ms"] / rr[f"{k}_ms"], 3)
                    for k in ("ttft_p99", "ttft_p50", "later_ttft_p99", "later_ttft_p50")
                }
        if "events_over_rr" in out:
            ev = routers["events"]
            out["targets"] = {
                "ttft_p99_at_most_half_rr": out["events_over_rr"]["ttft_p99"] <= 0.5,
                "later_turns_from_own_cache_at_least_0.9": ev["later_turns_from_own_cache"] >= 0.9,
            }
    finally:
        for p in reversed(procs):
            p.terminate()
        for r in replicas:
            r.terminate(60)
    out["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(out, default=lambda x: None if isinstance(x, float) and math.isnan(x) else x))
    return 0


def wait_hashing(url: str, timeout: float = 180.0) -> None:
    """Wait until a cache-mode router hashes with vLLM's own function (it imports torch
    in the background at start, which takes the machine's CPU for a while)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib_open(url + "/v1/status") as st:
            if json.loads(st.read())["router"].get("hash_function") in ("vllm", ""):
                return
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not load vLLM's hash function in {timeout} s")


def urllib_open(url: str) -> Any:
    import urllib.request

    return urllib.request.urlopen(url, timeout=30)


if __name__ == "__main__":
    sys.exit(main())
