"""Fuzzing of the control protocol, the node's request parser, UCX worker addresses
from the network, and the node's same-host control socket.

Thousands of malformed frames go to a real coordinator (over TCP) and a real node
process (over UCX, its UCX handshake port and its Unix control socket): every reply
must be a typed error (or a valid answer), every connection is answered or closed
within its deadline, the service must keep serving, and no stored block may change.
Mutants of real UCX worker addresses also go to the address parser in-process and, the
accepted ones, to a real UCX worker in a subprocess.  ``PEGAFLOW_FUZZ_SCALE`` (a
factor) and ``PEGAFLOW_FUZZ_SEED`` make the UCX-address and control-socket fuzzing
longer or different for a local run.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import shutil
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Coroutine, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pegaflow.client.data import DataClient

from pegaflow.checksum import checksum
from pegaflow.errors import ERRORS_BY_CODE
from pegaflow.protocol.codec import PROTOCOL_VERSION, pack, unpack
from pegaflow.protocol.framing import encode_frame
from pegaflow.tools.devcluster import Proc, start_node, start_server
from pegaflow.transport import rpc_server
from pegaflow.transport import ucx as pucx
from pegaflow.transport.rpc_client import RpcClient
from pegaflow.transport.ucx import UcxWorker, close_endpoint
from pegaflow.transport.ucx_address import (
    SELF,
    SHARED_MEMORY,
    TCP,
    AddressPolicy,
    InvalidWorkerAddress,
    WorkerAddress,
    check_peer_address,
    pack_worker_address,
    parse_worker_address,
    peer_on_this_host,
    tl_name_csum,
)

pytestmark = pytest.mark.ucx

T = TypeVar("T")
NS = "fuzz"
TYPED = set(ERRORS_BY_CODE)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=20),
    st.binary(max_size=80),
)
values = st.recursive(
    scalars,
    lambda c: st.lists(c, max_size=6) | st.dictionaries(st.text(max_size=8), c, max_size=6),
    max_leaves=20,
)


def request(ops: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    """Maps that look like requests: a known op (mostly) with random fields."""
    fields = st.dictionaries(
        st.sampled_from(
            [
                "id",
                "ns",
                "seq",
                "blocks",
                "hashes",
                "shards",
                "xxh3",
                "count",
                "block_bytes",
                "args",
                "deadline_ms",
                "token",
                "version",
            ]
        ),
        values,
        max_size=6,
    )
    return st.builds(lambda op, f: {**f, "op": op}, st.sampled_from([*ops, "nope", ""]), fields)


class LoopThread:
    """An event loop on its own thread, so sync hypothesis tests can drive async code."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


# ---- the node's data-plane parser --------------------------------------------------------


class NodeUnderFuzz:
    def __init__(self, node: Proc, lt: LoopThread) -> None:
        self.node = node
        self.lt = lt
        self.addr = node.ready["ucx"]
        self.data = np.random.default_rng(1).integers(0, 255, size=(4, 64 << 10), dtype=np.uint8)
        self.hashes = [bytes([i]) * 32 for i in range(4)]

    async def setup(self) -> None:
        self.client = DataClient()
        res = await self.client.put(
            self.addr, NS, [(h, 0, self.data[i]) for i, h in enumerate(self.hashes)], 10
        )
        assert res.stored == 4
        self.w = UcxWorker()
        host, port = self.addr.rsplit(":", 1)
        self.ep = await self.w.connect(host, int(port), 2)
        self.hello = await self.ask(pack({"op": "hello", "id": 0, "version": PROTOCOL_VERSION}))
        assert self.hello["ok"]

    async def ask(self, payload: bytes) -> dict[str, Any]:
        r = self.w.am_recv(self.ep)
        await self.w.wait(self.w.am_send(self.ep, payload), 5)
        await self.w.wait(r, 5)
        return unpack(bytes(r.recv_buffer), 1 << 20)

    async def intact(self) -> bool:
        out = np.zeros_like(self.data)
        ok = await self.client.get(
            self.addr, NS, [(h, 0, out[i]) for i, h in enumerate(self.hashes)], 10
        )
        return all(ok) and all(checksum(out[i]) == checksum(self.data[i]) for i in range(4))

    async def teardown(self) -> None:
        close_endpoint(self.ep)
        self.w.close()
        await self.client.close()


@pytest.fixture(scope="module")
def fuzz_node() -> Iterator[NodeUnderFuzz]:
    lt = LoopThread()
    node = start_node(
        "fuzz",
        pool="32MiB",
        slab="4MiB",
        extra=["--node-max-request-bytes", str(CONTROL_MAX_FRAME)],
    )
    f = NodeUnderFuzz(node, lt)
    lt.run(f.setup())
    yield f
    lt.run(f.teardown())
    node.kill()
    lt.stop()


CONTROL_MAX_FRAME = 65536
"""the fuzzed node's request size limit (UCX messages and control-socket frames)"""

NODE_OPS = ["hello", "get", "reserve", "commit", "abort", "stats"]


@settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck))
@given(frame=st.one_of(request(NODE_OPS).map(pack), st.binary(max_size=200)))
def test_node_parser_survives_malformed_frames(fuzz_node: NodeUnderFuzz, frame: bytes) -> None:
    reply = fuzz_node.lt.run(fuzz_node.ask(frame))
    if reply.get("ok") is False:
        assert reply["error"]["code"] in TYPED, reply


def test_node_blocks_intact_after_fuzzing(fuzz_node: NodeUnderFuzz) -> None:
    # runs after the fuzzer (file order): reservations it left are harmless and the
    # stored blocks are untouched
    assert fuzz_node.lt.run(fuzz_node.intact())


