"""A local PegaFlow cluster made of real processes: etcd, coordinators, storage nodes.

Used by the demo (``scripts/demo.py``), the benchmarks and the integration tests.
Services announce themselves with one stdout line ``READY k=v ...`` (ports chosen by
the OS when asked for port 0); :func:`start` waits for it.
"""

from __future__ import annotations

import atexit
import os
import random
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""the repository root (the processes started here run in it: ``python -m scripts.…``)"""

ETCD_BINARY = os.environ.get("PEGAFLOW_TEST_ETCD", "etcd")


_handed_out: set[int] = set()
_port_rng = random.Random()  # its own: a test's random.seed() must not repeat the ports


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port free on every address right now, below the kernel's ephemeral range.

    A port the kernel picks for ``bind(0)`` is also one it may give an outgoing
    connection's local end (or another process's ``bind(0)``) before the caller's process
    binds it; ports below the ephemeral range are never handed out that way.  Each port is
    handed out once per process."""
    low = max(_ephemeral_low(), 20000)
    for _ in range(1000):
        port = _port_rng.randrange(low - 10000, low)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free TCP port in {low - 10000}-{low - 1}")


class EtcdServer:
    """One etcd member on loopback, restartable on the same data dir and ports."""

    def __init__(
        self,
        data_dir: Path,
        *,
        binary: str = ETCD_BINARY,
        max_txn_ops: int = 1024,
        quota_bytes: int = 4 << 30,
        tls_dir: Path | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.data_dir = Path(data_dir)
        #: With TLS (files from :func:`make_test_certs`), clients must present a cert.
        self.tls_dir = tls_dir
        self.binary = binary
        self.client_port = free_port()
        self.peer_port = free_port()
        self.endpoint = f"127.0.0.1:{self.client_port}"
        self.max_txn_ops = max_txn_ops
        #: ``--quota-backend-bytes``: the database size past which etcd refuses writes.
        self.quota_bytes = quota_bytes
        self.extra_args = list(extra_args)
        self.log_path = self.data_dir.parent / f"{self.data_dir.name}.log"
        self._proc: subprocess.Popen[bytes] | None = None

    def argv(self) -> list[str]:
        """The etcd command line."""
        scheme = "https" if self.tls_dir else "http"
        client = f"{scheme}://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        tls = []
        if self.tls_dir:
            d = self.tls_dir
            tls = [
                "--cert-file", str(d / "server.crt"),
                "--key-file", str(d / "server.key"),
                "--trusted-ca-file", str(d / "ca.crt"),
                "--client-cert-auth",
            ]  # fmt: skip
        return [
            self.binary,
            "--name", "pegaflow-test",
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"pegaflow-test={peer}",
            "--auto-compaction-mode", "periodic",
            "--auto-compaction-retention", "1h",
            "--max-txn-ops", str(self.max_txn_ops),
            "--quota-backend-bytes", str(self.quota_bytes),
            "--log-level", "warn",
            *tls,
            *self.extra_args,
        ]  # fmt: skip

    @property
    def running(self) -> bool:
        """Whether the process is alive."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """The etcd process id while it runs."""
        return self._proc.pid if self._proc is not None and self.running else None

    def start(self, timeout: float = 30.0) -> None:
        """Start (or restart) etcd and wait until it reports healthy."""
        if self.running:
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # handed to the child
        try:
            self._proc = subprocess.Popen(
                self.argv(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.running:
                raise RuntimeError(f"etcd exited at start; see {self.log_path}:\n{self.tail()}")
            if self.healthy():
                return
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"etcd not healthy in {timeout} s; see {self.log_path}:\n{self.tail()}")

    def healthy(self) -> bool:
        """Whether etcd answers ``/health`` with ``true``."""
        context = None
        if self.tls_dir:
            context = ssl.create_default_context(cafile=str(self.tls_dir / "ca.crt"))
            context.load_cert_chain(self.tls_dir / "client.crt", self.tls_dir / "client.key")
        try:
            url = f"{'https' if self.tls_dir else 'http'}://{self.endpoint}/health"
            with urllib.request.urlopen(url, timeout=0.5, context=context) as r:
                return b"true" in r.read()
        except OSError:
            return False

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM and wait (SIGKILL after ``timeout``); the data dir stays."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)
        self._proc = None

    def kill(self) -> None:
        """SIGKILL and wait."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(10)
        self._proc = None

    def tail(self, lines: int = 30) -> str:
        """The end of etcd's log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class Proc:
    """A service process whose first stdout line ``READY k=v ...`` announced its ports."""

    name: str
    popen: subprocess.Popen[str]
    ready: dict[str, str] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def terminate(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it does not stop in ``timeout``."""
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        """SIGKILL (a crash, as far as the rest of the cluster can tell)."""
        if self.alive():
            self.popen.kill()
        self.popen.wait(10)


def start(
    name: str,
    argv: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    timeout: float = 60.0,
    prefix: Sequence[str] = (),
) -> Proc:
    """Run ``python -m <argv>`` (behind the command line ``prefix``, e.g. ``unshare``)
    and wait for its READY line."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    popen = subprocess.Popen(
        [*prefix, sys.executable, "-m", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=full_env,
        cwd=REPO,
    )
    proc = Proc(name, popen)
    got = threading.Event()

    def pump() -> None:
        assert popen.stdout is not None
        for line in popen.stdout:
            proc.log.append(line.rstrip())
            if len(proc.log) > 2000:
                del proc.log[:1000]
            if line.startswith("READY") and not got.is_set():
                proc.ready = dict(re.findall(r"(\w+)=(\S+)", line))
                first = line.split()[1:2]
                if first and "=" not in first[0]:
                    proc.ready["address"] = first[0]
                got.set()
        got.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not got.wait(0.1):
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{name} not ready in {timeout}s:\n" + "\n".join(proc.log[-50:]))
    if not proc.ready:
        proc.kill()
        raise RuntimeError(f"{name} exited before READY:\n" + "\n".join(proc.log[-50:]))
    return proc


def _temp_shm_dir() -> str:
    """A fresh directory for a pool (in /dev/shm where it exists), removed at exit."""
    d = tempfile.mkdtemp(prefix="pegaflow-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    atexit.register(shutil.rmtree, d, True)
    return d


def _etcd_args(etcd: str | None) -> list[str]:
    """The ``--etcd-endpoints`` flag (when given)."""
    return ["--etcd-endpoints", etcd] if etcd else []


def token_env(
    token: str | None, env: dict[str, str] | None = None, tenants: str = ""
) -> dict[str, str]:
    """``env`` with the cluster token and the tenant tokens (``"tenant=secret,..."``): a
    secret goes in the environment, where ``ps`` does not show it, never in a flag."""
    out = dict(env or {})
    if token:
        out["PEGAFLOW_SECURITY_TOKEN"] = token
    if tenants:
        out["PEGAFLOW_SECURITY_TENANT_TOKENS"] = tenants
    return out


def start_node(
    node_id: str,
    *,
    etcd: str | None = None,
    prefix: str = "/pegaflow/test",
    pool: str = "256MiB",
    slab: str = "16MiB",
    token: str | None = None,
    tenants: str = "",
    extra: Sequence[str] = (),
    env: dict[str, str] | None = None,
    shm_dir: str | None = None,
) -> Proc:
    """A ``pegaflow-node`` on free ports; ``ready['ucx']`` is its data address.

    The pool lives in ``shm_dir`` (default: a fresh directory in /dev/shm, removed when
    this process exits); pass the same one to restart a node on its old pool.
    """
    if shm_dir is None:
        shm_dir = _temp_shm_dir()
    argv = [
        "pegaflow.storage_node.main",
        "--node-id", node_id,
        "--node-ucx-port", "0",
        "--node-http-port", "0",
        "--node-pool-bytes", pool,
        "--node-slab-bytes", slab,
        "--etcd-prefix", prefix,
        "--etcd-lease-ttl-s", "3",
        "--node-shm-dir", shm_dir,
        *extra,
        *_etcd_args(etcd),
    ]  # fmt: skip
    return start(f"node {node_id}", argv, env=token_env(token, env, tenants))


def start_coordinator(
    *,
    etcd: str | None = None,
    prefix: str = "/pegaflow/test",
    token: str | None = None,
    tenants: str = "",
    extra: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> Proc:
    """A ``pegaflow-coordinator`` on free ports; ``ready['address']`` is its address."""
    argv = [
        "pegaflow.coordinator.main",
        "--coordinator-port", "0",
        "--coordinator-http-port", "0",
        "--etcd-prefix", prefix,
        *extra,
        *_etcd_args(etcd),
    ]  # fmt: skip
    return start("coordinator", argv, env=token_env(token, env, tenants))


def start_server(
    *,
    token: str | None = None,
    tenants: str = "",
    extra: Sequence[str] = (),
    env: dict[str, str] | None = None,
    prefix: Sequence[str] = (),
) -> Proc:
    """A single-host ``pegaflow-server``; ``ready['coordinator']`` is its address.  Its
    pool lives in a fresh directory removed when this process exits (a later
    ``--node-shm-dir`` in ``extra`` overrides it)."""
    argv = [
        "pegaflow.server",
        "--coordinator-port", "0",
        "--coordinator-http-port", "0",
        "--node-ucx-port", "0",
        "--node-shm-dir", _temp_shm_dir(),
        *extra,
    ]  # fmt: skip
    return start("pegaflow-server", argv, env=token_env(token, env, tenants), prefix=prefix)
