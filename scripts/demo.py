#!/usr/bin/env python3
"""The main job: bring up a PegaFlow cluster on this machine and use it.

1. etcd (temporary data dir), one coordinator and two storage nodes, as real processes;
2. a client on "host A" (local node n1) stores blocks; a client on "host B" (local node
   n2) stores others;
3. a third client looks both sets up through the coordinator and fetches them over UCX
   from whichever node holds them, verifying every byte;
4. two vLLM replicas (CPU, dummy-weight Llama) with PegaKVConnector share the cluster:
   replica A (local node n1) prefills prompts cold and saves their KV; replica B (another
   process, local node n2) runs the same prompts and loads their KV from the cluster;
   TTFT cold vs warm is printed and both replicas' outputs are compared;
5. ``pegaflow status`` shows the cluster.

    scripts/demo.sh            # sets up .venv and etcd, then runs this
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from pegaflow.client import PegaClient

from pegaflow.config import ClientConfig
from pegaflow.tools.devcluster import EtcdServer, start_coordinator, start_node

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from scripts._models import BENCH_MODEL  # noqa: E402
from tests.support.vllm_engine import VllmEngine, prompts, wait_saved  # noqa: E402

NS = "demo-model"
BLOCK = 1 << 20


async def use_cluster(coordinator: str) -> None:
    rng = np.random.default_rng(0)
    data = rng.integers(0, 255, size=(64, BLOCK), dtype=np.uint8)
    hashes = [os.urandom(32) for _ in range(64)]
    a = PegaClient(ClientConfig(coordinators=[coordinator], local_node="n1", lookup_timeout_s=2))
    b = PegaClient(ClientConfig(coordinators=[coordinator], local_node="n2", lookup_timeout_s=2))
    reader = PegaClient(ClientConfig(coordinators=[coordinator], lookup_timeout_s=2))
    try:
        t = time.perf_counter()
        ra = await a.put_blocks(NS, [(h, 0, data[i]) for i, h in enumerate(hashes[:32])])
        rb = await b.put_blocks(NS, [(h, 0, data[32 + i]) for i, h in enumerate(hashes[32:])])
        dt = time.perf_counter() - t
        print(f"stored {ra.stored} blocks on n1, {rb.stored} on n2 (64 MiB, {dt * 1000:.0f} ms)")
        res = None
        for _ in range(50):  # the index is eventually consistent: etcd -> watch -> mirror
            res = await reader.lookup(NS, hashes)
            if res.hits == 64:
                break
            await asyncio.sleep(0.1)
        assert res is not None and res.hits == 64, f"lookup found {res and res.hits} of 64 blocks"
        on = {n: sum(1 for b in res.blocks if b[0] == n) for n in ("n1", "n2")}
        print(f"lookup: 64 of 64 blocks stored ({on['n1']} on n1, {on['n2']} on n2)")
        out = np.zeros_like(data)
        t = time.perf_counter()
        items = [(res.blocks[i][0], h, 0, out[i]) for i, h in enumerate(hashes)]
        ok = await reader.get_blocks(NS, items)
        dt = time.perf_counter() - t
        exact = bool(np.array_equal(out, data))
        print(f"fetched {sum(ok)} of 64 blocks over UCX in {dt * 1000:.0f} ms, byte-exact: {exact}")
        if not (all(ok) and exact):
            raise SystemExit("demo failed: fetched blocks differ from what was stored")
        miss = await reader.lookup(NS, [os.urandom(32)])
        print(f"lookup of an unknown prefix: {miss.hits} hits (a miss, as it should be)")
    finally:
        for c in (a, b, reader):
            await c.close()


def vllm_replicas(coordinator: str, work: Path) -> None:
    """Two vLLM replicas on different local nodes share one cluster."""
    model = work / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(BENCH_MODEL))
    block, n_tokens = 128, 2048 + 16
    spec = {"model": str(model), "block_size": block, "max_model_len": n_tokens + 64,
            "kv_cache_bytes": 1 << 30, "max_num_batched_tokens": n_tokens + 64}  # fmt: skip
    ps = prompts(3, n_tokens, seed=42, vocab=31000)
    print(f"\nvLLM replicas: dummy Llama (hidden 1024, 4 layers), {len(ps)} x {n_tokens} tokens")
    stats_a = str(work / "replica-a")
    a = VllmEngine(
        {
            **spec,
            "connector": {"coordinators": coordinator, "local_node": "n1", "stats_path": stats_a},
        },
        name="replica A",
    )
    b = None
    try:
        a.ttft(prompts(1, 256, seed=1, vocab=31000))  # first-request costs
        cold = []
        for p in ps:
            time.sleep(1.0)
            cold.append(a.ttft([p])["ttft_ms"][0])
        print(
            "replica A (local node n1), cold: TTFT " + ", ".join(f"{t:.0f}" for t in cold) + " ms"
        )
        wait_saved(stats_a, len(ps) * (n_tokens // block) + 256 // block)
        b = VllmEngine(
            {**spec, "connector": {"coordinators": coordinator, "local_node": "n2"}},
            name="replica B",
        )
        b.ttft(prompts(1, 256, seed=2, vocab=31000))
        warm, cached = [], []
        for p in ps:
            time.sleep(1.0)
            r = b.ttft([p])
            warm.append(r["ttft_ms"][0])
            cached.append(r["cached"][0])
        print(
            "replica B (local node n2), KV from the cluster: TTFT "
            + ", ".join(f"{t:.0f}" for t in warm)
            + f" ms ({sum(cached)} of {len(ps) * n_tokens} prompt tokens loaded)"
        )
        out_a = a.generate(ps, max_tokens=8)["outputs"]
        out_b = b.generate(ps, max_tokens=8)["outputs"]
        same = out_a == out_b
        cm, wm = sorted(cold)[len(cold) // 2], sorted(warm)[len(warm) // 2]
        print(f"median TTFT cold {cm:.0f} ms -> warm {wm:.0f} ms ({wm / cm:.2f}x)")
        print(f"outputs of both replicas identical: {same}")
        if not same:
            raise SystemExit("demo failed: a replica using cached KV produced different tokens")
    finally:
        for e in (a, b):
            if e is not None:
                e.stop()


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="pegaflow-demo-") as tmp:
        etcd = EtcdServer(Path(tmp) / "etcd")
        procs = []
        try:
            etcd.start()
            print(f"etcd running at {etcd.endpoint}")
            coord = start_coordinator(etcd=etcd.endpoint, prefix="/pegaflow/demo")
            procs.append(coord)
            print(f"coordinator at {coord.ready['address']} (http {coord.ready['http']})")
            for nid in ("n1", "n2"):
                node = start_node(
                    nid, etcd=etcd.endpoint, prefix="/pegaflow/demo", pool="1GiB", slab="64MiB"
                )
                procs.append(node)
                print(f"node {nid} serving UCX at {node.ready['ucx']}")
            asyncio.run(use_cluster(coord.ready["address"]))
            vllm_replicas(coord.ready["address"], Path(tmp))
            print("\n$ pegaflow status")
            sys.stdout.flush()
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pegaflow.tools.cli",
                    "status",
                    "--coordinators",
                    coord.ready["address"],
                ],
                check=True,
            )
        finally:
            for p in procs:
                p.terminate()
            etcd.stop()


if __name__ == "__main__":
    main()