def test_node_refuses_an_oversized_message(fuzz_node: NodeUnderFuzz) -> None:
    reply = fuzz_node.lt.run(fuzz_node.ask(pack({"op": "get", "blob": b"x" * 100_000})))
    assert reply["ok"] is False and reply["error"]["code"] == "too_large"
    assert fuzz_node.lt.run(fuzz_node.intact())


# ---- the control protocol ----------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[Proc]:
    p = start_server(
        extra=[
            "--node-pool-bytes",
            "16MiB",
            "--node-slab-bytes",
            "4MiB",
            "--coordinator-max-frame-bytes",
            "65536",
        ]
    )
    yield p
    p.kill()


def _connect(addr: str) -> socket.socket:
    host, port = addr.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=5)
    s.sendall(encode_frame({"op": "hello", "version": PROTOCOL_VERSION, "token": None}))
    _read(s)
    return s


def _read(s: socket.socket) -> Any:
    head = b""
    while len(head) < 4:
        chunk = s.recv(4 - len(head))
        if not chunk:
            return None
        head += chunk
    (n,) = struct.unpack("!I", head)
    body = b""
    while len(body) < n:
        chunk = s.recv(n - len(body))
        if not chunk:
            return None
        body += chunk
    return unpack(body, 1 << 24)


CONTROL_OPS = ["lookup", "place", "status", "nodes"]


@pytest.fixture(scope="module")
def control_conn(server: Proc) -> Iterator[socket.socket]:
    s = _connect(server.ready["coordinator"])
    yield s
    s.close()


@settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    req=st.one_of(
        st.builds(
            lambda i, r: {"id": i, **r, "args": r}, st.integers(0, 2**62), request(CONTROL_OPS)
        ),
        values,
    )
)
def test_control_protocol_survives_malformed_requests(
    control_conn: socket.socket, req: Any
) -> None:
    control_conn.sendall(encode_frame(req))
    reply = _read(control_conn)
    assert isinstance(reply, dict), reply
    if reply.get("ok") is False:
        assert reply["error"]["code"] in TYPED, reply


def test_control_protocol_still_serving_after_fuzzing(server: Proc) -> None:
    _still_serving(server)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(junk=st.binary(min_size=1, max_size=300))
def test_control_protocol_survives_garbage_bytes(server: Proc, junk: bytes) -> None:
    s = _connect(server.ready["coordinator"])
    try:
        s.sendall(junk)
        s.shutdown(socket.SHUT_WR)
        while _read(s) is not None:  # typed error replies, then the server closes
            pass
    except OSError:
        pass
    finally:
        s.close()
    _still_serving(server)


def test_control_protocol_refuses_an_oversized_frame(server: Proc) -> None:
    s = _connect(server.ready["coordinator"])
    try:
        s.sendall(struct.pack("!I", 1 << 30))
        reply = _read(s)
        assert reply is not None and reply["error"]["code"] == "too_large"
    finally:
        s.close()
    _still_serving(server)


def _still_serving(server: Proc) -> None:
    async def go() -> None:
        c = RpcClient([server.ready["coordinator"]], timeout=5)
        try:
            res = await c.call("lookup", {"ns": NS, "hashes": [b"a" * 32], "shards": [0]})
            assert res["hits"] == 0
        finally:
            await c.close()

    asyncio.run(go())


# ---- UCX worker addresses from the network -----------------------------------------------
#
# A peer's worker address goes to UCX's unpacker, which trusts every byte; the node must
# refuse what UCX cannot take (pegaflow.transport.ucx_address) and keep serving.
# PEGAFLOW_FUZZ_SCALE multiplies the number of inputs below (e.g. 20 for a longer local run).

FUZZ_SCALE = float(os.environ.get("PEGAFLOW_FUZZ_SCALE", "1"))
FUZZ_SEED = int(os.environ.get("PEGAFLOW_FUZZ_SEED", "0"))
"""added to every seed below: another value explores other inputs"""


def scaled(n: int) -> int:
    """``n`` inputs times PEGAFLOW_FUZZ_SCALE."""
    return max(1, int(n * FUZZ_SCALE))


ADDRESS_CONFIGS: dict[str, dict[str, str]] = {
    "default": {},
    "tcp": {"TLS": "tcp"},
    "lo": {"NET_DEVICES": "lo"},
    "tcp-lo": {"TLS": "tcp", "NET_DEVICES": "lo"},
    "sm": {"TLS": "sm,self"},
    "v2": {"ADDRESS_VERSION": "v2"},
    "v2-lo": {"ADDRESS_VERSION": "v2", "NET_DEVICES": "lo"},
    "debug-info": {"ADDRESS_DEBUG_INFO": "y", "NET_DEVICES": "lo"},
}
"""UCX worker configurations whose addresses are fuzzed and must be accepted"""

_INTERESTING = (0x00, 0x01, 0x02, 0x0F, 0x10, 0x1F, 0x20, 0x3F, 0x40, 0x7F, 0x80, 0x85, 0xFF)


def make_worker(config: dict[str, str]) -> Any:
    """A bare UCX worker (not progressed: its address is all that is needed)."""
    ctx = pucx.ucx_api.UCXContext(
        config_dict=dict(config),
        feature_flags=(pucx.ucx_api.Feature.TAG, pucx.ucx_api.Feature.AM),
    )
    return pucx.ucx_api.UCXWorker(ctx)


def worker_address(w: Any) -> bytes:
    return bytes(w.address.tobytes())


