#!/usr/bin/env python3
"""Data-path throughput: batched get/put between a client and a node in another process,
next to ``ucx_perftest -t tag_bw`` on the same transport in the same run.

Every figure is a median over interleaved rounds (perftest, then ours, then perftest...)
because on a 2-core machine both ends of either test compete for the same cores and
single runs swing by 2-4x; the best round and the spread are printed too.  The last line
printed is one JSON object: ``get_gbps``, ``put_gbps``, ``ucx_perftest_gbps`` and
``get_ratio`` for 2 MiB blocks, batch 32, plus ``points`` with every size and batch
measured.

A second reference (``--stream``, on by default for the 2 MiB x 32 point) is a raw UCX
tag stream with *our* UCX settings, both ends busy-polling, 32 messages in flight: once
from one cache-hot buffer per side (what ``ucx_perftest`` does) and once cycling through
512 MiB per side (every byte from DRAM, as a get's blocks come from a pool much larger
than the cache).  Their ratio is what cache residency alone is worth to the reference.

    .venv/bin/python scripts/bench_datapath.py [--rounds 5] [--transport tcp]
        [--sizes 2MiB --batches 32] [--no-stream]
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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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


def ucx_perftest(
    size: int,
    tls: str,
    iters: int,
    *,
    server_prefix: Sequence[str] = (),
    client_prefix: Sequence[str] = (),
    host: str = "127.0.0.1",
) -> float:
    """GB/s of one ``ucx_perftest -t tag_bw`` run over loopback, or from a server run
    behind the command line ``server_prefix`` to a client behind ``client_prefix``
    reaching it at ``host`` (two hosts of ``tests/support/netns_hosts.py``)."""
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
        [*server_prefix, str(exe), "-p", port],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(50):  # the server may take a moment to listen
            time.sleep(0.2)
            out = subprocess.run(
                [
                    *client_prefix,
                    str(exe),
                    host,
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
    # ucx_perftest's "MB/s" are MiB/s (UCS_MBYTE = 2**20): the overhead column agrees
    return float(m.group(2)) * (1 << 20) / 1e9


STREAM_SPAN = 512 << 20
STREAM_WINDOW = 32


def _stream_end(role: str, size: int, span: int, total: int, port: int) -> None:
    """One end of :func:`ucx_stream` (run in its own process, ``--_stream``)."""
    import select

    import numpy as np

    from pegaflow.transport import ucx  # our UCX settings, set before ucxx loads

    api = ucx.ucx_api
    ctx = api.UCXContext(feature_flags=(api.Feature.TAG, api.Feature.WAKEUP))
    worker = api.UCXWorker(ctx)
    buf = np.ones(span, np.uint8)  # written once: every page is resident
    slots = [ucx.Array(buf[i * size : (i + 1) * size]) for i in range(span // size)]
    eps: list[Any] = []
    if role == "recv":
        listener = api.UCXListener.create(
            worker=worker,
            port=0,
            cb_func=lambda cr: eps.append(listener.create_endpoint_from_conn_request(cr, False)),
        )
        print(listener.port, flush=True)
        deadline = time.monotonic() + 30
        while not eps and time.monotonic() < deadline:
            worker.progress()
            select.select([], [], [], 0.0005)
    else:
        eps.append(api.UCXEndpoint.create(worker, "127.0.0.1", port, False))
    if not eps:
        raise SystemExit("no connection")
    ep = eps[0]
    n = total // size
    hello = ucx.Array(np.zeros(8, np.uint8))  # both ends ready before the clock starts
    first = (ep.tag_send if role == "send" else ep.tag_recv)(hello, ucx.make_tag(1 << 40, 0))
    while not first.completed:
        worker.progress()
    post = ep.tag_send if role == "send" else ep.tag_recv
    inflight: list[Any] = []
    posted = done = 0
    t0 = time.perf_counter()
    while done < n:
        while len(inflight) < STREAM_WINDOW and posted < n:
            inflight.append(post(slots[posted % len(slots)], ucx.make_tag(2, posted)))
            posted += 1
        worker.progress()
        while inflight and inflight[0].completed:
            inflight.pop(0).check_error()
            done += 1
    if role == "recv":
        print(f"{total / (time.perf_counter() - t0) / 1e9:.4f}", flush=True)


def ucx_stream(size: int, tls: str, span: int, total: int = 1 << 30) -> float:
    """GB/s of a raw UCX tag stream between two fresh processes with our UCX settings
    (``pegaflow.transport.ucx``: put_zcopy rendezvous, no peer error handling), both ends
    busy-polling, :data:`STREAM_WINDOW` messages in flight, cycling through ``span``
    bytes per side (``span == size``: one cache-hot buffer, like ``ucx_perftest``)."""
    env = {**os.environ, "UCX_TLS": tls, "PYTHONUNBUFFERED": "1"}
    me = [sys.executable, str(Path(__file__).resolve()), "--_stream"]
    args = [str(size), str(span), str(total)]
    recv = subprocess.Popen([*me, "recv", *args, "0"], env=env, stdout=subprocess.PIPE, text=True)
    send = None
    try:
        assert recv.stdout is not None
        port = recv.stdout.readline().strip()
        send = subprocess.Popen([*me, "send", *args, port], env=env)
        out, _ = recv.communicate(timeout=120)
        send.wait(30)
        return float(out.strip().splitlines()[-1])
    finally:
        for p in (recv, send):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)


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
            # zero-copy, as the connector's loads: its own buffers, reused once settled
            items = [(h, 0, dst[i]) for i, h in enumerate(hashes)]
            ok = await client.get(addr, "bench", items, 60, zero_copy=True)
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


def _spread(xs: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(xs), 3),
        "best": round(max(xs), 3),
        "worst": round(min(xs), 3),
    }


def measure_point(
    args: argparse.Namespace, tls: str, addr: str, size: int, batch: int, batches: list[int]
) -> dict[str, Any]:
    """One block size and batch: ``--rounds`` interleaved rounds of the references and
    ours; prints its line and returns its figures."""
    reps = max(2, min(16, (512 << 20) // (size * batch)))
    streams = not args.no_stream and size == 2 << 20 and batch == max(batches)
    perf: list[float] = []
    gets: list[float] = []
    puts: list[float] = []
    hot: list[float] = []
    cold: list[float] = []
    exact = True
    for _ in range(args.rounds):
        perf.append(ucx_perftest(size, tls, iters=max(50, (512 << 20) // size)))
        g, p, ok = asyncio.run(measure_ours(addr, size, batch, reps))
        gets.append(g)
        puts.append(p)
        exact = exact and ok
        if streams:
            hot.append(ucx_stream(size, tls, span=size))
            cold.append(ucx_stream(size, tls, span=STREAM_SPAN))
    pt: dict[str, Any] = {
        "block_bytes": size,
        "batch": batch,
        "get_gbps": round(statistics.median(gets), 3),
        "put_gbps": round(statistics.median(puts), 3),
        "ucx_perftest_gbps": round(statistics.median(perf), 3),
        "byte_exact": exact,
        "get_rounds": _spread(gets),
        "ucx_perftest_rounds": _spread(perf),
    }
    pt["get_ratio"] = round(pt["get_gbps"] / pt["ucx_perftest_gbps"], 3)
    pt["put_ratio"] = round(pt["put_gbps"] / pt["ucx_perftest_gbps"], 3)
    line = (
        f"{size >> 10:>6} KiB x{batch:<3} get {pt['get_gbps']:6.2f} GB/s"
        f" (best {max(gets):.2f}, worst {min(gets):.2f})"
        f"  put {pt['put_gbps']:6.2f} GB/s"
        f"  ucx_perftest {pt['ucx_perftest_gbps']:6.2f} GB/s"
        f" (best {max(perf):.2f}, worst {min(perf):.2f})"
        f"  get/perftest {pt['get_ratio']:.2f}"
    )
    if not exact:
        line += "  NOT BYTE-EXACT (a get missed or returned other bytes)"
    if streams:
        pt["stream_hot_gbps"] = round(statistics.median(hot), 3)
        pt["stream_cold_gbps"] = round(statistics.median(cold), 3)
        pt["get_ratio_cold_stream"] = round(pt["get_gbps"] / pt["stream_cold_gbps"], 3)
        line += (
            f"\n{'':>12} raw UCX stream, hot buffer {pt['stream_hot_gbps']:.2f}"
            f" GB/s (best {max(hot):.2f}), 512 MiB cycled {pt['stream_cold_gbps']:.2f} GB/s"
            f" (best {max(cold):.2f})  get/cold stream {pt['get_ratio_cold_stream']:.2f}"
        )
    print(line, flush=True)
    return pt


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--_stream":  # one end of ucx_stream()
        role, size, span, total, port = sys.argv[2:7]
        _stream_end(role, int(size), int(span), int(total), int(port))
        return
    from pegaflow.config import parse_size

    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per point")
    ap.add_argument("--transport", choices=sorted(TRANSPORTS), default="tcp")
    ap.add_argument("--pool", default="2GiB", help="node pool size")
    ap.add_argument("--sizes", default=",".join(f"{s >> 10}KiB" for s in SIZES), help="block sizes")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)), help="batch sizes")
    ap.add_argument("--no-stream", action="store_true", help="skip the raw UCX stream references")
    args = ap.parse_args()
    tls = TRANSPORTS[args.transport]
    os.environ["UCX_TLS"] = tls
    sizes = [parse_size(x) for x in args.sizes.split(",")]
    batches = [int(x) for x in args.batches.split(",")]

    from pegaflow.tools.devcluster import start_node

    points = []
    for size in sizes:
        for batch in batches:
            # a fresh node per point: blocks of earlier points would hold the pool's
            # slabs, and this size class would then evict its own blocks before the gets
            node = start_node(
                "bench-node",
                pool=args.pool,
                slab="64MiB",
                env={"UCX_TLS": tls},
                extra=["--node-http-port", "-1"],
            )
            try:
                points.append(measure_point(args, tls, node.ready["ucx"], size, batch, batches))
            finally:
                node.terminate()
    main_pt = next(
        (p for p in points if p["block_bytes"] == 2 << 20 and p["batch"] == 32), points[0]
    )
    print(
        json.dumps(
            {
                "transport": args.transport,
                "block_bytes": main_pt["block_bytes"],
                "batch": main_pt["batch"],
                "get_gbps": main_pt["get_gbps"],
                "put_gbps": main_pt["put_gbps"],
                "ucx_perftest_gbps": main_pt["ucx_perftest_gbps"],
                "get_ratio": main_pt["get_ratio"],
                "stream_hot_gbps": main_pt.get("stream_hot_gbps"),
                "stream_cold_gbps": main_pt.get("stream_cold_gbps"),
                "get_ratio_cold_stream": main_pt.get("get_ratio_cold_stream"),
                "rounds": args.rounds,
                "points": points,
            }
        )
    )


if __name__ == "__main__":
    main()
