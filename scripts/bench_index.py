"""Benchmark of the index path: etcd ingest, mirror catch-up, coordinator lookups.

Starts its own etcd (temporary data dir) and a ``pegaflow-coordinator`` process, then:

1. ingests ``--blocks`` block entries through an :class:`EtcdPublisher` (batched,
   concurrent transactions under one lease) and reports blocks/s; the last 90% while
   a load generator asks for lookups of the first 10% at ``--ingest-load`` per second
   (their rate and latency: ``ingesting_*``);
2. waits until the coordinator's mirror (following the etcd watch) holds them all;
3. measures lookup latency of a 128-block prefix over the control protocol from one
   client, sequentially (p50/p99);
4. measures lookups/s with ``--procs`` load-generator processes, each keeping
   ``--inflight`` lookups outstanding on one connection, and the coordinator's CPU;
5. measures lookup latency again while the load generator keeps a moderate load of
   ``--latency-load`` lookups/s on the coordinator (p50/p99);
6. times a second coordinator's cold start on the filled etcd (process start to every
   block indexed: ``cold_start_s``), asking it for lookups and its status while it
   loads (it serves what it has read, its status says ``loading`` and how far);
7. optionally (``--tls``) starts a second coordinator on the same index serving TLS
   (``[security] tls_cert``, a throw-away CA made by ``openssl``) and measures the
   sequential lookup latency of both coordinators in alternating rounds, through the
   library's :class:`RpcClient` and its :class:`BlockingRpcClient` (the connector's
   ``lookup_here``): p50/p99 each, and TLS's as a ratio to plain.

The load generator is as cheap per request as Python gets, so that on a small machine
the coordinator, not its clients, is what is measured: one blocking socket per
process, requests packed once (only the request id is patched in), replies cut out of
the stream by their length prefix without decoding.  Every reply is still checked: the
first answer to each distinct request is decoded and validated (every block of the
prefix found), and every later answer to it must equal that one byte for byte (after
the request id).  ``--client rpc`` uses the library's :class:`RpcClient` instead.

Memory: ``coordinator_bytes_per_block`` is the coordinator's RSS growth over the ingest
divided by the blocks; ``coordinator_huge_pages`` is its status's ``huge_pages``
(``[coordinator] huge_pages``: ``PEGAFLOW_COORDINATOR_HUGE_PAGES=false`` in the bench's
environment turns it off) and ``coordinator_anon_huge_mib`` how much of its memory was
on huge pages.  etcd runs with ``--quota-backend-bytes`` sized from ``--blocks``
(``--quota-bytes`` to set it); its size after the ingest (``dbSize``, ``dbSizeInUse`` of
its status endpoint) is reported beside it.

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
import select
import shutil
import socket
import ssl
import statistics
import struct
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import uvloop

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


from pegaflow.storage_node.publisher import EtcdPublisher  # noqa: E402

from pegaflow.config import EtcdConfig, SecurityConfig  # noqa: E402
from pegaflow.keys import BlockLocation, NodeRecord  # noqa: E402
from pegaflow.protocol.codec import PROTOCOL_VERSION, unpack  # noqa: E402
from pegaflow.protocol.framing import encode_frame, parse_address  # noqa: E402
from pegaflow.tls import client_context  # noqa: E402
from pegaflow.transport.rpc_blocking import BlockingRpcClient  # noqa: E402
from pegaflow.transport.rpc_client import RpcClient  # noqa: E402
from scripts._common import proc_cpu_seconds, proc_rss_bytes  # noqa: E402
from tests.support.etcd_fixture import (  # noqa: E402
    EtcdServer,
    make_test_certs,
    start_coordinator_async,
)

NS = "bench:llama-8b:bf16:bs16:tp1"
PREFIX = 128


def block_hash(i: int) -> bytes:
    """Block ``i``'s 32-byte hash: uniform like vLLM's sha256 block hashes."""
    return hashlib.sha256(i.to_bytes(8, "big")).digest()


def say(msg: str) -> None:
    print(msg, flush=True)


async def ingest(pub: EtcdPublisher, first: int, n: int) -> float:
    """Publish blocks ``first`` to ``n`` through ``pub``; returns the seconds it took."""
    hashes = [block_hash(i) for i in range(first, n)]  # vLLM computes them, not the node
    t0 = time.perf_counter()
    chunk = 50_000
    for start in range(first, n, chunk):
        pub.publish_many(
            (NS, hashes[i - first], 0, BlockLocation("bench-node", i, 1, 1 << 20, i))
            for i in range(start, min(n, start + chunk))
        )
        await asyncio.sleep(0)  # let the writers start on the first chunk
    if not await pub.flush(timeout=3600):
        raise RuntimeError(f"ingest did not finish: {pub.stats()}")
    return time.perf_counter() - t0


def anon_huge_mib(pid: int) -> float:
    """MiB of a process's memory on transparent huge pages (-1: unreadable)."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return -1.0
    for line in text.splitlines():
        if line.startswith("AnonHugePages:"):
            return round(int(line.split()[1]) / 1024, 1)
    return -1.0


