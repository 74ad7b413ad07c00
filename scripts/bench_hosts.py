#!/usr/bin/env python3
"""The data path and TTFT across two hosts (network namespaces on one bridge).

Two hosts of ``tests/support/netns_hosts.py`` (each its own address, ``/dev/shm``, boot id and
host name, so UCX and PegaFlow take them for separate machines): ``h1`` runs a
``pegaflow-server`` (coordinator + node) bound to its address, ``h2`` the clients.
Needs root (``ip netns``).

* **Data path**: batched put, then get, of ``--batch`` blocks of ``--block`` bytes from
  a client on h2 to the node on h1, UCX over TCP across the veth bridge
  (``scripts/bench_datapath.py``'s ``measure_ours``, in a process on h2).  The
  reference, in the same run and interleaved round by round: a plain TCP stream over
  the same link (a Python socket, ``--tcp-message`` byte ``sendall`` from h1 to
  ``recv_into`` on h2, as many bytes as one round of gets; the time runs from the first
  byte sent to the receiver's one-byte acknowledgement) and ``ucx_perftest -t tag_bw``
  from h2 to h1 with UCX's own defaults.  Medians over ``--rounds``; the ratios are
  ours to the TCP stream.  Target (issue 35): get and put >= 0.8 x the TCP stream.
* **TTFT** (unless ``--skip-ttft``): ``scripts/bench_vllm_ttft.py`` run on h2 against
  a fresh server on h1, so its engines have no node of their own host: engine 1 computes
  the prompts cold and saves them across the link to h1's node, engine 2 (a new process,
  empty local cache) loads them back across the link.  Target: warm <= 0.2 x cold.

The last line printed is one JSON object with everything: ``get_gbps``, ``put_gbps``,
``tcp_stream_gbps``, ``get_ratio``, ``put_ratio`` (ratios of the medians),
``get_ratio_paired`` / ``put_ratio_paired`` (medians of each round's own ratio),
``ucx_perftest_gbps`` (null when not measured), the spread of every figure over the
rounds, ``rounds``, ``loadavg`` (at the start and end), and with TTFT
``cold_ttft_ms``, ``warm_ttft_ms``, ``warm_over_cold``, ``cold_ms`` / ``warm_ms`` (per
prompt) and ``ttft`` (bench_vllm_ttft's whole answer).

    .venv/bin/python scripts/bench_hosts.py [--rounds 5] [--skip-ttft]
        [--block 2MiB --batch 32] [--ttft-lengths 2048,8192 --ttft-prompts 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts"
sys.path[:0] = [str(REPO), str(SCRIPTS)]

import bench_datapath  # noqa: E402

TLS = bench_datapath.TRANSPORTS["tcp"]
"""UCX over TCP, as ``bench_datapath --transport tcp`` (hosts share no memory anyway)"""
PORT_LINE_TIMEOUT_S = 60.0


# ---- the processes on the hosts (hidden roles of this script) ------------------------


def _client_role(addr: str, size: int, batch: int, reps: int) -> None:
    """``--_client``: put then get ``reps`` batches against the node at ``addr``."""
    get, put, exact = asyncio.run(bench_datapath.measure_ours(addr, size, batch, reps))
    print(json.dumps({"get_gbps": get, "put_gbps": put, "byte_exact": exact}), flush=True)


def _tcp_recv_role(bind: str, msg: int, total: int) -> None:
    """``--_tcp recv``: take ``total`` bytes on one connection, then acknowledge."""
    import numpy as np

    buf = np.zeros(msg, np.uint8)  # written once: every page is resident
    view = memoryview(buf)
    with socket.socket() as srv:
        srv.bind((bind, 0))
        srv.listen(1)
        print(srv.getsockname()[1], flush=True)
        srv.settimeout(PORT_LINE_TIMEOUT_S)
        conn, _ = srv.accept()
        with conn:
            got = 0
            while got < total:
                n = conn.recv_into(view[: min(msg, total - got)])
                if not n:
                    raise SystemExit(f"stream cut after {got} of {total} bytes")
                got += n
            conn.sendall(b"k")


def _tcp_send_role(host: str, port: int, msg: int, total: int) -> None:
    """``--_tcp send``: stream ``total`` bytes in ``msg``-byte ``sendall``; prints GB/s
    from the first byte to the receiver's acknowledgement."""
    import numpy as np

    buf = np.ones(msg, np.uint8)
    with socket.create_connection((host, port), timeout=PORT_LINE_TIMEOUT_S) as s:
        t0 = time.perf_counter()
        sent = 0
        while sent < total:
            n = min(msg, total - sent)
            s.sendall(memoryview(buf)[:n])
            sent += n
        if s.recv(1) != b"k":
            raise SystemExit("no acknowledgement")
        print(f"{total / (time.perf_counter() - t0) / 1e9:.4f}", flush=True)


