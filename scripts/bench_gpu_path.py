#!/usr/bin/env python3
"""GPU data path: load and save of Llama-3.1-8B-shaped KV between the GPU's paged KV
cache and the pool of a storage node on the same host, through the connector's own
code (``LocalPath`` + ``KVBlockIO``), next to the pinned ``cudaMemcpy`` ceiling of the
same machine measured in the same run.

Shape: 32 layers, 8 KV heads, head size 128, bf16, so 128 KiB of KV per token; a
10,000-token prefix is 1.31 GB.  Layouts: vLLM 0.26's per-layer FlashAttention cache
``(blocks, heads, block_size, 2*head)`` and its cross-layer cache (one tensor, every
layer of a block contiguous).  Copy modes: ``kernel`` (one kernel per layer reading or
writing the pinned, mapped pool directly), ``dma2d`` (loads: the copy engines, one 2-D
copy per layer and run of consecutive blocks, digests by a read-only kernel behind
them; saves as ``kernel``) and ``dma`` (copy engine, 1 DMA per block, scatter on the
device).

A load is the whole connector path: locate (pins the blocks on the node), the copies,
the check of every block (the device digest of what landed in the KV cache against the
writer's; ``verify: host`` when blocks have none and xxh3 is recomputed on CPU threads),
unpin.  ``load_located_*``: the same without the locate, which the scheduler makes
while it looks the blocks up (the worker's part of a layer-wise load).  A save: local
reserve, copies with device digests, commit (the node hashes every slot before
publishing); ``save_free_*``: until the copies are done and vLLM may reuse the blocks
(the commit goes on without the engine).  ``*_copy_*`` figures time the device copies
alone.  Every load is checked byte for byte.

    python3 scripts/bench_gpu_path.py [--tokens 10000] [--rounds 5]

Last line: one JSON object with ``ceiling_h2d_gbps``, ``ceiling_d2h_gbps``,
``load_gbps``/``load_ms``/``load_ratio`` (best mode, 16-token blocks, per-layer layout),
``save_gbps``/``save_ratio``, and ``points`` with every layout, block size and mode.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pegaflow.client import SyncPegaClient  # noqa: E402
from pegaflow.connector.media.kvio import KVBlockIO  # noqa: E402
from pegaflow.connector.media.localpath import LocalPath  # noqa: E402

from pegaflow.config import ClientConfig  # noqa: E402
from pegaflow.tools.devcluster import start_server  # noqa: E402

LAYERS, HEADS, HEAD = 32, 8, 128
DTYPE = torch.bfloat16


def memcpy_ceiling(nbytes: int, rounds: int) -> tuple[float, float]:
    """GB/s of one pinned host <-> device cudaMemcpy of ``nbytes`` (best of rounds)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = []
    for src, dst in ((host, dev), (dev, host)):
        best = float("inf")
        for _ in range(rounds + 1):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            best = min(best, a.elapsed_time(b) / 1000)
        out.append(nbytes / best / 1e9)
    return out[0], out[1]


def kv_caches(layout: str, num_blocks: int, block_tokens: int) -> dict[str, torch.Tensor]:
    """KV caches as vLLM 0.26 allocates them for FlashAttention (NHD)."""
    if layout == "cross_layer":
        t = torch.empty(
            (num_blocks, LAYERS, block_tokens, HEADS, 2 * HEAD), dtype=DTYPE, device="cuda"
        )
        t.view(torch.int16).random_(-30000, 30000)
        return {"cross_layers": t}
    caches = {}
    for i in range(LAYERS):
        raw = torch.empty((num_blocks, block_tokens, HEADS, 2 * HEAD), dtype=DTYPE, device="cuda")
        raw.view(torch.int16).random_(-30000, 30000)
        caches[f"model.layers.{i}.self_attn.attn"] = raw.permute(0, 2, 1, 3)  # (B, H, N, 2D)
    return caches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pool", default="24GiB")
    ap.add_argument("--verify-threads", type=int, default=0, help="0: the connector's default")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gpu_path needs a CUDA device")
    torch.cuda.init()
    prefix_bytes = args.tokens * LAYERS * HEADS * HEAD * 2 * 2
    h2d, d2h = memcpy_ceiling(prefix_bytes, args.rounds)
    gb = prefix_bytes / 1e9
    print(f"pinned memcpy ceiling ({gb:.2f} GB): H2D {h2d:.1f} GB/s, D2H {d2h:.1f} GB/s")
    server = start_server(
        extra=["--node-pool-bytes", args.pool, "--node-slab-bytes", "64MiB"]
    )  # fmt: skip
    node = server.ready["node"]
    client = SyncPegaClient(ClientConfig(coordinators=[server.ready["coordinator"]]))
    points = []
    try:
        for layout in ("per_layer", "cross_layer"):
            for block_tokens in (16, 64):
                n = args.tokens // block_tokens
                num_blocks = 2 * n + 8
                kv = kv_caches(layout, num_blocks, block_tokens)
                io = KVBlockIO(kv, num_blocks)
                path = LocalPath(io, node, timeout=60.0, verify_threads=args.verify_threads)
                assert path.attach(client) and path.pool is not None
                path.pool.wait_registered()
                modes = (
                    ["kernel", "dma2d", "dma"] if io.kernel_ok and path.pool.registered else ["dma"]
                )
                for mode in modes:
                    try:
                        p = run_point(args, client, path, io, kv, layout, block_tokens, n, mode)
                    except Exception as e:  # report the mode's failure, measure the rest
                        torch.cuda.synchronize()
                        points.append({"layout": layout, "block_tokens": block_tokens,
                                       "mode": mode, "error": str(e)[:500]})  # fmt: skip
                        print(json.dumps(points[-1]), flush=True)
                        continue
                    p["load_ratio"] = round(p["load_gbps"] / h2d, 3)
                    p["save_ratio"] = round(p["save_gbps"] / d2h, 3)
                    p["register_s"] = round(path.pool.register_seconds, 2)
                    points.append(p)
                    print(json.dumps(p))
                path.close()
                del kv, io
                torch.cuda.empty_cache()
    finally:
        client.close()
        server.terminate()
    main_pts = [
        p
        for p in points
        if p["layout"] == "per_layer" and p["block_tokens"] == 16 and "error" not in p
    ]
    best_load = max(main_pts, key=lambda p: p["load_gbps"])
    best_save = max(main_pts, key=lambda p: p["save_gbps"])
    print(
        json.dumps(
            {
                "tokens": args.tokens,
                "prefix_bytes": prefix_bytes,
                "ceiling_h2d_gbps": round(h2d, 2),
                "ceiling_d2h_gbps": round(d2h, 2),
                "load_gbps": best_load["load_gbps"],
                "load_ms": best_load["load_ms"],
                "load_ratio": best_load["load_ratio"],
                "load_mode": best_load["mode"],
                "load_located_ms": best_load["load_located_ms"],
                "load_located_ratio": round(best_load["load_located_gbps"] / h2d, 3),
                "save_gbps": best_save["save_gbps"],
                "save_ratio": best_save["save_ratio"],
                "save_mode": best_save["mode"],
                "save_free_ms": best_save["save_free_ms"],
                "save_free_ratio": round(best_save["save_free_gbps"] / d2h, 3),
                "points": points,
            }
        )
    )