def _structural(rng: random.Random, src: bytes) -> bytes:
    """A well-encoded address with one field of ``src`` changed (lengths, indices,
    checksums, attributes: what only the policy can refuse)."""
    a = parse_worker_address(src)
    devs = [list(d.transports) for d in a.devices]
    di = rng.randrange(len(devs))
    d = a.devices[di]
    ti = rng.randrange(len(devs[di]))
    t = devs[di][ti]
    junk = rng.randbytes(rng.choice((0, 1, 2, 4, 6, 7, 8, 9, 16, 17, 18, 19, 31, 40)))
    op = rng.randrange(10)
    new_dev = d
    if op == 9:  # one attribute edge value in every transport (so the lanes use it)
        seed = rng.randrange(1 << 30)
        devs = [
            [replace(tt, attrs=_attrs(random.Random(seed), tt.attrs)) for tt in ts] for ts in devs
        ]
    elif op == 0:
        devs[di][ti] = replace(t, tl_csum=rng.choice([*CSUMS, rng.randrange(1 << 16)]))
    elif op == 1:
        devs[di][ti] = replace(t, iface_addr=junk)
    elif op == 2:
        new_dev = replace(d, dev_addr=junk)
    elif op == 3:
        new_dev = replace(d, md_index=rng.choice((0, 1, 5, 31, 63, 64, 100, 126)))
    elif op == 4:
        new_dev = replace(d, num_paths=rng.randrange(1, 256), sys_dev=rng.randrange(256))
    elif op == 5:
        devs[di][ti] = replace(t, attrs=_attrs(rng, t.attrs))
    elif op == 6:
        devs[di].append(t)  # a transport twice
    elif op == 7 and len(devs[di]) > 1:
        del devs[di][ti]
    elif op == 8:
        a = replace(a, uuid=rng.randrange(1 << 64), release=rng.randrange(16))
    new = [
        replace(new_dev if i == di else dd, transports=tuple(devs[i]))
        for i, dd in enumerate(a.devices)
    ]
    return pack_worker_address(replace(a, devices=tuple(new)))


CSUMS = [tl_name_csum(n) for n in ("tcp", "self", "posix", "sysv", "cma", "rc_verbs")]


_FLOATS = (0.0, -0.0, -1.0, 1e-45, 1e-30, 1e-9, 0.5, 1.0, 2.0, 1e10, 1e30, math.inf, math.nan)


def _attrs(rng: random.Random, attrs: bytes) -> bytes:
    """Interface attributes with one field set to an edge value."""
    if len(attrs) == 16:  # format v1: overhead, bandwidth, latency (float32), flags
        fields = list(struct.unpack("<fffI", attrs))
        i = rng.randrange(5)
        if i < 3:
            fields[i] = rng.choice(_FLOATS)
        elif i == 3:
            fields[3] ^= 1 << rng.randrange(32)
        else:
            fields[3] = (fields[3] & ~0xFF) | rng.choice(_INTERESTING)
        return struct.pack("<fffI", *fields)
    # format v2: fp8 overhead, bandwidth, latency; priority; segment size / 64; flags
    fields = list(struct.unpack("<BBBBHH", attrs))
    i = rng.randrange(6)
    if i < 4:
        fields[i] = rng.choice(_INTERESTING)
    elif i == 4:
        fields[4] = rng.choice((0, 1, 2, 15, 16, 17, 0x7FFF, 0xFFFF))
    else:
        fields[5] ^= 1 << rng.randrange(16)
    return struct.pack("<BBBBHH", *fields)


def mutate(rng: random.Random, src: bytes, others: list[bytes]) -> bytes:
    """A mutant of the real address ``src``: bit flips, byte changes, length fields off
    by a little, truncations, insertions, deletions, splices, or one structural change."""
    if rng.random() < 0.25:
        return _structural(rng, src)
    b = bytearray(src)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        op = rng.randrange(8)
        i = rng.randrange(len(b)) if b else 0
        if op == 0 and b:
            b[i] ^= 1 << rng.randrange(8)
        elif op == 1 and b:
            b[i] = rng.choice(_INTERESTING)
        elif op == 2 and b:
            b[i] = rng.randrange(256)
        elif op == 3 and b:
            b[i] = (b[i] + rng.choice((-2, -1, 1, 2))) & 0xFF
        elif op == 4:
            del b[rng.randrange(len(b) + 1) :]
        elif op == 5:
            b[i:i] = bytes(rng.choice(_INTERESTING) for _ in range(rng.randint(1, 4)))
        elif op == 6 and b:
            del b[i : i + rng.randint(1, 4)]
        else:
            other = rng.choice(others)
            b = b[:i] + other[rng.randrange(len(other) + 1) :]
    return bytes(b)


def safe_for_this_host(policy: AddressPolicy, addr: WorkerAddress, originals: set[Any]) -> bool:
    """Whether the entries of ``addr`` that name this host are ones of real, live
    workers of ours: only such an address may be taken on this (shared) machine, else
    UCX would map other processes' shared memory or dial other local ports.  (The
    node takes such entries only from a connection from this host, whose peer could
    name them anyway.)"""
    return all(
        (t.tl_csum, d.dev_addr, t.iface_addr) in originals
        for d, t in addr.transports()
        if policy.names_this_host(t, d.dev_addr)
    )


def entries_of(addresses: list[bytes]) -> set[Any]:
    return {
        (t.tl_csum, d.dev_addr, t.iface_addr)
        for a in addresses
        for d, t in parse_worker_address(a).transports()
    }


@pytest.fixture(scope="module")
def address_workers() -> dict[str, Any]:
    """A live worker of each of ADDRESS_CONFIGS."""
    return {name: make_worker(cfg) for name, cfg in ADDRESS_CONFIGS.items()}


def test_real_addresses_are_accepted(address_workers: dict[str, Any]) -> None:
    """Every address of this machine's workers (tcp, shared memory, self; all devices or
    loopback only; both address formats) is taken by a worker packing the same format;
    the other format is refused with what to do."""
    addresses = {n: worker_address(w) for n, w in address_workers.items()}
    for name, own in addresses.items():
        policy = AddressPolicy(own)
        for peer_name, peer in addresses.items():
            if policy.own.fmt != parse_worker_address(peer).fmt:
                with pytest.raises(InvalidWorkerAddress, match="UCX_ADDRESS_VERSION"):
                    policy.check(peer, from_this_host=True)
                continue
            addr = policy.check(peer, from_this_host=True)
            assert pack_worker_address(addr) == peer, (name, peer_name)
            assert check_peer_address(peer, own, from_this_host=True) == peer


