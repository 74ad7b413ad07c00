#!/usr/bin/env python3
"""What the node's Prometheus metrics cost on the data path: batched get/put throughput
against a node with its metrics on and an identical node with every metric replaced by a
no-op, measured with ``scripts/bench_datapath.py``'s own client loop.

Three figures per block size (batch of 32):

* **throughput**: median GB/s over interleaved rounds (on, off, off, on, ...), both
  nodes running the whole time, so drift and noise hit both alike; the overhead is
  ``1 - on/off``.  On a shared 2-core machine wall-clock throughput swings by tens of
  percent between runs: this figure cannot resolve a few percent there.
* **node CPU**: the node process's CPU time (all threads, from /proc) per batch,
  on vs off, medians over the same rounds: what the metrics cost the node, much less
  sensitive to other load on the machine than throughput.
* **CPU share**: the exact metric updates one batched get (put) makes on the node,
  timed in a tight loop, divided by the measured time of one batch.  The metrics'
  share of a batch, free of transfer noise.

The last line printed is one JSON object (``points``, and ``max_overhead_pct`` /
``max_cpu_share_pct`` over all points).

    .venv/bin/python scripts/bench_metrics_overhead.py [--rounds 7] [--transport tcp]
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import importlib.util
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

SIZES = [64 << 10, 256 << 10, 2 << 20]
BATCH = 32


def _bench_datapath() -> Any:
    """scripts/bench_datapath.py as a module (its ``measure_ours`` and ``TRANSPORTS``)."""
    spec = importlib.util.spec_from_file_location(
        "bench_datapath", REPO / "scripts" / "bench_datapath.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Noop:
    """Stands in for every metric object: accepts every update, records nothing."""

    value = 0.0  # an unlabelled counter's value, as the node reads it for its record

    def labels(self, *args: Any, **kw: Any) -> _Noop:
        return self

    def inc(self, amount: float = 1) -> None:
        pass

    def dec(self, amount: float = 1) -> None:
        pass

    def set(self, value: float) -> None:
        pass

    def observe(self, value: float) -> None:
        pass


def serve_node_without_metrics(argv: list[str]) -> None:
    """Run ``pegaflow-node`` with every NodeMetrics field a no-op (the "off" node)."""
    import pegaflow.storage_node.node as node_mod
    from pegaflow.storage_node.metrics import NodeMetrics

    class NoMetrics(NodeMetrics):
        def __init__(self, registry: Any) -> None:
            super().__init__(registry)
            for name, value in list(vars(self).items()):
                if name != "registry" and (hasattr(value, "inc") or hasattr(value, "observe")):
                    setattr(self, name, _Noop())

    node_mod.NodeMetrics = NoMetrics  # type: ignore[misc]
    from pegaflow.storage_node import main as node_main

    node_main.main(argv)


def cpu_seconds(pid: int) -> float:
    """CPU seconds process ``pid`` has run so far, all threads: nanosecond run times from
    /proc/<pid>/task/*/schedstat (utime/stime in /proc/<pid>/stat tick at only 100 Hz)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that just ended
    return total / 1e9


def metric_cost_per_batch(batch: int, size: int, iters: int = 2000) -> dict[str, float]:
    """Seconds the node spends in metric updates for one batched get and one put of
    ``batch`` blocks (the same calls as storage_node/reads.py and puts.py make)."""
    from pegaflow.storage_node.metrics import NodeMetrics
    from prometheus_client import CollectorRegistry

    m = NodeMetrics(CollectorRegistry())

    def one_get() -> None:
        for _ in range(batch):
            m.get_blocks.labels(result="hit").inc()
        m.get_bytes.inc(batch * size)
        m.request_seconds.labels(op="get").observe(0.001)

    def one_put() -> None:
        m.request_seconds.labels(op="reserve").observe(0.001)
        m.put_bytes.inc(batch * size)
        m.put_blocks.inc(batch)
        m.request_seconds.labels(op="commit").observe(0.001)

    out = {}
    for name, fn in (("get", one_get), ("put", one_put)):
        runs = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(iters):
                fn()
            runs.append((time.perf_counter() - t) / iters)
        out[name] = min(runs)
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-node-without-metrics":
        serve_node_without_metrics(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds per point")
    ap.add_argument("--transport", choices=["tcp", "shm"], default="tcp")
    args = ap.parse_args()
    bd = _bench_datapath()
    tls = bd.TRANSPORTS[args.transport]
    os.environ["UCX_TLS"] = tls

    from pegaflow.tools.devcluster import start, start_node

    shm_dir = tempfile.mkdtemp(prefix="pegaflow-bench-", dir="/dev/shm")
    atexit.register(shutil.rmtree, shm_dir, True)
    common = ["--node-ucx-port", "0", "--node-http-port", "-1", "--node-pool-bytes", "1GiB",
              "--node-slab-bytes", "64MiB", "--node-keep-pool", "false",
              "--node-shm-dir", shm_dir]  # fmt: skip
    on = start_node("bench-on", pool="1GiB", slab="64MiB", env={"UCX_TLS": tls},
                    extra=["--node-http-port", "-1"])  # fmt: skip
    off = start(
        "node bench-off",
        ["scripts.bench_metrics_overhead", "--serve-node-without-metrics",
         "--node-id", "bench-off", *common],
        env={"UCX_TLS": tls},
    )  # fmt: skip
    points = []
    try:
        for size in SIZES:
            reps = max(2, min(16, (64 << 20) // (size * BATCH)))
            res: dict[str, dict[str, list[float]]] = {
                k: {"get": [], "put": [], "cpu": []} for k in ("on", "off")
            }
            for r in range(args.rounds):
                order = [("on", on), ("off", off)] if r % 2 == 0 else [("off", off), ("on", on)]
                for key, proc in order:
                    cpu0 = cpu_seconds(proc.pid)
                    g, p, exact = asyncio.run(bd.measure_ours(proc.ready["ucx"], size, BATCH, reps))
                    # one put and one get of each of the reps batches
                    res[key]["cpu"].append((cpu_seconds(proc.pid) - cpu0) / (2 * reps))
                    if not exact:
                        raise RuntimeError(f"{key}: bytes differ")
                    res[key]["get"].append(g)
                    res[key]["put"].append(p)
            med = {k: {op: statistics.median(v) for op, v in d.items()} for k, d in res.items()}
            cost = metric_cost_per_batch(BATCH, size)
            nbytes = size * BATCH
            pt: dict[str, Any] = {"block_bytes": size, "batch": BATCH}
            pt["node_cpu_us_per_batch_metrics_on"] = round(med["on"]["cpu"] * 1e6, 1)
            pt["node_cpu_us_per_batch_metrics_off"] = round(med["off"]["cpu"] * 1e6, 1)
            pt["node_cpu_overhead_pct"] = round(100 * (med["on"]["cpu"] / med["off"]["cpu"] - 1), 2)
            for op in ("get", "put"):
                pt[f"{op}_gbps_metrics_on"] = round(med["on"][op], 3)
                pt[f"{op}_gbps_metrics_off"] = round(med["off"][op], 3)
                pt[f"{op}_overhead_pct"] = round(100 * (1 - med["on"][op] / med["off"][op]), 2)
                batch_s = nbytes / (med["off"][op] * 1e9)
                pt[f"{op}_metrics_us_per_batch"] = round(cost[op] * 1e6, 2)
                pt[f"{op}_cpu_share_pct"] = round(100 * cost[op] / batch_s, 3)
            points.append(pt)
            print(
                f"{size >> 10:>5} KiB x{BATCH}: get on {pt['get_gbps_metrics_on']:.2f} / off "
                f"{pt['get_gbps_metrics_off']:.2f} GB/s ({pt['get_overhead_pct']:+.1f}%), "
                f"put on {pt['put_gbps_metrics_on']:.2f} / off {pt['put_gbps_metrics_off']:.2f}"
                f" GB/s ({pt['put_overhead_pct']:+.1f}%); metric updates "
                f"{pt['get_metrics_us_per_batch']:.1f} us/get = {pt['get_cpu_share_pct']:.2f}%"
                f" of a batch, {pt['put_metrics_us_per_batch']:.1f} us/put = "
                f"{pt['put_cpu_share_pct']:.2f}%; node CPU/batch on "
                f"{pt['node_cpu_us_per_batch_metrics_on']:.0f} / off "
                f"{pt['node_cpu_us_per_batch_metrics_off']:.0f} us "
                f"({pt['node_cpu_overhead_pct']:+.1f}%)",
                flush=True,
            )
    finally:
        on.terminate()
        off.terminate()
    print(
        json.dumps(
            {
                "transport": args.transport,
                "rounds": args.rounds,
                "max_overhead_pct": max(
                    max(p["get_overhead_pct"], p["put_overhead_pct"]) for p in points
                ),
                "max_node_cpu_overhead_pct": max(p["node_cpu_overhead_pct"] for p in points),
                "max_cpu_share_pct": max(
                    max(p["get_cpu_share_pct"], p["put_cpu_share_pct"]) for p in points
                ),
                "points": points,
            }
        )
    )


if __name__ == "__main__":
    main()