# ---- the driver ----------------------------------------------------------------------


def _me(*args: object) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), *map(str, args)]


def _run_on(prefix: Sequence[str], argv: list[str], timeout: float) -> str:
    """Run ``argv`` behind ``prefix`` to completion; its stdout (raises on failure)."""
    env = {**os.environ, "UCX_TLS": TLS, "PYTHONUNBUFFERED": "1"}
    p = subprocess.run(
        [*prefix, *argv], capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO
    )
    if p.returncode != 0:
        raise RuntimeError(f"{argv[2:4]} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return p.stdout


def tcp_stream(src: Any, dst: Any, msg: int, total: int) -> float:
    """GB/s of one plain TCP stream of ``total`` bytes from host ``src`` to ``dst``."""
    recv = subprocess.Popen(
        [*dst.prefix, *_me("--_tcp", "recv", dst.ip, msg, total)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert recv.stdout is not None
        port = recv.stdout.readline().strip()
        if not port:
            raise RuntimeError("the TCP receiver did not start")
        out = _run_on(src.prefix, _me("--_tcp", "send", dst.ip, port, msg, total), 120)
        recv.wait(30)
        return float(out.strip().splitlines()[-1])
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait(10)


def ours(client: Any, addr: str, size: int, batch: int, reps: int) -> dict[str, Any]:
    """One round of puts then gets from a fresh client process on host ``client``."""
    out = _run_on(client.prefix, _me("--_client", addr, size, batch, reps), 300)
    return dict(json.loads(out.strip().splitlines()[-1]))


def _spread(xs: list[float]) -> dict[str, float] | None:
    return bench_datapath._spread(xs) if xs else None


def _paired(ours: list[float], ref: list[float]) -> float:
    return round(statistics.median(a / b for a, b in zip(ours, ref, strict=True)), 3)


def datapath(args: argparse.Namespace, h1: Any, h2: Any, addr: str) -> dict[str, Any]:
    """``--rounds`` interleaved rounds of perftest, ours and the TCP stream."""
    size, batch = args.block, args.batch
    reps = max(2, min(16, (512 << 20) // (size * batch)))
    total = reps * batch * size  # the bytes one round of gets moves
    perf: list[float] = []
    gets: list[float] = []
    puts: list[float] = []
    tcp: list[float] = []
    exact = True
    perf_error = None
    for r in range(args.rounds):
        if not args.no_perftest and perf_error is None:
            try:
                perf.append(
                    bench_datapath.ucx_perftest(
                        size,
                        TLS,
                        iters=max(50, total // size),
                        server_prefix=h1.prefix,
                        client_prefix=h2.prefix,
                        host=h1.ip,
                    )
                )
            except (RuntimeError, OSError, subprocess.SubprocessError) as e:
                perf_error = f"{type(e).__name__}: {e}"[:500]
                print(f"ucx_perftest failed, not measured further: {perf_error}", flush=True)
        got = ours(h2, addr, size, batch, reps)
        gets.append(got["get_gbps"])
        puts.append(got["put_gbps"])
        exact = exact and got["byte_exact"]
        tcp.append(tcp_stream(h1, h2, args.tcp_message, total))
        print(
            f"round {r + 1}: get {gets[-1]:.2f} GB/s, put {puts[-1]:.2f} GB/s,"
            f" TCP stream {tcp[-1]:.2f} GB/s"
            + (f", ucx_perftest {perf[-1]:.2f} GB/s" if len(perf) == r + 1 else ""),
            flush=True,
        )
    get_gbps, put_gbps, tcp_gbps = (round(statistics.median(x), 3) for x in (gets, puts, tcp))
    return {
        "block_bytes": size,
        "batch": batch,
        "bytes_per_round": total,
        "get_gbps": get_gbps,
        "put_gbps": put_gbps,
        "tcp_stream_gbps": tcp_gbps,
        "get_ratio": round(get_gbps / tcp_gbps, 3),
        "put_ratio": round(put_gbps / tcp_gbps, 3),
        # each round's own ratio (ours and the stream back to back), median: steadier
        # than the ratio of medians when the machine's load swings between rounds
        "get_ratio_paired": _paired(gets, tcp),
        "put_ratio_paired": _paired(puts, tcp),
        "ucx_perftest_gbps": round(statistics.median(perf), 3) if perf else None,
        "ucx_perftest_error": perf_error,
        "byte_exact": exact,
        "get_rounds": _spread(gets),
        "put_rounds": _spread(puts),
        "tcp_stream_rounds": _spread(tcp),
        "ucx_perftest_rounds": _spread(perf),
    }


def start_h1_server(h1: Any, pool: str) -> Any:
    """A ``pegaflow-server`` on h1, bound to h1's address, pool in h1's ``/dev/shm``."""
    from pegaflow.tools.devcluster import start_server

    return start_server(
        prefix=h1.prefix,
        env={"UCX_TLS": TLS},
        extra=[
            "--coordinator-host", h1.ip,
            "--node-host", h1.ip,
            "--coordinator-http-port", "-1",
            "--node-http-port", "-1",
            "--node-pool-bytes", pool,
            "--node-slab-bytes", "64MiB",
            "--node-shm-dir", "/dev/shm",  # h1's own: removed with the hosts
            "--node-fresh-pool",
        ],
    )  # fmt: skip


def ttft(args: argparse.Namespace, h2: Any, coordinator: str) -> dict[str, Any]:
    """``scripts/bench_vllm_ttft.py`` on h2 against ``coordinator``; its JSON answer."""
    argv = [
        sys.executable, str(SCRIPTS / "bench_vllm_ttft.py"),
        "--coordinator", coordinator,
        "--lengths", args.ttft_lengths,
        "--prompts", str(args.ttft_prompts),
    ]  # fmt: skip
    p = subprocess.Popen(
        [*h2.prefix, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env={**os.environ, "UCX_TLS": TLS, "PYTHONUNBUFFERED": "1"},
    )
    last = ""
    try:
        assert p.stdout is not None
        for line in p.stdout:
            line = line.rstrip("\n")
            print(f"  [ttft] {line}", flush=True)
            if line.startswith("{"):
                last = line
        p.wait()
    finally:
        if p.poll() is None:  # interrupted: let it stop its engines (SIGINT: its finally)
            p.send_signal(signal.SIGINT)
            try:
                p.wait(90)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
    if p.returncode != 0 or not last:
        raise RuntimeError(f"bench_vllm_ttft.py on h2 failed with code {p.returncode}")
    res = dict(json.loads(last))
    top = res["points"][-1]
    return {
        "tokens": res["tokens"],
        "cold_ttft_ms": res["ttft_cold_ms"],
        "warm_ttft_ms": res["ttft_warm_ms"],
        "local_hit_ttft_ms": res["ttft_local_hit_ms"],
        "warm_over_cold": res["warm_over_cold"],
        "cold_ms": top["cold_ms"],
        "warm_ms": top["warm_ms"],
        "warm_cached_tokens": top["warm_cached_tokens"],
        "ttft": res,
    }


def _kill_namespace(netns: str) -> None:
    """SIGKILL whatever still runs in network namespace ``netns`` (one this script made:
    every process in it was started here), so that the namespace can go."""
    out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
    for pid in out.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from pegaflow.config import parse_size

    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=5, help="interleaved data-path rounds")
    ap.add_argument("--block", type=parse_size, default=2 << 20, help="block size (2MiB)")
    ap.add_argument("--batch", type=int, default=32, help="blocks per get or put")
    ap.add_argument(
        "--tcp-message", type=parse_size, default=64 << 20, help="TCP stream message (64MiB)"
    )
    ap.add_argument("--pool", default="2GiB", help="pool of h1's node")
    ap.add_argument("--no-perftest", action="store_true", help="skip ucx_perftest")
    ap.add_argument("--skip-ttft", action="store_true", help="data path only")
    ap.add_argument("--ttft-lengths", default="2048,8192", help="prompt lengths (tokens)")
    ap.add_argument("--ttft-prompts", type=int, default=3, help="prompts per length")
    ap.add_argument("--ttft-pool", default="2GiB", help="pool of h1's node for the TTFT part")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.batch < 1 or args.block < 1 or args.tcp_message < 1:
        ap.error("--rounds, --batch, --block and --tcp-message must be positive")
    return args


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--_client"]:
        addr, size, batch, reps = argv[1:5]
        _client_role(addr, int(size), int(batch), int(reps))
        return
    if argv[:2] == ["--_tcp", "recv"]:
        _tcp_recv_role(argv[2], int(argv[3]), int(argv[4]))
        return
    if argv[:2] == ["--_tcp", "send"]:
        _tcp_send_role(argv[2], int(argv[3]), int(argv[4]), int(argv[5]))
        return
    args = parse_args(argv)

    import tests.support.netns_hosts as netns_hosts

    why = netns_hosts.available()
    if why:
        raise SystemExit(f"cannot make hosts here: {why}")
    signal.signal(signal.SIGTERM, _interrupt)

    result: dict[str, Any] = {"loadavg_start": [round(x, 2) for x in os.getloadavg()]}
    hosts = netns_hosts.NetHosts()
    server = None
    try:
        h1, h2 = hosts.add_host("h1"), hosts.add_host("h2")
        server = start_h1_server(h1, args.pool)
        addr = server.ready["ucx"]
        print(f"hosts h1 {h1.ip} (pegaflow-server, node at {addr}), h2 {h2.ip}", flush=True)
        result.update(datapath(args, h1, h2, addr))
        server.terminate()
        server = None
        if not args.skip_ttft:
            # a fresh server: the data path's 2 MiB blocks hold the pool's slabs
            server = start_h1_server(h1, args.ttft_pool)
            result.update(ttft(args, h2, server.ready["coordinator"]))
    finally:
        if server is not None:
            server.terminate()
        for h in hosts.hosts.values():
            _kill_namespace(h.netns)
        hosts.close()
    result["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    result["rounds"] = args.rounds
    result["cpu_count"] = os.cpu_count()
    print(
        f"{args.block >> 10} KiB x{args.batch}: get {result['get_gbps']:.2f} GB/s"
        f" ({result['get_ratio']:.2f} x TCP), put {result['put_gbps']:.2f} GB/s"
        f" ({result['put_ratio']:.2f} x TCP; paired by round {result['get_ratio_paired']:.2f},"
        f" {result['put_ratio_paired']:.2f}), TCP stream {result['tcp_stream_gbps']:.2f} GB/s,"
        f" ucx_perftest {result['ucx_perftest_gbps']} GB/s",
        flush=True,
    )
    if "warm_over_cold" in result:
        print(
            f"TTFT {result['tokens']} tokens across hosts: cold {result['cold_ttft_ms']:.1f} ms,"
            f" warm {result['warm_ttft_ms']:.1f} ms, warm/cold {result['warm_over_cold']:.3f}",
            flush=True,
        )
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
