"""Lifecycle of real ``pegaflow-node`` processes: starting over a damaged journal, a
journal on a full file system, a pool file deleted under a running node, a second node
with a live node's id, and failed starts, which must leave nothing behind."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from pegaflow.client.data import DataClient
from pegaflow.storage_node.pool import BlockPool

from pegaflow.checksum import checksum
from pegaflow.config import EtcdConfig
from pegaflow.etcd import EtcdClient
from pegaflow.keys import Keyspace, NodeRecord
from pegaflow.tools.devcluster import REPO, Proc, start_node
from tests.support.journal import fill, frame, pack_v1, tmpfs, unframe, unpack_v1, v1_journal
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.etcd, pytest.mark.ucx]

KiB, MiB = 1 << 10, 1 << 20
NS = "lifecycle"
POOL, SLAB = 4 * MiB, MiB


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    d = tempfile.mkdtemp(prefix="pegaflow-test-", dir="/dev/shm")
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def http_json(port: int | str, path: str) -> tuple[int, dict[str, Any]]:
    """Status code and JSON body of ``GET http://127.0.0.1:<port><path>``."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def node(
    procs: list[Proc], node_id: str, shm: Path, etcd: EtcdConfig | None = None, **kw: Any
) -> Proc:
    p = start_node(
        node_id,
        pool="4MiB",
        slab="1MiB",
        shm_dir=str(shm),
        etcd=etcd.endpoints[0] if etcd else None,
        prefix=etcd.prefix if etcd else "/pegaflow/test",
        **kw,
    )
    procs.append(p)
    return p


def node_argv(
    node_id: str,
    shm: Path,
    *,
    pool: str = "4MiB",
    extra: Sequence[str] = (),
    etcd: EtcdConfig | None = None,
) -> list[str]:
    argv = [
        sys.executable, "-m", "pegaflow.storage_node.main",
        "--node-id", node_id, "--node-ucx-port", "0", "--node-http-port", "0",
        "--node-pool-bytes", pool, "--node-slab-bytes", "1MiB", "--node-shm-dir", str(shm),
        "--etcd-lease-ttl-s", "3", *extra,
    ]  # fmt: skip
    if etcd is not None:
        argv += ["--etcd-endpoints", etcd.endpoints[0], "--etcd-prefix", etcd.prefix]
    return argv


def failed_start(node_id: str, shm: Path, **kw: Any) -> subprocess.CompletedProcess[str]:
    """Run a ``pegaflow-node`` that is expected to exit (a bounded wait)."""
    return subprocess.run(
        node_argv(node_id, shm, **kw),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        stdin=subprocess.DEVNULL,
    )


def make_blocks(n: int, size: int = 20000) -> tuple[list[bytes], np.ndarray]:
    rng = np.random.default_rng(n)
    return [os.urandom(32) for _ in range(n)], rng.integers(0, 255, (n, size), dtype=np.uint8)


def log_lines(p: Proc, level: str, words: str) -> list[str]:
    return [x for x in p.log if f" {level} " in x and words in x]


async def fetch(addr: str, hashes: list[bytes], size: int) -> tuple[list[bool], np.ndarray]:
    c = DataClient()
    try:
        out = np.zeros((len(hashes), size), dtype=np.uint8)
        ok = await c.get(addr, NS, [(h, 0, out[i]) for i, h in enumerate(hashes)], 10)
        return ok, out
    finally:
        await c.close()


# ---- a damaged journal (#8) --------------------------------------------------------


