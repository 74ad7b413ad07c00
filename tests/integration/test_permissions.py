"""Same-host access for an engine running as another user (#14): with ``[node]
access_group`` the pool file and the control socket belong to that group, mode 0660, so
a user in the group maps the pool and asks the socket; a user outside it is refused.

Runs as root (it makes a throwaway user and group, kept for later runs) and a client
process as that user (``setpriv``); skipped otherwise."""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pegaflow.client.data import DataClient

from pegaflow.tools.devcluster import REPO, Proc, start_node

pytestmark = pytest.mark.ucx

USER, GROUP = "pegaflow-test-peer", "pegaflow-test-access"
NS = "perm"
SIZE = 12288
NODE_ENV = {"UCX_TLS": "^shm"}
"""UCX cannot share memory with another user's process: a node without an access group
needs this for the other user's handshake to get as far as the refusal (a node with one
turns shared memory off by itself)"""

PEER_CLIENT = """
import asyncio, json, mmap, os, site, sys
site.addsitedir(sys.argv[1])
from pegaflow.client.samehost import open_pool_file
from pegaflow.client.data import DataClient
from pegaflow.client.session import NodeSession
from pegaflow.errors import Unavailable
from pegaflow.protocol.framing import UNIX_PREFIX
from pegaflow.transport.rpc_client import RpcClient

async def main(addr, hashes, want):
    out = {"uid": os.getuid(), "groups": os.getgroups()}
    c = DataClient()
    rpc = None
    try:
        pool = await c.pool_file(addr, 10)
        try:
            fd = open_pool_file(pool)  # read and write, as a same-host engine does
        except PermissionError:
            out["pool"] = "denied"
        else:
            pin, where = await NodeSession.at(addr, c).locate(NS, hashes, 0, 5.0, 10)
            with mmap.mmap(fd, pool.size) as m:
                got = [m[b.offset : b.offset + b.size].hex() for b in where]
            out["pool"] = "mapped"
            out["bytes_ok"] = got == want
            os.close(fd)
        rpc = RpcClient([UNIX_PREFIX + pool.control], timeout=5)
        try:
            await rpc.call("unpin", {"pin": 0})
            out["socket"] = "ok"
        except Unavailable as e:
            out["socket"] = "denied" if "PermissionError" in str(e) else str(e)
    finally:
        if rpc is not None:
            await rpc.close()
        await c.close()
    print(json.dumps(out))

NS = sys.argv[3]
args = json.loads(sys.stdin.read())
asyncio.run(main(sys.argv[2], [bytes.fromhex(h) for h in args["hashes"]], args["want"]))
"""


def _python_for_others() -> str | None:
    """A Python of this version that other users may run (the venv's may live under an
    owner-only home)."""
    name = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for cand in (sys.executable, shutil.which(name, path="/usr/local/bin:/usr/bin:/bin")):
        if cand and all(
            os.stat(p).st_mode & stat.S_IXOTH for p in [*Path(cand).resolve().parents, cand]
        ):
            return cand
    return None