async def wait_indexed(
    address: str, n: int, timeout: float, tls: ssl.SSLContext | None = None
) -> tuple[float, dict[str, Any]]:
    client = RpcClient([address], timeout=5, tls=tls)
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


def etcd_db_size(endpoint: str) -> dict[str, int]:
    """etcd's ``dbSize`` and ``dbSizeInUse`` (bytes), from its status endpoint."""
    req = urllib.request.Request(f"http://{endpoint}/v3/maintenance/status", data=b"{}")
    with urllib.request.urlopen(req, timeout=10) as r:
        st = json.loads(r.read())
    return {"db_size": int(st["dbSize"]), "db_size_in_use": int(st.get("dbSizeInUse", 0))}


def quota_bytes(blocks: int) -> int:
    """A ``--quota-backend-bytes`` for ``blocks`` keys: twice the ~230 bytes a key took
    in etcd 3.4 here (1M keys, see docs/benchmarks.md), at least 2 GiB."""
    return max(2 << 30, blocks * 500)


async def cold_start(cfg: EtcdConfig, n: int, coords: list[Any]) -> dict[str, Any]:
    """Start another coordinator on the filled etcd; time until it holds all ``n``
    blocks, asking it for a lookup and its status as it loads."""
    t0 = time.perf_counter()
    coord = await start_coordinator_async(cfg, timeout=600)
    coords.append(coord)
    ready = time.perf_counter() - t0
    client = RpcClient([coord.address], timeout=30)
    argsets = _argsets(n, 256)
    served = hits = loading_seen = 0
    progress = ""
    try:
        while True:
            st = await client.call("status", {})
            etcd = st["coordinator"]["etcd"]
            if st["blocks"] >= n and etcd["state"] != "loading":
                break
            if time.perf_counter() - t0 > 1800:
                raise RuntimeError(f"cold start: holds {st['blocks']} of {n} blocks")
            if etcd["state"] == "loading":
                loading_seen += 1
                progress = f"{etcd['load_keys_read']} of {etcd['load_keys_total']} keys read"
            r = await client.call("lookup", argsets[served % len(argsets)])
            served += 1
            hits += r["hits"]
            await asyncio.sleep(0.1)
        dt = time.perf_counter() - t0
    finally:
        await client.close()
    rss = proc_rss_bytes(coord.pid, unreadable=0.0)
    say(
        f"cold start: a new coordinator served lookups {ready:.2f} s after its start and "
        f"held all {n} blocks after {dt:.2f} s (process start included); while loading it "
        f"answered {served} lookups ({hits} blocks hit), its status said 'loading' "
        f"{loading_seen} times (last: {progress or '-'}); RSS {rss / 2**20:.0f} MiB"
    )
    return {
        "cold_start_s": round(dt, 3),
        "cold_start_serving_after_s": round(ready, 3),
        "cold_start_lookups_while_loading": served,
        "cold_start_hit_blocks_while_loading": hits,
        "cold_start_loading_status_seen": loading_seen,
        "cold_start_last_progress": progress,
        "cold_start_rss_mib": round(rss / 2**20),
    }


def lookup_args(i: int) -> dict[str, Any]:
    return {"ns": NS, "hashes": [block_hash(i + j) for j in range(PREFIX)], "shards": [0]}


def _argsets(n: int, count: int) -> list[dict[str, Any]]:
    starts = [(i * 7919 * PREFIX) % max(PREFIX, n - PREFIX) for i in range(count)]
    return [lookup_args(s) for s in starts[:256]]


async def latency(
    address: str, n: int, count: int, tls: ssl.SSLContext | None = None
) -> list[float]:
    client = RpcClient([address], timeout=5, tls=tls)
    argsets = _argsets(n, count)
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