def test_address_from_another_host_may_not_name_this_host(
    address_workers: dict[str, Any],
) -> None:
    own = worker_address(address_workers["default"])
    policy = AddressPolicy(own)
    peer = parse_worker_address(worker_address(address_workers["lo"]))
    with pytest.raises(InvalidWorkerAddress, match="names this host"):
        policy.check(pack_worker_address(peer), from_this_host=False)
    # the same peer as seen from another host: its own host id, another IP
    remote = worker_address(address_workers["tcp"])
    a = parse_worker_address(remote)
    other = tuple(
        replace(d, dev_addr=bytes([0, 2, 10, 9, 8, 7])) for d in a.devices if len(d.dev_addr) == 6
    )
    moved = pack_worker_address(replace(a, devices=other))
    assert policy.check(moved, from_this_host=False).uuid == a.uuid
    with pytest.raises(InvalidWorkerAddress, match="own worker"):
        policy.check(pack_worker_address(replace(peer, uuid=policy.own.uuid)), from_this_host=True)


@pytest.mark.parametrize(
    "data",
    [
        b"\2",  # the 5-byte packet's address: format 2 (UCX asserts on it)
        b"\0",
        b"",
        b"\x20" + bytes(8),  # a header and id, no device
        b"\x20" + bytes(8) + b"\xff",  # no transports
        b"\x0f" * 40,
        bytes(range(256)),
    ],
)
def test_address_parser_refuses(address_workers: dict[str, Any], data: bytes) -> None:
    own = worker_address(address_workers["default"])
    with pytest.raises(InvalidWorkerAddress):
        check_peer_address(data, own, from_this_host=True)


def test_address_parser_survives_mutations(address_workers: dict[str, Any]) -> None:
    """>= 100,000 mutants of real addresses: each is accepted or refused with
    InvalidWorkerAddress, never anything else; both happen."""
    addresses = [worker_address(w) for w in address_workers.values()]
    policies = [AddressPolicy(a) for a in addresses]
    rng = random.Random(20261201 + FUZZ_SEED)
    accepted = refused = 0
    for i in range(scaled(100_000)):
        if i % 50 == 0:
            m = rng.randbytes(rng.randrange(300))
        else:
            m = mutate(rng, rng.choice(addresses), addresses)
        policy = policies[i % len(policies)]
        try:
            policy.check(m, from_this_host=bool(i & 1))
        except InvalidWorkerAddress:
            refused += 1
        else:
            accepted += 1
    assert accepted > 1000 and refused > 1000, (accepted, refused)


def test_accepted_mutants_are_taken_by_ucx(tmp_path: Path) -> None:
    """Mutants the policy accepts go to a real UCX worker in a subprocess (a UCX crash
    kills the process it happens in): none may kill it.  Half as if from another host
    (relocated addresses), half from this one (then only with this-host entries of the
    subprocess's live workers: a same-host peer may name its own segments, see
    pegaflow.transport.ucx_address).  Inside fresh user, network, IPC and PID namespaces (a veth
    pair in 198.18.0.0/24, a private /dev/shm) where the system allows them, so that the
    taker dials real TCP devices and nothing outside; else with a loopback-only taker."""
    n = scaled(2000)
    argv = [sys.executable, __file__, "take-mutants", str(tmp_path), str(n), str(7 + FUZZ_SEED)]
    sandbox = _sandbox_prefix()
    env = {**os.environ, "PEGAFLOW_TAKE_SANDBOXED": "1" if sandbox else ""}
    p = subprocess.run(
        [*sandbox, *argv] if sandbox else argv,
        capture_output=True,
        text=True,
        timeout=60 + n * 0.5,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
    )
    last = (
        (tmp_path / "current").read_text().strip().splitlines()[-1:]
        if (tmp_path / "current").exists()
        else []
    )
    assert p.returncode == 0, (
        f"UCX died (rc {p.returncode}) taking mutant {last}:\n{p.stdout[-3000:]}\n"
        f"{p.stderr[-3000:]}"
    )
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert summary["taken"] >= n, summary
    assert summary["taken_remote"] > 0 and summary["taken_local"] > 0, summary


_SANDBOX_SETUP = (
    "ip link set lo up && ip link add v0 type veth peer name v1"
    " && ip addr add 198.18.0.1/24 dev v0 && ip addr add 198.18.0.2/24 dev v1"
    ' && ip link set v0 up && ip link set v1 up && mount -t tmpfs tmpfs /dev/shm && exec "$@"'
)


