"""Benchmark of the index path: etcd ingest, mirror catch-up, coordinator lookups.

Starts its own etcd (temporary data dir) and a ``pegaflow-coordinator`` process, then:

1. ingests ``--blocks`` block entries through an :class:`EtcdPublisher` (batched,
   concurrent transactions under one lease) and reports blocks/s;
2. waits until the coordinator's mirror (following the etcd watch) holds them all;
3. measures lookup latency of a 128-block prefix over the control protocol from one
   client, sequentially (p50/p99);
4. measures lookups/s with ``--procs`` client processes, each keeping ``--inflight``
   lookups outstanding on one connection;
5. optionally (``--reload``) times a second coordinator loading the whole index.

Prints human-readable lines, then one JSON object as the last line.

    python scripts/bench_index.py --blocks 1000000
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import uvloop

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


from pegaflow.storage_node.publisher import EtcdPublisher  # noqa: E402

from pegaflow.config import EtcdConfig  # noqa: E402
from pegaflow.keys import BlockLocation, NodeRecord  # noqa: E402
from pegaflow.rpc import RpcClient  # noqa: E402
from tests.etcd_fixture import EtcdServer, start_coordinator_async  # noqa: E402

NS = "bench:llama-8b:bf16:bs16:tp1"
PREFIX = 128


def block_hash(i: int) -> bytes:
    """Block ``i``'s 32-byte hash: uniform like vLLM's sha256 block hashes."""
    return hashlib.sha256(i.to_bytes(8, "big")).digest()


def rss_mb(pid: int) -> float:
    """Resident memory of a process, MiB (0 where /proc is missing)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (0 where /proc is missing)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def say(msg: str) -> None:
    print(msg, flush=True)


async def ingest(cfg: EtcdConfig, n: int, concurrency: int) -> tuple[float, dict[str, Any]]:
    """Publish ``n`` blocks from one node; returns (seconds, publisher stats)."""
    pub = EtcdPublisher(cfg, lambda: [], concurrency=concurrency, max_pending=n + 1)
    await pub.start(NodeRecord("bench-node", "127.0.0.1", 9000, capacity_bytes=1 << 40))
    hashes = [block_hash(i) for i in range(n)]  # what vLLM computes, not the publisher
    t0 = time.perf_counter()
    chunk = 50_000
    for start in range(0, n, chunk):
        pub.publish_many(
            (NS, hashes[i], 0, BlockLocation("bench-node", i, 1, 1 << 20, i))
            for i in range(start, min(n, start + chunk))
        )
        await asyncio.sleep(0)  # let the writers start on the first chunk
    ok = await pub.flush(timeout=3600)
    dt = time.perf_counter() - t0
    stats = pub.stats()
    await pub.close(revoke=False)  # the entries stay for the rest of the benchmark
    if not ok:
        raise RuntimeError(f"ingest did not finish: {stats}")
    return dt, stats


async def wait_indexed(address: str, n: int, timeout: float) -> tuple[float, dict[str, Any]]:
    client = RpcClient([address], timeout=5)
    t0 = time.perf_counter()
    try:
        while True:
            st = await client.call("status", {})
            if st["blocks"] >= n:
                return time.perf_counter() - t0, st
            if time.perf_counter() - t0 > timeout:
                raise RuntimeError(f"coordinator holds {st['blocks']} of {n} blocks")
            await asyncio.sleep(0.2)
    finally:
        await client.close()


def lookup_args(i: int) -> dict[str, Any]:
    return {"ns": NS, "hashes": [block_hash(i + j) for j in range(PREFIX)], "shards": [0]}


async def latency(address: str, n: int, count: int) -> list[float]:
    client = RpcClient([address], timeout=5)
    starts = [(i * 7919 * PREFIX) % max(PREFIX, n - PREFIX) for i in range(count)]
    argsets = [lookup_args(s) for s in starts[:256]]
    out: list[float] = []
    try:
        for k in range(count + 200):
            args = argsets[k % len(argsets)]
            t0 = time.perf_counter()
            r = await client.call("lookup", args)
            dt = time.perf_counter() - t0
            if r["hits"] != PREFIX:
                raise RuntimeError(f"lookup hit {r['hits']} of {PREFIX}")
            if k >= 200:  # warm-up
                out.append(dt)
    finally:
        await client.close()
    return out


def _throughput_proc(
    address: str, n: int, inflight: int, start_at: float, seconds: float, q: Any
) -> None:
    # A load generator: keep the collector's full passes (over everything imported) out
    # of the measurement.
    gc.freeze()
    gc.set_threshold(20_000)

    async def run() -> tuple[int, int, float]:
        client = RpcClient([address], timeout=10)
        starts = [(i * 104729 * PREFIX) % max(PREFIX, n - PREFIX) for i in range(64)]
        argsets = [lookup_args(s) for s in starts]
        done = errors = 0
        await client.call("lookup", argsets[0])
        await asyncio.sleep(max(0.0, start_at - time.time()))  # all clients start together
        t_end = time.perf_counter() + seconds

        async def worker(w: int) -> None:
            nonlocal done, errors
            k = w
            while time.perf_counter() < t_end:
                r = await client.call("lookup", argsets[k % len(argsets)])
                k += 1
                if r["hits"] == PREFIX:
                    done += 1
                else:
                    errors += 1

        cpu0 = time.process_time()
        await asyncio.gather(*(worker(w) for w in range(inflight)))
        cpu = time.process_time() - cpu0
        await client.close()
        return done, errors, cpu

    q.put(uvloop.run(run()))


