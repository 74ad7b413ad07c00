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
   disk tier in the same directory; prefix A is put, then prefixes B and C (which evict
   all of A to disk); one batched get of A through a real client is timed (``promote_s``: the disk
   reads, the commits into the pool and the sends).  Then a set of blocks in memory is
   read by back-to-back gets, alone and while a writer puts new blocks that evict (and
   spill) others: ``get_from_memory_gbps`` and ``get_from_memory_during_spills_gbps``.

``O_DIRECT`` bypasses the page cache, so no cache dropping is needed (on a file system
without ``O_DIRECT``, e.g. some tmpfs, both sides are buffered and say so).  Every figure
is the best of ``--rounds`` rounds, the median is printed too.  The last line printed is
one JSON object: ``spill_gbps``, ``read_gbps``, ``raw_read_gbps``, ``read_ratio``
(best read / best raw), ``read_ratio_paired_median`` (the median over rounds of each
round's read / raw: steadier on a shared disk), ``dd_read_gbps``, ``recover_s``,
``recover_verify_s``, ``read_during_spills_gbps``, ``spill_during_reads_gbps``, the
node figures (``node``: ``promote_s``, ``promote_gbps``, ``get_from_memory_gbps``,
``get_from_memory_during_spills_gbps``, ``spilled_during``) and the parameters.

    .venv/bin/python scripts/bench_disk_tier.py [--gb 2] [--block-mib 2] [--batch 32]
        [--read-threads 4] [--dir /path/on/the/disk] [--rounds 3] [--node-prefix-gb 1.31]
"""

from __future__ import annotations

import argparse
import asyncio
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
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pegaflow.storage_node.disk_tier import DiskTier  # noqa: E402

GB = 1e9


def blocks_for(gb: float, block: int) -> int:
    return max(1, int(gb * GB) // block)


def raw_read(path: Path, size: int, chunk: int, threads: int) -> tuple[float, bool]:
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
            n += os.preadv(fd, [buf], off)
        return n

    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as ex:
            total = sum(ex.map(work, [offsets[i : i + per] for i in range(0, len(offsets), per)]))
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


def dd_read(path: Path, chunk: int) -> float | None:
    """GB/s that ``dd iflag=direct`` reports reading ``path`` (None without dd)."""
    if shutil.which("dd") is None:
        return None
    p = subprocess.run(
        ["dd", f"if={path}", "of=/dev/null", f"bs={chunk}", "iflag=direct"],
        capture_output=True,
        text=True,
        timeout=600,
    )
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


def spill_round(tier: DiskTier, blocks: list[np.ndarray], first: int = 0) -> float:
    """GB/s of spilling ``blocks`` (keys from ``first`` on) until all are on disk."""
    t0 = time.perf_counter()
    for i, b in enumerate(blocks, first):
        while not tier.spill(key(i), i, b):
            time.sleep(0.0005)  # queue full: the disk is the bottleneck
    tier.flush(600)
    return sum(b.nbytes for b in blocks) / (time.perf_counter() - t0) / GB


def read_round(tier: DiskTier, ids: range, block: int, batch: int, bufs: list[np.ndarray]) -> float:
    """GB/s of reading ``ids`` in batches of ``batch`` reads in flight."""
    t0 = time.perf_counter()
    for start in range(ids.start, ids.stop, batch):
        futs = [
            tier.read_into(key(i), bufs[i - start])
            for i in range(start, min(ids.stop, start + batch))
        ]
        for f in futs:
            if f.result(600) != block:
                raise SystemExit("a block failed to read back")
    return len(ids) * block / (time.perf_counter() - t0) / GB


def mixed_round(
    tier: DiskTier, blocks: list[np.ndarray], batch: int, bufs: list[np.ndarray]
) -> tuple[float, float]:
    """Read the newer half of a full tier while new blocks are spilled into the older
    half (evicting it); GB/s of the reads and of the spills."""
    n, block = len(blocks), blocks[0].nbytes
    half = n // 2
    spill_gbps: list[float] = []

    def spiller() -> None:
        spill_gbps.append(spill_round(tier, blocks[:half], first=n))

    th = threading.Thread(target=spiller)
    th.start()
    read_gbps = read_round(tier, range(n - half, n), block, batch, bufs)
    th.join()
    return read_gbps, spill_gbps[0]


def summary(xs: list[float]) -> dict[str, float]:
    return {"best": round(max(xs), 3), "median": round(statistics.median(xs), 3)}


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    block = int(args.block_mib * (1 << 20))
    n = blocks_for(args.gb, block)
    size = n * block
    scratch = root / "scratch"
    print(f"raw: writing a {size / GB:.2f} GB scratch file ...", file=sys.stderr)
    write_scratch(scratch, size, block)
    raws: list[float] = []
    dds: list[float] = []
    blocks = make_blocks(n, block)
    kw = {
        "read_threads": args.read_threads,
        "write_threads": args.write_threads,
        "queue_depth": args.queue_depth,
    }
    tier_dir = root / "tier"
    bufs = [np.empty(block, dtype=np.uint8) for _ in range(args.batch)]
    spills: list[float] = []
    reads: list[float] = []
    mixed_reads: list[float] = []
    mixed_spills: list[float] = []
    for r in range(args.rounds):  # raw and tier interleaved: both see the same disk state
        gbps, direct = raw_read(scratch, size, block, args.read_threads)
        raws.append(gbps)
        dd = dd_read(scratch, block)
        if dd is not None:
            dds.append(dd)
        shutil.rmtree(tier_dir, ignore_errors=True)
        t0 = time.perf_counter()
        tier = DiskTier(tier_dir, size, block, **kw)
        open_s = time.perf_counter() - t0
        tier.recover()
        print(f"round {r}: spilling {n} blocks of {block >> 20} MiB ...", file=sys.stderr)
        spills.append(spill_round(tier, blocks))
        reads.append(read_round(tier, range(n), block, args.batch, bufs))
        if n >= 2:
            mr, ms = mixed_round(tier, blocks, args.batch, bufs)
            mixed_reads.append(mr)
            mixed_spills.append(ms)
        st = tier.stats()
        tier.close()
        print(
            f"round {r}: spill {spills[-1]:.2f} GB/s, read {reads[-1]:.2f} GB/s, "
            f"raw {raws[r]:.2f} GB/s",
            file=sys.stderr,
        )
    del blocks
    scratch.unlink()

    t0 = time.perf_counter()
    tier = DiskTier(tier_dir, size, block, **kw)
    kept = tier.recover()
    recover_s = time.perf_counter() - t0
    tier.close()
    t0 = time.perf_counter()
    tier = DiskTier(tier_dir, size, block, **kw)
    kept_verified = tier.recover(verify=True)
    recover_verify_s = time.perf_counter() - t0
    tier.close()
    if len(kept) != n or len(kept_verified) != n:  # full: the mixed rounds only evicted
        raise SystemExit(f"recover kept {len(kept)}/{len(kept_verified)} of {n} blocks")
    shutil.rmtree(tier_dir, ignore_errors=True)
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
        "recover_s": round(recover_s, 3),
        "recover_verify_s": round(recover_verify_s, 3),
        "read_during_spills_gbps": summary(mixed_reads)["best"] if mixed_reads else None,
        "spill_during_reads_gbps": summary(mixed_spills)["best"] if mixed_spills else None,
        "spill": summary(spills),
        "read": summary(reads),
        "raw_read": summary(raws),
        "create_s": round(open_s, 3),
        "direct_io": st.direct_io and direct,
        "tier_gb": round(size / GB, 3),
        "blocks": n,
        "block_bytes": block,
        "batch": args.batch,
        "read_threads": args.read_threads,
        "write_threads": args.write_threads,
        "rounds": args.rounds,
        "dir": str(root),
    }


def node_run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Step 6 (see the module docstring): a real node with a disk tier."""
    from pegaflow.client.data import DataClient

    from pegaflow.devcluster import start_node

    block = int(args.block_mib * (1 << 20))
    n = blocks_for(args.node_prefix_gb, block)
    slab = 64 << 20
    pool = -(-(n * block) // slab) * slab + slab  # one prefix, a slab to spare
    pool_blocks = pool // block
    node = start_node(
        "bench-disk", pool=str(pool), slab=str(slab),
        extra=["--node-disk-path", str(root / "node-disk"),
               "--node-disk-bytes", str(4 * n * block), "--node-disk-block-bytes", str(block),
               "--node-disk-read-threads", str(args.read_threads),
               "--node-disk-write-threads", str(args.write_threads)],
    )  # fmt: skip
    addr = node.ready["ucx"]
    ns = "bench-disk"
    rng = np.random.default_rng(7)
    data = rng.integers(0, 255, (n, block), dtype=np.uint8)
    step = 64

    def hashes(tag: int, k: int) -> list[bytes]:
        return [tag.to_bytes(4, "little") + i.to_bytes(12, "little") for i in range(k)]

    async def put(c: DataClient, hs: list[bytes]) -> None:
        for i in range(0, len(hs), step):
            part = [(h, 0, data[(i + j) % n]) for j, h in enumerate(hs[i : i + step])]
            out = await c.put(addr, ns, part, 60)
            assert out.stored + out.skipped == len(part), out

    async def get(c: DataClient, hs: list[bytes], out: np.ndarray) -> float:
        t0 = time.perf_counter()
        ok = await c.get(addr, ns, [(h, 0, out[i]) for i, h in enumerate(hs)], 120)
        dt = time.perf_counter() - t0
        assert all(ok), f"{ok.count(False)} of {len(ok)} blocks missing"
        return dt

    def spills() -> float:
        url = f"http://127.0.0.1:{node.ready['http']}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("pegaflow_node_disk_spills_total "):
                    return float(line.split()[1])
        return 0.0

    def wait_spills(k: float) -> None:
        deadline = time.monotonic() + 120
        while spills() < k and time.monotonic() < deadline:
            time.sleep(0.2)

    async def main() -> dict[str, Any]:
        c = DataClient()
        out = np.empty((n, block), dtype=np.uint8)
        try:
            a = hashes(1, n)
            await put(c, a)
            await put(c, hashes(2, n))  # B then C evict all of A (written in the background)
            await put(c, hashes(3, n))
            await asyncio.to_thread(wait_spills, 0.95 * (3 * n - pool_blocks))
            promote_s = await get(c, a, out)  # A only on disk: promoted, then sent
            assert np.array_equal(out[-1], data[n - 1])
            hot = a[: max(1, n // 4)]
            view = out[: len(hot)]
            alone = [len(hot) * block / await get(c, hot, view) / GB for _ in range(5)]
            before = spills()
            writer = asyncio.ensure_future(put(c, hashes(4, n)))  # evicts: spills
            during: list[float] = []
            while not writer.done() or not during:
                during.append(len(hot) * block / await get(c, hot, view) / GB)
            await writer
            return {
                "prefix_gb": round(n * block / GB, 3),
                "promote_s": round(promote_s, 3),
                "promote_gbps": round(n * block / promote_s / GB, 3),
                "get_from_memory_gbps": round(statistics.median(alone), 3),
                "get_from_memory_during_spills_gbps": round(statistics.median(during), 3),
                "spilled_during": int(spills() - before),
                "pool_bytes": pool,
            }
        finally:
            await c.close()

    try:
        return asyncio.run(main())
    finally:
        node.terminate()


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
    p.add_argument(
        "--node-prefix-gb", type=float, default=1.31,
        help="prefix of the node step (default 1.31: 10k tokens of Llama-8B; 0: skip it)",
    )  # fmt: skip
    args = p.parse_args()
    base = args.dir or Path("/var/tmp")
    base.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="pegaflow-bench-disk-", dir=base))
    try:
        result = run(args, root)
        if args.node_prefix_gb > 0:
            print("node: a real node with a disk tier ...", file=sys.stderr)
            result["node"] = node_run(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