def _sandbox_prefix() -> list[str]:
    """The command prefix that runs a command in fresh namespaces, [] where not allowed."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return []
    prefix = [
        "unshare", "--user", "--map-root-user", "--net", "--ipc", "--pid", "--fork",
        "--mount", "--mount-proc", "sh", "-c", _SANDBOX_SETUP, "sandbox",
    ]  # fmt: skip
    try:
        ok = subprocess.run([*prefix, "true"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return prefix if ok else []


def relocate(rng: random.Random, src: bytes) -> bytes:
    """``src`` as if packed on another host: random shared-memory host ids, loopback
    namespaces and ``self`` interfaces, IPv4 device addresses moved into 198.18.0.0/24
    (nothing of these is reachable from here)."""
    a = parse_worker_address(src)
    devices = []
    for d in a.devices:
        csums = {t.tl_csum for t in d.transports}
        dev = d.dev_addr
        if csums & SHARED_MEMORY and len(dev) >= 8:
            dev = rng.randbytes(7) + bytes([(rng.randrange(128) | (dev[7] & 0x80))]) + dev[8:]
        elif TCP in csums and dev[:1] == b"\1":
            dev = dev[:2] + rng.randbytes(len(dev) - 2)
        elif TCP in csums and len(dev) == 6:
            dev = dev[:2] + bytes([198, 18, 0, rng.randrange(3, 250)])
        ts = tuple(
            replace(t, iface_addr=rng.randbytes(8)) if t.tl_csum == SELF else t
            for t in d.transports
        )
        devices.append(replace(d, dev_addr=dev, transports=ts))
    return pack_worker_address(replace(a, devices=tuple(devices), uuid=rng.randrange(1 << 64)))


def _take_mutants(out: Path, n: int, seed: int) -> None:
    """The subprocess of test_accepted_mutants_are_taken_by_ucx."""
    sandboxed = bool(os.environ.get("PEGAFLOW_TAKE_SANDBOXED"))
    rng = random.Random(seed)
    api = pucx.ucx_api
    # the takers: every device in the sandbox (lo, a veth pair in 198.18.0.0/24), else lo
    base = {} if sandboxed else {"NET_DEVICES": "lo"}
    takers = [make_worker(base), make_worker({**base, "ADDRESS_VERSION": "v2"})]
    workers = [*takers, *(make_worker(c) for c in ADDRESS_CONFIGS.values())]
    sources = [worker_address(w) for w in workers]
    elsewhere = [relocate(rng, a) for a in sources for _ in range(4)]
    originals = entries_of(sources)
    policies = [AddressPolicy(worker_address(t)) for t in takers]
    current = open(out / "current", "w")
    taken = {True: 0, False: 0}
    failed = tries = 0

    def progress(rounds: int) -> None:
        for _ in range(rounds):
            for w in workers:
                w.progress()

    while sum(taken.values()) < n and tries < 500 * n:
        tries += 1
        k = rng.randrange(len(takers))
        local = rng.random() < 0.5
        m = mutate(rng, rng.choice(sources if local else elsewhere), sources)
        try:
            addr = policies[k].check(m, from_this_host=local)
        except InvalidWorkerAddress:
            continue
        if local and not safe_for_this_host(policies[k], addr, originals):
            continue
        current.write(f"{k} {m.hex()}\n")
        current.flush()
        try:
            ep = api.UCXEndpoint.create_from_worker_address(
                takers[k], api.UCXAddress.create_from_buffer(m), False
            )
        except Exception:
            failed += 1
        else:
            progress(20)
            ep.close()
            progress(5)
        taken[local] += 1
    summary = {
        "taken": sum(taken.values()),
        "taken_local": taken[True],
        "taken_remote": taken[False],
        "refused_by_ucx": failed,
        "tries": tries,
        "sandboxed": sandboxed,
    }
    print(json.dumps(summary), flush=True)


# ---- the node's UCX handshake port ---------------------------------------------------


@pytest.fixture(scope="module")
def handshake_node() -> Iterator[Proc]:
    node = start_node("fuzz-handshake", pool="16MiB", slab="4MiB")
    yield node
    node.kill()


async def _handshake(host: str, port: int, payload: bytes, half_close: bool = True) -> bytes:
    """Send ``payload`` to the handshake port; what came back before the node closed."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(payload)
        await writer.drain()
        if half_close:
            writer.write_eof()
        return await reader.read()
    except ConnectionError:
        return b""
    finally:
        writer.close()


def _frame(address: bytes) -> bytes:
    return struct.pack("!I", len(address)) + address


def handshake_inputs(
    rng: random.Random, live: list[bytes], node: AddressPolicy, n: int
) -> list[bytes]:
    """``n`` handshake payloads: random bytes, length-prefix lies and truncations of
    real addresses, mutants of real addresses (of ``live`` workers and as if from other
    hosts), real addresses.  Mutants the node would take only if their this-host
    entries are those of ``live`` workers (see safe_for_this_host)."""
    originals = entries_of(live)
    sources = live + [relocate(rng, a) for a in live]
    out = []
    while len(out) < n:
        kind = rng.randrange(10)
        src = rng.choice(sources)
        if kind == 0:
            out.append(rng.randbytes(rng.randrange(1, 64)))
        elif kind == 1:  # a length prefix that lies (short, long, zero, huge)
            n_claim = rng.choice((0, 1, len(src) + 1, len(src) * 2, 1 << 20, 0xFFFFFFFF))
            out.append(struct.pack("!I", n_claim) + src[: rng.randrange(len(src) + 1)])
        elif kind == 2:  # a truncated frame
            f = _frame(src)
            out.append(f[: rng.randrange(1, len(f))])
        elif kind == 3 and rng.random() < 0.1:
            out.append(_frame(src))
        else:
            m = mutate(rng, src, sources)
            try:
                addr = node.check(m, from_this_host=True)
            except InvalidWorkerAddress:
                pass
            else:
                if not safe_for_this_host(node, addr, originals):
                    continue
            out.append(_frame(m))
    return out


