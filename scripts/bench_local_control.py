#!/usr/bin/env python3
"""Same-host control round trips: what a layer-wise load's ``locate`` costs.

A connector whose node shares its host asks the node where a prefix's blocks lie in the
pool file (and pins them) while vLLM schedules the request, so this round trip is on the
path of the first token.  This bench starts a ``pegaflow-server`` (coordinator + node),
stores ``--blocks`` blocks, and times ``locate`` of 1 and of ``--blocks`` blocks the way
the connector's scheduler makes it: from another thread through a
:class:`~pegaflow.client.SyncPegaClient`.  Two clients take turns, round by round: one
asks over the node's Unix control socket (the default), one over UCX active messages
(``[client] local_control = false``).  Each locate is followed by its unpin (not timed).
The coordinator's ``lookup`` of the same blocks is timed too, for scale, and so is the
scheduler's whole answer to vLLM for a request whose blocks all lie on the local node
(``get_num_new_matched_tokens``: the locate, the coordinator lookup it sends alongside,
and the bookkeeping), over either transport.

Ceiling, in the same run: a bare Unix-socket round trip between this process and a
child process (blocking sockets, no framing, messages of a locate's request and reply
sizes): what any control call on this machine costs at the least.  ``*_ratio`` is that
ceiling over our figure.  The node's own time per locate comes from its
``pegaflow_node_request_seconds`` metric.

``here`` is the locate (and ``lookup_here`` the coordinator lookup) the connector's
scheduler makes now: from the calling thread over
a blocking socket of its own that keeps the GIL through the round trip
(``SyncPegaClient.locate_here``), where ``socket`` hops to the client's loop thread and
back.  With ``--busy-thread`` a thread of this process hashes all the while, as vLLM's
input thread does the blocks of new requests (sha256 of pickled 16-token blocks): each
time a call releases the GIL it then waits for it, up to the switch interval.

The save side too: the ``reserve`` of a same-host save's slots (over either transport,
like the locate), and the commit of a same-host save (``--save-blocks`` new blocks of
``--save-bytes``, written through the pool file): the node hashes every slot (xxh3, on
``[node] hash_threads``) before it publishes.  Its ceiling is xxh3 of as many bytes on
as many threads in this process.

The last line printed is one JSON object.

    .venv/bin/python scripts/bench_local_control.py [--blocks 625] [--rounds 6] [--calls 100]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import socket
import statistics
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts.busy_thread import BusyThread  # noqa: E402

NS = "bench-local-control"
BLOCK_BYTES = 4096


def socket_ceiling(sizes: list[tuple[int, int]], calls: int) -> dict[int, float]:
    """p50 ms of a bare Unix-socket round trip per (request, reply) size, keyed by
    request size."""
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:  # the echo side: answer each request with a reply of the paired size
        parent.close()
        replies = dict(sizes)
        try:
            while True:
                head = child.recv(8, socket.MSG_WAITALL)
                if len(head) < 8:
                    break
                n = int.from_bytes(head, "big")
                child.recv(n, socket.MSG_WAITALL)
                child.sendall(bytes(replies[n]))
        finally:
            os._exit(0)
    child.close()
    out: dict[int, float] = {}
    try:
        for req, rep in sizes:
            msg = req.to_bytes(8, "big") + bytes(req)
            times = []
            for _ in range(calls):
                t0 = time.perf_counter()
                parent.sendall(msg)
                parent.recv(rep, socket.MSG_WAITALL)
                times.append(time.perf_counter() - t0)
            out[req] = statistics.median(times) * 1e3
    finally:
        parent.close()
        os.waitpid(pid, 0)
    return out


def node_locate_seconds(http: str) -> tuple[float, float]:
    """(sum, count) of the node's ``locate`` request histogram."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=5).read().decode()
    got = dict.fromkeys(("sum", "count"), 0.0)
    for kind in got:
        m = re.search(rf'pegaflow_node_request_seconds_{kind}\{{op="locate"\}} (\S+)', text)
        if m:
            got[kind] = float(m.group(1))
    return got["sum"], got["count"]


