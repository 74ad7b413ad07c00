#!/usr/bin/env python3
"""How long the engine's CPU is held up issuing a step of layer-wise loads.

A step with layer-wise loads queues every load's copies on the connector's stream
(``KVBlockIO.copy_in_many``: layer-major, one event per layer), then vLLM issues the
forward pass, each layer's kernels behind a device-side wait for that layer's copies.
Nothing there waits on the CPU, yet the H200 batch of eight 10,000-token hits
(docs/benchmarks.md) showed the forward pass taking about as long to *issue* as the
copies take to run, which keeps vLLM from scheduling the next step meanwhile.  This
script issues the same work without vLLM: ``--loads`` loads of a Llama-3.1-8B-shaped
prefix (32 layers, 8 KV heads, head 128, bf16, 16-token blocks) from pinned memory,
then a stand-in forward pass of ``--kernels`` small kernels per layer, and reports the
CPU time of each part against the device time of the whole, per copy mode.  When
``issue_ms`` tracks ``copies_device_ms`` the CPU was blocked by the device (the launch
queues full), not by our code.

    python3 scripts/bench_copy_issue.py [--tokens 10000] [--loads 1,4] [--kernels 15,40]
    python3 scripts/bench_copy_issue.py --busy-thread --loads 1 --kernels 15 --modes dma2d

``--busy-thread`` runs each point twice beside a thread that hashes 10k-token requests
the way vLLM's input thread does (sha256 of each pickled 16-token block), once with the
GIL's usual hand-back (``quick_handback`` and the GIL-keeping 2-D copy off: ``gil``
``"off"``) and once as the connector runs (``"on"``), and reports how many requests
the thread hashed meanwhile (``busy_requests_per_s``).

Last line: one JSON object with ``ceiling_h2d_gbps`` (one pinned cudaMemcpy of the
same bytes) and ``points``, each with ``queue_ms`` (CPU, queueing the copies),
``issue_ms`` (CPU, issuing the forward), ``device_ms`` (until the device is done),
``copies_device_ms`` and ``copy_gbps`` / ``copy_x`` (against the ceiling).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pegaflow.connector.media import tilecopy  # noqa: E402
from pegaflow.connector.media.kvio import KVBlockIO  # noqa: E402
from pegaflow.connector.media.layerfeed import CopyIn  # noqa: E402

from pegaflow.transport import gil_io  # noqa: E402
from scripts.bench_gpu_path import kv_caches, memcpy_ceiling  # noqa: E402
from scripts.busy_thread import BusyThread  # noqa: E402

BLOCK_TOKENS = 16


@contextlib.contextmanager
def gil_handback(on: bool) -> Iterator[None]:
    """The connector's GIL hand-back (on), or the interpreter's usual one (off)."""
    saved = gil_io.QUICK_SWITCH_S, tilecopy._memcpy_2d
    if not on:
        gil_io.QUICK_SWITCH_S, tilecopy._memcpy_2d = 1.0, False
    try:
        yield
    finally:
        gil_io.QUICK_SWITCH_S, tilecopy._memcpy_2d = saved


def run_point(
    io: KVBlockIO, host: torch.Tensor, blocks: int, loads: int, kernels: int, mode: str, rounds: int
) -> dict[str, object]:
    """Median of ``rounds`` (after one warm-up) of one step: queue, issue, run."""
    bb = io.block_bytes
    x = torch.zeros((BLOCK_TOKENS * loads, 4096), dtype=torch.bfloat16, device="cuda")
    q, iss, dev, cdev = [], [], [], []
    for r in range(rounds + 1):
        jobs = [
            CopyIn(
                host,
                [(j * blocks + i) * bb for i in range(blocks)],
                list(range(j * blocks, (j + 1) * blocks)),
                mapped=True,
                digest=True,
            )
            for j in range(loads)
        ]
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        xfers = io.copy_in_many(jobs, mode=mode)
        t1 = time.perf_counter()
        for layer in range(len(io.layers)):
            for t in xfers:
                t.wait_layer(layer)
            for _ in range(kernels):
                x.add_(1)
        t2 = time.perf_counter()
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        for t in xfers:
            t.synchronize()
        if r:
            q.append(t1 - t0)
            iss.append(t2 - t1)
            dev.append(start.elapsed_time(end) / 1e3)
            cdev.append(max(t.device_ms() or 0.0 for t in xfers) / 1e3)
    med = statistics.median
    nbytes = loads * blocks * bb
    out: dict[str, object] = {
        "mode": mode,
        "loads": loads,
        "kernels_per_layer": kernels,
        "bytes": nbytes,
        "queue_ms": round(med(q) * 1e3, 2),
        "issue_ms": round(med(iss) * 1e3, 2),
        "device_ms": round(med(dev) * 1e3, 2),
    }
    if any(cdev):
        out["copies_device_ms"] = round(med(cdev) * 1e3, 2)
        out["copy_gbps"] = round(nbytes / med(cdev) / 1e9, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=10000)
    ap.add_argument("--loads", default="1,4")
    ap.add_argument("--kernels", default="15,40")
    ap.add_argument("--modes", default="dma2d,kernel")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--busy-thread", action="store_true", help="beside a hashing thread")
    args = ap.parse_args()
    import logging

    logging.getLogger("pegaflow.connector").setLevel(logging.DEBUG)  # device timing of copies
    logging.getLogger("pegaflow.connector").addHandler(logging.NullHandler())
    loads = [int(x) for x in args.loads.split(",")]
    blocks = args.tokens // BLOCK_TOKENS
    kv = kv_caches("per_layer", blocks * max(loads) + 8, BLOCK_TOKENS)
    io = KVBlockIO(kv, blocks * max(loads) + 8, warm_up=True)
    host = torch.empty(blocks * max(loads) * io.block_bytes, dtype=torch.uint8, pin_memory=True)
    h2d, _ = memcpy_ceiling(blocks * io.block_bytes, 3)
    points = []
    for mode in args.modes.split(","):
        for n in loads:
            for k in (int(x) for x in args.kernels.split(",")):
                for gil in ("off", "on") if args.busy_thread else ("on",):
                    t0 = time.perf_counter()
                    beside = BusyThread(blocks) if args.busy_thread else contextlib.nullcontext()
                    with gil_handback(gil == "on"), beside as busy:
                        p = run_point(io, host, blocks, n, k, mode, args.rounds)
                        if busy is not None:
                            p["gil"] = gil
                            per_s = busy.requests / (time.perf_counter() - t0)
                            p["busy_requests_per_s"] = round(per_s)
                    if "copy_gbps" in p:
                        p["copy_x"] = round(float(p["copy_gbps"]) / h2d, 3)  # type: ignore[arg-type]
                    points.append(p)
                    print(json.dumps(p), file=sys.stderr, flush=True)
    print(json.dumps({"ceiling_h2d_gbps": round(h2d, 2), "points": points}))


if __name__ == "__main__":
    main()
