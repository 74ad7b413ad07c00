#!/usr/bin/env python3
"""The disk tier alone: spill and batched-read throughput next to the raw direct-I/O
read bandwidth of the same file system, measured in the same run, and recover() time.

Steps, on one directory (``--dir``, default a fresh one under /var/tmp):

1. raw: a scratch file of the tier's size is written once; each round reads it back
   with ``O_DIRECT`` in ``--block-mib`` chunks on ``--read-threads`` threads (the
   tier's read parallelism), and once more with ``dd iflag=direct`` (one stream);
2. spill: the tier is filled with ``--gb`` GB of blocks (retrying a spill whenever the
   bounded queue is full: the figure is the disk's write rate through the tier);
3. read: every block is read back with ``read_into`` into its own buffer, ``--batch``
   reads in flight (as a batched get does), each verified against its xxh3;
4. mixed: the newer half is read again while new blocks are spilled into (and evict)
   the older half: the effect of spills on concurrent reads;
5. restart: the tier is closed and reopened; ``recover()`` (records only) and
   ``recover(verify=True)`` (every payload read and checked) are timed;
6. node (``--node-prefix-gb``, 0: skipped): a real ``pegaflow-node`` whose pool holds a
   bit more than one prefix of that size (1.31 GB: a 10k-token Llama-8B prefix) and a
   disk tier of four prefixes in the same directory, in five steps:

   ``node_saves_during_spills``: a prefix's blocks are put (saved) unpaced into the
   empty pool (no evictions), then, the pool filled, into the full pool (every put
   pushes a block out: into a slot the spill-ahead freed, ``[node]
   disk_spill_ahead_bytes``, or by an eviction whose block is copied to the spill
   queue, or dropped past it), ``--rounds`` times: ``save_gbps``,
   ``save_during_spills_gbps`` and their ratio ("saves are not slowed by spills"), and
   how the blocks left memory (``spill_ahead_during``, ``spill_copies_during``,
   ``spill_drops_during``);

   ``node_control_during_spills``: ``--locates`` one-block locates (through a client's
   node session: the control socket) of blocks in memory, alone, while a writer puts
   into a pool with room, and while it puts into a full pool (spilling): p50 / p99 ms;

   ``node_promote``: prefix A is put, then prefixes B and C (which evict
   all of A to disk), paced so that the spills keep up (a put waits until the
   evictions before it are written or dropped); one batched get of A through a real
   client is timed (``promote_s``: the disk reads, the commits into the pool and the
   sends, streamed).  Then a set of blocks in memory is read by back-to-back gets,
   alone and while a writer puts new blocks that evict (and spill) others:
   ``get_from_memory_gbps`` and ``get_from_memory_during_spills_gbps``
   (``node_spills_effect``);

   ``node_restart_get``: a probe block and a prefix are put and pushed out to disk, and
   more blocks until the tier is full; the node is stopped (SIGTERM) and started on an
   empty pool (a fresh pool file) and the same tier: ``ready_s`` (process start to its
   READY line), ``serving_s`` (to a first one-block get, from disk, answered), then one
   batched get of the prefix (held only on disk): ``get_gbps``, byte-exact, and
   ``get_to_raw_read`` (its ratio to step 1's raw read).

Every step has a deadline (``--step-timeout-s``) and prints its JSON line
(``{"step": ...}``) the moment it is done, so a run killed midway still shows the
steps before; a step that fails or runs out of time prints ``{"step": ..., "error":
...}`` and the run goes on with the next one (but ``node_spills_effect``, which reads
what ``node_promote`` promoted).

``O_DIRECT`` bypasses the page cache, so no cache dropping is needed (on a file system
without ``O_DIRECT``, e.g. some tmpfs, both sides are buffered and say so).  Every figure
is the best of ``--rounds`` rounds, the median is printed too.  The last line printed is
one JSON object of all the steps: ``spill_gbps``, ``read_gbps``, ``raw_read_gbps``, ``read_ratio``
(best read / best raw), ``read_ratio_paired_median`` (the median over rounds of each
round's read / raw: steadier on a shared disk), ``dd_read_gbps``, ``recover_s``,
``recover_verify_s``, ``read_during_spills_gbps``, ``spill_during_reads_gbps``, the
node figures (``node``: ``promote_s``, ``promote_gbps``, ``promoted_blocks`` and
``byte_exact_blocks`` of the prefix's ``blocks``, ``streamed_blocks`` (sent ahead of a
later disk read), ``spill_drops_before`` / ``spill_drops_during`` (evictions not kept on
disk, before the get and by the get's own promotions), ``get_from_memory_gbps``,
``get_from_memory_during_spills_gbps``, ``spilled_during``; the other node steps'
lines under their names) and the parameters.
``--gb 0`` skips steps 1 to 5.

    .venv/bin/python scripts/bench_disk_tier.py [--gb 2] [--block-mib 2] [--batch 32]
        [--read-threads 4] [--dir /path/on/the/disk] [--rounds 3] [--node-prefix-gb 1.31]
        [--locates 300] [--step-timeout-s 300]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import mmap
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pegaflow.storage_node.disk_tier import DiskTier  # noqa: E402
from pegaflow.storage_node.spill_ahead import reserve_bytes  # noqa: E402

from pegaflow.config import NodeConfig  # noqa: E402
from pegaflow.deadline import Deadline  # noqa: E402
from pegaflow.protocol import node as proto  # noqa: E402

GB = 1e9
NS = "bench-disk"
SCRATCH = "bench-disk-scratch"
SPILL_COUNTERS = ("spills", "spill_drops", "spill_copies", "spill_ahead_blocks")
"""the namespace of the saves and writers of the first node steps, dropped after each"""


class StepTimeout(Exception):
    """A step ran past its deadline."""


def check(deadline: Deadline, what: str) -> None:
    if deadline.expired:
        raise StepTimeout(f"{what}: past the step's deadline")


def emit(step: str, result: dict[str, Any]) -> None:
    """Print one step's JSON line now (a run killed later still shows it)."""
    print(json.dumps({"step": step, **result}), flush=True)