async def test_a_damaged_journal_never_keeps_the_node_from_starting(
    shm_dir: Path, procs: list[Proc]
) -> None:
    # a pool left by a 0.1.0 node (a version 1 journal) with 5 crafted type changes and
    # a flipped bit in the last record's size
    hashes, data = make_blocks(10)
    pool = BlockPool(shm_dir / "pegaflow-j1.pool", POOL, SLAB, node_id="j1")
    entries = []
    for h, d in zip(hashes, data, strict=True):
        e = pool.reserve((NS, h, 0), d.size, 30)
        assert e is not None
        pool.view(e)[:] = d
        pool.commit(e, checksum(d))
        entries.append(e)
    pool.close()
    jpath = shm_dir / "pegaflow-j1.journal"
    objs = unpack_v1(v1_journal(entries, POOL, SLAB))
    for i, (field, value) in enumerate(
        [(1, "0"), (3, None), (4, b"gen"), (7, "hash"), (8, [0])], start=1
    ):
        objs[i][field] = value  # objs[0] is the header: blocks 0-4
    raw = bytearray(pack_v1(objs))
    size_at = len(raw) - len(pack_v1(objs[-1:])) + len(pack_v1([objs[-1][:3]]))
    raw[size_at + 1] ^= 0x80  # block 9: 20000 bytes -> 52768, more than its slot
    jpath.write_bytes(bytes(raw))

    n = node(procs, "j1", shm_dir)  # the old code died here with a TypeError
    code, status = http_json(n.ready["http"], "/v1/status")
    assert code == 200 and status["pool"]["blocks"] == 4
    assert status["journal"]["bad_records"] == 6
    assert log_lines(n, "WARNING", "skipped 6 bad record(s)")
    intact = [5, 6, 7, 8]
    ok, out = await fetch(n.ready["ucx"], [hashes[i] for i in intact], data.shape[1])
    assert all(ok) and np.array_equal(out, data[intact])

    # the node rewrote its journal (version 2); damage that one too and restart
    n.kill()
    objs = unframe(jpath.read_bytes())
    by_hash = {r[7]: i for i, r in enumerate(objs) if r[0] == "C"}
    objs[by_hash[hashes[6]]][5] = -1  # an xxh3 out of range, in a frame whose crc is fine
    raw = bytearray(b"".join(frame(o) for o in objs))
    victim = frame(objs[by_hash[hashes[7]]])
    raw[raw.index(victim) + 8 + len(msgpack.packb(objs[by_hash[hashes[7]]][:3])) + 1] ^= 0x01
    jpath.write_bytes(bytes(raw))
    n = node(procs, "j1", shm_dir)
    code, status = http_json(n.ready["http"], "/v1/status")
    assert code == 200 and status["pool"]["blocks"] == 2
    assert status["journal"]["bad_records"] == 2
    ok, out = await fetch(n.ready["ucx"], [hashes[5], hashes[8]], data.shape[1])
    assert all(ok) and np.array_equal(out, data[[5, 8]])


# ---- a journal on a full file system (#9) -----------------------------------------


async def test_a_full_journal_file_system_keeps_the_node_serving_and_loses_nothing_once_freed(
    procs: list[Proc],
) -> None:
    size = 4096
    with tmpfs(POOL + 256 * KiB) as d:
        n = node(procs, "f1", d)
        filler = fill(d, leave=0)  # the journal has the rest of its last page
        hashes, data = make_blocks(120, size)
        c = DataClient()
        try:
            for i in range(0, 100, 10):  # 100 commits do not fit the journal: all stored
                batch = [(hashes[j], 0, data[j]) for j in range(i, i + 10)]
                assert (await c.put(n.ready["ucx"], NS, batch, 10)).stored == 10
            _, status = http_json(n.ready["http"], "/v1/status")
            assert status["journal"]["degraded"] and status["pool"]["blocks"] == 100
            assert log_lines(n, "ERROR", "Free space in")
            code, health = http_json(n.ready["http"], "/health")
            assert code == 200 and health["journal_degraded"]  # degraded, still serving

            filler.unlink()  # space comes back: the journal is rewritten whole
            await wait_until(
                lambda: not http_json(n.ready["http"], "/v1/status")[1]["journal"]["degraded"],
                "journal rewritten",
                60,
            )
            batch = [(hashes[j], 0, data[j]) for j in range(100, 120)]
            assert (await c.put(n.ready["ucx"], NS, batch, 10)).stored == 20
        finally:
            await c.close()
        n.kill()
        n = node(procs, "f1", d)  # every block committed, degraded or not, comes back
        _, status = http_json(n.ready["http"], "/v1/status")
        assert status["pool"]["blocks"] == 120 and status["journal"]["bad_records"] == 0
        ok, out = await fetch(n.ready["ucx"], hashes, size)
        assert all(ok) and np.array_equal(out, data)
        n.kill()


# ---- the pool file deleted under a running node (#10) -----------------------------


