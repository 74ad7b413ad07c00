#!/usr/bin/env python3
"""Soak: concurrent clients doing put / lookup / get for a set time against a small pool
under constant eviction, on a real cluster (etcd, a coordinator, two nodes).

Every block's bytes are derived from its hash, so every byte a get reports as fetched
is checked: a mismatch is a *corruption* (must be 0).  A miss (evicted, not yet
indexed) is not an error; an *error* is a call that raised.  Gets are fenced by the
generations the lookup returned (a block evicted and stored again since is a *stale*
miss).  The coordinator runs its index GC every ``--gc-interval`` seconds meanwhile.
The RSS of each service is sampled after warm-up and at the end (must stay flat).

    .venv/bin/python scripts/soak.py [--seconds 60] [--clients 4]

The last line printed is one JSON object with ``ops``, ``errors``, ``corruptions`` and
``rss_growth_pct`` (the largest growth of any service), plus details.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pegaflow.client import PegaClient  # noqa: E402

from pegaflow.config import ClientConfig  # noqa: E402
from pegaflow.errors import PegaError  # noqa: E402
from pegaflow.tools.devcluster import EtcdServer, start_coordinator, start_node  # noqa: E402
from pegaflow.transport.rpc_client import RpcClient  # noqa: E402

NS = "soak"
BLOCK = 64 << 10
BATCH = 16


def block_bytes(h: bytes) -> np.ndarray:
    """The content every block with hash ``h`` must have."""
    return np.frombuffer(h * (BLOCK // len(h)), dtype=np.uint8)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


async def client_loop(
    i: int, coordinator: str, until: float, stats: Counter[str], known: list[bytes]
) -> None:
    c = PegaClient(
        ClientConfig(
            coordinators=[coordinator],
            local_node=f"n{1 + i % 2}",
            lookup_timeout_s=1.0,
            transfer_timeout_s=5,
        )
    )
    rng = random.Random(i)
    try:
        while time.monotonic() < until:
            op = rng.random()
            try:
                if op < 0.4 or len(known) < BATCH:
                    hashes = [rng.randbytes(32) for _ in range(BATCH)]
                    res = await c.put_blocks(NS, [(h, 0, block_bytes(h)) for h in hashes])
                    stats["put_blocks"] += res.stored
                    known.extend(hashes)
                    del known[: max(0, len(known) - 20_000)]
                    stats["put"] += 1
                else:
                    start = rng.randrange(0, len(known) - BATCH + 1)
                    hashes = known[start : start + BATCH]
                    found = await c.lookup(NS, hashes, generations=True)
                    stats["lookup"] += 1
                    stats["lookup_hits"] += found.hits
                    if found.hits:
                        out = np.zeros((found.hits, BLOCK), dtype=np.uint8)
                        items = [
                            (found.blocks[j][0], h, 0, out[j])
                            for j, h in enumerate(hashes[: found.hits])
                        ]
                        stale = c.stale_misses
                        ok = await c.get_blocks(
                            NS, items, generations=[g[0] for g in found.generations]
                        )
                        stats["get"] += 1
                        stats["stale_misses"] += c.stale_misses - stale
                        for j, good in enumerate(ok):
                            if not good:
                                stats["get_misses"] += 1
                            elif not np.array_equal(out[j], block_bytes(hashes[j])):
                                stats["corruptions"] += 1
                            else:
                                stats["get_blocks"] += 1
            except PegaError as e:
                stats["errors"] += 1
                stats[f"error_{e.code}"] += 1
            stats["ops"] += 1
    finally:
        await c.close()


async def gc_status(coordinator: str) -> dict[str, Any]:
    """The coordinator's index GC counters (it is the only one: the leader)."""
    rpc = RpcClient([coordinator], timeout=5)
    try:
        st = (await rpc.call("status", {}))["coordinator"]
        return {"leader": st.get("leader"), **st.get("gc", {})}
    finally:
        await rpc.close()


async def soak(coordinator: str, seconds: float, clients: int, stats: Counter[str]) -> None:
    known: list[bytes] = []
    until = time.monotonic() + seconds
    await asyncio.gather(
        *(client_loop(i, coordinator, until, stats, known) for i in range(clients))
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument(
        "--warmup", type=float, default=5, help="seconds of load before the first RSS sample"
    )
    ap.add_argument("--gc-interval", type=float, default=5, help="seconds between index GC passes")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="pegaflow-soak-") as tmp:
        etcd = EtcdServer(Path(tmp) / "etcd")
        procs = []
        try:
            etcd.start()
            coord = start_coordinator(
                etcd=etcd.endpoint,
                prefix="/pegaflow/soak",
                extra=["--coordinator-gc-interval-s", str(args.gc_interval)],
            )
            procs.append(coord)
            for nid in ("n1", "n2"):  # 16 MiB pools: ~250 blocks each, constant eviction
                procs.append(
                    start_node(
                        nid, etcd=etcd.endpoint, prefix="/pegaflow/soak", pool="16MiB", slab="4MiB"
                    )
                )
            services = {"coordinator": coord.pid, "n1": procs[1].pid, "n2": procs[2].pid}
            stats: Counter[str] = Counter()
            asyncio.run(soak(coord.ready["address"], args.warmup, args.clients, stats))
            before = {name: rss_kib(pid) for name, pid in services.items()}
            t0 = time.monotonic()
            asyncio.run(soak(coord.ready["address"], args.seconds, args.clients, stats))
            elapsed = time.monotonic() - t0
            after = {name: rss_kib(pid) for name, pid in services.items()}
            dead = [p.name for p in procs if not p.alive()]
            gc = asyncio.run(gc_status(coord.ready["address"]))
        finally:
            for p in procs:
                p.terminate()
            etcd.stop()
    growth = {n: round(100 * (after[n] - before[n]) / max(1, before[n]), 2) for n in services}
    for n in services:
        mib = f"{before[n] / 1024:8.1f} MiB -> {after[n] / 1024:8.1f} MiB"
        print(f"{n:12s} RSS {mib} ({growth[n]:+.2f} %)")
    print(
        f"{stats['ops']} ops in {args.warmup + elapsed:.0f} s ({stats['put']} puts, "
        f"{stats['lookup']} lookups, {stats['get']} gets), {stats['errors']} errors, "
        f"{stats['corruptions']} corruptions, "
        f"{stats['get_misses']} misses (evicted after lookup; {stats['stale_misses']} of them "
        f"stale: stored again since), index GC: {gc.get('passes', 0)} passes, "
        f"{gc.get('checked', 0)} entries checked, {gc.get('deleted', 0)} deleted"
    )
    print(
        json.dumps(
            {
                "ops": stats["ops"],
                "errors": stats["errors"],
                "corruptions": stats["corruptions"],
                "rss_growth_pct": max(growth.values()),
                "seconds": round(args.warmup + elapsed, 1),
                "clients": args.clients,
                "services_died": dead,
                "gc": gc,
                "rss_kib_before": before,
                "rss_kib_after": after,
                "counts": dict(stats),
            }
        )
    )
    if dead or stats["corruptions"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