def run_point(
    args: argparse.Namespace,
    client: SyncPegaClient,
    path: LocalPath,
    io: KVBlockIO,
    kv: dict[str, torch.Tensor],
    layout: str,
    block_tokens: int,
    n: int,
    mode: str,
) -> dict[str, object]:
    pool = path.pool
    assert pool is not None
    path.copy_mode = mode  # the pool stays pinned in every mode
    loads, saves, load_copy, save_copy, located, frees = [], [], [], [], [], []
    src_ids, dst_ids = list(range(n)), list(range(n + 8, 2 * n + 8))
    try:
        for r in range(args.rounds + 1):  # round 0 warms up (kernel compile, first touch)
            ns = f"bench-gpu-{layout}-{block_tokens}-{mode}-{r}"
            hashes = [r.to_bytes(4, "big") + i.to_bytes(12, "big") for i in range(n)]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fut = path.save(client, ns, hashes, 0, src_ids)
            t_free = time.perf_counter()  # copied out: vLLM may reuse the blocks
            out = fut.result(60)
            t1 = time.perf_counter()
            assert out.stored == n, out
            t2 = time.perf_counter()
            pending = path.start_load(client, ns, hashes, 0, dst_ids)
            ok = pending.finish()
            t3 = time.perf_counter()
            verify = "device" if pending.on_device else "host"
            assert all(ok), f"{ok.count(False)} blocks failed"
            for t in kv.values():  # bit patterns (random bits include NaNs)
                bits = t.view(torch.int16)
                assert torch.equal(bits[dst_ids[0]], bits[src_ids[0]])
                assert torch.equal(bits[dst_ids[-1]], bits[src_ids[-1]])
            # device copies alone, blocks already located
            pin, where = client.locate(ns, path.node_id, hashes, 0, 5.0, 10.0)
            offs = where.column("offset").tolist()
            torch.cuda.synchronize()
            t4 = time.perf_counter()
            io.copy_in(
                pool.tensor, offs, dst_ids, mapped=True, mode=mode, piece=pool.piece
            ).synchronize()
            t5 = time.perf_counter()
            io.copy_out(src_ids, pool.tensor, offs, mapped=mode != "dma")
            t6 = time.perf_counter()
            # the worker's part when the scheduler located the blocks during its lookup
            pending = path.start_load(client, ns, hashes, 0, dst_ids, located=([pin], where))
            assert all(pending.finish())
            t7 = time.perf_counter()
            if r:
                saves.append(t1 - t0)
                frees.append(t_free - t0)
                loads.append(t3 - t2)
                load_copy.append(t5 - t4)
                save_copy.append(t6 - t5)
                located.append(t7 - t6)
    finally:
        path.copy_mode = "auto"
    nbytes = n * io.block_bytes
    med = statistics.median
    return {
        "layout": layout,
        "block_tokens": block_tokens,
        "mode": mode,
        "verify": verify,
        "blocks": n,
        "bytes": nbytes,
        "load_ms": round(med(loads) * 1000, 2),
        "load_gbps": round(nbytes / med(loads) / 1e9, 2),
        "load_copy_gbps": round(nbytes / med(load_copy) / 1e9, 2),
        "load_located_ms": round(med(located) * 1000, 2),
        "load_located_gbps": round(nbytes / med(located) / 1e9, 2),
        "save_ms": round(med(saves) * 1000, 2),
        "save_gbps": round(nbytes / med(saves) / 1e9, 2),
        "save_copy_gbps": round(nbytes / med(save_copy) / 1e9, 2),
        "save_free_ms": round(med(frees) * 1000, 2),
        "save_free_gbps": round(nbytes / med(frees) / 1e9, 2),
    }


if __name__ == "__main__":
    main()