async def test_health_fails_once_the_pool_file_is_gone(shm_dir: Path, procs: list[Proc]) -> None:
    n = node(procs, "h1", shm_dir)
    port = n.ready["http"]
    assert http_json(port, "/health")[0] == 200
    (shm_dir / "pegaflow-h1.pool").unlink()
    for _ in range(3):
        code, body = http_json(port, "/health")
        assert code == 503 and not body["ok"] and "pegaflow-h1.pool" in body["reason"]
    _, status = http_json(port, "/v1/status")
    assert not status["health"]["ok"] and "pegaflow-h1.pool" in status["health"]["reason"]
    await wait_until(lambda: log_lines(n, "ERROR", "restart the node"), "the error logged", 60)
    await asyncio.sleep(2.5)  # a few watchdog ticks: still logged once
    assert len(log_lines(n, "ERROR", "restart the node")) == 1


# ---- a duplicate node id (#13) --------------------------------------------------


def _tmp_shm() -> Path:
    return Path(tempfile.mkdtemp(prefix="pegaflow-test-", dir="/dev/shm"))


async def test_a_second_node_with_a_live_node_id_is_refused(
    etcd_config: EtcdConfig, shm_dir: Path, procs: list[Proc]
) -> None:
    first = node(procs, "d1", shm_dir, etcd_config)
    client = EtcdClient(etcd_config)
    key = Keyspace(etcd_config.prefix).node_key("d1")
    try:
        before = await client.get(key)
        assert before is not None
        other = _tmp_shm()  # another host, as far as the pool file can tell
        try:
            r = failed_start("d1", other, etcd=etcd_config)
            assert r.returncode != 0
            assert "node id d1 is in use" in r.stdout + r.stderr
            assert not list(other.iterdir())  # it left nothing behind
        finally:
            shutil.rmtree(other, ignore_errors=True)
        after = await client.get(key)
        assert after is not None and after.lease == before.lease
        assert NodeRecord.decode(after.value).ucx_port == NodeRecord.decode(before.value).ucx_port
        assert first.alive() and http_json(first.ready["http"], "/health")[0] == 200
    finally:
        await client.close()


def test_a_node_restarted_without_its_pool_file_waits_out_its_old_lease(
    etcd_config: EtcdConfig, shm_dir: Path, procs: list[Proc]
) -> None:
    n = node(procs, "w1", shm_dir, etcd_config)
    n.kill()  # kill -9 and the pool is gone too (a reboot wiped /dev/shm): no pool id
    for f in shm_dir.iterdir():
        f.unlink()
    # stopped while it waits: it exits and removes the pool it had created
    waiting = subprocess.Popen(
        node_argv("w1", shm_dir, etcd=etcd_config),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
    )
    assert waiting.stdout is not None
    lines = []
    for line in waiting.stdout:
        lines.append(line)
        if "waiting for it to expire" in line:
            waiting.send_signal(signal.SIGTERM)
            break
        if line.startswith("READY"):  # it did not wait for the old lease
            waiting.kill()
            pytest.fail("".join(lines))
    assert waiting.wait(30) != 0, "".join(lines)
    assert not list(shm_dir.iterdir())
    n = node(procs, "w1", shm_dir, etcd_config)  # not refused: the old lease runs out
    assert http_json(n.ready["http"], "/health")[0] == 200


# ---- failed starts leave nothing behind (#14) ------------------------------------


def test_a_pool_larger_than_its_file_system_fails_and_leaves_it_empty() -> None:
    with tmpfs(16 * MiB) as d:
        r = failed_start("s1", d, pool="64MiB")
        assert r.returncode != 0
        assert r.returncode == 2 and "does not fit" in r.stdout + r.stderr
        assert "--node-pool-bytes" in r.stdout + r.stderr
        assert not list(d.iterdir())
        assert os.statvfs(d).f_bfree == os.statvfs(d).f_blocks  # nothing held either


