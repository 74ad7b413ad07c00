#!/usr/bin/env python3
"""Data-path throughput: batched get/put between a client and a node in another process,
next to ``ucx_perftest -t tag_bw`` on the same transport in the same run.

Every figure is a median over interleaved rounds (perftest, then ours, then perftest...)
because on a 2-core machine both ends of either test compete for the same cores and
single runs swing by 2-4x.  The last line printed is one JSON object:
``get_gbps``, ``put_gbps``, ``ucx_perftest_gbps`` and ``get_ratio`` for 2 MiB blocks,
batch 32, plus ``points`` with every size and batch measured.

    .venv/bin/python scripts/bench_datapath.py [--rounds 5] [--transport tcp]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TRANSPORTS = {"tcp": "tcp,self", "shm": "sm,self"}
SIZES = [256 << 10, 2 << 20, 8 << 20]
BATCHES = [1, 32]


def perftest_binary() -> Path:
    import libucx  # the wheel that ships UCX's tools

    return Path(libucx.__file__).parent / "bin" / "ucx_perftest"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ucx_perftest(size: int, tls: str, iters: int) -> float:
    """GB/s of one ``ucx_perftest -t tag_bw`` run over loopback."""
    exe = perftest_binary()
    # UCX's own defaults: importing ucxx in this process sets UCX_* variables
    # (e.g. UCX_MAX_RNDV_RAILS=1) that must not leak into the reference measurement
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("UCX")},
        "UCX_TLS": tls,
        "LD_LIBRARY_PATH": f"{exe.parent.parent / 'lib'}:{os.environ.get('LD_LIBRARY_PATH', '')}",
        "UCX_WARN_UNUSED_ENV_VARS": "n",
    }
    port = str(free_port())
    server = subprocess.Popen(
        [str(exe), "-p", port], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        for _ in range(50):  # the server may take a moment to listen
            time.sleep(0.2)
            out = subprocess.run(
                [
                    str(exe),
                    "127.0.0.1",
                    "-p",
                    port,
                    "-t",
                    "tag_bw",
                    "-s",
                    str(size),
                    "-n",
                    str(iters),
                ],
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            ).stdout
            if "Final:" in out:
                break
    finally:
        server.kill()
        server.wait(30)
    m = re.search(r"Final:\s+\d+\s+\S+\s+\S+\s+\S+\s+(\S+)\s+(\S+)", out)
    if not m:
        raise RuntimeError(f"ucx_perftest printed no result:\n{out}")
    return float(m.group(2)) * 1e6 / 1e9  # MB/s (10^6) -> GB/s


async def measure_ours(addr: str, size: int, batch: int, reps: int) -> tuple[float, float, bool]:
    """(get GB/s, put GB/s, bytes identical) for ``reps`` batches of ``batch`` blocks."""
    import numpy as np
    from pegaflow.client.data import DataClient

    client = DataClient()
    try:
        rng = np.random.default_rng(size + batch)
        src = rng.integers(0, 255, size=(batch, size), dtype=np.uint8)
        dst = np.zeros_like(src)
        put_times, get_times = [], []
        all_hashes = []
        for _ in range(reps):
            hashes = [os.urandom(32) for _ in range(batch)]
            all_hashes.append(hashes)
            t = time.perf_counter()
            res = await client.put(
                addr, "bench", [(h, 0, src[i]) for i, h in enumerate(hashes)], 60
            )
            put_times.append(time.perf_counter() - t)
            if res.stored != batch:
                raise RuntimeError(f"put stored {res.stored}/{batch}")
        exact = True
        for hashes in all_hashes:
            dst[:] = 0
            t = time.perf_counter()
            ok = await client.get(addr, "bench", [(h, 0, dst[i]) for i, h in enumerate(hashes)], 60)
            get_times.append(time.perf_counter() - t)
            exact = exact and all(ok) and bool(np.array_equal(src, dst))
        nbytes = size * batch
        return (
            nbytes / statistics.median(get_times) / 1e9,
            nbytes / statistics.median(put_times) / 1e9,
            exact,
        )
    finally:
        await client.close()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per point")
    ap.add_argument("--transport", choices=sorted(TRANSPORTS), default="tcp")
    ap.add_argument("--pool", default="2GiB", help="node pool size")
    args = ap.parse_args()
    tls = TRANSPORTS[args.transport]
    os.environ["UCX_TLS"] = tls

    from pegaflow.devcluster import start_node

    node = start_node(
        "bench-node",
        pool=args.pool,
        slab="64MiB",
        env={"UCX_TLS": tls},
        extra=["--node-http-port", "-1"],
    )
    addr = node.ready["ucx"]
    points = []
    try:
        for size in SIZES:
            for batch in BATCHES:
                reps = max(2, min(16, (64 << 20) // (size * batch)))
                perf, gets, puts, exact = [], [], [], True
                for _ in range(args.rounds):
                    perf.append(ucx_perftest(size, tls, iters=max(50, (256 << 20) // size)))
                    g, p, ok = asyncio.run(measure_ours(addr, size, batch, reps))
                    gets.append(g)
                    puts.append(p)
                    exact = exact and ok
                pt = {
                    "block_bytes": size,
                    "batch": batch,
                    "get_gbps": round(statistics.median(gets), 3),
                    "put_gbps": round(statistics.median(puts), 3),
                    "ucx_perftest_gbps": round(statistics.median(perf), 3),
                    "byte_exact": exact,
                }
                pt["get_ratio"] = round(pt["get_gbps"] / pt["ucx_perftest_gbps"], 3)
                pt["put_ratio"] = round(pt["put_gbps"] / pt["ucx_perftest_gbps"], 3)
                points.append(pt)
                print(
                    f"{size >> 10:>6} KiB x{batch:<3} get {pt['get_gbps']:6.2f} GB/s"
                    f"  put {pt['put_gbps']:6.2f} GB/s"
                    f"  ucx_perftest {pt['ucx_perftest_gbps']:6.2f} GB/s"
                    f"  get/perftest {pt['get_ratio']:.2f}",
                    flush=True,
                )
    finally:
        node.terminate()
    main_pt = next(p for p in points if p["block_bytes"] == 2 << 20 and p["batch"] == 32)
    print(
        json.dumps(
            {
                "transport": args.transport,
                "get_gbps": main_pt["get_gbps"],
                "put_gbps": main_pt["put_gbps"],
                "ucx_perftest_gbps": main_pt["ucx_perftest_gbps"],
                "get_ratio": main_pt["get_ratio"],
                "rounds": args.rounds,
                "points": points,
            }
        )
    )


if __name__ == "__main__":
    main()