def blocking_latency(
    address: str, n: int, count: int, tls: ssl.SSLContext | None = None
) -> list[float]:
    """:func:`latency` through a :class:`BlockingRpcClient` (no event loop)."""
    client = BlockingRpcClient(address, timeout=5, tls=tls)
    argsets = _argsets(n, count)
    out: list[float] = []
    try:
        for k in range(count + 200):
            t0 = time.perf_counter()
            r = client.call("lookup", argsets[k % len(argsets)])
            dt = time.perf_counter() - t0
            if r["hits"] != PREFIX:
                raise RuntimeError(f"lookup hit {r['hits']} of {PREFIX}")
            if k >= 200:
                out.append(dt)
    finally:
        client.close()
    return out


def _pcts(lat: list[float]) -> tuple[float, float]:
    """p50 and p99 in ms."""
    lat = sorted(lat)
    return statistics.median(lat) * 1000, lat[int(len(lat) * 0.99) - 1] * 1000


async def tls_latency(
    cfg: EtcdConfig, base: Path, plain: str, n: int, count: int, coords: list[Any]
) -> dict[str, Any]:
    """Lookup latency of a TLS coordinator beside the plain one at ``plain``, in
    alternating rounds (so that both see the same machine), and TLS's ratio to plain."""
    certs = make_test_certs(base / "certs")
    coord = await start_coordinator_async(cfg, extra_args=[
        "--security-tls-cert", str(certs / "server.crt"),
        "--security-tls-key", str(certs / "server.key"),
    ])  # fmt: skip
    coords.append(coord)
    tls = client_context(SecurityConfig(tls_ca=str(certs / "ca.crt")))
    await wait_indexed(coord.address, n, timeout=600, tls=tls)
    lat: dict[str, list[float]] = {}
    rounds = 4
    for _ in range(rounds):
        for name, addr, ctx in (("plain", plain, None), ("tls", coord.address, tls)):
            lat.setdefault(name, []).extend(await latency(addr, n, count // rounds, ctx))
            lat.setdefault(f"blocking_{name}", []).extend(
                await asyncio.to_thread(blocking_latency, addr, n, count // rounds, ctx)
            )
    out: dict[str, Any] = {}
    for client in ("", "blocking_"):
        p50, p99 = _pcts(lat[client + "plain"])
        t50, t99 = _pcts(lat[client + "tls"])
        out.update({
            f"{client}plain_lookup_p50_ms": round(p50, 4),
            f"{client}plain_lookup_p99_ms": round(p99, 4),
            f"{client}tls_lookup_p50_ms": round(t50, 4),
            f"{client}tls_lookup_p99_ms": round(t99, 4),
            f"{client}tls_p50_ratio": round(t50 / p50, 3),
            f"{client}tls_p99_ratio": round(t99 / p99, 3),
        })  # fmt: skip
        say(
            f"lookup latency, {'BlockingRpcClient' if client else 'RpcClient'}, TLS against "
            f"plain ({len(lat[client + 'tls'])} calls each, alternating rounds): p50 "
            f"{t50:.3f} / {p50:.3f} ms = {t50 / p50:.2f}x, p99 {t99:.3f} / {p99:.3f} ms = "
            f"{t99 / p99:.2f}x"
        )
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


_RID_BASE = 1 << 24  # ids in [2**24, 2**32): msgpack encodes them as 0xce + 4 bytes
_RID_SPAN = (1 << 32) - _RID_BASE
_N_ARGSETS = 64


class LeanLookups:
    """A lookup load generator on one blocking socket (see the module docstring).

    Request frames are packed once per distinct request with a 4-byte id field that is
    patched per call; a reply is ``{"id": <0xce + 4 bytes>, "ok": true, "result": ..}``
    with the result always the same for the same request, so after the first one
    (decoded and validated) every reply is checked by comparing bytes.
    """

    def __init__(self, address: str, n: int, seed: int = 0) -> None:
        host, port = parse_address(address)
        self.sock = socket.create_connection((host, port), timeout=10)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(encode_frame({"op": "hello", "version": PROTOCOL_VERSION}))
        self.buf = bytearray()
        self._views: list[memoryview] = []
        self._consumed = 0
        while not (frames := self._frames(block=True)):
            pass
        hello = unpack(frames[0], 1 << 20)
        self._release()
        if not hello.get("ok"):
            raise RuntimeError(f"handshake refused: {hello}")
        starts = [
            ((i + seed * _N_ARGSETS) * 104729 * PREFIX) % max(PREFIX, n - PREFIX)
            for i in range(_N_ARGSETS)
        ]
        self.templates: list[bytes] = []
        self.id_at = 0
        for st in starts:
            frame = encode_frame(
                {"id": _RID_BASE, "op": "lookup", "args": lookup_args(st), "deadline_ms": 10_000}
            )
            self.id_at = frame.index(b"\xce" + _RID_BASE.to_bytes(4, "big")) + 1
            self.templates.append(frame)
        self.expect: list[bytes | None] = [None] * _N_ARGSETS
        self.next_rid = 0
        self.errors = 0
        self.sent_at: dict[int, float] = {}

    def requests(self, count: int, stamp: bool = False) -> bytes:
        """``count`` request frames in one buffer (ids patched in)."""
        out = []
        rid = self.next_rid
        now = time.perf_counter() if stamp else 0.0
        for _ in range(count):
            frame = bytearray(self.templates[rid % _N_ARGSETS])
            frame[self.id_at : self.id_at + 4] = (_RID_BASE + rid % _RID_SPAN).to_bytes(4, "big")
            out.append(frame)
            if stamp:
                self.sent_at[rid % _RID_SPAN] = now
            rid += 1
        self.next_rid = rid
        return b"".join(out)

    def _frames(self, block: bool) -> list[memoryview]:
        """Reply frames received so far, reading the socket once (blocking if
        ``block``); views into the buffer, valid until :meth:`_release`."""
        buf = self.buf
        if block or select.select([self.sock], [], [], 0)[0]:
            data = self.sock.recv(1 << 20)
            if not data:
                raise RuntimeError("the coordinator closed the connection")
            buf += data
        spans = []
        pos = 0
        while len(buf) - pos >= 4:
            (size,) = struct.unpack_from("!I", buf, pos)
            if len(buf) - pos - 4 < size:
                break
            spans.append((pos + 4, pos + 4 + size))
            pos += 4 + size
        self._consumed = pos
        if not spans:
            self._views = []
            return []
        mv = memoryview(buf)
        self._views = [mv, *(mv[a:b] for a, b in spans)]
        return self._views[1:]

    def _release(self) -> None:
        for v in reversed(self._views):
            v.release()
        self._views = []
        del self.buf[: self._consumed]

    def check(self, body: memoryview) -> int:
        """The request id of a reply, after checking the reply (errors are counted)."""
        if body[:5] != b"\x83\xa2id\xce":
            self.errors += 1
            return -1
        rid = int.from_bytes(body[5:9], "big") - _RID_BASE
        k = rid % _N_ARGSETS
        tail = body[9:]
        want = self.expect[k]
        if want is not None and tail == want:
            return rid
        msg = unpack(body, 16 << 20)  # first answer to this request, or a different one
        r = msg.get("result") if msg.get("ok") else None
        good = (
            isinstance(r, dict)
            and r.get("hits") == PREFIX
            and len(r.get("blocks", ())) == PREFIX
            and all(b and b[0] in r.get("nodes", {}) for b in r["blocks"])
        )
        if not good:
            self.errors += 1
        elif want is None:
            self.expect[k] = bytes(tail)
        return rid

    def run(
        self, inflight: int, seconds: float, rate: float = 0.0, start_at: float = 0.0
    ) -> tuple[int, list[float]]:
        """Keep ``inflight`` lookups outstanding (at most ``rate`` per second when
        given) for ``seconds``; returns (replies in that window, latencies in s when
        paced)."""
        paced = rate > 0
        self.sock.sendall(self.requests(1))  # a first answer to check, before the clock
        while not (frames := self._frames(block=True)):
            pass
        for f in frames:
            self.check(f)
        self._release()
        time.sleep(max(0.0, start_at - time.time()))
        t0 = time.perf_counter()
        t_end = t0 + seconds
        outstanding = done = sent = 0
        lat: list[float] = []
        while True:
            now = time.perf_counter()
            if now >= t_end:
                break
            room = inflight - outstanding
            if paced:
                room = min(room, int(rate * (now - t0)) + 1 - sent)
            if room > 0:
                self.sock.sendall(self.requests(room, stamp=paced))
                outstanding += room
                sent += room
            if paced:
                # wait for a reply, or for the next request's time
                wait = max(0.0, min((sent - rate * (now - t0)) / rate, t_end - now))
                if not select.select([self.sock], [], [], wait)[0]:
                    continue
            frames = self._frames(block=True)
            t_rx = time.perf_counter()
            for f in frames:
                rid = self.check(f)
                if paced and rid >= 0:
                    lat.append(t_rx - self.sent_at.pop(rid % _RID_SPAN, t_rx))
            self._release()
            outstanding -= len(frames)
            done += len(frames)
        return done, lat

    def close(self) -> None:
        self.sock.close()


def _lean_proc(
    address: str,
    n: int,
    seed: int,
    inflight: int,
    start_at: float,
    seconds: float,
    rate: float,
    q: Any,
) -> None:
    gc.freeze()
    gc.set_threshold(20_000)
    gen = LeanLookups(address, n, seed)
    cpu0 = time.process_time()
    done, lat = gen.run(inflight, seconds, rate, start_at)
    cpu = time.process_time() - cpu0
    gen.close()
    q.put((done, gen.errors, cpu, lat))


def throughput(
    address: str,
    n: int,
    procs: int,
    inflight: int,
    seconds: float,
    *,
    lean: bool = True,
    rate: float = 0.0,
) -> tuple[float, float, list[float]]:
    """Lookups/s of ``procs`` load-generator processes running over the same window,
    the CPU seconds they used and (when paced at ``rate`` lookups/s in all) the latency
    of every paced lookup."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    start_at = time.time() + 5.0  # time enough to spawn and connect
    if lean:
        ps = [
            ctx.Process(
                target=_lean_proc,
                args=(address, n, i, inflight, start_at, seconds, rate / procs, q),
            )
            for i in range(procs)
        ]
    else:
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
        raise RuntimeError(f"lookups that missed or were wrong: {sum(r[1] for r in results)}")
    lat = [x for r in results for x in (r[3] if len(r) > 3 else ())]
    return sum(r[0] for r in results) / seconds, sum(r[2] for r in results), lat


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="pegaflow-bench-", dir=args.tmp or None))
    quota = args.quota_bytes or quota_bytes(args.blocks)
    etcd = EtcdServer(base / "etcd", max_txn_ops=max(128, args.batch), quota_bytes=quota)
    etcd.start()
    say(f"etcd {etcd.endpoint} data {etcd.data_dir} quota {quota / 2**30:.1f} GiB")
    cfg = EtcdConfig(
        endpoints=[etcd.endpoint],
        prefix="/pegaflow/bench",
        batch_size=args.batch,
        timeout_s=30.0,
        lease_ttl_s=3600,  # the entries outlive their publisher (closed, not revoked)
        flush_interval_ms=0,
    )
    coords = []
    try:
        coord = await start_coordinator_async(cfg)
        coords.append(coord)
        say(f"coordinator {coord.address} (pid {coord.pid})")
        rss0 = proc_rss_bytes(coord.pid, unreadable=0.0)

        ingesting: dict[str, Any] = {}
        n0 = max(2 * PREFIX, args.blocks // 10) if args.ingest_load > 0 else 0
        pub = EtcdPublisher(
            cfg, lambda: [], concurrency=args.concurrency, max_pending=args.blocks + 1
        )
        await pub.start(NodeRecord("bench-node", "127.0.0.1", 9000, capacity_bytes=1 << 40))
        dt = await ingest(pub, 0, n0)
        if n0:  # the rest is ingested while lookups of the first part go on
            await wait_indexed(coord.address, n0, timeout=600)
            bg = asyncio.create_task(asyncio.to_thread(
                throughput, coord.address, n0, 1, 8,
                max(2.0, 0.8 * (args.blocks - n0) / 40_000), rate=args.ingest_load,
            ))  # fmt: skip
            await asyncio.sleep(5.5)  # the generator spawns, connects and starts
        dt2 = await ingest(pub, n0, args.blocks)
        dt += dt2
        stats = pub.stats()
        await pub.close(revoke=False)  # the entries stay for the rest of the benchmark
        ingest_rate = args.blocks / dt
        say(
            f"ingest: {args.blocks} blocks in {dt:.2f} s = {ingest_rate:,.0f} blocks/s "
            f"({stats['batches']} txns of <= {args.batch}, "
            f"{args.concurrency} in flight)"
        )
        if n0:
            bg_rate, _, bg_lat = await bg
            p50_i, p99_i = _pcts(bg_lat)
            ingesting = {
                "ingesting_lookups_per_s": round(bg_rate),
                "ingesting_lookup_p50_ms": round(p50_i, 4),
                "ingesting_lookup_p99_ms": round(p99_i, 4),
                "ingesting_blocks_per_s": round((args.blocks - n0) / dt2),
            }
            say(
                f"while blocks {n0} to {args.blocks} were ingested "
                f"({ingesting['ingesting_blocks_per_s']:,} blocks/s), lookups paced at "
                f"{args.ingest_load:,.0f}/s got {bg_rate:,.0f}/s, p50 {p50_i:.3f} ms, "
                f"p99 {p99_i:.3f} ms"
            )
        lag, st = await wait_indexed(coord.address, args.blocks, timeout=600)
        rss_b = proc_rss_bytes(coord.pid, unreadable=0.0)
        rss = rss_b / 2**20
        per_block = (rss_b - rss0) / max(1, st["blocks"])
        db = etcd_db_size(etcd.endpoint)
        etcd_rss = proc_rss_bytes(etcd.pid or 0, unreadable=0.0)
        say(
            f"mirror: holds {st['blocks']} blocks {lag:.2f} s after the ingest finished; "
            f"coordinator RSS {rss:.0f} MiB ({rss0 / 2**20:.0f} MiB before the ingest: "
            f"{per_block:.0f} bytes per block); etcd db {db['db_size'] / 2**20:.0f} MiB "
            f"({db['db_size_in_use'] / 2**20:.0f} MiB in use) of a {quota / 2**30:.1f} GiB quota, "
            f"etcd RSS {etcd_rss / 2**20:.0f} MiB"
        )

        await asyncio.sleep(args.settle)  # etcd snapshots/compacts after a big ingest
        lat = await latency(coord.address, args.blocks, args.lookups)
        p50, p99 = _pcts(lat)
        say(
            f"lookup latency ({PREFIX}-block prefix, 1 client, sequential, {len(lat)} calls): "
            f"p50 {p50:.3f} ms, p99 {p99:.3f} ms, max {max(lat) * 1000:.3f} ms"
        )
        lean = args.client == "lean"
        runs = []
        for _ in range(args.runs):
            cpu0 = proc_cpu_seconds(coord.pid, unreadable=0.0)
            rate, client_cpu, _ = await asyncio.to_thread(
                throughput,
                coord.address,
                args.blocks,
                args.procs,
                args.inflight,
                args.seconds,
                lean=lean,
            )
            server_cpu = proc_cpu_seconds(coord.pid, unreadable=0.0) - cpu0
            per_cpu = rate * args.seconds / server_cpu if server_cpu else 0.0
            runs.append((rate, server_cpu, client_cpu, per_cpu))
            say(
                f"throughput: {rate:,.0f} lookups/s ({args.procs} {args.client} load "
                f"generator(s) x {args.inflight} in flight, {args.seconds:.0f} s); coordinator "
                f"used {server_cpu / args.seconds:.0%} of a core = {per_cpu:,.0f} lookups per "
                f"CPU-second, load generators {client_cpu / args.seconds:.0%}; load average "
                f"{os.getloadavg()[0]:.1f}"
            )
        rate, server_cpu, client_cpu, per_cpu = max(runs)  # the best run; the spread below
        rates = sorted(r[0] for r in runs)

        # latency under a moderate load: the library's client, one call at a time,
        # while the load generator keeps --latency-load lookups/s going
        loaded: dict[str, Any] = {}
        if args.latency_load > 0:
            bg = asyncio.create_task(
                asyncio.to_thread(
                    throughput,
                    coord.address,
                    args.blocks,
                    1,
                    8,  # a few in flight: no queue builds up at a moderate rate
                    args.seconds + 7.0,
                    rate=args.latency_load,
                )
            )
            await asyncio.sleep(5.5)  # the generator spawns, connects and starts
            cpu0 = proc_cpu_seconds(coord.pid, unreadable=0.0)
            t0 = time.perf_counter()
            lat_l = await latency(coord.address, args.blocks, args.lookups)
            dt = time.perf_counter() - t0
            share = (proc_cpu_seconds(coord.pid, unreadable=0.0) - cpu0) / dt
            bg_rate, _, bg_lat = await bg
            lat_l.sort()
            bg_lat.sort()
            loaded = {
                "loaded_background_lookups_per_s": round(bg_rate),
                "loaded_coordinator_core_share": round(share, 3),
                "loaded_lookup_p50_ms": round(statistics.median(lat_l) * 1000, 4),
                "loaded_lookup_p99_ms": round(lat_l[int(len(lat_l) * 0.99) - 1] * 1000, 4),
                "loaded_background_p50_ms": round(statistics.median(bg_lat) * 1000, 4),
                "loaded_background_p99_ms": round(bg_lat[int(len(bg_lat) * 0.99) - 1] * 1000, 4),
            }
            say(
                f"lookup latency under {bg_rate:,.0f} lookups/s of background load "
                f"(coordinator at {share:.0%} of a core): library client, sequential: p50 "
                f"{loaded['loaded_lookup_p50_ms']:.3f} ms, p99 "
                f"{loaded['loaded_lookup_p99_ms']:.3f} ms; the background lookups "
                f"themselves: p50 {loaded['loaded_background_p50_ms']:.3f} ms, p99 "
                f"{loaded['loaded_background_p99_ms']:.3f} ms"
            )
        result: dict[str, Any] = {
            "lookup_p50_ms": round(p50, 4),
            "lookup_p99_ms": round(p99, 4),
            **loaded,
            "lookups_per_s": round(rate),
            "lookups_per_s_runs": [round(r) for r in rates],
            "lookups_per_coordinator_cpu_s": round(per_cpu),
            "coordinator_core_share": round(server_cpu / args.seconds, 3),
            "load_generator_core_share": round(client_cpu / args.seconds, 3),
            "loadavg_1m": round(os.getloadavg()[0], 2),
            "ingest_blocks_per_s": round(ingest_rate),
            **ingesting,
            "indexed_blocks": st["blocks"],
            "mirror_catchup_s": round(lag, 3),
            "coordinator_rss_mib": round(rss),
            "coordinator_bytes_per_block": round(per_block, 1),
            "coordinator_huge_pages": st["coordinator"]["huge_pages"],
            "coordinator_anon_huge_mib": anon_huge_mib(coord.pid),
            "etcd_db_bytes": db["db_size"],
            "etcd_db_in_use_bytes": db["db_size_in_use"],
            "etcd_db_bytes_per_block": round(db["db_size"] / max(1, st["blocks"]), 1),
            "etcd_quota_backend_bytes": quota,
            "etcd_rss_bytes": round(etcd_rss),
            "blocks": args.blocks,
            "prefix_blocks": PREFIX,
            "txn_ops": args.batch,
            "txn_concurrency": args.concurrency,
            "client": args.client,
            "client_procs": args.procs,
            "client_inflight": args.inflight,
            "cpus": os.cpu_count(),
        }
        if args.tls:
            result.update(
                await tls_latency(cfg, base, coord.address, args.blocks, args.lookups, coords)
            )
        if not args.no_cold_start:
            for c in coords:  # their memory is the new one's
                c.terminate()
            coords.clear()
            result.update(await cold_start(cfg, args.blocks, coords))
            result["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
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
    p.add_argument("--procs", type=int, default=1, help="load-generator processes")
    p.add_argument("--inflight", type=int, default=64, help="lookups in flight per process")
    p.add_argument("--seconds", type=float, default=5.0, help="throughput run length")
    p.add_argument("--runs", type=int, default=3, help="throughput runs (best reported)")
    p.add_argument(
        "--client",
        choices=("lean", "rpc"),
        default="lean",
        help="load generator: raw socket, pre-packed requests (lean) or RpcClient (rpc)",
    )
    load_help = "lookups/s of background load while latency is measured again (0: skip)"
    p.add_argument("--latency-load", type=float, default=10_000, help=load_help)
    ingest_help = "lookups/s paced during the last 90%% of the ingest (0: none)"
    p.add_argument("--ingest-load", type=float, default=10_000, help=ingest_help)
    p.add_argument("--settle", type=float, default=2.0, help="pause after the ingest, s")
    p.add_argument("--no-cold-start", action="store_true", help="skip the cold start")
    p.add_argument("--quota-bytes", type=int, default=0, help="etcd quota (0: from --blocks)")
    tls_help = "also measure lookup latency with TLS, against plain, in the same run"
    p.add_argument("--tls", action="store_true", help=tls_help)
    p.add_argument("--tmp", default="", help="directory for etcd's data (default: system tmp)")
    args = p.parse_args()
    result = uvloop.run(main_async(args))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
