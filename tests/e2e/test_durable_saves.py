"""Saves that cannot be lost when the engine is killed: once the node took a same-host
commit, it carries it out by itself, whatever happens to the writer after that.

The writers here are real processes that die (SIGKILL) at the worst moments: right
after sending their commit, and (a real CPU vLLM engine) right after the connector told
vLLM that a request's blocks may be reused.  A real ``pegaflow-server`` serves them.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pegaflow.client import SyncPegaClient

from pegaflow.config import ClientConfig
from pegaflow.protocol.framing import UNIX_PREFIX
from pegaflow.tools.devcluster import Proc, start_server
from pegaflow.transport.rpc_client import RpcClient
from tests.support.vllm_engine import VllmEngine, prompts

pytestmark = pytest.mark.ucx

NS = "test-durable"
BLOCK = 4096

# A writer that reserves slots on the node's control socket, writes the blocks through
# the pool file, then (told to go on) sends its commit and is killed at once: the frame
# is in the node's socket queue, nothing of the writer is left to wait for the answer.
# With ``commit`` false it dies after its copies, before any commit.
_WRITER = r"""
import json, os, signal, socket, struct, sys
from pegaflow.protocol.codec import PROTOCOL_VERSION, pack, unpack

spec = json.loads(sys.argv[1])
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(spec["control"])

def send(obj):
    body = pack(obj)
    s.sendall(struct.pack("!I", len(body)) + body)

def recv():
    def exact(n):
        buf = b""
        while len(buf) < n:
            got = s.recv(n - len(buf))
            if not got:
                raise SystemExit("the node closed the socket")
            buf += got
        return buf
    (n,) = struct.unpack("!I", exact(4))
    return unpack(exact(n), 1 << 24)

send({"op": "hello", "version": PROTOCOL_VERSION, "token": spec["token"]})
assert recv()["ok"]
hashes = [bytes.fromhex(h) for h in spec["hashes"]]
fd = os.open(spec["pool"], os.O_RDWR)
st = os.fstat(fd)  # a local reservation names the file its writer maps
send({"id": 1, "op": "reserve", "args": {"ns": spec["ns"], "local": True,
      "pool": [st.st_dev, st.st_ino], "blocks": [[h, 0, spec["size"]] for h in hashes]}})
res = recv()["result"]
for i, off in enumerate(res["offsets"]):
    os.pwrite(fd, bytes([i + 1]) * spec["size"], off)
print("WRITTEN", flush=True)
sys.stdin.readline()
if spec["commit"]:
    send({"id": 2, "op": "commit", "args": {"seq": res["seq"], "xxh3": [None] * len(hashes)}})
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.fixture(scope="module")
def server() -> Iterator[Proc]:
    p = start_server(
        token="admin", extra=["--node-pool-bytes", "64MiB", "--node-slab-bytes", "4MiB"]
    )
    try:
        yield p
    finally:
        p.terminate()


def _client(server: Proc) -> SyncPegaClient:
    cfg = ClientConfig(coordinators=[server.ready["coordinator"]], lookup_timeout_s=2)
    return SyncPegaClient(cfg, token="admin")