class _Request:
    """What the connector's scheduler reads of a ``vllm.v1.request.Request``."""

    def __init__(self, request_id: str, hashes: list[bytes], block_size: int) -> None:
        self.request_id = request_id
        self.block_hashes = hashes
        self.num_tokens = len(hashes) * block_size


def wait_indexed(client: Any, hashes: list[bytes]) -> None:
    """Until the coordinator's index holds every block (published asynchronously)."""
    deadline = time.monotonic() + 30
    while client.lookup(NS, hashes, timeout=5.0).hits < len(hashes):
        if time.monotonic() > deadline:
            raise SystemExit("the coordinator never indexed the stored blocks")
        time.sleep(0.05)


def scheduler(coord: list[str], node: str, client: Any, block_size: int) -> Any:
    """The connector's scheduler side (layer-wise, same-host node) on ``client``."""
    from pegaflow.connector.metrics import Counters
    from pegaflow.connector.scheduler.side import SchedulerSide
    from pegaflow.connector.settings import ConnectorSettings

    settings = ConnectorSettings.load({"coordinators": ",".join(coord), "local_node": node}, {})
    return SchedulerSide(settings, block_size, 1, lambda: NS, Counters(), client=client)


def reserve(client: Any, node: str, n: int, size: int, calls: int) -> list[float]:
    """ms of a same-host save's ``reserve`` of ``n`` new blocks (aborted, not timed)."""
    out = []
    pool_id = client.local_pool(node).file_id
    for _ in range(calls):
        blocks = [(os.urandom(16), 0, size) for _ in range(n)]
        t0 = time.perf_counter()
        seq, _ = client.reserve_local(NS, node, blocks, pool_id, 30.0)
        out.append((time.perf_counter() - t0) * 1e3)
        client.abort_local(node, seq, 30.0)
    return out


