"""Fuzzing (hypothesis) of the control protocol and of the node's request parser.

Thousands of malformed frames go to a real coordinator (over TCP) and a real node
process (over UCX): every reply must be a typed error (or a valid answer), the service
must keep serving, and no stored block may change.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pegaflow.client.data import DataClient

from pegaflow.checksum import checksum
from pegaflow.devcluster import Proc, start_node, start_server
from pegaflow.errors import ERRORS_BY_CODE
from pegaflow.rpc import RpcClient, encode_frame
from pegaflow.ucx import UcxWorker, close_endpoint
from pegaflow.wire import PROTOCOL_VERSION, pack, unpack

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
        assert (await self.ask(pack({"op": "hello", "id": 0, "version": PROTOCOL_VERSION})))["ok"]

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
        "fuzz", pool="32MiB", slab="4MiB", extra=["--node-max-request-bytes", "65536"]
    )
    f = NodeUnderFuzz(node, lt)
    lt.run(f.setup())
    yield f
    lt.run(f.teardown())
    node.kill()
    lt.stop()


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
