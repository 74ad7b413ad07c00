#!/usr/bin/env python3
"""What pinning a node's pool costs an engine, on a CUDA GPU (issue 38).

A same-host engine maps the node's pool file and pins it (``cudaHostRegister``) on a
background thread, piece by piece, so that its loads DMA at full speed.  This measures,
on a shared-memory file like the node's pool (``--pool-gib``, filled first):

* ``register_gbps``: pinning rate by piece size (``--pieces``), with the mapping cold
  (pages not yet in this process's page tables) and after ``MADV_POPULATE_WRITE``
  (``populate_s``: what populating took, on this thread, outside the CUDA driver);
* ``copy_ms``: a pinned host-to-device copy of ``--copy-mib`` timed back to back, alone
  (``alone``) and while another thread pins pieces of each size (``p50``, ``p99``,
  ``max``): how long a load waits behind a registration;
* ``pageable_gbps`` / ``pinned_gbps``: one prompt's worth (``--prompt-gib``) copied to
  the GPU from the mapping before and after it is pinned, and ``bounce_gbps``: the same
  from the unpinned mapping through a pinned buffer filled by ``--threads`` CPU threads.

Last line: one JSON object; ``x_ceiling`` figures divide by ``pinned_gbps``.

    python3 scripts/bench_pinning.py [--pool-gib 8] [--pieces 64,256,1024]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import mmap
import os
import statistics
import tempfile
import threading
import time

import numpy as np
import torch

FLAGS = 0x01 | 0x02  # portable | mapped, as the connector registers the pool
POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14
MIB = 1 << 20


def fill(path: str, size: int) -> None:
    """A pool-like file of ``size`` bytes, every page written (the node's pool is)."""
    chunk = np.full(64 * MIB, 7, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        for _ in range(0, size, len(chunk)):
            f.write(chunk)


def mapped(path: str, size: int) -> tuple[mmap.mmap, np.ndarray, int]:
    fd = os.open(path, os.O_RDWR)
    try:
        m = mmap.mmap(fd, size, mmap.MAP_SHARED)
    finally:
        os.close(fd)
    arr = np.frombuffer(m, dtype=np.uint8)
    return m, arr, int(arr.ctypes.data)


def populate(m: mmap.mmap, arr: np.ndarray) -> str:
    """Fault the mapping's pages in for writing, outside the CUDA driver; returns how."""
    try:
        m.madvise(POPULATE_WRITE)
        return "madvise"
    except OSError:
        arr[:: mmap.PAGESIZE] += 0  # one write per page
        return "touch"


def register(ptr: int, size: int, piece: int) -> tuple[float, list[int]]:
    cudart = torch.cuda.cudart()
    t0 = time.perf_counter()
    done = []
    for off in range(0, size, piece):
        err = cudart.cudaHostRegister(ptr + off, min(piece, size - off), FLAGS)
        if int(getattr(err, "value", err)) != 0:
            raise RuntimeError(f"cudaHostRegister failed: {err}")
        done.append(off)
    return time.perf_counter() - t0, done


def unregister(ptr: int, done: list[int]) -> None:
    for off in done:
        torch.cuda.cudart().cudaHostUnregister(ptr + off)


def copy_times(src: torch.Tensor, dst: torch.Tensor, stop: threading.Event, n: int) -> list[float]:
    """Back-to-back copies of ``src`` to ``dst`` (ms each) until ``stop`` or ``n`` copies."""
    out = []
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        while not stop.is_set() and len(out) < n:
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            stream.synchronize()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def summary(xs: list[float]) -> dict[str, float]:
    q = statistics.quantiles(xs, n=100) if len(xs) > 1 else xs * 99
    return {"n": len(xs), "p50": round(q[49], 2), "p99": round(q[98], 2), "max": round(max(xs), 2)}


def rate(nbytes: int, fn, reps: int = 3) -> float:
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return round(nbytes / best / 1e9, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pool-gib", type=float, default=8.0)
    ap.add_argument("--pieces", default="64,256,1024", help="piece sizes (MiB)")
    ap.add_argument("--copy-mib", type=int, default=64)
    ap.add_argument("--prompt-gib", type=float, default=1.25)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--dir", default="/dev/shm")
    a = ap.parse_args()
    size = int(a.pool_gib * 1024) * MIB
    pieces = [int(x) * MIB for x in a.pieces.split(",")]
    out: dict[str, object] = {"pool_gib": a.pool_gib, "gpu": torch.cuda.get_device_name()}
    torch.cuda.init()
    fd, path = tempfile.mkstemp(dir=a.dir, prefix="pinbench-")
    os.close(fd)
    try:
        fill(path, size)
        reg: dict[str, float] = {}
        for piece in pieces:
            for populated in (False, True):
                m, arr, ptr = mapped(path, size)
                if populated:
                    t0 = time.perf_counter()
                    out["populate_by"] = populate(m, arr)
                    out["populate_s"] = round(time.perf_counter() - t0, 3)
                secs, done = register(ptr, size, piece)
                reg[f"{piece // MIB}MiB{'_populated' if populated else ''}"] = round(
                    size / secs / 1e9, 2
                )
                unregister(ptr, done)
                del arr
                m.close()
        out["register_gbps"] = reg

        src = torch.empty(a.copy_mib * MIB, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty_like(src, device="cuda")
        copy_times(src, dst, threading.Event(), 20)  # warm
        alone = copy_times(src, dst, threading.Event(), 200)
        ms: dict[str, dict[str, float]] = {"alone": summary(alone)}
        for piece in pieces:
            m, arr, ptr = mapped(path, size)
            populate(m, arr)
            stop = threading.Event()
            with concurrent.futures.ThreadPoolExecutor(1) as ex:
                fut = ex.submit(copy_times, src, dst, stop, 10**9)
                _, done = register(ptr, size, piece)
                stop.set()
                ms[f"pinning_{piece // MIB}MiB"] = summary(fut.result())
            unregister(ptr, done)
            del arr
            m.close()
        out["copy_ms"] = ms

        n = int(a.prompt_gib * 1024) * MIB
        m, arr, ptr = mapped(path, size)
        host = torch.from_numpy(arr[:n])
        gpu = torch.empty(n, dtype=torch.uint8, device="cuda")
        out["pageable_gbps"] = rate(n, lambda: gpu.copy_(host))
        bounce = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        bnp = bounce.numpy()
        part = -(-n // a.threads)
        with concurrent.futures.ThreadPoolExecutor(a.threads) as ex:

            def through_bounce() -> None:
                list(ex.map(lambda i: np.copyto(bnp[i : i + part], arr[i : i + part]),
                            range(0, n, part)))  # fmt: skip
                gpu.copy_(bounce, non_blocking=True)

            out["bounce_gbps"] = rate(n, through_bounce)
        _, done = register(ptr, size, 1024 * MIB)
        out["pinned_gbps"] = rate(n, lambda: gpu.copy_(host, non_blocking=True))
        unregister(ptr, done)
        for k in ("pageable_gbps", "bounce_gbps"):
            out[k.replace("gbps", "x_ceiling")] = round(out[k] / out["pinned_gbps"], 3)
    finally:
        os.unlink(path)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
