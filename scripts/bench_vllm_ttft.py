#!/usr/bin/env python3
"""TTFT of real vLLM (CPU) with PegaKVConnector: cold, warm from the cluster, local hit.

For each prompt length (default 2k and 8k tokens):

* **cold**: engine 1 sees the prompts for the first time (full prefill; the connector
  saves the blocks to the cluster);
* **warm**: engine 1 is stopped; engine 2, a new process with an empty local cache,
  runs the same prompts: every full block is loaded from the cluster;
* **local hit**: engine 2 runs each prompt once more: vLLM's own prefix cache serves
  every full block (the floor: only the tail is computed).

TTFT is the wall time of one request with ``max_tokens=1``, one prompt at a time, each
after ``--pause`` seconds of quiet (median over ``--prompts`` prompts).  Warm and local
hit are measured in the same (restarted) engine, interleaved prompt by prompt: first the
load from the cluster, then vLLM's own prefix-cache hit on the same prompt.  The model
is a dummy-weight Llama whose prefill dominates (its config is printed and recorded).
A single-host ``pegaflow-server`` is started unless ``--coordinator`` points at a
running cluster.

The last output line is one JSON object: ``ttft_cold_ms``, ``ttft_warm_ms``,
``ttft_local_hit_ms``, ``warm_over_cold``, ``warm_over_local_hit`` of the longest
prompts, and ``points`` for every length.  Targets (issue 3): warm <= 0.2 x cold and
<= 1.5 x local hit at 8k tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pegaflow.tools.devcluster import start_server  # noqa: E402
from scripts._models import BENCH_MODEL  # noqa: E402
from tests.support.vllm_engine import VllmEngine, prompts, wait_saved  # noqa: E402
from tests.support.vllm_engine import connector_stats as stats  # noqa: E402


def notes(engine: VllmEngine) -> None:
    """The connector's warnings from an engine's output, if any (to stderr)."""
    lines = [line for line in engine.log if "PegaFlow" in line or "DBG" in line]
    if lines:
        print(f"{engine.name} connector log:\n" + "\n".join(lines[-30:]), file=sys.stderr)


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--lengths", default="2048,8192", help="prompt lengths in tokens")
    ap.add_argument("--prompts", type=int, default=3, help="prompts per length")
    ap.add_argument("--coordinator", default="", help="use this cluster instead of a server")
    ap.add_argument("--local-node", default="", help="with --coordinator: the local node id")
    ap.add_argument("--pool", default="2GiB", help="pool of the started pegaflow-server")
    ap.add_argument("--pause", type=float, default=1.5, help="seconds of quiet before each request")
    block_help = "vLLM block size in tokens (128: 256 KiB blocks, nearer real models' MiB blocks)"
    ap.add_argument("--block-size", type=int, default=128, help=block_help)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",") if x]
    block = args.block_size
    # a partial last block: the local-hit floor then needs no connector load at all
    lengths_eff = [n + 16 if n % block == 0 else n for n in lengths]

    work = Path(tempfile.mkdtemp(prefix="pf-bench-"))
    model_dir = work / "bench-llama"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(BENCH_MODEL, indent=2))
    print(f"model (dummy weights, bf16): {json.dumps(BENCH_MODEL)}", flush=True)

    server = None
    shm = work
    coordinator, local_node = args.coordinator, args.local_node
    if not coordinator:
        shm = Path(tempfile.mkdtemp(prefix="pegaflow-bench-", dir="/dev/shm"))
        server = start_server(
            extra=[
                "--node-pool-bytes", args.pool,
                "--node-slab-bytes", "64MiB",
                "--node-id", f"bench-{os.getpid()}",
                "--node-shm-dir", str(shm),
            ]
        )  # fmt: skip
        coordinator = server.ready["coordinator"]
        local_node = server.ready.get("node", "")
        print(f"pegaflow-server at {coordinator}, node {local_node}", flush=True)

    max_len = max(lengths_eff) + 64
    spec = {
        "model": str(model_dir),
        "block_size": block,
        "max_model_len": max_len,
        "kv_cache_bytes": 1 << 30,
        "max_num_batched_tokens": max_len,
    }
    sets = {n: prompts(args.prompts, n, seed=1000 + n, vocab=31000) for n in lengths_eff}
    warm_up = prompts(1, 512, seed=7, vocab=31000)
    results: dict[int, dict[str, Any]] = {}

    def one(engine: VllmEngine, prompt: list[int]) -> tuple[float, int]:
        time.sleep(args.pause)  # vLLM busy-polls for ~1 s after a step: start quiescent
        r = engine.ttft([prompt])
        return r["ttft_ms"][0], r["cached"][0]

    def start_engine(k: int) -> tuple[VllmEngine, str]:
        """Engine ``k`` (a process of its own) and the path of its connector counters."""
        stats_path = str(work / f"engine{k}")
        conn = {"coordinators": coordinator, "local_node": local_node, "stats_path": stats_path}
        t0 = time.monotonic()
        engine = VllmEngine({**spec, "connector": conn}, name=f"engine{k}")
        print(f"engine {k} up in {time.monotonic() - t0:.1f} s", flush=True)
        return engine, stats_path

    try:
        e1, s1 = start_engine(1)
        try:
            e1.ttft(warm_up)  # first-request costs, and a block set for engine 2's warm-up
            for n, ps in sets.items():
                cold = [one(e1, p) for p in ps]
                assert all(c == 0 for _, c in cold), cold
                results[n] = {"tokens": n, "cold": [t for t, _ in cold]}
                print(f"{n} tokens: cold {results[n]['cold']} ms", flush=True)
            total = sum(len(ps) * (n // block) for n, ps in sets.items()) + 512 // block
            st = wait_saved(s1, total)
            print(f"engine 1 connector counters: {st}", flush=True)
        finally:
            e1.stop()
            notes(e1)

        # engine 2: a new process (a restarted engine) with an empty local cache; per
        # prompt, first the warm load from the cluster, then vLLM's own local hit on the
        # very same prompt: same engine, same conditions, interleaved
        e2, s2 = start_engine(2)
        try:
            e2.ttft(warm_up)  # a warm hit: connections to the node are set up here
            e2.ttft(warm_up)
            for n, ps in sets.items():
                warm, local = [], []
                for p in ps:
                    warm.append(one(e2, p))
                    local.append(one(e2, p))
                results[n]["warm"] = [t for t, _ in warm]
                results[n]["warm_cached"] = [c for _, c in warm]
                results[n]["local_hit"] = [t for t, _ in local]
                print(
                    f"{n} tokens: warm {results[n]['warm']} ms (cached {results[n]['warm_cached']})"
                    f", local hit {results[n]['local_hit']} ms",
                    flush=True,
                )
            time.sleep(1.0)
            print(f"engine 2 connector counters: {stats(s2)}", flush=True)
        finally:
            e2.stop()
            notes(e2)
    finally:
        if server is not None:
            rc = server.popen.poll()
            if rc is not None:
                print(f"pegaflow-server exited early with code {rc}", file=sys.stderr)
            server.terminate()
            shutil.rmtree(shm, ignore_errors=True)
            bad = [line for line in server.log if "ERROR" in line or "WARNING" in line]
            if bad:
                print("pegaflow-server warnings:\n" + "\n".join(bad[-20:]), file=sys.stderr)

    points = []
    for n in lengths_eff:
        r = results[n]
        c, w, lh = med(r["cold"]), med(r["warm"]), med(r["local_hit"])
        points.append(
            {
                "tokens": n,
                "ttft_cold_ms": round(c, 2),
                "ttft_warm_ms": round(w, 2),
                "ttft_local_hit_ms": round(lh, 2),
                "warm_over_cold": round(w / c, 4),
                "warm_over_local_hit": round(w / lh, 3),
                "warm_cached_tokens": r["warm_cached"],
                "cold_ms": [round(x, 1) for x in r["cold"]],
                "warm_ms": [round(x, 1) for x in r["warm"]],
                "local_hit_ms": [round(x, 1) for x in r["local_hit"]],
            }
        )
    for p in points:
        print(
            f"{p['tokens']:>6} tokens: cold {p['ttft_cold_ms']:9.1f} ms"
            f" | warm {p['ttft_warm_ms']:7.1f} ms"
            f" | local hit {p['ttft_local_hit_ms']:7.1f} ms"
            f" | warm/cold {p['warm_over_cold']:.3f}"
            f" | warm/local {p['warm_over_local_hit']:.2f}",
            flush=True,
        )
    top = points[-1]
    summary = {
        "ttft_cold_ms": top["ttft_cold_ms"],
        "ttft_warm_ms": top["ttft_warm_ms"],
        "ttft_local_hit_ms": top["ttft_local_hit_ms"],
        "warm_over_cold": top["warm_over_cold"],
        "warm_over_local_hit": top["warm_over_local_hit"],
        "tokens": top["tokens"],
        "block_size": block,
        "model": {
            k: BENCH_MODEL[k]
            for k in (
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
            )
        },
        "cpu_count": os.cpu_count(),
        "points": points,
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