def _write_and_die(
    server: Proc, control: str, pool: str, hashes: list[bytes], commit: bool
) -> None:
    """Run the writer; the node is stopped (SIGSTOP) from the writer's last copy until
    the writer is dead, so the node finds the commit and the closed socket together,
    as when it is busy while an engine dies."""
    spec = {
        "control": control,
        "pool": pool,
        "token": "admin",
        "ns": NS,
        "size": BLOCK,
        "hashes": [h.hex() for h in hashes],
        "commit": commit,
    }
    p = subprocess.Popen(
        [sys.executable, "-c", _WRITER, json.dumps(spec)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None and p.stdin is not None
    try:
        line = p.stdout.readline()
        assert line == "WRITTEN\n", p.stderr.read() if p.stderr else line
        os.kill(server.pid, signal.SIGSTOP)
        try:
            p.stdin.write("go\n")
            p.stdin.flush()
            assert p.wait(30) == -signal.SIGKILL  # it got as far as its own SIGKILL
        finally:
            os.kill(server.pid, signal.SIGCONT)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def _found(c: SyncPegaClient, node: str, hashes: list[bytes]) -> list[bool]:
    pin, where = c.locate(NS, node, hashes, 0, 1.0)
    c.unpin(node, pin)
    return where.found.tolist()


def _until(cond: Callable[[], bool], timeout: float = 60.0) -> bool:
    """Whether ``cond`` holds within ``timeout`` (polled)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return cond()
        time.sleep(0.05)
    return True


def _reserved(c: SyncPegaClient, node: str) -> int:
    addr = c.nodes()[node].ucx_address
    return int(c._on_loop(lambda a: a._data.call(addr, {"op": "stats"}, 5.0), 5.0)["reserved"])


def test_a_commit_sent_by_a_writer_killed_at_once_is_carried_out(server: Proc) -> None:
    node = server.ready["node"]
    c = _client(server)
    try:
        info = c.local_pool(node)
        assert info is not None and info.control is not None
        hashes = [bytes([0xD0, i]) * 8 for i in range(16)]
        _write_and_die(server, info.control, info.path, hashes, commit=True)
        assert _until(lambda: all(_found(c, node, hashes))), "a commit the node received was lost"
        bufs = [bytearray(BLOCK) for _ in hashes]
        ok = c.get_blocks(NS, [(node, h, 0, b) for h, b in zip(hashes, bufs, strict=True)], 5.0)
        assert ok == [True] * len(hashes)  # over UCX, checked against the node's xxh3
        assert [bytes(b) for b in bufs] == [bytes([i + 1]) * BLOCK for i in range(len(hashes))]
        assert _reserved(c, node) == 0  # nothing left half-committed
    finally:
        c.close()


def test_a_writer_killed_before_its_commit_stores_nothing(server: Proc) -> None:
    """Without a commit the node cannot know the copies finished: the slots go back."""
    node = server.ready["node"]
    c = _client(server)
    try:
        info = c.local_pool(node)
        assert info is not None and info.control is not None
        hashes = [bytes([0xD1, i]) * 8 for i in range(4)]
        _write_and_die(server, info.control, info.path, hashes, commit=False)
        assert _until(lambda: _reserved(c, node) == 0)
        assert _found(c, node, hashes) == [False] * 4
    finally:
        c.close()


def test_taken_says_whether_the_node_holds_a_commit(server: Proc) -> None:
    """``taken`` right behind a commit on the same session: the node holds the commit
    (and carries it out whatever happens to the session); an unknown one: no."""
    node = server.ready["node"]
    c = _client(server)
    try:
        info = c.local_pool(node)
        assert info is not None and info.control is not None
    finally:
        c.close()

    async def run() -> tuple[Any, Any, Any]:
        rpc = RpcClient([UNIX_PREFIX + info.control], token="admin", timeout=5.0)
        try:
            h = b"\xd2" * 16
            res = await rpc.call(
                "reserve",
                {"ns": NS, "local": True, "pool": list(info.file_id), "blocks": [[h, 0, BLOCK]]},
                5.0,
            )
            seq = res["seq"]
            fd = os.open(info.path, os.O_RDWR)
            try:
                os.pwrite(fd, b"\x07" * BLOCK, res["offsets"][0])
            finally:
                os.close(fd)
            commit = asyncio.ensure_future(rpc.call("commit", {"seq": seq, "xxh3": [None]}, 5.0))
            taken = asyncio.ensure_future(rpc.call("taken", {"seq": seq}, 5.0))
            unknown = await rpc.call("taken", {"seq": 1 << 40}, 5.0)
            return await taken, await commit, unknown
        finally:
            await rpc.close()

    taken, commit, unknown = asyncio.run(run())
    assert taken == {"taken": True}
    assert commit["stored"] == 1
    assert unknown == {"taken": False}


_REUSABLE = re.compile(r"PegaFlow: saves done, blocks reusable: \[(.*)\]")


def _reusable(engine: VllmEngine) -> set[str]:
    """The requests whose blocks the connector told vLLM it may reuse (its debug log)."""
    out: set[str] = set()
    for line in list(engine.log):
        m = _REUSABLE.search(line)
        if m:
            out.update(x.strip().strip("'") for x in m.group(1).split(",") if x.strip())
    return out


@pytest.mark.slow
@pytest.mark.vllm
def test_an_engine_killed_once_told_its_blocks_are_reusable_loses_no_save(
    tmp_path: Path,
) -> None:
    """A real CPU vLLM engine saves two requests through the same-host path and is
    SIGKILLed (its whole process group) the moment the connector tells vLLM their
    blocks may be reused; a new engine then loads every one of those blocks, and its
    outputs are the cold run's."""
    server = start_server(extra=["--node-pool-bytes", "256MiB", "--node-slab-bytes", "16MiB"])
    conn = {
        "coordinators": server.ready["coordinator"],
        "local_node": server.ready["node"],
        "lookup_timeout_s": 0.5,
        "transfer_timeout_s": 5.0,
        "log_level": "debug",
    }
    ps = prompts(2, 200, seed=41)  # 6 full blocks each
    e1 = e2 = None
    try:
        e1 = VllmEngine({"connector": {**conn, "stats_path": str(tmp_path / "e1")}}, name="e1")
        cold = e1.generate(ps, 8)
        assert cold["cached"] == [0, 0]
        deadline = time.monotonic() + 60
        while len(_reusable(e1)) < len(ps):
            assert time.monotonic() < deadline, e1.tail()
            time.sleep(0.001)
        e1.kill()  # SIGKILL, the whole process group: no shutdown path runs
        s2 = str(tmp_path / "e2")
        e2 = VllmEngine({"connector": {**conn, "stats_path": s2}}, name="e2")
        warm = e2.generate(ps, 8)
        assert warm["outputs"] == cold["outputs"]
        assert warm["cached"] == [192, 192], e2.tail()  # every full block was stored
    finally:
        for e in (e1, e2):
            if e is not None:
                e.kill()
        server.terminate()
