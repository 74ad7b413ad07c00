#!/usr/bin/env python3
"""Control ops under bulk data: what a lookup or a locate costs while the same
``pegaflow-server`` streams large gets and takes large puts.

Starts a ``pegaflow-server``, stores ``--blocks`` blocks of ``--block-bytes``, then times
``--calls`` control ops of each kind in two phases, idle and under load (``--streams``
clients getting the whole set over and over, one client putting fresh blocks, each in a
process of its own, as engines are): the
coordinator's ``lookup`` of the set, a ``locate`` (and its unpin) over the node's Unix
control socket, and one over UCX.  Reported per op and phase: p50, p99 and max in ms,
and the ratio of the loaded p99 to the idle p99 (1.0: bulk data costs the control plane
nothing).  Ceiling for the bulk traffic in the same run: a memcpy of one block in this
process (GB/s); the gets' and puts' rate is given against it.

The last line printed is one JSON object.

    .venv/bin/python scripts/bench_control_under_load.py [--calls 200] [--streams 2]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pegaflow.client import PegaClient

from pegaflow.config import ClientConfig
from pegaflow.tools.devcluster import start_server

NS = "bench-control-load"


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs), q)) if xs else float("nan")


def memcpy_gbps(nbytes: int) -> float:
    """This process's memcpy rate for one block (best of 5)."""
    src = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def _bulk(coord: str, node: str, kind: str, args: dict[str, int], stop: Any, moved: Any) -> None:
    """A bulk client in a process of its own (its loop must not be the one timed)."""

    async def go() -> None:
        c = PegaClient(ClientConfig(coordinators=[coord], local_node=node, rpc_timeout_s=30))
        blocks, size = args["blocks"], args["block_bytes"]
        data = np.random.default_rng(7).integers(0, 255, size=(blocks, size), dtype=np.uint8)
        hashes = [i.to_bytes(4, "big") * 8 for i in range(blocks)]
        fresh = itertools.count((1 << 20) + 1000 * args["seed"])
        out = np.zeros_like(data)
        items = [(node, h, 0, out[i]) for i, h in enumerate(hashes)]
        try:
            while not stop.is_set():
                if kind == "get":
                    n = sum(await c.get_blocks(NS, items, timeout=30))
                else:
                    part = [(i.to_bytes(8, "big") * 4, 0, data[i % blocks])
                            for i in itertools.islice(fresh, 4)]  # fmt: skip
                    n = (await c.put_blocks(NS, part, node_id=node, timeout=30)).stored
                with moved.get_lock():
                    moved.value += n * size
        finally:
            await c.close()

    asyncio.run(go())


async def run(args: argparse.Namespace) -> dict[str, Any]:
    srv = start_server(extra=["--node-pool-bytes", args.pool, "--node-slab-bytes", "32MiB"])
    coord, node = srv.ready["coordinator"], srv.ready["node"]
    writer = PegaClient(ClientConfig(coordinators=[coord], local_node=node, rpc_timeout_s=30))
    control = PegaClient(ClientConfig(coordinators=[coord], lookup_timeout_s=5))
    remote = PegaClient(ClientConfig(coordinators=[coord], local_control=False))
    data = np.random.default_rng(7).integers(
        0, 255, size=(args.blocks, args.block_bytes), dtype=np.uint8
    )
    hashes = [i.to_bytes(4, "big") * 8 for i in range(args.blocks)]
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    got, put = ctx.Value("q", 0), ctx.Value("q", 0)

    async def lookup() -> None:
        assert (await control.lookup(NS, hashes)).hits == len(hashes)

    async def locate_socket() -> None:
        pin, _ = await control.locate(NS, node, hashes, 0, 5.0, 5.0)
        await control.unpin(node, pin, 5.0)

    async def locate_ucx() -> None:
        pin, _ = await remote.locate(NS, node, hashes, 0, 5.0, 5.0)
        await remote.unpin(node, pin, 5.0)

    ops = {"lookup": lookup, "locate_socket": locate_socket, "locate_ucx": locate_ucx}

    async def phase() -> dict[str, list[float]]:
        times: dict[str, list[float]] = {k: [] for k in ops}
        for _ in range(args.calls):
            for name, op in ops.items():
                t0 = time.perf_counter()
                await op()
                times[name].append((time.perf_counter() - t0) * 1e3)
            await asyncio.sleep(0.002)
        return times

    shape = {"blocks": args.blocks, "block_bytes": args.block_bytes}
    procs = [
        ctx.Process(target=_bulk, args=(coord, node, kind, {**shape, "seed": i}, stop, moved))
        for i, (kind, moved) in enumerate([("get", got)] * args.streams + [("put", put)])
    ]
    try:
        for i in range(0, args.blocks, 8):
            part = [(h, 0, data[i + j]) for j, h in enumerate(hashes[i : i + 8])]
            assert (await writer.put_blocks(NS, part, node_id=node)).stored == len(part)
        for op in ops.values():  # connections made before timing
            await op()
        idle = await phase()
        for p in procs:
            p.start()
        for _ in range(600):  # until every bulk client moves
            if got.value and put.value:
                break
            await asyncio.sleep(0.1)
        got.value = put.value = 0
        t0 = time.perf_counter()
        loaded = await phase()
        seconds = time.perf_counter() - t0
        moved_get, moved_put = got.value, put.value
    finally:
        stop.set()
        for p in procs:
            p.join(60)
        for c in (writer, control, remote):
            await c.close()
        srv.terminate()
    ceiling = memcpy_gbps(args.block_bytes)
    out: dict[str, Any] = {
        "blocks": args.blocks,
        "block_bytes": args.block_bytes,
        "streams": args.streams,
        "calls": args.calls,
        "bulk_get_gbps": round(moved_get / seconds / 1e9, 2),
        "bulk_put_gbps": round(moved_put / seconds / 1e9, 2),
        "memcpy_gbps": round(ceiling, 2),
    }
    out["bulk_x_memcpy"] = round((out["bulk_get_gbps"] + out["bulk_put_gbps"]) / ceiling, 3)
    for name in ops:
        for label, xs in (("idle", idle[name]), ("loaded", loaded[name])):
            out[f"{name}_{label}_p50_ms"] = round(_pct(xs, 50), 3)
            out[f"{name}_{label}_p99_ms"] = round(_pct(xs, 99), 3)
            out[f"{name}_{label}_max_ms"] = round(max(xs), 3)
        out[f"{name}_loaded_over_idle_p99"] = round(
            out[f"{name}_loaded_p99_ms"] / out[f"{name}_idle_p99_ms"], 2
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=24)
    ap.add_argument("--block-bytes", type=int, default=8 << 20)
    ap.add_argument("--pool", default="1GiB")
    ap.add_argument("--streams", type=int, default=2)
    ap.add_argument("--calls", type=int, default=200)
    out = asyncio.run(run(ap.parse_args()))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
