#!/usr/bin/env python3
"""TTFT and engine start of real vLLM on a GPU with PegaKVConnector (run on the H200).

The model is Llama-3.1-8B's public shape with dummy weights (bf16, eager mode, block
size 16); prompts are 10,000 token ids; one request at a time, ``max_tokens=1``.  A
single-host ``pegaflow-server`` holds the cache in shared memory on the same host, so
the connector takes its same-host shortcut (pool file pinned for DMA, blocks copied
straight into the paged KV cache, every block's xxh3 checked).

1. **engine 1** with the connector (vLLM's own prefix cache off): cold TTFT; the
   blocks are saved.  It is the machine's first engine, so its start time is not compared.
2. **plain**: vLLM without a connector: start time (to ready), cold TTFT, and its own
   GPU prefix-cache hit on the same prompts (the floor).
3. **engine 2**, a new process (a restarted engine, empty GPU cache): start time, then
   per prompt the warm TTFT from the cluster (loaded layer by layer during the forward
   pass) and vLLM's own prefix-cache hit; then the same on a second prompt set (also
   saved by engine 1) with ``--quiet-pause`` before each request instead of ``--pause``
   (vLLM's engine keeps polling for a while after a step; ``*_quiet_*`` figures).  Its
   connector logs at debug level: one line per lookup and per layer-wise load.
4. **engine 3**, the same with ``layerwise: false``: every load asynchronous, before
   the request is scheduled (the effect of layer-wise loading on TTFT).

First tokens of cold and warm runs are compared (dummy weights are seeded: equal
engines give equal tokens).  Last line: one JSON object with ``ttft_cold_ms``,
``ttft_warm_ms``, ``ttft_local_hit_ms``, ``start_plain_s``, ``start_connector_s`` and
the per-prompt figures.

    python3 scripts/bench_vllm_gpu.py [--prompts 8] [--tokens 10000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pegaflow.devcluster import start_server  # noqa: E402
from tests.vllm_engine import VllmEngine, prompts, wait_saved  # noqa: E402
from tests.vllm_engine import connector_stats as stats  # noqa: E402

LLAMA_31_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "vocab_size": 128256,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=10_000)
    ap.add_argument("--pool", default="24GiB")
    ap.add_argument("--kv-cache-gb", type=float, default=40.0)
    ap.add_argument("--pause", type=float, default=0.5, help="seconds before each request")
    ap.add_argument(
        "--quiet-pause", type=float, default=1.5, help="the same for the second, quieter pass"
    )
    ap.add_argument("--log-dir", default="", help="write each engine's output there")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="pf-gpu-bench-"))
    model_dir = work / "llama-3.1-8b-dummy"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(LLAMA_31_8B))
    spec = {
        "model": str(model_dir),
        "block_size": 16,
        "max_model_len": args.tokens + 64,
        "max_num_batched_tokens": args.tokens + 64,
        "kv_cache_bytes": int(args.kv_cache_gb * 1e9),
    }
    ps = prompts(args.prompts, args.tokens, seed=10_000, vocab=128_000)
    ps_quiet = prompts(args.prompts, args.tokens, seed=20_000, vocab=128_000)
    warm_up = prompts(1, 1024, seed=7, vocab=128_000)
    out: dict[str, Any] = {"tokens": args.tokens, "prompts": args.prompts}

    def timed(
        engine: VllmEngine, p: list[int], pause: float | None = None
    ) -> tuple[float, int, list[int]]:
        time.sleep(args.pause if pause is None else pause)
        r = engine.generate([p], max_tokens=1)
        return r["elapsed_s"] * 1000.0, r["cached"][0], r["outputs"][0]

    engines: list[VllmEngine] = []

    def start(name: str, **extra: Any) -> tuple[VllmEngine, float]:
        t0 = time.monotonic()
        # vLLM 0.26 seeds its block-hash chain randomly per process unless
        # PYTHONHASHSEED is set: replicas must share it to share a cache (docs/connector.md)
        e = VllmEngine({**spec, **extra}, env={"PYTHONHASHSEED": "0"}, name=name, start_timeout=600)
        engines.append(e)
        dt = time.monotonic() - t0
        print(f"{name} ready in {dt:.1f} s", flush=True)
        return e, dt

    server = start_server(
        extra=["--node-pool-bytes", args.pool, "--node-slab-bytes", "64MiB"]
    )  # fmt: skip
    coordinator, node = server.ready["coordinator"], server.ready["node"]
    try:
        # engine 1 is the first engine on this machine: its start pays one-off costs,
        # so start times are compared between the plain engine and engine 2 (a restart)
        s1 = str(work / "engine1")
        conn1 = {"coordinators": coordinator, "local_node": node, "stats_path": s1}
        e, out["start_first_s"] = start("engine1", connector=conn1, prefix_caching=False)
        try:
            e.generate(warm_up, 1)
            cold = [timed(e, p) for p in ps]
            cold_q = [timed(e, p) for p in ps_quiet]
            blocks = 2 * args.prompts * (args.tokens // 16) + 1024 // 16
            st = wait_saved(s1, blocks, timeout=300)
            print(f"engine1 counters: {st}", flush=True)
        finally:
            e.stop()
        out["cold_ms"] = [round(t, 1) for t, _, _ in cold]
        ref_tokens = [o for _, _, o in cold]

        e, out["start_plain_s"] = start("plain", connector=None)
        try:
            e.generate(warm_up, 1)
            pcold = [timed(e, p) for p in ps]
            phit = [timed(e, p) for p in ps]
            phit_q = [timed(e, p, args.quiet_pause) for p in ps]
        finally:
            e.stop()
        out["plain_cold_ms"] = [round(t, 1) for t, _, _ in pcold]
        out["plain_local_hit_ms"] = [round(t, 1) for t, _, _ in phit]
        out["plain_local_hit_quiet_ms"] = [round(t, 1) for t, _, _ in phit_q]
        out["plain_tokens_match"] = [o for _, _, o in pcold] == ref_tokens

        s2 = str(work / "engine2")
        conn2 = {"coordinators": coordinator, "local_node": node, "stats_path": s2,
                 "log_level": "debug"}  # fmt: skip
        e, out["start_connector_s"] = start("engine2", connector=conn2)
        try:
            e.generate(warm_up, 1)  # from the cluster: connections and pool mapping set up
            warm, hit = [], []
            for p in ps:
                warm.append(timed(e, p))
                hit.append(timed(e, p))
            # the same after a longer quiet (vLLM's engine busy-polls for a while after
            # a step), on the second prompt set
            warm_q, hit_q = [], []
            for p in ps_quiet:
                warm_q.append(timed(e, p, args.quiet_pause))
                hit_q.append(timed(e, p, args.quiet_pause))
            time.sleep(1.0)
            print(f"engine2 counters: {stats(s2)}", flush=True)
        finally:
            e.stop()
            lines = [x for x in e.log if "PegaFlow" in x]
            print("\n".join(lines[-40:]), file=sys.stderr)

        # engine 3: the same restart with layer-wise loading off (every load async)
        s3 = str(work / "engine3")
        conn3 = {"coordinators": coordinator, "local_node": node, "stats_path": s3,
                 "layerwise": False}  # fmt: skip
        e, _ = start("engine3", connector=conn3)
        try:
            e.generate(warm_up, 1)
            warm_async = [timed(e, p) for p in ps]
        finally:
            e.stop()
    finally:
        server.terminate()
        if args.log_dir:
            for e in engines:
                Path(args.log_dir, f"{e.name}.log").write_text("\n".join(e.log))
    out["warm_async_ms"] = [round(t, 1) for t, _, _ in warm_async]
    out["ttft_warm_async_ms"] = round(med(out["warm_async_ms"]), 1)
    out["warm_async_tokens_match_cold"] = [o for _, _, o in warm_async] == ref_tokens
    out["warm_ms"] = [round(t, 1) for t, _, _ in warm]
    out["warm_cached_tokens"] = [c for _, c, _ in warm]
    out["local_hit_ms"] = [round(t, 1) for t, _, _ in hit]
    out["warm_tokens_match_cold"] = [o for _, _, o in warm] == ref_tokens
    out["warm_quiet_ms"] = [round(t, 1) for t, _, _ in warm_q]
    out["local_hit_quiet_ms"] = [round(t, 1) for t, _, _ in hit_q]
    out["warm_quiet_tokens_match_cold"] = [o for _, _, o in warm_q] == [o for _, _, o in cold_q]
    out["ttft_warm_quiet_ms"] = round(med(out["warm_quiet_ms"]), 1)
    out["ttft_local_hit_quiet_ms"] = round(med(out["local_hit_quiet_ms"]), 1)
    out["ttft_plain_local_hit_quiet_ms"] = round(med(out["plain_local_hit_quiet_ms"]), 1)
    out["ttft_cold_ms"] = round(med(out["cold_ms"]), 1)
    out["ttft_warm_ms"] = round(med(out["warm_ms"]), 1)
    out["ttft_local_hit_ms"] = round(med(out["local_hit_ms"]), 1)
    out["ttft_plain_local_hit_ms"] = round(med(out["plain_local_hit_ms"]), 1)
    out["start_connector_over_plain"] = round(out["start_connector_s"] / out["start_plain_s"], 3)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