@pytest.mark.parametrize("what", ["ucx-port", "http-port", "host"])
def test_a_failed_start_removes_the_pool_it_created(shm_dir: Path, what: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        extra = {
            "ucx-port": ["--node-ucx-port", port],
            "http-port": ["--node-http-port", port],
            "host": ["--node-host", "198.18.0.1"],  # an address this host does not have
        }[what]
        r = failed_start("p1", shm_dir, extra=extra)
    assert r.returncode != 0, r.stdout + r.stderr
    assert "cannot start node" in r.stdout + r.stderr
    assert not list(shm_dir.iterdir())


async def test_a_failed_start_leaves_a_pool_it_was_going_to_reattach(
    shm_dir: Path, procs: list[Proc]
) -> None:
    n = node(procs, "k1", shm_dir)
    hashes, data = make_blocks(3)
    c = DataClient()
    try:
        put = await c.put(n.ready["ucx"], NS, [(h, 0, data[i]) for i, h in enumerate(hashes)], 10)
        assert put.stored == 3
    finally:
        await c.close()
    n.terminate()  # a clean stop keeps the pool ([node] keep_pool)
    pool_file = shm_dir / "pegaflow-k1.pool"
    ino = pool_file.stat().st_ino
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        r = failed_start("k1", shm_dir, extra=["--node-http-port", str(taken.getsockname()[1])])
    assert r.returncode != 0
    assert pool_file.stat().st_ino == ino and (shm_dir / "pegaflow-k1.journal").exists()
    n = node(procs, "k1", shm_dir)  # and it still re-attaches
    assert http_json(n.ready["http"], "/v1/status")[1]["pool"]["blocks"] == 3


# ---- pools that do not fit, and starts cut short, leave nothing (#14) ----------------

GiB = 1 << 30


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[Path]:
    """A memory cgroup (v1) of ``limit`` bytes for the processes a test starts in it:
    a pool that ignored the limit would only get them OOM-killed, never the host."""
    root = Path("/sys/fs/cgroup/memory")
    if os.geteuid() != 0 or not (root / "cgroup.procs").exists():
        pytest.skip("needs root and a cgroup v1 memory controller")
    d = root / f"pegaflow-test-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    try:
        d.mkdir()
        (d / "memory.limit_in_bytes").write_text(str(limit))
    except OSError as e:
        pytest.skip(f"cannot make a memory cgroup: {e}")
    try:
        yield d
    finally:
        for _ in range(50):
            try:
                d.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def run_in(cgroup: Path, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` inside ``cgroup`` until it exits (a bounded wait)."""
    procs = str(cgroup / "cgroup.procs")

    def enter() -> None:
        with open(procs, "w") as fh:
            fh.write(str(os.getpid()))

    return subprocess.run(
        argv, capture_output=True, text=True, timeout=60, cwd=REPO, stdin=subprocess.DEVNULL,
        preexec_fn=enter,
    )  # fmt: skip


def error_lines(r: subprocess.CompletedProcess[str]) -> list[str]:
    return [x for x in (r.stdout + r.stderr).splitlines() if " ERROR " in x]


def test_a_pool_larger_than_memory_is_refused_before_anything_is_made() -> None:
    with memory_cgroup(768 * MiB) as cg, tmpfs(4 * GiB) as d:
        r = run_in(cg, node_argv("m1", d, pool="1GiB"))
        assert r.returncode == 2, r.stdout + r.stderr
        (line,) = error_lines(r)  # one line saying why, with the sizes and the flag
        assert "pool of 1.0 GiB does not fit" in line, line
        assert "of memory available to its cgroup" in line and f"free in {d}" in line, line
        assert "--node-pool-bytes" in line and "Traceback" not in r.stdout + r.stderr
        assert not list(d.iterdir())
        assert os.statvfs(d).f_bfree == os.statvfs(d).f_blocks


def test_a_node_killed_while_preparing_its_pool_leaves_nothing() -> None:
    with tmpfs(2 * GiB + 64 * MiB) as d:
        p = subprocess.Popen(
            node_argv("k9", d, pool="2GiB"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPO,
        )
        assert p.stdout is not None
        try:
            lines = []
            for line in p.stdout:  # the OOM killer strikes while the pool is backed
                lines.append(line)
                if "preparing pool of 2.0 GiB" in line or line.startswith("READY"):
                    p.kill()
                    break
            assert p.wait(30) == -signal.SIGKILL, "".join(lines)
            assert not lines[-1].startswith("READY"), "".join(lines)  # it said nothing
        finally:
            if p.poll() is None:
                p.kill()
            p.stdout.close()
        assert not list(d.iterdir())
        assert os.statvfs(d).f_bfree == os.statvfs(d).f_blocks  # its memory came back