def blocks_for(gb: float, block: int) -> int:
    return max(1, int(gb * GB) // block)


def raw_read(
    path: Path, size: int, chunk: int, threads: int, deadline: Deadline
) -> tuple[float, bool]:
    """GB/s of reading ``path`` (``size`` bytes) in ``chunk`` pieces on ``threads``
    threads with O_DIRECT where allowed; and whether it was allowed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        direct = True
    except OSError:
        fd, direct = os.open(path, os.O_RDONLY), False
    offsets = list(range(0, size - chunk + 1, chunk))
    per = -(-len(offsets) // threads)

    def work(part: list[int]) -> int:
        buf = mmap.mmap(-1, chunk)
        n = 0
        for off in part:
            if deadline.expired:
                break
            n += os.preadv(fd, [buf], off)
        return n

    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as ex:
            total = sum(ex.map(work, [offsets[i : i + per] for i in range(0, len(offsets), per)]))
        check(deadline, "raw read")
        return total / (time.perf_counter() - t0) / GB, direct
    finally:
        os.close(fd)


def write_scratch(path: Path, size: int, chunk: int) -> None:
    buf = mmap.mmap(-1, chunk)
    buf.write(np.random.default_rng(0).integers(0, 256, chunk, dtype=np.uint8).tobytes())
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    except OSError:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for off in range(0, size, chunk):
            os.pwritev(fd, [buf], off)
        os.fsync(fd)
    finally:
        os.close(fd)


def dd_read(path: Path, chunk: int, deadline: Deadline) -> float | None:
    """GB/s that ``dd iflag=direct`` reports reading ``path`` (None without dd)."""
    if shutil.which("dd") is None:
        return None
    try:
        p = subprocess.run(
            ["dd", f"if={path}", "of=/dev/null", f"bs={chunk}", "iflag=direct"],
            capture_output=True,
            text=True,
            timeout=deadline.left(),
        )
    except subprocess.TimeoutExpired:
        raise StepTimeout("dd: past the step's deadline") from None
    m = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", p.stderr)
    if p.returncode != 0 or m is None:
        return None
    return int(m.group(1)) / float(m.group(2)) / GB


def make_blocks(n: int, block: int) -> list[np.ndarray]:
    """``n`` distinct blocks sharing a few random bases (cheap to make, distinct xxh3s)."""
    rng = np.random.default_rng(1)
    bases = [rng.integers(0, 256, block, dtype=np.uint8) for _ in range(4)]
    out = []
    for i in range(n):
        b = bases[i % 4].copy()
        b[:8] = np.frombuffer(i.to_bytes(8, "little"), dtype=np.uint8)
        out.append(b)
    return out


def key(i: int) -> tuple[str, bytes, int]:
    return ("bench", i.to_bytes(8, "little"), 0)


def spill_round(
    tier: DiskTier, blocks: list[np.ndarray], deadline: Deadline, first: int = 0
) -> float:
    """GB/s of spilling ``blocks`` (keys from ``first`` on) until all are on disk."""
    t0 = time.perf_counter()
    for i, b in enumerate(blocks, first):
        while not tier.spill(key(i), i, b):
            check(deadline, "spill")
            time.sleep(0.0005)  # queue full: the disk is the bottleneck
    if not tier.flush(deadline.left()):
        raise StepTimeout("spill: past the step's deadline")
    return sum(b.nbytes for b in blocks) / (time.perf_counter() - t0) / GB


def read_round(
    tier: DiskTier,
    ids: range,
    block: int,
    batch: int,
    bufs: list[np.ndarray],
    deadline: Deadline,
) -> float:
    """GB/s of reading ``ids`` in batches of ``batch`` reads in flight."""
    t0 = time.perf_counter()
    for start in range(ids.start, ids.stop, batch):
        futs = [
            tier.read_into(key(i), bufs[i - start])
            for i in range(start, min(ids.stop, start + batch))
        ]
        for f in futs:
            if f.result(deadline.left()) != block:
                raise SystemExit("a block failed to read back")
    return len(ids) * block / (time.perf_counter() - t0) / GB


def mixed_round(
    tier: DiskTier,
    blocks: list[np.ndarray],
    batch: int,
    bufs: list[np.ndarray],
    deadline: Deadline,
) -> tuple[float, float]:
    """Read the newer half of a full tier while new blocks are spilled into the older
    half (evicting it); GB/s of the reads and of the spills."""
    n, block = len(blocks), blocks[0].nbytes
    half = n // 2
    spill_gbps: list[float] = []

    def spiller() -> None:
        spill_gbps.append(spill_round(tier, blocks[:half], deadline, first=n))

    th = threading.Thread(target=spiller, daemon=True)
    th.start()
    read_gbps = read_round(tier, range(n - half, n), block, batch, bufs, deadline)
    th.join(deadline.left())
    if not spill_gbps:
        raise StepTimeout("mixed: the spills did not finish by the step's deadline")
    return read_gbps, spill_gbps[0]


def quantile_ms(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (seconds), in milliseconds."""
    ys = sorted(xs)
    return round(ys[min(len(ys) - 1, int(q * len(ys)))] * 1000, 3)


def summary(xs: list[float]) -> dict[str, float]:
    return {"best": round(max(xs), 3), "median": round(statistics.median(xs), 3)}


def tier_rounds(args: argparse.Namespace, root: Path, deadline: Deadline) -> dict[str, Any]:
    """Steps 1 to 4: raw reads, and the tier's spills, reads and mixed rounds."""
    block = int(args.block_mib * (1 << 20))
    n = blocks_for(args.gb, block)
    size = n * block
    scratch = root / "scratch"
    print(f"raw: writing a {size / GB:.2f} GB scratch file ...", file=sys.stderr)
    write_scratch(scratch, size, block)
    check(deadline, "writing the scratch file")
    raws: list[float] = []
    dds: list[float] = []
    blocks = make_blocks(n, block)
    tier_dir = root / "tier"
    bufs = [np.empty(block, dtype=np.uint8) for _ in range(args.batch)]
    spills: list[float] = []
    reads: list[float] = []
    mixed_reads: list[float] = []
    mixed_spills: list[float] = []
    direct = io_direct = False
    open_s = 0.0
    for r in range(args.rounds):  # raw and tier interleaved: both see the same disk state
        gbps, direct = raw_read(scratch, size, block, args.read_threads, deadline)
        raws.append(gbps)
        dd = dd_read(scratch, block, deadline)
        if dd is not None:
            dds.append(dd)
        shutil.rmtree(tier_dir, ignore_errors=True)
        t0 = time.perf_counter()
        tier = DiskTier(tier_dir, size, block, **tier_kw(args))
        open_s = time.perf_counter() - t0
        try:
            tier.recover()
            print(f"round {r}: spilling {n} blocks of {block >> 20} MiB ...", file=sys.stderr)
            spills.append(spill_round(tier, blocks, deadline))
            reads.append(read_round(tier, range(n), block, args.batch, bufs, deadline))
            if n >= 2:
                mr, ms = mixed_round(tier, blocks, args.batch, bufs, deadline)
                mixed_reads.append(mr)
                mixed_spills.append(ms)
            io_direct = tier.stats().direct_io
        finally:
            tier.close(timeout=max(1.0, deadline.remaining()))
        print(
            f"round {r}: spill {spills[-1]:.2f} GB/s, read {reads[-1]:.2f} GB/s, "
            f"raw {raws[r]:.2f} GB/s",
            file=sys.stderr,
        )
    scratch.unlink()
    raw_best = max(raws)
    return {
        "spill_gbps": summary(spills)["best"],
        "read_gbps": summary(reads)["best"],
        "raw_read_gbps": round(raw_best, 3),
        "read_ratio": round(max(reads) / raw_best, 3),
        "read_ratio_paired_median": round(
            statistics.median(t / r for t, r in zip(reads, raws, strict=True)), 3
        ),
        "dd_read_gbps": round(max(dds), 3) if dds else None,
        "read_during_spills_gbps": summary(mixed_reads)["best"] if mixed_reads else None,
        "spill_during_reads_gbps": summary(mixed_spills)["best"] if mixed_spills else None,
        "spill": summary(spills),
        "read": summary(reads),
        "raw_read": summary(raws),
        "create_s": round(open_s, 3),
        "direct_io": io_direct and direct,
        "tier_gb": round(size / GB, 3),
        "blocks": n,
        "block_bytes": block,
        "batch": args.batch,
        "read_threads": args.read_threads,
        "write_threads": args.write_threads,
        "rounds": args.rounds,
        "dir": str(root),
    }


def tier_kw(args: argparse.Namespace) -> dict[str, int]:
    return {
        "read_threads": args.read_threads,
        "write_threads": args.write_threads,
        "queue_depth": args.queue_depth,
    }


def restart(args: argparse.Namespace, root: Path, deadline: Deadline) -> dict[str, Any]:
    """Step 5: reopen the full tier the rounds left, records only, then verifying."""
    block = int(args.block_mib * (1 << 20))
    n = blocks_for(args.gb, block)
    tier_dir = root / "tier"
    t0 = time.perf_counter()
    tier = DiskTier(tier_dir, n * block, block, **tier_kw(args))
    kept = tier.recover()
    recover_s = time.perf_counter() - t0
    tier.close()
    check(deadline, "recover")
    t0 = time.perf_counter()
    tier = DiskTier(tier_dir, n * block, block, **tier_kw(args))
    try:
        kept_verified = tier.recover()
        dropped = tier.scrub().result(deadline.left())
    finally:
        tier.close()
    recover_verify_s = time.perf_counter() - t0
    shutil.rmtree(tier_dir, ignore_errors=True)
    if len(kept) != n or dropped or len(kept_verified) != n:  # full: the rounds only evicted
        raise RuntimeError(f"recover kept {len(kept)}/{len(kept_verified) - len(dropped)} of {n}")
    return {"recover_s": round(recover_s, 3), "recover_verify_s": round(recover_verify_s, 3)}


async def _data_client() -> Any:
    from pegaflow.client.data import DataClient

    return DataClient()


class NodeBench:
    """Step 6 (see the module docstring): a real node with a disk tier, in two steps
    (``promote``, then ``spills_effect``) that share the node."""

    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        from pegaflow.tools.devcluster import start_node

        self.block = block = int(args.block_mib * (1 << 20))
        self.n = n = blocks_for(args.node_prefix_gb, block)
        slab = 64 << 20
        while slab > 2 * block and slab > n * block:  # a small prefix: a small pool
            slab //= 2
        self.pool = -(-(n * block) // slab) * slab + slab  # one prefix, a slab to spare
        self.pool_blocks = self.pool // block
        self.queue_blocks = max(1, args.node_queue_mib * (1 << 20) // block)
        self.disk_slots = 4 * n
        self._start = partial(
            start_node, "bench-disk", pool=str(self.pool), slab=str(slab),
            extra=["--node-disk-path", str(root / "node-disk"),
                   "--node-disk-bytes", str(self.disk_slots * block),
                   "--node-disk-block-bytes", str(block),
                   "--node-disk-read-threads", str(args.read_threads),
                   "--node-disk-write-threads", str(args.write_threads),
                   "--node-disk-queue-bytes", str(self.queue_blocks * block)],
        )  # fmt: skip
        self.node = self._start()
        self.addr = self.node.ready["ucx"]
        self.put_blocks = 0
        self.data = np.random.default_rng(7).integers(0, 255, (n, block), dtype=np.uint8)
        self.loop = asyncio.new_event_loop()
        self.client = self.loop.run_until_complete(_data_client())

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.loop.run_until_complete(asyncio.wait_for(self.client.close(), 10))
        self.loop.close()
        self.node.terminate()

    def run(self, coro: Any, deadline: Deadline) -> Any:
        try:
            return self.loop.run_until_complete(asyncio.wait_for(coro, deadline.left()))
        except TimeoutError:
            raise StepTimeout("past the step's deadline") from None

    @staticmethod
    def hashes(tag: int, k: int) -> list[bytes]:
        return [tag.to_bytes(4, "little") + i.to_bytes(12, "little") for i in range(k)]

    def metric(self, name: str) -> float:
        url = f"http://127.0.0.1:{self.node.ready['http']}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        return 0.0

    def settled(self) -> float:
        """Evictions written to disk or given up (dropped)."""
        spilled = self.metric("pegaflow_node_disk_spills_total")
        return spilled + self.metric("pegaflow_node_disk_spill_drops_total")

    async def wait_settled(self) -> None:
        """Until the evictions so far are all written or dropped: at least those the
        puts must have caused, and no change over a poll (the node's metrics: nothing to
        await)."""
        floor = self.put_blocks - self.pool_blocks
        last = -1.0
        while (now := await asyncio.to_thread(self.settled)) < floor or now != last:
            last = now
            await asyncio.sleep(0.1)

    async def put(self, hs: list[bytes], paced: bool, ns: str = NS) -> None:
        """Put ``hs``; ``paced``: in pieces no larger than the spill queue, each once
        the evictions before it are written (so that none is dropped)."""
        most = max(1, min(64, self.pool_blocks // 4))  # within a connection's quota
        step = min(most, self.queue_blocks) if paced else most
        n = self.n
        for i in range(0, len(hs), step):
            part = [(h, 0, self.data[(i + j) % n]) for j, h in enumerate(hs[i : i + step])]
            if paced:
                await self.wait_settled()
            out = await self.client.put(self.addr, ns, part, 60)
            assert out.stored + out.skipped == len(part), out
            self.put_blocks += out.stored

    async def drop_scratch(self) -> None:
        """Drop the scratch namespace's blocks (the pool has room again, and the tier
        holds none of them)."""
        reply = await self.client.call(self.addr, proto.encode_drop(SCRATCH), 30)
        out = proto.drop_reply(reply)
        self.put_blocks -= out.dropped + out.pinned
        await self.wait_settled()

    async def get(self, hs: list[bytes], out: np.ndarray) -> tuple[float, int]:
        """Seconds of one batched get of ``hs``, and the blocks it found."""
        t0 = time.perf_counter()
        ok = await self.client.get(self.addr, NS, [(h, 0, out[i]) for i, h in enumerate(hs)], 120)
        return time.perf_counter() - t0, sum(ok)

    async def get_gbps(self, hs: list[bytes], out: np.ndarray) -> float:
        """GB/s of one batched get of ``hs``, all of which must be in the node."""
        dt, hits = await self.get(hs, out)
        if hits != len(hs):
            raise RuntimeError(f"{len(hs) - hits} of {len(hs)} blocks missing")
        return len(hs) * self.block / dt / GB

    async def promote(self) -> dict[str, Any]:
        n, block = self.n, self.block
        a = self.hashes(1, n)
        drops0 = self.metric("pegaflow_node_disk_spill_drops_total")
        await self.put(a, paced=True)
        await self.put(self.hashes(2, n), paced=True)  # B then C evict all of A to disk
        await self.put(self.hashes(3, n), paced=True)
        await self.wait_settled()
        on_disk = self.metric("pegaflow_node_disk_blocks")
        drops = self.metric("pegaflow_node_disk_spill_drops_total")
        # touched first, as a connector's KV cache is: receiving 0.3-1.3 GB into fresh
        # pages faults inside the client's UCX receive and took longer than the disk reads
        out = np.ones((n, block), dtype=np.uint8)
        promote_s, hits = await self.get(a, out)  # A only on disk: streamed, read as sent
        good = sum(np.array_equal(out[i], self.data[i]) for i in range(n))
        return {
            "prefix_gb": round(n * block / GB, 3),
            "blocks": n,
            "promote_s": round(promote_s, 3),
            "promote_gbps": round(n * block / promote_s / GB, 3),
            "promoted_blocks": hits,
            "byte_exact_blocks": int(good),
            "disk_blocks_before": int(on_disk),
            "spill_drops_before": int(drops - drops0),  # evictions of its puts not kept
            "spill_drops_during": int(self.metric("pegaflow_node_disk_spill_drops_total") - drops),
            "streamed_blocks": int(self.metric("pegaflow_node_disk_streamed_blocks_total")),
            "pool_bytes": self.pool,
        }

    async def spills_effect(self) -> dict[str, Any]:
        n, block = self.n, self.block
        hot = self.hashes(1, n)[: max(1, n // 4)]  # in memory: just promoted
        view = np.empty((len(hot), block), dtype=np.uint8)
        alone = [await self.get_gbps(hot, view) for _ in range(5)]
        before = self.metric("pegaflow_node_disk_spills_total")
        writer = asyncio.ensure_future(self.put(self.hashes(4, n), paced=False))  # spills
        during: list[float] = []
        try:
            while not writer.done() or not during:
                during.append(await self.get_gbps(hot, view))
            await writer
        finally:
            writer.cancel()
        return {
            "get_from_memory_gbps": round(statistics.median(alone), 3),
            "get_from_memory_during_spills_gbps": round(statistics.median(during), 3),
            "spilled_during": int(self.metric("pegaflow_node_disk_spills_total") - before),
        }

    def spill_counts(self) -> dict[str, float]:
        """The tier's spill counters: written, dropped, copied at eviction (the put's
        own cost), written ahead of eviction from the pool (``disk_spill_ahead_bytes``)."""
        return {k: self.metric(f"pegaflow_node_disk_{k}_total") for k in SPILL_COUNTERS}

    async def timed_put(self, hs: list[bytes]) -> tuple[float, dict[str, int]]:
        """GB/s of putting ``hs`` (scratch) unpaced, as a save does, and what became of
        the blocks it pushed out of memory (:meth:`spill_counts`, once those settled;
        the tier's counters: the pool's own gauge lags by up to a second)."""
        before = self.spill_counts()
        t0 = time.perf_counter()
        await self.put(hs, paced=False, ns=SCRATCH)
        gbps = len(hs) * self.block / (time.perf_counter() - t0) / GB
        await self.wait_settled()
        after = self.spill_counts()
        return gbps, {k: int(after[k] - before[k]) for k in SPILL_COUNTERS}

    async def fill(self, keep: int = 0) -> None:
        """Fill a pool holding only ``keep`` other blocks with scratch blocks (the next
        put evicts)."""
        await self.put(self.hashes(11, self.pool_blocks - keep), paced=True, ns=SCRATCH)

    async def saves_during_spills(self, rounds: int) -> dict[str, Any]:
        """Put throughput of the same batches into an empty pool (no evictions), then
        into a full one (every put evicts, and each eviction is spilled or dropped; or,
        with spill-ahead, finds a slot freed ahead), in ``rounds`` rounds (the scratch
        blocks dropped after each put)."""
        n = self.n
        room: list[float] = []
        full: list[float] = []
        during = dict.fromkeys(SPILL_COUNTERS, 0)
        for _ in range(rounds):
            gbps, c = await self.timed_put(self.hashes(10, n))
            if c["spill_copies"] + c["spill_drops"]:  # spill-ahead may have written some
                raise RuntimeError(f"the pool evicted with room left: {c}")
            room.append(gbps)
            await self.drop_scratch()
            await self.fill()
            gbps, c = await self.timed_put(self.hashes(12, n))
            full.append(gbps)
            during = {k: during[k] + c[k] for k in SPILL_COUNTERS}
            await self.drop_scratch()
        return {
            "save_gbps": summary(room)["best"],
            "save_during_spills_gbps": summary(full)["best"],
            "save_ratio": round(max(full) / max(room), 3),
            "save_ratio_paired_median": round(
                statistics.median(f / r for f, r in zip(full, room, strict=True)), 3
            ),
            "save": summary(room),
            "save_during_spills": summary(full),
            "blocks": n,
            "rounds": rounds,
            "spilled_during": during["spills"],
            "spill_drops_during": during["spill_drops"],  # past the spill queue: not kept
            "spill_copies_during": during["spill_copies"],  # copied by the evicting put
            "spill_ahead_during": during["spill_ahead_blocks"],  # written from the pool
        }

    async def control_during_spills(self, count: int) -> dict[str, Any]:
        """Latency of ``count`` one-block locates (through a client's node session: the
        control socket on this host) of a few blocks in memory: alone, while a writer
        puts into a pool with room (no evictions), and while it puts into a full pool
        (every put evicts, and the evictions are spilled)."""
        from pegaflow.client.session import NodeSession

        session = NodeSession.at(self.addr, self.client)
        hot = self.hashes(40, 8)
        await self.put(hot, paced=True)
        # the room spill-ahead keeps free (the node runs the default) holds no block
        ahead = -(-reserve_bytes(NodeConfig().disk_spill_ahead_bytes, self.pool) // self.block)
        held = self.pool_blocks - ahead
        batch = max(1, min(self.n, held - 2 * len(hot)))  # fits beside them
        tags = iter(range(41, 1 << 30))

        async def locate(i: int) -> float:
            t0 = time.perf_counter()
            pin, where = await session.locate(NS, [hot[i % len(hot)]], 0, 5.0, 10)
            dt = time.perf_counter() - t0
            await session.unpin(pin, 10)
            if not where.found[0]:
                raise RuntimeError("a located block was not found")
            return dt

        async def during(room: bool) -> tuple[list[float], dict[str, int]]:
            """Locates while writers put ``batch`` new blocks each (dropped after each
            one with ``room``), until ``count`` overlapped one; and the spill counters'
            changes meanwhile."""
            before = self.spill_counts()
            out: list[float] = []
            while len(out) < count:
                hs = self.hashes(next(tags), batch)
                writer = asyncio.ensure_future(self.put(hs, paced=False, ns=SCRATCH))
                try:
                    while not writer.done():
                        out.append(await locate(len(out)))
                    await writer
                finally:
                    writer.cancel()
                if room:
                    await self.drop_scratch()
                else:  # the next batch evicts only blocks older than these
                    for i in range(len(hot)):
                        await locate(i)
            after = self.spill_counts()
            return out, {k: int(after[k] - before[k]) for k in SPILL_COUNTERS}

        try:
            alone = [await locate(i) for i in range(count)]
            with_room, spilled_room = await during(room=True)
            if spilled_room["spill_copies"] + spilled_room["spill_drops"]:
                raise RuntimeError(f"the pool evicted with room left: {spilled_room}")
            await self.fill(keep=len(hot) + ahead)
            for i in range(len(hot)):  # the most recently used: the fill is evicted first
                await locate(i)
            spilling, spilled = await during(room=False)
            over_socket = session.over_socket
        finally:
            session.close()
        await self.drop_scratch()
        return {
            "locate_p50_ms": quantile_ms(alone, 0.5),
            "locate_p99_ms": quantile_ms(alone, 0.99),
            "locate_during_saves_p50_ms": quantile_ms(with_room, 0.5),
            "locate_during_saves_p99_ms": quantile_ms(with_room, 0.99),
            "locate_during_spills_p50_ms": quantile_ms(spilling, 0.5),
            "locate_during_spills_p99_ms": quantile_ms(spilling, 0.99),
            "locates": count,
            "locates_during_saves": len(with_room),
            "locates_during_spills": len(spilling),
            "spilled_during": spilled["spills"],
            "spill_copies_during": spilled["spill_copies"],
            "spill_ahead_during": spilled["spill_ahead_blocks"],
            "over_control_socket": over_socket,
        }

    async def fill_for_restart(self) -> tuple[list[bytes], list[bytes]]:
        """A probe block and a prefix held only on disk, with the tier full: new blocks
        until the tier is full, then the probe and the prefix, then new blocks until
        both have left the pool (the tier's LRU evicts those older than the probe)."""
        tags = iter(range(32, 1 << 30))
        part = min(self.n, max(1, self.pool_blocks // 4))
        while self.metric("pegaflow_node_disk_blocks") < self.disk_slots:
            await self.put(self.hashes(next(tags), part), paced=True)
            await self.wait_settled()
        probe, prefix = self.hashes(30, 1), self.hashes(31, self.n)
        await self.put(probe, paced=True)
        await self.put(prefix, paced=True)
        for _ in range(-(-self.pool_blocks // part)):
            await self.put(self.hashes(next(tags), part), paced=True)
        await self.wait_settled()
        return probe, prefix

    def restart_get(self, raw_gbps: float | None, deadline: Deadline) -> dict[str, Any]:
        """The node stopped (SIGTERM) with its tier full and restarted on an empty pool
        (a fresh pool file): seconds to its READY line and to a first one-block get
        answered, then one batched get of a prefix held only on disk."""
        probe, prefix = self.run(self.fill_for_restart(), deadline)
        disk_blocks = self.metric("pegaflow_node_disk_blocks")
        t0 = time.perf_counter()
        self.node.terminate(timeout=max(1.0, deadline.remaining()))  # queued spills first
        stop_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.node = self._start()
        ready_s = time.perf_counter() - t0
        self.addr = self.node.ready["ucx"]
        first = np.empty((1, self.block), dtype=np.uint8)
        _, probe_hits = self.run(self.get(probe, first), deadline)
        serving_s = time.perf_counter() - t0
        if probe_hits != 1:
            raise RuntimeError("the probe block was not served from disk after the restart")
        out = np.ones((self.n, self.block), dtype=np.uint8)  # touched: see promote()
        get_s, hits = self.run(self.get(prefix, out), deadline)
        good = sum(np.array_equal(out[i], self.data[i]) for i in range(self.n))
        gbps = self.n * self.block / get_s / GB
        return {
            "stop_s": round(stop_s, 3),
            "ready_s": round(ready_s, 3),
            "serving_s": round(serving_s, 3),
            "disk_blocks": int(disk_blocks),
            "disk_slots": self.disk_slots,
            "recovered_blocks": int(self.metric("pegaflow_node_disk_blocks")),
            "get_s": round(get_s, 3),
            "get_gbps": round(gbps, 3),
            "get_to_raw_read": round(gbps / raw_gbps, 3) if raw_gbps else None,
            "got_blocks": hits,
            "byte_exact_blocks": int(good),
            "blocks": self.n,
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gb", type=float, default=2.0, help="tier size in GB (default 2)")
    p.add_argument("--block-mib", type=float, default=2.0, help="block size (default 2 MiB)")
    p.add_argument("--batch", type=int, default=32, help="reads in flight (default 32)")
    p.add_argument("--read-threads", type=int, default=4)
    p.add_argument("--write-threads", type=int, default=2)
    p.add_argument("--queue-depth", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", type=Path, default=None, help="a directory on the disk to test")
    steps: list[tuple[str, type, float, str]] = [
        ("--node-prefix-gb", float, 1.31,
         "prefix of the node step (default 1.31: 10k tokens of Llama-8B; 0: skip it)"),
        ("--node-queue-mib", int, 256,
         "the node's spill queue ([node] disk_queue_bytes, default 256 MiB)"),
        ("--locates", int, 300,
         "one-block locates of the control step, alone and during spills (default 300)"),
        ("--step-timeout-s", float, 300.0,
         "deadline of each step (default 300 s): past it the step reports an error"),
    ]  # fmt: skip
    for flag, kind, default, text in steps:
        p.add_argument(flag, type=kind, default=default, help=text)
    args = p.parse_args()
    base = args.dir or Path("/var/tmp")
    base.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="pegaflow-bench-disk-", dir=base))
    result: dict[str, Any] = {}

    def step(name: str, fn: Any) -> dict[str, Any] | None:
        deadline = Deadline.after(args.step_timeout_s)
        t0 = time.perf_counter()
        try:
            out = fn(deadline)
        except (StepTimeout, TimeoutError) as e:
            emit(name, {"error": f"timed out after {args.step_timeout_s:g} s ({e})"})
            return None
        except Exception as e:
            emit(name, {"error": f"{type(e).__name__}: {e}"})
            return None
        emit(name, {**out, "step_s": round(time.perf_counter() - t0, 3)})
        return out

    try:
        if args.gb > 0:
            rounds = step("tier", lambda d: tier_rounds(args, root, d))
            if rounds is not None:
                result.update(rounds)
                result.update(step("restart", lambda d: restart(args, root, d)) or {})
        if args.node_prefix_gb > 0:
            print("node: a real node with a disk tier ...", file=sys.stderr)
            node: dict[str, Any] = {}
            result["node"] = node
            try:
                nb = NodeBench(args, root)
            except Exception as e:
                emit("node_promote", {"error": f"the node did not start: {e}"})
            else:
                try:
                    saves = step(
                        "node_saves_during_spills",
                        lambda d: nb.run(nb.saves_during_spills(args.rounds), d),
                    )
                    node["saves_during_spills"] = saves
                    node["control_during_spills"] = step(
                        "node_control_during_spills",
                        lambda d: nb.run(nb.control_during_spills(args.locates), d),
                    )
                    promoted = step("node_promote", lambda d: nb.run(nb.promote(), d))
                    if promoted is not None:  # the next steps read what this one promoted
                        node.update(promoted)
                        node.update(
                            step("node_spills_effect", lambda d: nb.run(nb.spills_effect(), d))
                            or {}
                        )
                    raw = result.get("raw_read_gbps")
                    node["restart_get"] = step("node_restart_get", lambda d: nb.restart_get(raw, d))
                finally:
                    nb.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