def test_handshake_port_survives_fuzzing(
    handshake_node: Proc, address_workers: dict[str, Any]
) -> None:
    """>= 10,000 inputs to a real node's handshake port: the node answers (with its
    address) or refuses every connection (saying why) within the handshake timeout,
    never dies, and then serves a real client."""
    host, port_s = handshake_node.ready["ucx"].rsplit(":", 1)
    port = int(port_s)
    sources = [worker_address(w) for w in address_workers.values()]

    async def go() -> tuple[int, int]:
        node_addr = await _node_address(host, port, sources[0])
        payloads = handshake_inputs(
            random.Random(99 + FUZZ_SEED),
            [*sources, node_addr],
            AddressPolicy(node_addr),
            scaled(10_000),
        )
        gate = asyncio.Semaphore(32)
        answered = closed = 0

        async def one(p: bytes) -> None:
            nonlocal answered, closed
            async with gate:
                async with asyncio.timeout(pucx.HANDSHAKE_TIMEOUT_S + 10):
                    got = await _handshake(host, port, p)
            if got and not _refused(got):
                assert got == _frame(node_addr), got[:64]
                answered += 1
            else:
                closed += 1

        # a few that stop mid-frame and keep the connection open: the node closes them
        slow = [
            asyncio.ensure_future(_slow(host, port, f))
            for f in (b"\0\0", b"\0\0\0\x40\x20", _frame(node_addr)[:20])
        ]
        await asyncio.gather(*(one(p) for p in payloads))
        await asyncio.gather(*slow)
        return answered, closed

    try:
        answered, closed = asyncio.run(go())
    except OSError as e:
        raise AssertionError(
            f"{e}; the node said:\n" + "\n".join(handshake_node.log[-30:])
        ) from None
    assert handshake_node.alive(), "\n".join(handshake_node.log[-30:])
    assert answered > 0 and closed > 0, (answered, closed)
    _node_serves(handshake_node.ready["ucx"])


def _refused(answer: bytes) -> str | None:
    """The reason of a handshake refusal (a zero length, then msgpack ``{code,
    message}``), None for any other answer."""
    if answer[:4] != b"\0\0\0\0" or len(answer) < 8:
        return None
    (n,) = struct.unpack("!I", answer[4:8])
    msg = msgpack.unpackb(answer[8 : 8 + n])
    assert msg["code"] == "handshake_refused", msg
    return str(msg["message"])


async def _slow(host: str, port: int, partial: bytes) -> None:
    async with asyncio.timeout(pucx.HANDSHAKE_TIMEOUT_S + 10):
        got = await _handshake(host, port, partial, half_close=False)
        assert got == b"" or _refused(got) == "handshake timed out", got


async def _node_address(host: str, port: int, ours: bytes) -> bytes:
    """The node's worker address, as its handshake answers it."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(_frame(ours))
        (n,) = struct.unpack("!I", await reader.readexactly(4))
        return await reader.readexactly(n)
    finally:
        writer.close()


def _recv_all(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(4096):
        out += chunk
    return out


def test_handshake_refuses_a_5_byte_packet(handshake_node: Proc) -> None:
    """The probe that killed nodes: ``printf '\\0\\0\\0\\1\\2'`` to the handshake port."""
    host, port = handshake_node.ready["ucx"].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"\0\0\0\1\2")
        assert "not a UCX" in str(_refused(_recv_all(s)))
    assert handshake_node.alive(), "\n".join(handshake_node.log[-30:])
    _node_serves(handshake_node.ready["ucx"])


_REFUSED_CLIENT = """
import asyncio, sys
from pegaflow.errors import HandshakeRefused
from pegaflow.transport.ucx import UcxWorker

async def main(host: str, port: int) -> None:
    w = UcxWorker({"ADDRESS_VERSION": "v2"})  # the node packs v1 (UCX's default)
    try:
        await w.connect(host, port, 10)
    except HandshakeRefused as e:
        print("refused:", e)
    else:
        print("connected")
    w.close()

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