def commits(client: Any, node: str, n: int, size: int, rounds: int) -> list[float]:
    """ms of a same-host save's commit of ``n`` blocks of ``size`` bytes (the node hashes
    every slot, then publishes), new blocks each round."""
    out = []
    pool_id = client.local_pool(node).file_id
    for r in range(rounds + 1):  # the first round warms up
        hashes = [f"save-{r}-{i}".encode().ljust(16, b".") for i in range(n)]
        blocks = [(h, 0, size) for h in hashes]
        seq, offsets = client.reserve_local(NS, node, blocks, pool_id, 30.0)
        accepted = [o is not None for o in offsets]
        t0 = time.perf_counter()
        res = client.commit_local(node, seq, accepted, 30.0)
        if res.stored != n:
            raise SystemExit(f"the node stored {res.stored} of {n} blocks")
        if r:
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def hash_ceiling(n: int, size: int, threads: int) -> float:
    """ms to xxh3 ``n`` buffers of ``size`` bytes on ``threads`` threads in this process,
    each thread one contiguous share (the least the node's commit can take)."""
    from concurrent.futures import ThreadPoolExecutor

    from pegaflow.checksum import checksums

    bufs = [memoryview(bytearray(os.urandom(1024)) * (size // 1024)) for _ in range(n)]
    step = -(-n // threads)
    with ThreadPoolExecutor(threads) as ex:
        best = float("inf")
        for _ in range(4):
            t0 = time.perf_counter()
            list(ex.map(checksums, [bufs[i : i + step] for i in range(0, n, step)]))
            best = min(best, time.perf_counter() - t0)
    return best * 1e3


def timed(fn: Callable[[], Any], calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=625, help="a 10k-token prefix of 16-token blocks")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--calls", type=int, default=100, help="calls per size, transport and round")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per block (scheduler)")
    ap.add_argument(
        "--busy-thread",
        action="store_true",
        help="a thread of this process hashes all the while (vLLM's input thread's work)",
    )
    ap.add_argument("--save-blocks", type=int, default=625, help="blocks per timed commit")
    ap.add_argument(
        "--save-bytes", type=int, default=2 << 20, help="block size of the commits (Llama-8B)"
    )
    args = ap.parse_args()

    import numpy as np
    from pegaflow.client import SyncPegaClient

    from pegaflow.config import ClientConfig
    from pegaflow.tools.devcluster import start_server

    n = args.blocks
    pool = 2 * args.save_blocks * args.save_bytes + (256 << 20)
    threads = min(8, os.cpu_count() or 1)  # the node's default [node] hash_threads
    server = start_server(
        extra=[
            "--node-pool-bytes",
            str(pool),
            "--node-slab-bytes",
            str(max(16 << 20, 8 * args.save_bytes)),
        ]
    )
    try:
        node, http = server.ready["node"], server.ready["http"]
        coord = [server.ready["coordinator"]]
        clients = {
            "socket": SyncPegaClient(ClientConfig(coordinators=coord, lookup_timeout_s=5)),
            "ucx": SyncPegaClient(
                ClientConfig(coordinators=coord, lookup_timeout_s=5, local_control=False)
            ),
        }
        hashes = [i.to_bytes(16, "big") for i in range(n)]
        buf = np.zeros(BLOCK_BYTES, np.uint8)
        for k in range(0, n, 128):
            clients["socket"].put_blocks(NS, [(h, 0, buf) for h in hashes[k : k + 128]], node)

        def locate(c: SyncPegaClient, m: int) -> None:
            pin, where = c.submit_locate(NS, node, hashes[:m], 0, 10.0, 5.0).result(5)
            if not where.found.all():
                raise SystemExit(f"locate found {int(where.found.sum())} of {m} blocks")
            c.submit_unpin(node, pin, 5.0)

        def locate_here(c: SyncPegaClient, m: int) -> None:
            pin, where = c.locate_here(NS, node, hashes[:m], 0, 10.0, 5.0)
            if not where.found.all():
                raise SystemExit(f"locate found {int(where.found.sum())} of {m} blocks")
            c.submit_unpin(node, pin, 5.0)

        def lookup_here(c: SyncPegaClient, m: int) -> None:
            if c.lookup_here(NS, hashes[:m], timeout=5.0).hits != m:
                raise SystemExit("lookup missed stored blocks")

        def lookup(c: SyncPegaClient, m: int) -> None:
            if c.lookup(NS, hashes[:m], timeout=5.0).hits != m:
                raise SystemExit("lookup missed stored blocks")

        wait_indexed(clients["ucx"], hashes)
        schedulers = {
            name: scheduler(coord, node, c, args.block_size) for name, c in clients.items()
        }
        ids = itertools.count()

        def schedule(name: str) -> None:
            req = _Request(f"r{next(ids)}", hashes, args.block_size)
            got = schedulers[name].get_num_new_matched_tokens(req, 0)
            if got != ((n - 1) * args.block_size, False):  # layer-wise, all but the last
                raise SystemExit(f"the scheduler answered {got} for {n} stored blocks")
            # the request ends (vLLM says so in a later step's output): its state goes
            schedulers[name].build_plan(SimpleNamespace(finished_req_ids={req.request_id}))

        times: dict[str, list[float]] = {}
        node_ms: dict[str, list[float]] = {}
        for c in clients.values():  # connect, warm up both paths
            for m in (1, n):
                timed(lambda c=c, m=m: locate(c, m), 20)
                timed(lambda c=c, m=m: locate_here(c, m), 20)
        busy = BusyThread(args.blocks) if args.busy_thread else None
        for _ in range(args.rounds):
            for m in (1, n):
                times.setdefault(f"here_{m}", []).extend(
                    timed(lambda m=m: locate_here(clients["socket"], m), args.calls)
                )
            for name, c in clients.items():
                for m in (1, n):
                    s0, k0 = node_locate_seconds(http)
                    times.setdefault(f"{name}_{m}", []).extend(
                        timed(lambda c=c, m=m: locate(c, m), args.calls)
                    )
                    s1, k1 = node_locate_seconds(http)
                    node_ms.setdefault(f"{name}_{m}", []).append((s1 - s0) / (k1 - k0) * 1e3)
            for m in (1, n):
                times.setdefault(f"lookup_{m}", []).extend(
                    timed(lambda m=m: lookup(clients["ucx"], m), args.calls)
                )
                times.setdefault(f"lookup_here_{m}", []).extend(
                    timed(lambda m=m: lookup_here(clients["ucx"], m), args.calls)
                )
            for name in clients:
                times.setdefault(f"scheduler_{name}", []).extend(
                    timed(lambda name=name: schedule(name), args.calls)
                )
            for name, c in clients.items():
                times.setdefault(f"reserve_{name}", []).extend(
                    reserve(c, node, n, args.save_bytes, args.calls // 4)
                )
        if busy is not None:
            busy.stop()
        saves = commits(clients["socket"], node, args.save_blocks, args.save_bytes, args.rounds)
        for sch in schedulers.values():  # their last same-host reports, then the clients
            sch.close()
        for c in clients.values():
            c.close()
    finally:
        server.terminate()

    save_ceiling = hash_ceiling(args.save_blocks, args.save_bytes, threads)
    # a locate's request: the hashes plus ~80 bytes; its reply: 41 bytes a block plus ~40
    ceiling = socket_ceiling([(16 + 80, 41 + 40), (16 * n + 80, 41 * n + 40)], 2000)

    def pct(xs: list[float], q: float) -> float:
        return round(sorted(xs)[min(len(xs) - 1, int(len(xs) * q))], 3)

    out: dict[str, Any] = {"blocks": n, "rounds": args.rounds, "calls": args.calls}
    out["busy_thread"] = args.busy_thread
    for key, xs in times.items():
        out[f"{key}_p50_ms"] = pct(xs, 0.5)
        out[f"{key}_p90_ms"] = pct(xs, 0.9)
    for key, xs in node_ms.items():
        out[f"{key}_node_ms"] = round(statistics.median(xs), 3)
    gb = args.save_blocks * args.save_bytes / 1e9
    out["commit_ms"] = round(statistics.median(saves), 2)
    out["commit_gbps"] = round(gb / out["commit_ms"] * 1e3, 2)
    out["commit_hash_ceiling_ms"] = round(save_ceiling, 2)
    out["commit_ratio"] = round(save_ceiling / out["commit_ms"], 3)
    out["ceiling_1_ms"] = round(ceiling[16 + 80], 3)
    out[f"ceiling_{n}_ms"] = round(ceiling[16 * n + 80], 3)
    for m in (1, n):
        out[f"socket_{m}_ratio"] = round(out[f"ceiling_{m}_ms"] / out[f"socket_{m}_p50_ms"], 3)
        out[f"ucx_{m}_ratio"] = round(out[f"ceiling_{m}_ms"] / out[f"ucx_{m}_p50_ms"], 3)
        out[f"here_{m}_ratio"] = round(out[f"ceiling_{m}_ms"] / out[f"here_{m}_p50_ms"], 3)
    print(
        f"the scheduler's whole lookup of a {n}-block local hit (get_num_new_matched_tokens): "
        f"p50 {out['scheduler_socket_p50_ms']:.3f} ms over the socket, "
        f"{out['scheduler_ucx_p50_ms']:.3f} ms over UCX"
    )
    for m in (1, n):
        print(
            f"locate of {m:4d} blocks: socket p50 {out[f'socket_{m}_p50_ms']:.3f} ms "
            f"(node {out[f'socket_{m}_node_ms']:.3f}), from the calling thread p50 "
            f"{out[f'here_{m}_p50_ms']:.3f} ms, UCX p50 {out[f'ucx_{m}_p50_ms']:.3f} ms "
            f"(node {out[f'ucx_{m}_node_ms']:.3f}); coordinator lookup "
            f"{out[f'lookup_{m}_p50_ms']:.3f} ms (from the calling thread "
            f"{out[f'lookup_here_{m}_p50_ms']:.3f}); bare socket round trip "
            f"{out[f'ceiling_{m}_ms']:.3f} ms"
        )
    print(
        f"reserve of {n} blocks for a same-host save: p50 {out['reserve_socket_p50_ms']:.3f} ms"
        f" over the socket, {out['reserve_ucx_p50_ms']:.3f} ms over UCX"
    )
    print(
        f"commit of a same-host save, {args.save_blocks} x {args.save_bytes} bytes: "
        f"{out['commit_ms']:.1f} ms ({out['commit_gbps']:.1f} GB/s); xxh3 of the same bytes "
        f"on {threads} threads here: {out['commit_hash_ceiling_ms']:.1f} ms"
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