@pytest.fixture(scope="module")
def peer() -> tuple[int, int, int]:
    """(uid, primary gid, access group gid) of a second user, made if missing."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a client as a second user")
    if not all(shutil.which(t) for t in ("useradd", "groupadd", "setpriv")):
        pytest.skip("needs useradd, groupadd and setpriv")
    for argv in (
        ["groupadd", "--system", GROUP],
        ["useradd", "--system", "--user-group", "--no-create-home", "--shell",
         "/usr/sbin/nologin", USER],
    ):  # fmt: skip
        r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        if r.returncode not in (0, 9):  # 9: it exists already
            pytest.skip(f"cannot make the test user: {r.stderr.strip()}")
    pw = pwd.getpwnam(USER)
    problem = _cannot_import_as(pw.pw_uid, pw.pw_gid)
    if problem:
        pytest.skip(
            f"user {USER} cannot import pegaflow from this checkout ({problem}): a folder "
            "above it, or above the virtual environment, is owner-only (mode 0700, as home "
            "directories often are); run from a checkout other users can read"
        )
    return pw.pw_uid, pw.pw_gid, grp.getgrnam(GROUP).gr_gid


def _cannot_import_as(uid: int, gid: int) -> str:
    """Why the second user cannot import the client from this checkout ('' if it can)."""
    python = _python_for_others()
    if python is None:
        return "no Python that another user may run"
    probe = "import site, sys; site.addsitedir(sys.argv[1]); import pegaflow.client.data"
    r = subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", python, "-c", probe,
         sysconfig.get_paths()["purelib"]],
        capture_output=True, text=True, timeout=60, cwd="/",
        env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"},
    )  # fmt: skip
    lines = r.stderr.strip().splitlines()
    return "" if r.returncode == 0 else (lines[-1] if lines else f"exit status {r.returncode}")


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="pegaflow-test-", dir="/dev/shm"))
    d.chmod(0o755)  # the engine's user must reach the pool file, as in /dev/shm itself
    yield d
    shutil.rmtree(d, ignore_errors=True)


def run_as(
    uid: int, gid: int, groups: list[int], addr: str, hashes: list[bytes], data: np.ndarray
) -> dict[str, Any]:
    """Run the same-host client as ``uid`` with exactly ``groups``; its findings."""
    python = _python_for_others()
    if python is None:
        pytest.skip("no Python that another user may run")
    ids = ["--groups", ",".join(map(str, groups))] if groups else ["--clear-groups"]
    r = subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={gid}", *ids, python, "-c", PEER_CLIENT,
         sysconfig.get_paths()["purelib"], addr, NS],
        input=json.dumps({"hashes": [h.hex() for h in hashes],
                          "want": [d.tobytes().hex() for d in data]}),
        capture_output=True, text=True, timeout=60, cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"},
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["uid"] == uid and sorted(out["groups"]) == sorted(groups)
    return out


async def stored(p: Proc, n: int) -> tuple[list[bytes], np.ndarray]:
    hashes = [os.urandom(32) for _ in range(n)]
    data = np.random.default_rng(n).integers(0, 255, (n, SIZE), dtype=np.uint8)
    c = DataClient()
    try:
        put = await c.put(p.ready["ucx"], NS, [(h, 0, data[i]) for i, h in enumerate(hashes)], 10)
        assert put.stored == n
    finally:
        await c.close()
    return hashes, data


async def test_an_engine_of_another_user_in_the_access_group_takes_the_same_host_path(
    peer: tuple[int, int, int], shm_dir: Path, procs: list[Proc]
) -> None:
    uid, gid, access = peer
    p = start_node("perm1", pool="32MiB", slab="4MiB", shm_dir=str(shm_dir),
                   extra=["--node-access-group", GROUP])  # fmt: skip
    procs.append(p)
    pool, sock = shm_dir / "pegaflow-perm1.pool", shm_dir / "pegaflow-perm1.pool.sock"
    for f in (pool, sock):
        st = f.stat()
        assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == access, f
    hashes, data = await stored(p, 3)

    member = run_as(uid, gid, [access], p.ready["ucx"], hashes, data)
    assert member == {**member, "pool": "mapped", "bytes_ok": True, "socket": "ok"}
    outsider = run_as(uid, gid, [], p.ready["ucx"], hashes, data)
    assert outsider == {**outsider, "pool": "denied", "socket": "denied"}


async def test_without_an_access_group_another_user_is_refused(
    peer: tuple[int, int, int], shm_dir: Path, procs: list[Proc]
) -> None:
    uid, gid, access = peer
    p = start_node("perm2", pool="32MiB", slab="4MiB", shm_dir=str(shm_dir), env=NODE_ENV)
    procs.append(p)
    for f in ("pegaflow-perm2.pool", "pegaflow-perm2.pool.sock"):
        assert not (shm_dir / f).stat().st_mode & 0o077, f  # owner-only
    hashes, data = await stored(p, 2)
    out = run_as(uid, gid, [access], p.ready["ucx"], hashes, data)  # even in the group
    assert out == {**out, "pool": "denied", "socket": "denied"}


def test_an_unknown_access_group_is_refused_at_start(shm_dir: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "pegaflow.storage_node.main", "--node-id", "perm3",
         "--node-ucx-port", "0", "--node-http-port", "0", "--node-pool-bytes", "8MiB",
         "--node-slab-bytes", "4MiB", "--node-shm-dir", str(shm_dir),
         "--node-access-group", "pegaflow-no-such-group"],
        capture_output=True, text=True, timeout=60, cwd=REPO, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert r.returncode == 2, r.stdout + r.stderr
    assert "access_group 'pegaflow-no-such-group': no such group" in r.stderr
    assert not list(shm_dir.iterdir())
