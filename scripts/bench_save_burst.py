#!/usr/bin/env python3
"""A burst of small saves: how fast the connector's save thread drains a backlog.

While an engine decodes many requests, each step fills a block or two of some of them,
and each is one save job (a request's new blocks of one step).  On a busy host the save
thread falls behind, and a finished request's blocks stay allocated in vLLM until its
save is held by the node.  This bench starts a ``pegaflow-server``, a connector worker
(``WorkerSide``, the three keys: it finds the node and saves through its pool file) on
KV caches in host memory shaped like Llama-3.1-8B's (32 layers, 8 KV heads of 128, 16
tokens a block: 2 MiB a block; ``--layers`` fewer for smaller blocks), and times, round
after round with new blocks:

- ``burst``: ``--jobs`` save jobs of one block each, queued as ``--jobs`` steps back to
  back (as decoding requests fill them): ``held``, until the node holds every commit
  and no request is held (vLLM may reuse all the blocks); ``stored``, until the node
  published them all;
- ``one_job``: the same number of blocks as one job (one reservation, copy, commit).

The ceiling, in the same run: a memcpy of the same bytes out of the KV cache
(``memcpy_ms``).  ``*_ratio`` is the ceiling over our figure.  The last line printed
is one JSON object.

    .venv/bin/python scripts/bench_save_burst.py [--jobs 256] [--rounds 5] [--layers 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch
from pegaflow.client import SyncPegaClient
from pegaflow.connector.metadata import SaveJob, StepPlan
from pegaflow.connector.metrics import Counters
from pegaflow.connector.settings import ConnectorSettings
from pegaflow.connector.worker.side import WorkerSide

from pegaflow.config import ClientConfig
from pegaflow.tools.devcluster import start_server

NS = "bench-save-burst"
LAYERS, HEADS, HEAD_DIM, BLOCK_TOKENS = 32, 8, 128, 16


def drained(w: WorkerSide, t0: float, timeout: float = 120.0) -> tuple[float, float]:
    """Seconds from ``t0`` until no request is held (vLLM may reuse every block), then
    until no save is queued or unanswered (the node published them all)."""
    deadline = time.monotonic() + timeout
    held = 0.0
    while w.pending_saves() or w.books.pending_gathers:
        if not held and not w.books.pending_gathers:
            held = time.perf_counter() - t0
        if time.monotonic() > deadline:
            raise RuntimeError(f"saves did not drain: {w.pending_saves()} blocks pending")
        time.sleep(0.0002)
    stored = time.perf_counter() - t0
    return held or stored, stored


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=256, help="one-block save jobs a burst")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--layers", type=int, default=LAYERS, help="fewer: smaller blocks, the round trips show"
    )
    a = ap.parse_args()

    nb = 2 * a.jobs + 2
    caches = {
        f"model.layers.{i}.self_attn.attn": torch.randn(nb, 2, BLOCK_TOKENS, HEADS, HEAD_DIM).to(
            torch.bfloat16
        )
        for i in range(a.layers)
    }
    pool_bytes = max(1 << 30, 4 * a.jobs * (a.layers << 16) * (a.rounds + 1))
    server = start_server(extra=["--pool-size", str(pool_bytes)])
    coordinator = server.ready["coordinator"]
    settings = ConnectorSettings.load({"coordinators": coordinator}, env={})
    w = WorkerSide(
        settings,
        0,
        Counters(),
        lambda: SyncPegaClient(ClientConfig(coordinators=[coordinator])),
    )
    out: dict[str, Any] = {"jobs": a.jobs, "rounds": a.rounds, "layers": a.layers}
    try:
        w.register_kv_caches(caches, nb)
        assert w.finder.wait(30.0), "the worker did not find the node on this host"
        assert w.io is not None
        out["block_bytes"] = w.io.block_bytes
        ids = list(range(1, a.jobs + 1))
        burst, one, memcpy = [], [], []
        buf = torch.empty(a.jobs, w.io.block_bytes, dtype=torch.uint8)
        for r in range(a.rounds + 1):  # round 0 warms up (first mapping, first commits)
            hashes = [f"{r}-b-{i}".encode().ljust(32, b".") for i in ids]
            t0 = time.perf_counter()
            for i, h in zip(ids, hashes, strict=True):
                w.submit_saves(StepPlan(NS, saves=[SaveJob(f"r{r}-{i}", [i], [h])]))
            t_burst = drained(w, t0)
            hashes = [f"{r}-o-{i}".encode().ljust(32, b".") for i in ids]
            t0 = time.perf_counter()
            w.submit_saves(StepPlan(NS, saves=[SaveJob(f"o{r}", ids, hashes)]))
            t_one = drained(w, t0)
            t0 = time.perf_counter()
            w.io.gather(ids, buf)
            t_copy = time.perf_counter() - t0
            if r:
                burst.append(t_burst)
                one.append(t_one)
                memcpy.append(t_copy)
        totals = w.counters.totals()
    finally:
        w.shutdown()
        server.terminate()
    med = statistics.median
    out.update(
        burst_held_ms=round(med(x[0] for x in burst) * 1e3, 2),
        burst_stored_ms=round(med(x[1] for x in burst) * 1e3, 2),
        one_job_held_ms=round(med(x[0] for x in one) * 1e3, 2),
        one_job_stored_ms=round(med(x[1] for x in one) * 1e3, 2),
        memcpy_ms=round(med(memcpy) * 1e3, 2),
        burst_held_runs_ms=[round(x[0] * 1e3, 1) for x in burst],
        saved_blocks=int(totals.get("save_blocks", 0)),
        dropped_blocks=int(totals.get("save_dropped_blocks", 0)),
        cpu_count=os.cpu_count(),
    )
    out["burst_held_ratio"] = round(out["memcpy_ms"] / out["burst_held_ms"], 3)
    out["one_job_held_ratio"] = round(out["memcpy_ms"] / out["one_job_held_ms"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