def test_a_refused_client_is_told_why(handshake_node: Proc) -> None:
    """A client whose UCX address the node cannot take gets a typed error naming the
    cause (it used to read "0 bytes read on a total of 4 expected bytes"), and the
    node says it at WARNING."""
    host, port = handshake_node.ready["ucx"].rsplit(":", 1)
    p = subprocess.run(
        [sys.executable, "-c", _REFUSED_CLIENT, host, port],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "refused:" in p.stdout and "UCX_ADDRESS_VERSION" in p.stdout, p.stdout + p.stderr
    assert any(
        "WARNING" in line and "refused a UCX connection" in line for line in handshake_node.log
    ), "\n".join(handshake_node.log[-30:])


def test_server_with_a_token_survives_the_5_byte_packet() -> None:
    """The same packet killed ``pegaflow-server`` (coordinator and node in one process)
    before any authentication: it must refuse it and keep both serving."""
    token = "fuzz-token"
    server = start_server(
        token=token, extra=["--node-pool-bytes", "16MiB", "--node-slab-bytes", "4MiB"]
    )
    try:
        host, port = server.ready["ucx"].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(b"\0\0\0\1\2")
            assert "not a UCX" in str(_refused(_recv_all(s)))

        async def coordinator_answers() -> None:
            c = RpcClient([server.ready["coordinator"]], token=token, timeout=5)
            try:
                res = await c.call("lookup", {"ns": NS, "hashes": [b"a" * 32], "shards": [0]})
                assert res["hits"] == 0
            finally:
                await c.close()

        asyncio.run(coordinator_answers())
        assert server.alive(), "\n".join(server.log[-30:])
    finally:
        server.kill()


_BAD_ANSWER = """
import asyncio, sys
from pegaflow.errors import Unavailable
from pegaflow.transport.ucx import UcxWorker

async def main(answer: bytes) -> None:
    async def peer(reader, writer):  # a node that answers the handshake with junk
        await reader.read(4)
        writer.write(answer)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(peer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    w = UcxWorker({"NET_DEVICES": "lo"})
    try:
        await w.connect("127.0.0.1", port, 5)
    except Unavailable as e:
        print("refused:", e)
    else:
        print("connected")
    w.close()
    server.close()

asyncio.run(main(bytes.fromhex(sys.argv[1])))
"""


@pytest.mark.parametrize(
    "answer",
    [b"\0\0\0\1\2", b"\0\0\0\2\x20\0", b"\0\0\0\x10" + b"\x51\x02" + bytes(14)],
    ids=["1-byte", "2-byte", "16-byte-v2"],
)
def test_client_refuses_a_bad_handshake_answer(answer: bytes) -> None:
    """A peer answering the client's handshake with a malformed address (a 1-byte one
    aborted the client, a vLLM engine): the client gets Unavailable and lives.  In a
    subprocess, so that an abort would fail this test rather than end the run."""
    p = subprocess.run(
        [sys.executable, "-c", _BAD_ANSWER, answer.hex()],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "refused: cannot connect to UCX" in p.stdout, p.stdout + p.stderr


class _Conn:
    def __init__(self, sock: Any, peer: Any) -> None:
        self.info = {"sockname": sock, "peername": peer}

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.info.get(name, default)


@pytest.mark.parametrize(
    "sock, peer, local",
    [
        (("127.0.0.1", 1), ("127.0.0.1", 2), True),
        (("10.0.0.5", 1), ("127.0.0.9", 2), True),
        (("10.0.0.5", 1), ("10.0.0.5", 2), True),
        (("::ffff:10.0.0.5", 1, 0, 0), ("::ffff:10.0.0.5", 2, 0, 0), True),
        (("::1", 1, 0, 0), ("::1", 2, 0, 0), True),
        (("10.0.0.5", 1), ("10.0.0.6", 2), False),
        (("fe80::1%eth0", 1, 0, 2), ("fe80::2%eth0", 2, 0, 2), False),
        (None, None, False),
        ("/tmp/sock", "", False),
    ],
)
def test_peer_on_this_host(sock: Any, peer: Any, local: bool) -> None:
    assert peer_on_this_host(_Conn(sock, peer)) is local


def _node_serves(addr: str) -> None:
    async def go() -> None:
        client = DataClient()
        try:
            data = np.arange(4096, dtype=np.uint8)
            res = await client.put(addr, NS, [(b"h" * 32, 0, data)], 10)
            assert res.stored + res.skipped == 1, res
            out = np.zeros_like(data)
            assert await client.get(addr, NS, [(b"h" * 32, 0, out)], 10) == [True]
            assert (out == data).all()
        finally:
            await client.close()

    asyncio.run(go())


# ---- the node's same-host control socket -------------------------------------------------

_INTS = (-(2**63), -(2**31), -1, 0, 1, 2, 31, 32, 33, 4095, 4096, 65535, 65536, 2**31,
         2**32, 2**40, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1)  # fmt: skip


def _value(rng: random.Random, depth: int = 0) -> Any:
    """A random msgpack value, biased to edge cases."""
    k = rng.randrange(9 if depth < 2 else 6)
    if k == 0:
        return rng.choice(_INTS)
    if k == 1:
        return rng.choice((None, True, False, math.nan, math.inf, -0.0, 1e308))
    if k == 2:
        return rng.choice(("", NS, "x" * 300, "\u2603", "fuzz/\0", "op"))
    if k == 3:
        return rng.randbytes(rng.choice((0, 1, 31, 32, 33, 64, 4096)))
    if k == 4:
        return rng.randrange(-1000, 100_000)
    if k == 5:
        return b"h" * 32 * rng.choice((1, 2, 3))
    if k == 6:
        if rng.random() < 0.1:  # long: past max_batch
            return [rng.choice(_INTS)] * rng.choice((4096, 4097, 5000))
        return [_value(rng, depth + 1) for _ in range(rng.choice((0, 1, 3)))]
    if k == 7:
        return [[b"h" * 32, rng.choice(_INTS), rng.choice((1, 4096, 2**40, -1))]]
    return {str(_value(rng, depth + 1))[:20]: _value(rng, depth + 1) for _ in range(3)}


def _control_args(rng: random.Random, op: str, pool: list[int] | None = None) -> dict[str, Any]:
    """Arguments that look like ``op``'s (``locate``, ``reserve`` ...) with edge values
    (``pool``: the node's pool file, which a local reservation names)."""
    hl = rng.choice((32, 32, 1, 0, 33, 4096, -1, 2**63))
    count = rng.choice((0, 1, 4, 4097))
    fields: dict[str, Any] = {
        "ns": rng.choice((NS, NS, "", None, "x" * 1000, 7)),
        "ttl_ms": rng.choice((1, 1000, 0, -1, 2**63 - 1, "1", None)),
        "shard": rng.choice((0, 1, 65535, 65536, -1, 2**64 - 1)),
        "hash_len": hl,
        "hashes": rng.randbytes(32) * count if rng.random() < 0.8 else _value(rng),
        "pin": rng.choice(_INTS),
        "seq": rng.choice(_INTS),
        "local": rng.choice((True, True, False, 1, None)),
        "size": rng.choice((1, 4096, 0, -1, 2**40, 2**63, 4 << 20)),
        "xxh3": [rng.choice(_INTS) for _ in range(rng.choice((0, 1, 4)))],
        "blocks": _value(rng),
        "pool": rng.choice((pool, pool, pool, [0, 0], [1], None)),
    }
    keys = {
        "locate": ("ns", "ttl_ms", "shard", "hash_len", "hashes"),
        "unpin": ("pin",),
        "reserve": ("ns", "local", "pool", "shard", "size", "hash_len", "hashes", "blocks"),
        "commit": ("seq", "xxh3"),
        "abort": ("seq",),
    }.get(op, tuple(fields))
    args = {k: fields[k] for k in keys if rng.random() < 0.9}
    if rng.random() < 0.2:
        args[rng.choice(list(fields))] = _value(rng)
    if op == "reserve" and isinstance(args.get("size"), int) and args["size"] > 4096:
        args["hashes"] = rng.randbytes(32)  # big reservations: one block, refused or small
    return args


CONTROL_SOCKET_OPS = ["locate", "unpin", "reserve", "commit", "abort"]


def control_request(rng: random.Random, rid: int, pool: list[int] | None = None) -> Any:
    """A control-protocol request frame's message: mostly well-formed requests of the
    socket's ops with edge-value arguments, some with bad ids, deadlines or shapes."""
    if rng.random() < 0.05:
        return _value(rng)
    op = rng.choice([*CONTROL_SOCKET_OPS, *CONTROL_SOCKET_OPS, "hello", "get", "nope", ""])
    msg: dict[str, Any] = {"id": rid, "op": op, "args": _control_args(rng, op, pool)}
    if rng.random() < 0.2:
        msg["deadline_ms"] = rng.choice((1, 5000, 0, -1, 600_001, 2**63, "x", None))
    if rng.random() < 0.05:
        msg["id"] = rng.choice((None, -1, 2**63, "1", 1.5))
    if rng.random() < 0.05:
        msg["args"] = _value(rng)
    return msg


def _control_garbage(rng: random.Random) -> bytes:
    """What a connection sends before it gives up: junk, lies, bad hellos."""
    hello = encode_frame({"op": "hello", "version": PROTOCOL_VERSION, "token": None})
    k = rng.randrange(7)
    if k == 0:
        return rng.randbytes(rng.randrange(1, 200))
    if k == 1:  # a length prefix far over the limit
        return struct.pack("!I", rng.choice((1 << 24, 1 << 30, 0xFFFFFFFF))) + b"\x80"
    if k == 2:  # a frame cut short
        f = encode_frame(control_request(rng, 1))
        return hello + f[: rng.randrange(1, len(f))]
    if k == 3:  # undecodable msgpack inside a good frame
        body = rng.choice((b"\xc1", b"\xd9\xff", b"\x92\x01", rng.randbytes(20)))
        return hello + struct.pack("!I", len(body)) + body
    if k == 4:  # no hello first
        return encode_frame(control_request(rng, 1))
    if k == 5:  # a hello of the wrong version or shape
        return encode_frame(rng.choice(({"op": "hello", "version": 999}, [1, 2], "hello", {})))
    return hello + encode_frame(_value(rng))


async def _unix_exchange(path: str, payload: bytes, replies: int | None) -> list[Any]:
    """Send ``payload`` and read ``replies`` frames (None: until the node closes)."""
    reader, writer = await asyncio.open_unix_connection(path)
    try:
        try:
            writer.write(payload)
            await writer.drain()
            if replies is None:
                writer.write_eof()
        except ConnectionError:  # closed before it read all (after an error reply)
            assert replies is None, "closed before the requests were read"
        out: list[Any] = []
        while replies is None or len(out) < replies:
            try:
                (n,) = struct.unpack("!I", await reader.readexactly(4))
                out.append(unpack(await reader.readexactly(n), 1 << 24))
            except (asyncio.IncompleteReadError, ConnectionError):
                assert replies is None, f"closed after {len(out)} of {replies} replies"
                break
        return out
    finally:
        writer.close()


def test_control_socket_survives_fuzzing(fuzz_node: NodeUnderFuzz) -> None:
    """>= 10,000 inputs to a real node's same-host control socket: pipelined requests
    with edge values (each answered, with a result or a typed error) and connections
    that send junk (answered or closed within the deadline); the node then still
    serves, and its stored blocks are intact."""
    path = fuzz_node.hello["pool"]["control"]
    pool = [fuzz_node.hello["pool"]["dev"], fuzz_node.hello["pool"]["ino"]]
    rng = random.Random(31337 + FUZZ_SEED)
    hello = encode_frame({"op": "hello", "version": PROTOCOL_VERSION, "token": None})
    n_requests, n_junk = scaled(8_000), scaled(2_000)
    batch = 500

    async def silent() -> None:  # says nothing at all: closed at the handshake timeout
        async with asyncio.timeout(rpc_server.HANDSHAKE_TIMEOUT_S + 10):
            reader, writer = await asyncio.open_unix_connection(path)
            assert await reader.read() != b""  # the timeout's error reply, then EOF
            writer.close()

    async def go() -> int:
        quiet = asyncio.ensure_future(silent())
        answered = 0
        oversized: list[bytes] = []  # refused as too_large, and the connection closed
        for start in range(0, n_requests, batch):
            frames = []
            for i in range(min(batch, n_requests - start)):
                f = encode_frame(control_request(rng, start + i, pool))
                (oversized if len(f) > CONTROL_MAX_FRAME else frames).append(f)
            async with asyncio.timeout(60):
                replies = await _unix_exchange(path, hello + b"".join(frames), len(frames) + 1)
            assert replies[0]["ok"], replies[0]
            for r in replies[1:]:
                assert isinstance(r, dict) and isinstance(r.get("ok"), bool), r
                if not r["ok"]:
                    assert r["error"]["code"] in TYPED, r
            answered += len(replies) - 1
        gate = asyncio.Semaphore(16)
        for f in oversized:
            assert (await _unix_exchange(path, hello + f, None))[-1]["error"]["code"] == "too_large"
            answered += 1

        async def junk(p: bytes) -> None:
            async with gate, asyncio.timeout(rpc_server.HANDSHAKE_TIMEOUT_S + 10):
                for r in await _unix_exchange(path, p, None):
                    if isinstance(r, dict) and r.get("ok") is False:
                        assert r["error"]["code"] in TYPED, r

        await asyncio.gather(*(junk(_control_garbage(rng)) for _ in range(n_junk)))
        await quiet
        return answered

    assert asyncio.run(go()) == n_requests
    assert fuzz_node.node.alive(), "\n".join(fuzz_node.node.log[-30:])

    async def serves() -> None:
        c = RpcClient([f"unix:{path}"], timeout=5)
        try:
            res = await c.call(
                "locate",
                {"ns": NS, "ttl_ms": 1000, "shard": 0, "hash_len": 32,
                 "hashes": b"".join(fuzz_node.hashes)},
            )  # fmt: skip
            assert "pin" in res, res
        finally:
            await c.close()

    asyncio.run(serves())
    assert fuzz_node.lt.run(fuzz_node.intact())


if __name__ == "__main__" and sys.argv[1:2] == ["take-mutants"]:
    _take_mutants(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
