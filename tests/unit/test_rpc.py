"""The control protocol (pegaflow.protocol.framing) in one process: handlers, deadlines, limits,
failover, pipelining."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from pegaflow.errors import (
    BadRequest,
    DeadlineExceeded,
    Internal,
    TooLarge,
    Unauthorized,
    Unavailable,
)
from pegaflow.protocol import framing as rpc
from pegaflow.protocol.codec import PROTOCOL_VERSION, pack
from pegaflow.protocol.framing import encode_frame, read_frame
from pegaflow.transport import gil_io, rpc_server
from pegaflow.transport.rpc_blocking import BlockingRpcClient
from pegaflow.transport.rpc_client import RpcClient
from pegaflow.transport.rpc_server import Packed, RpcServer


async def _slow(args: dict[str, Any]) -> Any:
    await asyncio.sleep(args.get("s", 0.0))
    return args.get("v")


def _boom(args: dict[str, Any]) -> Any:
    raise RuntimeError("bug")


def _raw(args: dict[str, Any]) -> Packed:
    return Packed(pack({"n": 1, "b": b"\x00"}))


async def _server(**kw: Any) -> tuple[RpcServer, str]:
    handlers: dict[str, Any] = {
        "echo": lambda a: a,
        "slow": _slow,
        "boom": _boom,
        "raw": _raw,
        "unencodable": lambda a: {"x": object()},
    }
    srv = RpcServer("test", handlers, **kw)
    port = await srv.start("127.0.0.1", 0)
    return srv, f"127.0.0.1:{port}"


async def test_sync_async_and_packed_handlers() -> None:
    srv, addr = await _server()
    c = RpcClient([addr])
    try:
        assert await c.call("echo", {"b": b"\x01", "l": [1, "x"]}) == {"b": b"\x01", "l": [1, "x"]}
        assert await c.call("slow", {"v": 7}) == 7
        assert await c.call("raw") == {"n": 1, "b": b"\x00"}
        with pytest.raises(Internal):
            await c.call("boom")
        with pytest.raises(Internal):
            await c.call("unencodable")
        with pytest.raises(BadRequest):
            await c.call("nope")
        # Many calls in flight on one connection, answered out of order, matched by id.
        got = await asyncio.gather(
            *(c.call("slow", {"v": i, "s": (20 - i) / 1000}) for i in range(20)),
            *(c.call("echo", {"i": i}) for i in range(20)),
        )
        assert got[:20] == list(range(20))
        assert got[20:] == [{"i": i} for i in range(20)]
    finally:
        await c.close()
        await srv.close()


async def test_client_deadline_and_server_deadline() -> None:
    srv, addr = await _server()
    c = RpcClient([addr], timeout=5)
    try:
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            await c.call("slow", {"s": 5}, timeout=0.1)
        assert time.monotonic() - t0 < 1.0
        # The connection stays usable and later calls with later deadlines still work.
        assert await c.call("echo", {"a": 1}) == {"a": 1}
        calls = [c.call("slow", {"s": 1, "v": 1}, timeout=0.05 * (i + 1)) for i in range(4)]
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert all(isinstance(r, DeadlineExceeded) for r in results)
        # The server enforces the deadline it was sent, too.
        reader, writer = await asyncio.open_connection(*rpc.parse_address(addr))
        writer.write(encode_frame({"op": "hello", "version": PROTOCOL_VERSION}))
        assert (await read_frame(reader, 1 << 16))["ok"]
        req = {"id": 1, "op": "slow", "args": {"s": 5}, "deadline_ms": 50}
        writer.write(encode_frame(req))
        reply = await asyncio.wait_for(read_frame(reader, 1 << 16), 5)
        assert reply["id"] == 1 and reply["error"]["code"] == DeadlineExceeded.code
        writer.close()
    finally:
        await c.close()
        await srv.close()


async def test_inflight_limit_pauses_reading_without_losing_requests() -> None:
    srv, addr = await _server(max_inflight_per_conn=2)
    c = RpcClient([addr])
    try:
        got = await asyncio.gather(*(c.call("slow", {"v": i, "s": 0.01}) for i in range(30)))
        assert got == list(range(30))
    finally:
        await c.close()
        await srv.close()


async def test_failover_when_the_server_goes_away() -> None:
    srv1, a1 = await _server()
    srv2, a2 = await _server()
    c = RpcClient([a1, a2], timeout=3)
    try:
        assert await c.call("echo", {"x": 1}) == {"x": 1}
        assert c.current_address == a1
        pending = asyncio.ensure_future(c.call("slow", {"s": 0.3, "v": "again"}))
        await asyncio.sleep(0.05)
        await srv1.close()
        assert await pending == "again"  # in flight when the connection broke: re-sent
        assert await c.call("echo", {"x": 2}) == {"x": 2}
        assert c.current_address == a2
        await srv2.close()
        with pytest.raises(Unavailable):
            await c.call("echo", {"x": 3})
    finally:
        await c.close()


async def test_oversized_frame_and_handshake_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rpc_server, "HANDSHAKE_TIMEOUT_S", 0.2)
    srv, addr = await _server(max_frame=1024)
    try:
        c = RpcClient([addr])
        with pytest.raises(TooLarge):
            await c.call("echo", {"blob": b"x" * 4096})
        assert await c.call("echo", {"ok": 1}) == {"ok": 1}  # reconnected
        await c.close()

        reader, writer = await asyncio.open_connection(*rpc.parse_address(addr))
        reply = await asyncio.wait_for(read_frame(reader, 1 << 16), 5)  # said nothing
        assert reply["error"]["code"] == "protocol"
        assert await reader.read() == b""  # closed
        writer.close()
    finally:
        await srv.close()


async def test_unix_socket_server_and_client(tmp_path: Any) -> None:
    path = str(tmp_path / "ctl.sock")
    srv = RpcServer("t", {"echo": lambda a: a}, token="s")
    await srv.start_unix(path)
    c = RpcClient([rpc.UNIX_PREFIX + path], token="s")
    try:
        assert await c.call("echo", {"x": b"\x00" * 40_000}) == {"x": b"\x00" * 40_000}
        with pytest.raises(BadRequest):
            await c.call("nope", {})
    finally:
        await c.close()
        await srv.close()
    assert not (tmp_path / "ctl.sock").exists()  # the socket goes with its server
    with pytest.raises(Unavailable):  # nothing listens there now: a typed error
        await RpcClient([rpc.UNIX_PREFIX + path], connect_timeout=0.5).call("echo", timeout=1)


@pytest.mark.parametrize("transport", ["unix", "tcp"])
async def test_blocking_client(tmp_path: Any, transport: str) -> None:
    """The blocking client (run on another thread: the server shares the test's loop)
    gets answers and typed errors, and reconnects after a deadline or a lost server."""
    handlers: dict[str, Any] = {"echo": lambda a: a, "slow": _slow, "boom": _boom}
    srv = RpcServer("t", handlers, token="s")
    if transport == "unix":
        path = str(tmp_path / "ctl.sock")
        await srv.start_unix(path)
        addr = rpc.UNIX_PREFIX + path
    else:
        addr = f"127.0.0.1:{await srv.start('127.0.0.1', 0)}"
    c = BlockingRpcClient(addr, token="s", connect_timeout=0.5)
    call = c.call
    try:
        big = {"x": b"\x01" * 300_000}  # more than one receive
        assert await asyncio.to_thread(call, "echo", big, 5.0) == big
        assert await asyncio.to_thread(call, "slow", {"v": 3}, 5.0) == 3
        with pytest.raises(Internal):
            await asyncio.to_thread(call, "boom", {}, 5.0)
        with pytest.raises(BadRequest):
            await asyncio.to_thread(call, "nope", {}, 5.0)
        with pytest.raises(DeadlineExceeded):
            await asyncio.to_thread(call, "slow", {"s": 2.0, "v": 1}, 0.1)
        # a new connection: the late reply of the call given up cannot be taken for this one
        assert await asyncio.to_thread(call, "echo", {"a": 1}, 5.0) == {"a": 1}
        with pytest.raises(Unauthorized):
            bad = BlockingRpcClient(addr, token="wrong", connect_timeout=0.5)
            await asyncio.to_thread(bad.call, "echo", {}, 5.0)
    finally:
        await srv.close()
    with pytest.raises(Unavailable):  # the server went away: typed, not a hang
        await asyncio.to_thread(call, "echo", {}, 2.0)
    c.close()


def test_gil_io_send_and_receive() -> None:
    """The GIL-keeping socket calls: what was sent is received; nothing within the wait
    is None; a closed peer reads as empty."""
    import socket

    if not gil_io.AVAILABLE:
        pytest.skip("no loadable libc")
    a, b = socket.socketpair()
    try:
        r = gil_io.Receiver(64)
        assert r.recv(b.fileno(), 0.0) is None
        assert gil_io.send(a.fileno(), b"hello") == 5
        assert bytes(r.recv(b.fileno(), 1.0) or b"") == b"hello"
        a.close()
        got = r.recv(b.fileno(), 1.0)
        assert got is not None and len(got) == 0
    finally:
        a.close()
        b.close()


def test_quick_handback_lowers_the_switch_interval_until_the_last_block_leaves() -> None:
    """Inside ``quick_handback`` the interpreter hands the GIL back quickly; nested and
    concurrent blocks (other threads) keep it so until the last one leaves, which
    restores the interval the first one found."""
    import sys
    import threading

    saved = sys.getswitchinterval()
    sys.setswitchinterval(0.004)
    try:
        with gil_io.quick_handback():
            assert sys.getswitchinterval() == pytest.approx(gil_io.QUICK_SWITCH_S)
            with gil_io.quick_handback():
                assert sys.getswitchinterval() == pytest.approx(gil_io.QUICK_SWITCH_S)
            assert sys.getswitchinterval() == pytest.approx(gil_io.QUICK_SWITCH_S)
            entered, leave = threading.Event(), threading.Event()

            def other() -> None:
                with gil_io.quick_handback():
                    entered.set()
                    leave.wait(5)

            t = threading.Thread(target=other)
            t.start()
            assert entered.wait(5)
        assert sys.getswitchinterval() == pytest.approx(gil_io.QUICK_SWITCH_S)  # the thread's
        leave.set()
        t.join(5)
        assert sys.getswitchinterval() == pytest.approx(0.004)
        with pytest.raises(RuntimeError), gil_io.quick_handback():
            raise RuntimeError("left by an exception")
        assert sys.getswitchinterval() == pytest.approx(0.004)
    finally:
        sys.setswitchinterval(saved)