def throughput(
    address: str, n: int, procs: int, inflight: int, seconds: float
) -> tuple[float, float]:
    """Lookups/s of ``procs`` client processes running over the same window, and the
    CPU seconds the clients used."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    start_at = time.time() + 5.0  # time enough to spawn and connect
    ps = [
        ctx.Process(target=_throughput_proc, args=(address, n, inflight, start_at, seconds, q))
        for _ in range(procs)
    ]
    for p in ps:
        p.start()
    results = [q.get(timeout=seconds + 120) for _ in ps]
    for p in ps:
        p.join(30)
    if any(r[1] for r in results):
        raise RuntimeError(f"lookups that missed: {sum(r[1] for r in results)}")
    return sum(r[0] for r in results) / seconds, sum(r[2] for r in results)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="pegaflow-bench-", dir=args.tmp or None))
    etcd = EtcdServer(base / "etcd", max_txn_ops=max(128, args.batch))
    etcd.start()
    say(f"etcd {etcd.endpoint} data {etcd.data_dir}")
    cfg = EtcdConfig(
        endpoints=[etcd.endpoint],
        prefix="/pegaflow/bench",
        batch_size=args.batch,
        timeout_s=30.0,
        lease_ttl_s=600,
        flush_interval_ms=0,
    )
    coords = []
    try:
        coord = await start_coordinator_async(cfg)
        coords.append(coord)
        say(f"coordinator {coord.address} (pid {coord.pid})")

        dt, stats = await ingest(cfg, args.blocks, args.concurrency)
        ingest_rate = args.blocks / dt
        say(
            f"ingest: {args.blocks} blocks in {dt:.2f} s = {ingest_rate:,.0f} blocks/s "
            f"({stats['batches']} txns of <= {args.batch}, {args.concurrency} in flight)"
        )
        lag, st = await wait_indexed(coord.address, args.blocks, timeout=600)
        rss = rss_mb(coord.pid)
        say(
            f"mirror: holds {st['blocks']} blocks {lag:.2f} s after the ingest finished; "
            f"coordinator RSS {rss:.0f} MiB"
        )

        await asyncio.sleep(args.settle)  # etcd snapshots/compacts after a big ingest
        lat = await latency(coord.address, args.blocks, args.lookups)
        lat.sort()
        p50 = statistics.median(lat) * 1000
        p99 = lat[int(len(lat) * 0.99) - 1] * 1000
        say(
            f"lookup latency ({PREFIX}-block prefix, 1 client, sequential, {len(lat)} calls): "
            f"p50 {p50:.3f} ms, p99 {p99:.3f} ms, max {lat[-1] * 1000:.3f} ms"
        )
        cpu0 = cpu_seconds(coord.pid)
        rate, client_cpu = await asyncio.to_thread(
            throughput, coord.address, args.blocks, args.procs, args.inflight, args.seconds
        )
        server_cpu = cpu_seconds(coord.pid) - cpu0
        per_cpu = rate * args.seconds / server_cpu if server_cpu else 0.0
        say(
            f"throughput: {rate:,.0f} lookups/s ({args.procs} client processes x "
            f"{args.inflight} in flight, {args.seconds:.0f} s); coordinator used "
            f"{server_cpu / args.seconds:.0%} of a core = {per_cpu:,.0f} lookups per CPU-second, "
            f"clients {client_cpu / args.seconds:.0%}; load average {os.getloadavg()[0]:.1f}"
        )
        result: dict[str, Any] = {
            "lookup_p50_ms": round(p50, 4),
            "lookup_p99_ms": round(p99, 4),
            "lookups_per_s": round(rate),
            "lookups_per_coordinator_cpu_s": round(per_cpu),
            "coordinator_core_share": round(server_cpu / args.seconds, 3),
            "loadavg_1m": round(os.getloadavg()[0], 2),
            "ingest_blocks_per_s": round(ingest_rate),
            "indexed_blocks": st["blocks"],
            "mirror_catchup_s": round(lag, 3),
            "coordinator_rss_mib": round(rss),
            "blocks": args.blocks,
            "prefix_blocks": PREFIX,
            "txn_ops": args.batch,
            "txn_concurrency": args.concurrency,
            "client_procs": args.procs,
            "client_inflight": args.inflight,
            "cpus": os.cpu_count(),
        }
        if args.reload:
            t0 = time.perf_counter()
            c2 = await start_coordinator_async(cfg, timeout=600)
            coords.append(c2)
            load, _ = await wait_indexed(c2.address, args.blocks, timeout=600)
            result["reload_s"] = round(time.perf_counter() - t0, 3)
            say(f"reload: a new coordinator served all {args.blocks} blocks after "
                f"{result['reload_s']:.2f} s (process start included)")  # fmt: skip
            del load
        return result
    finally:
        for c in coords:
            c.terminate()
        etcd.kill()
        shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--blocks", type=int, default=1_000_000, help="block entries to ingest")
    p.add_argument("--batch", type=int, default=512, help="ops per etcd transaction")
    p.add_argument("--concurrency", type=int, default=4, help="transactions in flight")
    p.add_argument("--lookups", type=int, default=5000, help="sequential lookups timed")
    p.add_argument("--procs", type=int, default=2, help="client processes for throughput")
    p.add_argument("--inflight", type=int, default=32, help="lookups in flight per process")
    p.add_argument("--seconds", type=float, default=5.0, help="throughput run length")
    p.add_argument("--settle", type=float, default=2.0, help="pause after the ingest, s")
    p.add_argument("--reload", action="store_true", help="also time a fresh coordinator load")
    p.add_argument("--tmp", default="", help="directory for etcd's data (default: system tmp)")
    args = p.parse_args()
    result = uvloop.run(main_async(args))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
